"""Hostile-user hunt for stale or wrong results under `tg.jit` and composition.

Every numerical check compares with an independent reference: the same code run
uncompiled, `jax.jit`/`jax.grad` of the pure-JAX equivalent, or the explicit style.
Bugs found are kept as strict xfails with a minimal reproduction.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

K = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(jax.random.key(1), (8, 4))
Y = jnp.sum(X, axis=1, keepdims=True)


def make():
    return nn.Chain(nn.Dense(4, 6, jax.nn.tanh, key=K[0]), nn.Dense(6, 1, key=K[1]))


def loss_fn(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def assert_equal_trees(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def assert_close_trees(a, b, tol=1e-5):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


# --- static values equal by == but not interchangeable ------------------------------


class Scaled(tg.Module):
    def __init__(self, s):
        self.w = jnp.ones(2, jnp.int32)
        self.s = s  # static data


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
@pytest.mark.parametrize(("first", "then"), [(3, 3.0), (True, 1), (0.0, -0.0), (1, 1 + 0j)])
def test_module_static_equal_by_eq_traces_again(first, then):
    f = lambda m: m.w / m.s if isinstance(m.s, float) else m.w * m.s + (m.s is True)
    g = tg.jit(f)
    m = Scaled(first)
    np.testing.assert_array_equal(g(m), f(m))
    m.s = then
    out, ref = g(m), f(m)
    assert out.dtype == ref.dtype
    np.testing.assert_array_equal(out, ref)


def test_int_then_float_argument_traces_again():
    f = lambda x, n: x * n
    g = tg.jit(f)
    xi = jnp.ones(2, jnp.int32)
    assert g(xi, 3).dtype == f(xi, 3).dtype == jnp.int32
    out = g(xi, 3.0)  # float32 [3., 3.], not the int trace's int32
    assert out.dtype == f(xi, 3.0).dtype


def test_static_argnums_int_then_float_like_jax_jit():
    f = lambda x, n: x * n
    g, ref = tg.jit(f, static_argnums=1), jax.jit(f, static_argnums=1)
    xi = jnp.ones(2, jnp.int32)
    assert g(xi, 3).dtype == ref(xi, 3).dtype
    assert g(xi, 3.0).dtype == ref(xi, 3.0).dtype == jnp.float32


def test_true_then_one_argument_traces_again():
    def f(x, flag):
        return x + (1 if flag is True else 100)

    g = tg.jit(f)
    np.testing.assert_array_equal(g(jnp.zeros(2), True), f(jnp.zeros(2), True))  # [1, 1]
    np.testing.assert_array_equal(g(jnp.zeros(2), 1), f(jnp.zeros(2), 1))  # [100, 100]


def test_closure_negative_zero_is_read_fresh():
    cfg = {"s": 0.0}
    f = lambda x: x / cfg["s"]
    g = tg.jit(f)
    np.testing.assert_array_equal(g(jnp.ones(2)), f(jnp.ones(2)))  # [inf, inf]
    cfg["s"] = -0.0
    np.testing.assert_array_equal(g(jnp.ones(2)), f(jnp.ones(2)))  # [-inf, -inf]


def test_argument_negative_zero_traces_again():
    f = lambda x, n: x / n
    g = tg.jit(f)
    np.testing.assert_array_equal(g(jnp.ones(2), 0.0), f(jnp.ones(2), 0.0))
    np.testing.assert_array_equal(g(jnp.ones(2), -0.0), f(jnp.ones(2), -0.0))  # -inf


class Counted(tg.Module):
    def __init__(self):
        self.w = jnp.ones(2)
        self.calls = 0  # static data the step edits


@pytest.mark.parametrize("rebind_w", [True, False])
def test_static_counter_on_a_captured_module(rebind_w):
    def run(wrap):
        m = Counted()

        def step(x):
            if rebind_w:
                m.w = m.w + x * m.calls  # reads the counter it advances
            m.calls += 1

        step = wrap(step)
        for _ in range(3):
            step(jnp.ones(2))
        return m

    ref = run(lambda f: f)
    # A counter it advances each call: traced each call, and said (`_warn_changed`).
    with pytest.warns(tg.RetraceWarning, match=r"changes values .*static data of a Counted"):
        m = run(tg.jit)
    assert not isinstance(m.w, jax.core.Tracer), "a tracer leaked into the user's model"
    np.testing.assert_array_equal(m.w, ref.w)  # [4, 4] when rebound: 1 + 0 + 1 + 2
    assert m.calls == ref.calls == 3


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
@pytest.mark.parametrize("donate", [False, True])
def test_implicit_step_with_the_model_as_an_argument(donate):
    def run(compiled):
        model = make()
        other = jax.tree_util.tree_map(lambda a: a + 0.5, make())  # not captured
        ps = tg.params(model)
        state = tg.setup(optax.sgd(0.1), ps)

        def step(m, x, y):  # m *is* the model whose params ps holds (or another one)
            # Read before the update: under tg.jit an argument is its arrays' values
            # (as with jax.jit), so after update_ rebinds the model, m is not it.
            loss = loss_fn(m, x, y)
            tg.update_(state, ps, tg.gradient(lambda: loss_fn(m, x, y), ps))
            return loss

        if compiled:
            step = tg.jit(step, donate_argnums=(0,) if donate else ())
        losses = [step(model, X, Y) for _ in range(3)]
        # Another model's arrays are not the parameters: no gradient, as uncompiled.
        with pytest.warns(tg.NoGradientWarning):
            losses.append(step(other, X, Y))
        losses.append(step(model, X, Y))
        return model, losses

    ref, ref_losses = run(False)
    assert float(loss_fn(ref, X, Y)) < float(loss_fn(make(), X, Y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.NoGradientWarning)  # only the `other` call warns
        warnings.simplefilter("ignore", UserWarning)  # jax: some donated buffers unusable
        got, losses = run(True)
    assert_close_trees(got, ref)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert not any(a.is_deleted() for a in leaves(got))


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_grads_returned_from_tg_jit_is_a_clear_error_and_its_tree_is_right():
    model = make()
    ps = tg.params(model)
    # Carried out as static data, a Grads would hold the trace's tracers as its keys.
    with pytest.raises(
        TypeError,
        match=r"tg.jit: the compiled function returns a tg.Grads.*"
        r"grads.to_tree\(model\)",
    ):
        tg.jit(lambda x, y: tg.gradient(lambda: loss_fn(model, x, y), ps))(X, Y)
    ref = jax.grad(loss_fn)(model, X, Y)
    tree = tg.jit(lambda x, y: tg.gradient(lambda: loss_fn(model, x, y), ps).to_tree(model))(X, Y)
    assert_close_trees(tree, ref)
    named = tg.jit(lambda x, y: tg.gradient(lambda: loss_fn(model, x, y), ps).named())(X, Y)
    np.testing.assert_allclose(named["layers.0.weight"], ref[0].weight, rtol=1e-5, atol=1e-6)


def test_nested_tg_jit_writes_back_once():
    d = {"w": jnp.ones(3)}

    def upd(x):
        d["w"] = d["w"] + x

    inner = tg.jit(upd)
    outer = tg.jit(lambda x: inner(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RetraceWarning: the inner helper is seen into
        outer(jnp.ones(3))
        outer(2 * jnp.ones(3))
    assert isinstance(d["w"], jax.Array) and not isinstance(d["w"], jax.core.Tracer)
    np.testing.assert_array_equal(d["w"], [4.0, 4.0, 4.0])


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_nested_tg_jit_implicit_step_equals_the_uncompiled_step():
    def run(wrap):
        model = make()
        ps = tg.params(model)
        state = tg.setup(optax.adam(0.1), ps)

        def step(x, y):
            tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))

        outer = wrap(step)
        for k in range(3):
            outer(X * (k + 1), Y)
        return model, state

    ref_model, ref_state = run(lambda step: step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, state = run(lambda step: tg.jit(lambda x, y: tg.jit(step)(x, y)))
    assert_close_trees(model, ref_model)
    assert_close_trees(state, ref_state)
    assert not any(isinstance(x, jax.core.Tracer) for x in leaves((model, state)))


# --- freshness of tg.jit over arguments and closures --------------------------------


def test_python_numbers_rebound_in_globals_and_cells():
    def maker():
        k = 2.0

        def f(x):
            return x * k + SCALE["v"]

        def set_k(v):
            nonlocal k
            k = v

        return f, set_k

    f, set_k = maker()
    g = tg.jit(f)
    x = jnp.arange(3.0)
    for k, s in [(2.0, 0.0), (5.0, 0.0), (5.0, -1.5), (2.0, 0.0)]:
        set_k(k)
        SCALE["v"] = s
        np.testing.assert_array_equal(g(x), f(x))
    SCALE["v"] = 0.0


SCALE = {"v": 0.0}


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_module_static_attributes_edited_between_calls_argument_and_closure():
    class M(tg.Module):
        def __init__(self):
            self.w = jnp.array([0.5, -1.0])
            self.scale = 2.0
            self.act = jnp.sin

        def __call__(self, x):
            return self.act(self.w * x) * self.scale

    m = M()
    by_arg = tg.jit(lambda m, x: m(x))
    by_closure = tg.jit(lambda x: m(x))
    x = jnp.array([1.0, 2.0])
    edits = [lambda: None, lambda: setattr(m, "scale", -3.0), lambda: setattr(m, "act", jnp.cos)]
    for edit in edits:
        edit()
        np.testing.assert_allclose(by_arg(m, x), m(x), rtol=1e-6)
        np.testing.assert_allclose(by_closure(x), m(x), rtol=1e-6)


def test_method_swapped_on_the_class_between_calls():
    class Net(tg.Module):
        def __init__(self):
            self.w = jnp.ones(3)

        def act(self, x):
            return jnp.sin(x)

        def __call__(self, x):
            return self.act(self.w * x)

    n = Net()
    f = tg.jit(lambda m, x: m(x))
    x = jnp.arange(3.0)
    np.testing.assert_allclose(f(n, x), jnp.sin(x), rtol=1e-6)
    Net.act = lambda self, x: jnp.cos(x)
    np.testing.assert_allclose(f(n, x), jnp.cos(x), rtol=1e-6)


def test_numpy_array_argument_and_closure_mutated_in_place():
    a = np.ones(2, np.float32)
    b = np.ones(2, np.float32)
    by_arg = tg.jit(lambda x, a: x * a)
    by_closure = tg.jit(lambda x: x * b)
    x = jnp.array([2.0, 3.0])
    np.testing.assert_array_equal(by_arg(x, a), [2.0, 3.0])
    np.testing.assert_array_equal(by_closure(x), [2.0, 3.0])
    a[0] = 5.0
    b[1] = -1.0
    np.testing.assert_array_equal(by_arg(x, a), x * a)
    np.testing.assert_array_equal(by_closure(x), x * b)


def test_function_arguments_new_lambda_reuses_changed_code_retraces():
    traces = []

    @tg.jit
    def apply(f, x):
        traces.append(1)
        return f(x)

    x = jnp.ones(3)
    for k in [1.0, 2.0, 3.0]:
        a = jnp.full(3, k)
        np.testing.assert_array_equal(apply(lambda v: v * a, x), x * a)  # noqa: B023
    assert len(traces) == 1  # new lambda, same code, same shapes: no re-trace
    for k in [1.0, 2.0, 1.0]:
        np.testing.assert_array_equal(apply(lambda v: v * k, x), x * k)  # noqa: B023
    np.testing.assert_array_equal(apply(lambda v: v + 1.0, x), x + 1.0)  # other code
    assert len(traces) == 4  # 1 + one per distinct float + the new code


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_loss_swapped_in_a_helper_dict_read_by_a_compiled_withgradient():
    helpers = {"loss": loss_fn}
    l1 = lambda m, x, y: jnp.mean(jnp.abs(m(x) - y))
    step = tg.jit(lambda m, x, y: tg.withgradient(lambda m: helpers["loss"](m, x, y), m))
    model = make()
    for fn in [loss_fn, l1, loss_fn]:
        helpers["loss"] = fn
        v, (g,) = step(model, X, Y)
        rv, rg = jax.jit(jax.value_and_grad(fn))(model, X, Y)
        np.testing.assert_allclose(v, rv, rtol=1e-6)
        assert_close_trees(g, rg)


# --- implicit steps under tg.jit ---------------------------------------------------


class TiedW(tg.Module):
    def __init__(self):
        self.w = 0.5 * jax.random.normal(K[2], (4, 4))
        self.v = self.w  # tied
        self.o = jax.random.normal(K[3], (4, 1))

    def __call__(self, x):
        return jnp.tanh(jnp.tanh(x @ self.w) @ self.v) @ self.o


CASES = {
    "clip-global-norm": (
        make,
        lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
        loss_fn,
    ),
    "none-gradients": (  # only the first layer is used: the second gets None
        make,
        lambda: optax.adam(1e-2),
        lambda m, x, y: jnp.mean((m[0](x).sum(-1, keepdims=True) - y) ** 2),
    ),
    "inject-hyperparams": (make, lambda: optax.inject_hyperparams(optax.adam)(1e-2), loss_fn),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_implicit_step_equals_uncompiled_and_compiled_explicit(case):
    build, rule, loss = CASES[case]

    def implicit(compiled):
        model = build()
        ps = tg.params(model)
        state = tg.setup(rule(), ps)

        def step(x, y):
            tg.update_(state, ps, tg.gradient(lambda: loss(model, x, y), ps))

        step = tg.jit(step) if compiled else step
        for _ in range(3):
            step(X, Y)
        return model, state

    m_c, s_c = implicit(True)
    m_u, s_u = implicit(False)
    assert_close_trees(m_c, m_u)
    assert_close_trees(s_c, s_u)

    m_e = build()
    s_e = tg.setup(rule(), m_e)

    @tg.jit
    def explicit(st, m, x, y):
        (g,) = tg.gradient(lambda m: loss(m, x, y), m)
        return tg.update(st, m, g)

    for _ in range(3):
        s_e, m_e = explicit(s_e, m_e, X, Y)
    assert_equal_trees(m_c, m_e)  # bit for bit
    assert_equal_trees(s_c, s_e)
    if case == "none-gradients":
        assert_equal_trees(m_c[1], build()[1])  # the unused layer did not move


def implicit_tied(compiled, n=3):
    model = TiedW()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)

    def step(x, y):
        tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))

    step = tg.jit(step) if compiled else step
    for _ in range(n):
        step(X, Y)
    return model


def optax_tied(n=3):
    """Pure optax on the one tied array: the reference for both styles."""
    m = TiedW()
    params = {"w": m.w, "o": m.o}
    loss = lambda p: jnp.mean((jnp.tanh(jnp.tanh(X @ p["w"]) @ p["w"]) @ p["o"] - Y) ** 2)
    opt = optax.adam(1e-2)
    s = opt.init(params)
    for _ in range(n):
        u, s = opt.update(jax.grad(loss)(params), s, params)
        params = optax.apply_updates(params, u)
    return params


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_compiled_implicit_step_keeps_a_tied_weight_tied_and_equals_optax():
    ref = optax_tied()
    for compiled in (True, False):
        m = implicit_tied(compiled)
        assert m.w is m.v
        np.testing.assert_allclose(m.w, ref["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m.o, ref["o"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_compiled_explicit_step_unties_a_tied_weight():
    m = TiedW()
    s = tg.setup(optax.adam(1e-2), m)

    @tg.jit
    def step(s, m, x, y):
        (g,) = tg.gradient(lambda m: loss_fn(m, x, y), m)
        return tg.update(s, m, g)

    for _ in range(3):
        s, m = step(s, m, X, Y)
    # Uncompiled tg.update keeps m.w is m.v and matches optax; compiled: untied, 1e-4 off.
    np.testing.assert_allclose(m.w, optax_tied()["w"], rtol=1e-5, atol=1e-6)
    assert m.w is m.v


def test_tg_jit_output_splits_a_shared_submodule():
    class Shared(tg.Module):
        def __init__(self):
            self.a = nn.Dense(2, 2, key=K[0])
            self.b = self.a

    out = tg.jit(lambda m: m)(Shared())
    assert out.a is out.b
    # A root tuple holding one model twice, and a list inside a dict.
    m = Shared()
    pair = tg.jit(lambda t: t)((m, {"l": [m.a, m.a]}))
    assert pair[0].a is pair[0].b is pair[1]["l"][0] is pair[1]["l"][1]


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_tg_jit_step_keeps_a_shared_submodule_one_object():
    class Shared(tg.Module):
        def __init__(self):
            self.a = nn.Dense(4, 4, jnp.tanh, key=K[0])
            self.b = self.a
            self.out = nn.Dense(4, 1, key=K[1])

        def __call__(self, x):
            return self.out(self.b(self.a(x)))

    def step(model, state, x, y):
        # Inside the trace the sub-model is one object too: an edit through one place
        # is seen through the other, as uncompiled.
        assert model.a is model.b
        g = tg.gradient(lambda m: loss_fn(m, x, y), model)[0]
        state, model = tg.update(state, model, g)
        return model, state

    ref = Shared()
    ref_state = tg.setup(optax.adam(0.1), ref)
    model, state = Shared(), tg.setup(optax.adam(0.1), Shared())
    compiled = tg.jit(step)
    for _ in range(3):
        ref, ref_state = step(ref, ref_state, X, Y)
        model, state = compiled(model, state, X, Y)
        assert model.a is model.b and ref.a is ref.b
    for a, b in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the same arrays in two separate Modules (a tie, not a shared Module): not shared
    split = Shared()
    split.b = nn.Dense(4, 4, jnp.tanh, key=K[0])
    split.b.weight, split.b.bias = split.a.weight, split.a.bias
    ident = tg.jit(lambda m: m)
    out = ident(Shared())
    assert out.a is out.b
    out = ident(split)  # same structure and ties, other sharing: not the same program
    assert out.a is not out.b and out.a.weight is out.b.weight
    again = ident(Shared())
    assert again.a is again.b


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_compiled_implicit_step_follows_a_replaced_layer():
    def run(compiled):
        model = make()
        ps = tg.params(model)
        state = tg.setup(optax.sgd(0.1, momentum=0.9), ps)

        def step(x, y):
            tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))

        step = tg.jit(step) if compiled else step
        step(X, Y)
        model.layers[1] = nn.Dense(6, 1, key=K[2])  # replaced between calls
        step(X, Y)
        model.layers[0].weight = model.layers[0].weight * 0.5  # rebound between calls
        step(X, Y)
        return model, state

    (mc, sc), (mu, su) = run(True), run(False)
    assert_close_trees(mc, mu)
    assert_close_trees(sc, su)
    assert not np.allclose(mc[1].weight, nn.Dense(6, 1, key=K[2]).weight)  # new layer trained


def test_compiled_implicit_step_after_a_list_append_fails_like_uncompiled():
    model = {"ws": [jnp.ones(3)]}
    ps = tg.params(model)
    state = tg.setup(optax.sgd(0.1), ps)

    @tg.jit
    def step(x):
        g = tg.gradient(lambda: sum(jnp.sum(w * x) ** 2 for w in model["ws"]), ps)
        tg.update_(state, ps, g)

    step(jnp.arange(3.0))
    before = model["ws"][0]
    model["ws"].append(jnp.full(3, 2.0))
    with pytest.raises(ValueError, match=r"state does not match the model.*'ws\.1'.*tg\.setup"):
        step(jnp.arange(3.0))
    assert model["ws"][0] is before and len(model["ws"]) == 2  # nothing changed


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_static_argname_in_implicit_step_retraces_only_on_a_new_value():
    def build():
        model = make()
        ps = tg.params(model)
        return model, ps, tg.setup(optax.sgd(0.1), ps)

    model, ps, state = build()
    traces = []

    def step(x, y, scale):
        traces.append(scale)
        tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y) * scale, ps))

    jstep = tg.jit(step, static_argnames="scale")
    m2, ps2, st2 = build()
    for s in [1.0, 0.0, 2.0, 0.0, 1.0]:
        jstep(X, Y, scale=s)
        tg.update_(st2, ps2, tg.gradient(lambda: loss_fn(m2, X, Y) * s, ps2))  # noqa: B023
        assert_close_trees(model, m2)
    assert traces == [1.0, 0.0, 2.0]


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_adjust_and_freeze_between_compiled_implicit_steps():
    def run(compiled):
        model = make()
        ps = tg.params(model)
        state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), model)

        def step(x, y):
            tg.update_(state, model, tg.gradient(lambda m: loss_fn(m, x, y), model)[0])

        step = tg.jit(step) if compiled else step
        step(X, Y)
        tg.adjust_(state, learning_rate=0.0)
        step(X, Y)
        snap = [np.asarray(p) for p in ps]
        tg.adjust_(state, learning_rate=0.05)
        tg.freeze_(state.layers[0])
        step(X, Y)
        return model, state, snap

    (mc, sc, snap_c), (mu, su, snap_u) = run(True), run(False)
    np.testing.assert_array_equal(snap_c[0], snap_u[0])
    assert_close_trees(mc, mu)
    assert_close_trees(sc, su)
    np.testing.assert_array_equal(mc[0].weight, snap_c[0])  # frozen layer unchanged
    assert not np.array_equal(mc[1].weight, snap_c[2])  # the other one moved


# --- tg.jit returning Modules, nested tg.jit --------------------------------------------


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_tg_jit_returns_module_gradients_with_their_static_data():
    model = make()
    g = tg.jit(lambda m, x, y: tg.gradient(lambda m: loss_fn(m, x, y), m)[0])(model, X, Y)
    ref = jax.jit(jax.grad(loss_fn))(model, X, Y)
    assert type(g) is type(model) and g[0].activation is model[0].activation
    assert_close_trees(g, ref, tol=1e-6)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_nested_pure_tg_jit_inside_tg_jit_and_tg_gradient():
    model = make()
    inner = tg.jit(lambda m, x: m(x))
    outer = tg.jit(lambda m, x, y: jnp.mean((inner(m, x) - y) ** 2))
    np.testing.assert_allclose(outer(model, X, Y), jax.jit(loss_fn)(model, X, Y), rtol=1e-6)
    (g,) = tg.gradient(lambda m: jnp.mean((inner(m, X) - Y) ** 2), model)
    assert_close_trees(g, jax.grad(loss_fn)(model, X, Y), tol=1e-6)


# --- composition with jax transformations -------------------------------------------


def one_loss(m, x, y):
    return jnp.sum((m(x[None]) - y[None]) ** 2)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_per_example_gradients_implicit_under_vmap_and_tg_jit():
    model = make()
    ps = tg.params(model)

    def per_example(x, y):
        return tg.gradient(lambda: one_loss(model, x, y), ps).to_tree(model)

    ref = jax.jit(jax.vmap(lambda x, y: jax.grad(one_loss)(model, x, y)))(X, Y)
    assert_close_trees(jax.vmap(per_example)(X, Y), ref)
    assert_close_trees(tg.jit(lambda x, y: jax.vmap(per_example)(x, y))(X, Y), ref)
    assert_close_trees(jax.jit(jax.vmap(per_example))(X, Y), ref)


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_tg_jit_of_a_vmapped_function_is_cached_and_fresh():
    model = make()
    ps = tg.params(model)

    def per_example(x, y):
        return tg.gradient(lambda: one_loss(model, x, y), ps).to_tree(model)

    f = tg.jit(jax.vmap(per_example))
    ref = lambda: jax.vmap(jax.grad(one_loss), in_axes=(None, 0, 0))(model, X, Y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RetraceWarning: vmap's wrapped function is seen
        assert_close_trees(f(X, Y), ref())
        model[0].weight = model[0].weight * 2  # read fresh through vmap's wrapper
        assert_close_trees(f(X, Y), ref())
        g = lambda x, y: jax.tree_util.tree_map(jnp.sum, jax.vmap(per_example)(x, y))
        assert_close_trees(tg.jit(g)(X, Y), jax.tree_util.tree_map(jnp.sum, ref()))


def test_second_order_implicit_under_tg_jit_equals_jax_grad_of_grad():
    w = jnp.array([0.3, -1.2, 2.0])
    ps = tg.Params([w])
    f = lambda v: jnp.sum(jnp.sin(v) * v**2)

    def grad_norm():
        return jnp.sum(tg.gradient(lambda: f(w), ps)[w] ** 2)

    ref = jax.grad(lambda v: jnp.sum(jax.grad(f)(v) ** 2))(w)
    np.testing.assert_allclose(tg.jit(lambda: tg.gradient(grad_norm, ps)[w])(), ref, rtol=1e-5)
    np.testing.assert_allclose(
        jax.jacfwd(lambda v: tg.gradient(f, v)[0])(w), jax.hessian(f)(w), rtol=1e-6
    )


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_sgd_loop_in_lax_scan_inside_tg_jit_equals_pure_jax():
    def body(m, xy):
        loss, (g,) = tg.withgradient(lambda m: one_loss(m, *xy), m)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, m, g), loss

    def body_ref(m, xy):
        loss, g = jax.value_and_grad(one_loss)(m, *xy)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, m, g), loss

    model = make()
    got = tg.jit(lambda m: jax.lax.scan(body, m, (X, Y)))(model)
    ref = jax.jit(lambda m: jax.lax.scan(body_ref, m, (X, Y)))(model)
    assert_close_trees(got, ref, tol=1e-6)


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
@pytest.mark.parametrize("tie", [False, True], ids=["captured once", "captured twice"])
def test_fast_call_path_gives_way_when_an_argument_is_a_captured_array(tie):
    """A `tg.jit` call whose arguments are not arrays it captures runs in one step;
    an argument that IS a captured array (once, then back) must still be that array,
    as uncompiled: its parameter is the captured one. So with the array captured twice."""
    w = jnp.array([1.0, 2.0, 3.0])
    a = jnp.array([3.0, -4.0, 5.0])
    box = {"w": w, "again": w if tie else jnp.zeros(3)}

    def step(x):
        loss = lambda: jnp.sum(box["w"] ** 2) + jnp.sum(box["again"] * x) + jnp.sum(x)
        return tg.gradient(loss, tg.params(x))[x]

    compiled = tg.jit(step)
    for x in (a, w, a, w, a * 2):
        assert_equal_trees(compiled(x), step(x))
    # In closed form: 1 (+ `again`) for another array; for x = w, also 2w (+ w once more).
    np.testing.assert_allclose(compiled(a), 1 + (w if tie else 0))
    np.testing.assert_allclose(compiled(w), 1 + 2 * w + (2 * w if tie else 0))
