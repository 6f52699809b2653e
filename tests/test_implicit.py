"""Implicit mode: Params, Grads, and the classic Flux/Zygote questions."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

from .helpers import MLP, mse

x = jnp.array([3.0, 1, 0, 1, 2])


def test_question1_globals_and_replaced_array():
    global W, b
    W = jax.random.normal(jax.random.key(0), (3, 5))
    b = jnp.zeros(3)
    y = lambda x: jnp.sum(W @ x + b)
    old_W = W
    grads = tg.gradient(lambda: y(x), tg.Params([W, b]))
    np.testing.assert_allclose(grads[W], np.outer(np.ones(3), x))
    np.testing.assert_allclose(grads[b], np.ones(3))
    assert set(grads.named()) == {"0", "1"} and len(grads) == 2
    W = W * 2.0  # a new array: a new object
    with pytest.raises(KeyError, match="may have been replaced"):
        grads[W]
    np.testing.assert_allclose(grads[old_W], np.outer(np.ones(3), x))
    with pytest.raises(KeyError, match="not a registered parameter"):
        grads[jnp.ones(7)]


class RNNCell(tg.Module):
    def __init__(self, n_in, n_hidden, key):
        k1, k2 = jax.random.split(key)
        self.Wi = jax.random.normal(k1, (n_hidden, n_in)) * 0.5
        self.Wh = jax.random.normal(k2, (n_hidden, n_hidden)) * 0.5
        self.b = jnp.zeros(n_hidden)

    def __call__(self, h, x):
        return jnp.tanh(self.Wi @ x + self.Wh @ h + self.b)


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_question2_recurrent_model_names_each_gradient():
    rnn = RNNCell(2, 3, jax.random.key(1))
    seq = jax.random.normal(jax.random.key(2), (3, 2))

    def run(m):
        h = jnp.zeros(3)
        total = jnp.zeros(())
        for t in range(3):
            h = m(h, seq[t])
            total = total + jnp.sum(h)
        return total

    ps = tg.params(rnn)
    grads = tg.gradient(lambda: run(rnn), ps)
    assert list(grads.named()) == ["Wi", "Wh", "b"]
    assert all(a is b for a, b in zip(grads, [rnn.Wi, rnn.Wh, rnn.b], strict=True))

    ref = jax.grad(run)(rnn)
    for name in ("Wi", "Wh", "b"):
        np.testing.assert_allclose(grads.named()[name], getattr(ref, name), rtol=1e-5, atol=1e-7)


def test_question4_work_outside_the_closure_warns():
    model = nn.Dense(4, 2, key=jax.random.key(0))
    xs = jnp.ones((3, 4))
    target = jnp.zeros((3, 2))
    ps = tg.params(model)
    q = model(xs)  # computed outside
    with pytest.warns(tg.NoGradientWarning, match="outside the function"):
        grads = tg.gradient(lambda: jnp.mean((q - target) ** 2), ps)
    assert all(g is None for g in grads.values())
    with pytest.raises(tg.NoGradientError):
        tg.gradient(lambda: jnp.mean((q - target) ** 2), ps, strict=True)
    grads = tg.gradient(lambda: jnp.mean((model(xs) - target) ** 2), ps)
    assert all(g is not None for g in grads.values())


def test_parameter_through_inner_jit_helper():
    w = jnp.array([1.0, 2.0])
    helper = jax.jit(lambda v: jnp.sum(w * v))
    grads = tg.gradient(lambda: helper(jnp.array([3.0, 4.0])), tg.Params([w]))
    np.testing.assert_allclose(grads[w], [3.0, 4.0])


def test_parameter_through_dict_list_and_attribute():
    a, c = jnp.array(2.0), jnp.ones(2)
    store = {"a": a, "items": [c]}

    class Box:
        pass

    box = Box()
    box.store = store
    grads = tg.gradient(lambda: box.store["a"] * jnp.sum(box.store["items"][0]), tg.Params(store))
    assert float(grads[a]) == 2.0
    np.testing.assert_allclose(grads[c], [2.0, 2.0])
    assert list(grads.named()) == ["a", "items.0"]


def test_scalar_parameter():
    s = jnp.asarray(3.0)
    grads = tg.gradient(lambda: s**2, tg.Params(s))
    assert float(grads[s]) == 6.0


def test_unused_parameter_is_none_not_zero():
    u, v = jnp.ones(2), jnp.ones(2)
    grads = tg.gradient(lambda: jnp.sum(u), tg.Params([u, v]))
    assert grads[v] is None


def test_tied_weight_appears_once_with_total_gradient():
    w = jnp.array([1.0, 2.0])
    tree = {"enc": w, "dec": w}
    ps = tg.params(tree)
    assert len(ps) == 1
    grads = tg.gradient(lambda: jnp.sum(tree["enc"] * 3.0) + jnp.sum(tree["dec"] ** 2), ps)
    np.testing.assert_allclose(grads[w], [5.0, 7.0])


def test_trainable_respected():
    class Norm(tg.Module):
        __trainable__ = ("scale",)

        def __init__(self):
            self.scale = jnp.ones(2)
            self.running = jnp.zeros(2)

    m = Norm()
    assert list(tg.params(m).named()) == ["scale"]


def test_numpy_parameters_converted_in_place_and_standalone_refused():
    d = {"w": np.ones(2, dtype=np.float32)}
    ps = tg.Params(d)
    assert isinstance(d["w"], jax.Array) and d["w"] in ps
    with pytest.raises(TypeError, match=r"jnp\.asarray"):
        tg.Params(np.ones(2))


def test_params_follow_container_updates():
    model = nn.Dense(2, 1, key=jax.random.key(0))
    ps = tg.params(model)
    old = model.weight
    model.weight = model.weight + 1.0
    assert model.weight in ps and old not in ps


def test_grads_arithmetic_and_map():
    u, v = jnp.ones(2), jnp.full(2, 2.0)
    ps = tg.Params([u, v])
    g1 = tg.gradient(lambda: jnp.sum(u * 3.0), ps)
    g2 = tg.gradient(lambda: jnp.sum(u) + jnp.sum(v * 2.0), ps)
    np.testing.assert_allclose((g1 + g2)[u], [4.0, 4.0])
    np.testing.assert_allclose((g1 + g2)[v], [2.0, 2.0])  # None acts as zero
    np.testing.assert_allclose((g1 - g2)[v], [-2.0, -2.0])
    np.testing.assert_allclose((g2 * 2)[v], [4.0, 4.0])
    np.testing.assert_allclose((2 * g2)[v], [4.0, 4.0])
    np.testing.assert_allclose((g2 / 2)[v], [1.0, 1.0])
    np.testing.assert_allclose((-g2)[v], [-2.0, -2.0])
    assert g1.map(jnp.sign)[v] is None
    other = tg.gradient(lambda: jnp.sum(u), tg.Params([u]))
    with pytest.raises(ValueError, match="different parameter sets"):
        g1 + other
    with pytest.raises(TypeError, match="Grads is read-only"):
        g1["w"] = 1


def test_grads_summed_over_batches_equal_jax_grad_of_the_summed_loss():
    w = jnp.array([0.5, -1.0])
    ps = tg.Params([w])
    batches = [jnp.array([1.0, 2.0]), jnp.array([-3.0, 0.5]), jnp.array([2.0, 2.0])]
    total = sum(tg.gradient(lambda: jnp.sum(jnp.sin(w * x)), ps) for x in batches)  # noqa: B023
    want = jax.grad(lambda w: sum(jnp.sum(jnp.sin(w * x)) for x in batches))(w)
    np.testing.assert_allclose(total[w], want, rtol=1e-6)
    # Only Python's starting 0 is an identity: any other number is refused, by name.
    with pytest.raises(TypeError, match=r"unsupported operand type\(s\) for \+: 'int' and 'Grads'"):
        1 + total


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_to_tree_equals_explicit():
    m = MLP(jax.random.key(3))
    xs = jax.random.normal(jax.random.key(4), (6, 4))
    ys = jnp.ones((6, 1))
    grads = tg.gradient(lambda: mse(m, xs, ys), tg.params(m))
    (explicit,) = tg.gradient(lambda mm: mse(mm, xs, ys), m)
    tree = grads.to_tree(m)
    assert type(tree) is MLP
    # One engine: the two styles agree to the last bit.
    for a, c in zip(
        jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(explicit), strict=True
    ):
        np.testing.assert_array_equal(a, c)
    assert "layers.0.weight" in repr(grads) and "norm" in repr(grads)


def test_fifty_steps_one_trace_and_current_values():
    traces = []
    model = nn.Dense(3, 1, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (8, 3))
    ys = jnp.ones((8, 1))

    def loss(m):
        traces.append(1)
        return jnp.mean((m(xs) - ys) ** 2)

    ps = tg.params(model)
    for _ in range(50):
        grads = tg.gradient(lambda: loss(model), ps)
        ref = jax.grad(lambda m: jnp.mean((m(xs) - ys) ** 2))(model)
        np.testing.assert_allclose(grads[model.weight], ref.weight, rtol=1e-5, atol=1e-7)
        model.weight = model.weight - 0.1 * grads[model.weight]
        model.bias = model.bias - 0.1 * grads[model.bias]
    assert len(traces) == 1


def test_withgradient_implicit_returns_value():
    w = jnp.array([1.0, 2.0])
    value, grads = tg.withgradient(lambda: jnp.sum(w**2), tg.Params([w]))
    assert float(value) == 5.0
    np.testing.assert_allclose(grads[w], [2.0, 4.0])


def test_implicit_pullback_and_jacobian():
    w = jnp.array([1.0, 2.0])
    ps = tg.Params([w])
    _, back = tg.pullback(lambda: w * 3.0, ps)
    np.testing.assert_allclose(back(jnp.ones(2))[w], [3.0, 3.0])
    J = tg.jacobian(lambda: w**2, ps)
    np.testing.assert_allclose(J[w], np.diag([2.0, 4.0]))


def test_parameter_hidden_in_opaque_object_is_an_error():
    o = collections.deque([jnp.ones(2)])  # a container treegrad does not see into
    with pytest.raises(TypeError, match=r"registered parameter \(float32\[2\]\).*cannot see into"):
        tg.gradient(lambda: jnp.sum(o[0]), tg.Params(o[0]))


def test_parameter_in_slotted_object_is_found():
    class Slotted:
        __slots__ = ("w",)

    o = Slotted()
    o.w = jnp.array([1.0, 2.0])
    grads = tg.gradient(lambda: jnp.sum(o.w**2), tg.Params(o.w))
    np.testing.assert_allclose(grads[o.w], [2.0, 4.0])


# Flux's `Params([W, b])` with W and b globals: Julia's update! mutates the arrays; jax
# arrays are immutable, so tg.update_ rebinds them inside the list the Params holds,
# which the loss does not read. It trained nothing, silently, until the next gradient.
def _globals_case():
    W, b, x = jnp.ones((2, 3)), jnp.zeros(2), jnp.arange(3.0)
    ps = tg.Params([W, b])
    state = tg.setup(optax.adam(0.1), ps)
    return W, b, x, ps, state


def test_params_the_loss_does_not_read_are_refused_at_the_next_gradient_changing_nothing():
    W, b, x, ps, state = _globals_case()
    tg.update_(state, ps, tg.gradient(lambda: jnp.sum((W @ x + b) ** 2), ps))
    # The first step is optax's (the loss read the current arrays)...
    want = optax.apply_updates(
        [W, b],
        optax.adam(0.1).update(
            jax.grad(lambda ws: jnp.sum((ws[0] @ x + ws[1]) ** 2))([W, b]),
            optax.adam(0.1).init([W, b]),
        )[0],
    )
    np.testing.assert_allclose(ps[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(ps[1], want[1], rtol=1e-6)
    # ...and the next, reading W and b, which the update replaced only in the Params, is
    # refused before any change.
    arrays, before = list(ps.arrays()), jax.tree.leaves(state)
    with pytest.raises(
        TypeError,
        match=r"tg\.gradient: the loss reads, as W, the old array of the Params' parameter 0 "
        r"\(float32\[2×3\]\), which tg\.update_ replaced only inside the containers the "
        r"Params holds.*never train.*Nothing was changed",
    ):
        tg.gradient(lambda: jnp.sum((W @ x + b) ** 2), ps)
    assert all(a is c for a, c in zip(ps.arrays(), arrays, strict=True))
    assert all(a is c for a, c in zip(jax.tree.leaves(state), before, strict=True))


def test_update_in_place_refused_inside_tg_jit_too_and_the_model_is_kept():
    model = nn.Dense(3, 2, key=jax.random.key(1))
    weight, bias = model.weight, model.bias
    ps = tg.Params([model.bias])  # a list of its own: the loss reads model.bias
    state = tg.setup(optax.sgd(0.1), ps)

    @tg.jit
    def step(x):
        g = tg.gradient(lambda: jnp.sum(model(x) ** 2), ps)
        tg.update_(state, ps, g)

    with pytest.raises(TypeError, match=r"parameter 0 \(float32\[2\]\) as model\.bias"):
        step(jnp.ones((4, 3)))
    assert model.weight is weight and model.bias is bias and ps[0] is bias


def test_update_in_place_of_params_of_the_container_the_loss_reads_equals_optax():
    W, b, x, _, _ = _globals_case()
    p = {"W": W, "b": b}
    ps = tg.params(p)
    state = tg.setup(optax.adam(0.1), ps)

    def f(q):
        return jnp.sum((q["W"] @ x + q["b"]) ** 2)

    rule = optax.adam(0.1)
    ref, ref_state = {"W": W, "b": b}, rule.init({"W": W, "b": b})
    for _ in range(3):
        tg.update_(state, ps, tg.gradient(lambda: f(p), ps))
        u, ref_state = rule.update(jax.grad(f)(ref), ref_state, ref)
        ref = optax.apply_updates(ref, u)
    np.testing.assert_allclose(p["W"], ref["W"], rtol=1e-6)
    np.testing.assert_allclose(p["b"], ref["b"], rtol=1e-6)


def test_update_in_place_when_the_loss_reads_the_params_themselves_is_allowed():
    # Flux's weight-decay idiom reads the parameters through the Params: after the
    # update it reads the new arrays, so nothing is stale.
    W, b, _, ps, state = _globals_case()
    state = tg.setup(optax.sgd(0.1), ps)
    g = tg.gradient(lambda: sum(jnp.sum(q**2) for q in ps), ps)
    tg.update_(state, ps, g)
    np.testing.assert_allclose(ps[0], W - 0.1 * 2 * W, rtol=1e-6)
    np.testing.assert_allclose(ps[1], b, rtol=1e-6)


def test_train_with_params_the_loss_does_not_read_names_the_step_and_keeps_everything():
    W, b, x, ps, state = _globals_case()
    before = jax.tree.leaves(state)
    with pytest.raises(
        TypeError, match=r"tg\.train, at epoch 0, step 0: tg\.update_: the loss reads the Params'"
    ):
        tg.train(lambda x: jnp.sum((W @ x + b) ** 2), ps, [(x,)] * 3, state)
    assert ps[0] is W and ps[1] is b
    assert all(a is c for a, c in zip(jax.tree.leaves(state), before, strict=True))


@pytest.mark.parametrize("compiled", [False, True])
def test_update_in_place_with_the_model_given_as_an_argument_is_not_refused(compiled):
    # Inside tg.jit, an argument is rebuilt for the trace (`m` is not `model` there, as
    # it is uncompiled), yet each call gives it afresh: nothing stale to refuse.
    model = {"w": jnp.array([1.0, 2.0])}
    ps = tg.params(model)
    state = tg.setup(optax.sgd(0.1), ps)

    def step(m):
        tg.update_(state, ps, tg.gradient(lambda: jnp.sum(m["w"] ** 2), ps))

    step = tg.jit(step) if compiled else step
    step(model)
    step(model)
    np.testing.assert_allclose(model["w"], 0.8 * 0.8 * np.array([1.0, 2.0]), rtol=1e-6)


def test_gradients_summed_over_many_batches_keep_no_batch_alive_but_one():
    # A Grads keeps the loss it was taken of (for tg.update_'s read check): summed over
    # batches, one loss of each program is kept, not every batch it closed over.
    import gc
    import weakref

    p = {"w": jnp.array([0.5, -1.0])}
    ps = tg.params(p)
    refs = []

    def batch_gradient(i):
        x = jnp.full(2, float(i))
        refs.append(weakref.ref(x))
        return tg.gradient(lambda: jnp.sum(p["w"] * x), ps)

    total = batch_gradient(0)
    for i in range(1, 20):
        total = total + batch_gradient(i)
    gc.collect()
    assert sum(r() is not None for r in refs) <= 1
    np.testing.assert_allclose(total[p["w"]], np.full(2, sum(range(20))), rtol=1e-6)
