"""Implicit style compiled: whole implicit steps under tg.jit, Flux's idioms, tg.train(ps)."""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

K1, K2 = jax.random.split(jax.random.key(0))
X = jax.random.normal(jax.random.key(1), (16, 4))
Y = jnp.sum(X, axis=1, keepdims=True)


def make():
    return nn.Chain(nn.Dense(4, 8, jax.nn.tanh, key=K1), nn.Dense(8, 1, key=K2))


def loss_fn(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def test_compiled_implicit_step_equals_compiled_explicit_step_bit_for_bit():
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    traces = []

    @tg.jit
    def step(x, y):
        traces.append(1)
        grads = tg.gradient(lambda: loss_fn(model, x, y), ps)
        tg.update_(state, ps, grads)

    m2 = make()
    st2 = tg.setup(optax.adam(1e-2), m2)

    @tg.jit
    def explicit_step(st, m, x, y):
        _, (g,) = tg.withgradient(lambda m: loss_fn(m, x, y), m)
        return tg.update(st, m, g)

    for _ in range(20):
        w_before = model[0].weight
        step(X, Y)
        assert model[0].weight is not w_before  # the model holds the updated arrays
        assert ps.arrays()[0] is model[0].weight
        st2, m2 = explicit_step(st2, m2, X, Y)
        for a, b in zip(leaves(model), leaves(m2), strict=True):
            np.testing.assert_array_equal(a, b)
    assert len(traces) == 1
    for a, b in zip(leaves(state), leaves(st2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(leaves(state)[0]) == 20  # optax's count, written back each step


def test_compiled_implicit_step_matches_the_uncompiled_one():
    # One XLA computation fuses differently from two: equal to float rounding.
    model, m3 = make(), make()
    ps, ps3 = tg.params(model), tg.params(m3)
    state, st3 = tg.setup(optax.adam(1e-2), ps), tg.setup(optax.adam(1e-2), ps3)

    @tg.jit
    def step(x, y):
        tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))

    for _ in range(10):
        step(X, Y)
        tg.update_(st3, ps3, tg.gradient(lambda: loss_fn(m3, X, Y), ps3))
    for a, b in zip(leaves(model), leaves(m3), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_grads_looked_up_with_the_users_arrays_inside_a_compiled_step():
    model = make()
    ps = tg.params(model)
    seen = []

    @tg.jit
    def norms(x, y):
        grads = tg.gradient(lambda: loss_fn(model, x, y), ps)
        g = grads[model[0].weight]  # the user's own array: a tracer here, the same one
        seen.append(g.shape)
        return jnp.sum(g**2)

    ref = jax.grad(loss_fn)(model, X, Y)[0].weight
    np.testing.assert_allclose(norms(X, Y), jnp.sum(ref**2), rtol=1e-5)
    assert seen == [(8, 4)]


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_weight_decay_over_a_captured_params():
    model = make()
    ps = tg.params(model)

    def loss():
        return loss_fn(model, X, Y) + 1e-2 * sum(jnp.sum(p**2) for p in ps)

    grads = tg.gradient(loss, ps)

    def explicit(m):
        return loss_fn(m, X, Y) + 1e-2 * sum(jnp.sum(p**2) for p in leaves(m))

    ref = jax.grad(explicit)(model)
    for p, g in zip(leaves(model), leaves(ref), strict=True):
        np.testing.assert_allclose(grads[p], g, rtol=1e-5, atol=1e-7)


def test_parameter_held_by_a_plain_object_inside_a_list_and_a_tuple():
    class Holder:
        def __init__(self, w):
            self.w = w

    a, b = Holder(jnp.array([1.0, 2.0])), Holder(jnp.array([3.0]))
    things = [a, (b,)]
    ps = tg.Params([a.w, b.w])
    grads = tg.gradient(lambda: jnp.sum(things[0].w ** 2) + jnp.sum(things[1][0].w ** 3), ps)
    np.testing.assert_allclose(grads[a.w], jax.grad(lambda w: jnp.sum(w**2))(a.w))
    np.testing.assert_allclose(grads[b.w], jax.grad(lambda w: jnp.sum(w**3))(b.w))


def test_pullback_nested_in_a_gradient():
    w = jnp.array([0.5, -1.0, 2.0])
    ps = tg.Params([w])

    def outer():
        y, back = tg.pullback(lambda: jnp.sin(w) * w, ps)
        (gw,) = back(jnp.ones(3)).values()
        return jnp.sum(y) + jnp.sum(gw**2)

    grads = tg.gradient(outer, ps)

    def explicit(v):
        y, vjp = jax.vjp(lambda v: jnp.sin(v) * v, v)
        return jnp.sum(y) + jnp.sum(vjp(jnp.ones(3))[0] ** 2)

    np.testing.assert_allclose(grads[w], jax.grad(explicit)(w), rtol=1e-5)


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_train_with_params_equals_train_with_the_model():
    data = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 16, 4)] * 3
    m1 = make()
    _, m1, losses1 = tg.train(loss_fn, m1, data, tg.setup(optax.adam(1e-2), m1))
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    st2, m2, losses2 = tg.train(lambda x, y: loss_fn(model, x, y), ps, data, state)
    assert m2 is model and st2 is state  # updated in place
    np.testing.assert_allclose(losses1, losses2, rtol=1e-6)
    for a, b in zip(leaves(m1), leaves(model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_train_with_params_stops_on_a_nan_with_the_last_good_model():
    model = {"w": jnp.ones(())}
    ps = tg.params(model)
    state = tg.setup(optax.sgd(0.1, momentum=0.9), ps)
    data = [(jnp.ones(2),), (jnp.array([jnp.nan, 1.0]),)]
    with pytest.raises(tg.NonFiniteLossError, match=r"epoch 0, step 1.*last good step") as e:
        tg.train(lambda x: jnp.sum(model["w"] * x), ps, data, state)
    # One good step, replayed by hand with plain optax: gradient 2, momentum trace 2.
    rule = optax.sgd(0.1, momentum=0.9)
    ref_state = rule.init({"w": jnp.ones(())})
    updates, ref_state = rule.update({"w": jnp.asarray(2.0)}, ref_state)
    np.testing.assert_allclose(model["w"], 1.0 + updates["w"])
    np.testing.assert_allclose(state["w"].state[0].trace, ref_state[0].trace["w"])
    assert e.value.model is model and e.value.state is state


def test_params_add_remove_equality_and_empty():
    W, b, c = jnp.ones((2, 3)), jnp.zeros(2), jnp.ones(1)
    ps = tg.Params()
    assert len(ps) == 0 and list(ps) == []
    ps.add(W)
    ps.add(b)
    assert ps == tg.Params([W, b]) and ps != tg.Params([b, W])
    ps.add({"c": c})
    assert len(ps) == 3 and c in ps
    ps.remove(b)
    assert list(ps) == [W, c]
    with pytest.raises(KeyError, match=r"not one of the parameters.*discard"):
        ps.remove(b)
    ps.discard(b)  # no error
    assert tg.Params([]) == tg.Params()
    grads = tg.gradient(lambda: jnp.sum(W) + jnp.sum(c * 2), ps)
    np.testing.assert_allclose(grads[c], [2.0])
    assert (+grads)[W] is grads[W]


def test_destructure_of_a_params_uses_its_model():
    model = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    flat, rebuild = tg.destructure(tg.params(model))
    assert flat.shape == (6,)
    np.testing.assert_allclose(rebuild(flat * 3)["w"], 3 * np.ones((2, 2)))


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda m: tg.gradient(lambda: loss_fn(m, X, Y)), r"no argument.*tg\.params\(model\)"),
        (lambda m: tg.gradient(lambda: loss_fn(m, X, Y), m), r"takes no arguments.*implicit"),
        (
            lambda m: tg.gradient(lambda m: loss_fn(m, X, Y), tg.params(m)),
            r"implicit style.*no arguments.*takes 1.*explicit style",
        ),
        (
            lambda m: tg.withgradient(lambda a, b: loss_fn(a, X, Y), m),
            r"takes 2 positional argument.*given 1",
        ),
        (
            lambda m: tg.train(loss_fn, tg.params(m), [(X, Y)], tg.setup(optax.sgd(0.1), m)),
            r"with a tg\.Params.*loss\(\*batch\) with 2.*takes 3",
        ),
        (
            lambda m: tg.train(
                lambda x, y: loss_fn(m, x, y), m, [(X, Y)], tg.setup(optax.sgd(0.1), m)
            ),
            r"loss\(model, \*batch\) with 3.*takes 2.*pass tg\.params\(model\)",
        ),
    ],
    ids=[
        "gradient-without-argument",
        "zero-argument-loss-given-a-model",
        "one-argument-loss-given-params",
        "too-few-arguments",
        "train-params-with-model-loss",
        "train-model-with-closure-loss",
    ],
)
def test_style_mix_ups_say_which_style_and_how(call, words):
    with pytest.raises(TypeError, match=words):
        call(make())


def test_jit_static_arguments():
    traces = []

    @tg.jit
    def f(x, n, *, mode):
        traces.append((n, mode))
        return x * n if mode == "mul" else x + n

    g = tg.jit(f.__wrapped__, static_argnums=1, static_argnames="mode")
    np.testing.assert_allclose(g(jnp.ones(2), 3, mode="mul"), [3.0, 3.0])
    np.testing.assert_allclose(g(jnp.ones(2), 3, mode="add"), [4.0, 4.0])
    g(jnp.ones(2), 3, mode="add")
    assert traces == [(3, "mul"), (3, "add")]
    with pytest.raises(TypeError, match=r"static argument 1 must be hashable.*list"):
        g(jnp.ones(2), [3], mode="add")


def test_jit_donation():
    @tg.jit
    def step(m, x):
        return {"w": m["w"] - 0.1 * x}

    donating = tg.jit(step.__wrapped__, donate_argnums=0)
    m = {"w": jnp.ones(3)}
    out = donating(m, jnp.ones(3))
    np.testing.assert_allclose(out["w"], 0.9 * np.ones(3))
    assert m["w"].is_deleted()
    named = tg.jit(lambda m, x: {"w": m["w"] * x}, donate_argnames="m")
    m = {"w": jnp.ones(3)}
    named(m=m, x=jnp.ones(3))
    assert m["w"].is_deleted()


def test_jit_shardings_on_one_device():
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    f = tg.jit(
        lambda m, x: {"y": m["w"] * x}, in_shardings=({"w": dev}, dev), out_shardings={"y": dev}
    )
    out = f({"w": jnp.ones(2)}, jnp.full(2, 3.0))
    assert out["y"].sharding == dev
    np.testing.assert_allclose(out["y"], [3.0, 3.0])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"donate_argnums": "0"}, r"donate_argnums must be an int or a tuple of ints.*'0'"),
        ({"static_argnums": 1.5}, r"static_argnums must be an int or a tuple of ints"),
        ({"static_argnames": 3}, r"static_argnames must be a str or a tuple of str"),
        ({"donate_argnames": ["m", 2]}, r"donate_argnames must be a str or a tuple of str"),
    ],
)
def test_jit_options_of_the_wrong_type(kwargs, words):
    with pytest.raises(TypeError, match=words):
        tg.jit(lambda m: m, **kwargs)


def test_jit_in_shardings_that_do_not_fit():
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    f = tg.jit(lambda m, x: m["w"] * x, in_shardings=(dev,))
    with pytest.raises(ValueError, match=r"in_shardings has 1 entries for 2 positional"):
        f({"w": jnp.ones(2)}, jnp.ones(2))


def test_no_retrace_and_no_warning_over_many_compiled_implicit_steps():
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.sgd(0.1), ps)
    step = tg.jit(lambda x, y: tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            step(X, Y)
    assert tg._cache.cache_size() <= 3  # the step, the gradient inside, nothing per call


def test_module_level_state_is_written_back():
    ns = types.SimpleNamespace(model=make())
    ps = tg.params(ns.model)
    state = tg.setup(optax.sgd(0.05), ps)

    @tg.jit
    def step():
        tg.update_(state, ps, tg.gradient(lambda: loss_fn(ns.model, X, Y), ps))

    before = loss_fn(ns.model, X, Y)
    for _ in range(5):
        step()
    assert loss_fn(ns.model, X, Y) < before


def test_jit_in_shardings_of_the_wrong_type():
    f = tg.jit(lambda m, x: m["w"] * x, in_shardings=("fast", None))
    with pytest.raises(TypeError, match=r"tg\.jit: in_shardings: spec holds a str.*Sharding"):
        f({"w": jnp.ones(2)}, jnp.ones(2))


# --- the user's own jax.jit around an implicit gradient -----------------------------------


def test_tg_jit_reads_captured_parameters_fresh_where_jax_jit_bakes_them_in():
    # docs/pitfalls.md: jax.jit keeps the parameters' values at trace time (ordinary JAX
    # semantics, as jax.jit(jax.grad) over a captured model); tg.jit reads them fresh.
    model = {"w": jnp.array([1.0, 2.0])}
    ps = tg.params(model)
    x = jnp.ones(2)
    loss = lambda: jnp.sum(model["w"] ** 2 * x)
    baked = jax.jit(lambda x: tg.gradient(loss, ps)[model["w"]])
    fresh = tg.jit(lambda x: tg.gradient(loss, ps).to_tree(model))
    np.testing.assert_allclose(baked(x), [2.0, 4.0])
    np.testing.assert_allclose(fresh(x)["w"], [2.0, 4.0])
    model["w"] = model["w"] * 0.5
    np.testing.assert_allclose(baked(x), [2.0, 4.0])  # jax.jit's cache: the old weights
    np.testing.assert_allclose(fresh(x)["w"], [1.0, 2.0])

    # Traced by the user's jax.jit (the model an argument, the Params built inside): fresh.
    @jax.jit
    def inside(m, x):
        ps = tg.params(m)
        return tg.gradient(lambda: jnp.sum(m["w"] ** 2 * x), ps)[m["w"]]

    np.testing.assert_allclose(inside(model, x), [1.0, 2.0])


def _reference_run(steps):
    """The implicit step run uncompiled, with the losses it logs: the reference."""
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    losses = []
    with jax.disable_jit():
        for _ in range(steps):
            loss, grads = tg.withgradient(lambda: loss_fn(model, X, Y), ps)
            tg.update_(state, ps, grads)
            losses.append(loss)
    return model, losses


@pytest.mark.slow  # about 8 s: four traces and an uncompiled reference; message: test_docs
def test_a_loss_log_appended_to_inside_a_compiled_step_is_said_not_silently_empty():
    # docs/pitfalls.md: uncompiled, `losses` would hold one loss a call; a traced value
    # cannot stay in it, so it is taken out again and the step traced on every call.
    # That was silent (an empty log, a slow step); now a RetraceWarning says so, once.
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    losses, traces = [], []

    @tg.jit
    def step(x, y):
        traces.append(1)
        loss, grads = tg.withgradient(lambda: loss_fn(model, x, y), ps)
        tg.update_(state, ps, grads)
        losses.append(loss)
        return loss

    with pytest.warns(tg.RetraceWarning) as caught:
        got = [step(X, Y) for _ in range(3)]
    assert [str(w.message) for w in caught] == [
        "tg.jit: test_a_loss_log_appended_to_inside_a_compiled_step_is_said_not_silently_"
        "empty.<locals>.step stores values computed from its traced arrays in your objects "
        "(1 item(s) appended to a list). A traced value cannot stay there after the call, so "
        "each was taken out again (a new entry removed, an old value put back) and the "
        "function is traced again on every call. Return them from the function instead "
        "(`loss = step(x); losses.append(loss)`), or put an array there before the first "
        "call: an array the function replaces is written back after every call."
    ]
    assert losses == [] and len(traces) == 3
    # The step itself still trains as the uncompiled one does.
    ref_model, ref_losses = _reference_run(3)
    np.testing.assert_allclose(got, ref_losses, rtol=1e-5)
    for a, b in zip(leaves(model), leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over ~2 s: the default run stays under 3 minutes
@pytest.mark.parametrize("fix", ["returned", "array placeholder"])
def test_the_fixes_the_warning_names_log_every_loss_and_trace_once(fix):
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    losses, traces = [], []
    last = {"loss": jnp.zeros(())}  # an array there before the first call

    @tg.jit
    def step(x, y):
        traces.append(1)
        loss, grads = tg.withgradient(lambda: loss_fn(model, x, y), ps)
        tg.update_(state, ps, grads)
        if fix == "array placeholder":
            last["loss"] = loss  # replaces an array: an output, written back
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            loss = step(X, Y)
            losses.append(loss if fix == "returned" else last["loss"])
    assert len(traces) == 1
    assert not any(isinstance(v, jax.core.Tracer) for v in losses)
    np.testing.assert_allclose(losses, _reference_run(4)[1], rtol=1e-5)
