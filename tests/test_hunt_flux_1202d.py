"""Flux.jl's test suite, ported to treegrad (test/utils.jl, test/layers/basic.jl,
test/train.jl, test/loading.jl), each port checked against an independent
reference: `jax.grad` on the explicit function, plain optax on the leaves, or a
closed form. The hunt is for silent wrong results: ties coming apart, frozen
parameters moving, `tg.train` in its two styles disagreeing, a NaN step losing
the user's progress.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

K = jax.random.split(jax.random.key(1202), 8)


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _ls(*shape):
    """Flux's `ls(dims...)`: 1, 2, 3, ... in a float32 array of `shape`."""
    return jnp.arange(1, int(np.prod(shape)) + 1, dtype=jnp.float32).reshape(shape)


def _dense(nin, nout, bias, act=None):
    d = nn.Dense(nin, nout, act, key=K[0], use_bias=bias)
    d.weight = _ls(nout, nin)
    if bias:
        d.bias = jnp.arange(nout, dtype=jnp.float32) / 10
    return d


def _dm(bias):
    """Flux's `dm(bias)`: Chain(dl(3, 5), dl(5, 4), dl(4, 3))."""
    return nn.Chain(_dense(3, 5, bias), _dense(5, 4, bias), _dense(4, 3, bias))


def _apply(leaves, x, acts):
    """The explicit function of a Chain of Dense layers: [(W, b or None), ...]."""
    for (w, b), act in zip(leaves, acts, strict=True):
        x = x @ w.T + (0 if b is None else b)
        x = x if act is None else act(x)
    return x


def _data(n, nin=3, nout=2, batch=5):
    return [
        (
            jax.random.normal(jax.random.key(10 + i), (batch, nin)),
            jax.random.normal(jax.random.key(100 + i), (batch, nout)),
        )
        for i in range(n)
    ]


def _mse(m, x, y):
    return tg.losses.mse(m(x), y)


def _optax_run(rule, f, leaves, data, state=None):
    """Plain optax on a list of leaves: the reference for every training port."""
    state = rule.init(leaves) if state is None else state
    for batch in data:
        g = jax.grad(f)(leaves, *batch)
        u, state = rule.update(g, state, leaves)
        leaves = optax.apply_updates(leaves, u)
    return leaves, state


# ---------------------------------------------------------------- test/utils.jl


@pytest.mark.slow
def test_params_of_a_layer_held_twice_lists_each_array_once():
    # Flux: `c = Chain(m, m)`; trainables(c) == trainables(m), sizes in order.
    m = nn.Chain(nn.Dense(10, 5, key=K[0], use_bias=False), nn.Dense(5, 5, key=K[1]))
    c = nn.Chain(m, m)
    assert [p.shape for p in tg.params(m)] == [(5, 10), (5, 5), (5,)]
    assert [p.shape for p in tg.params(c)] == [(5, 10), (5, 5), (5,)]
    assert all(a is b for a, b in zip(tg.params(c), tg.params(m), strict=True))
    assert list(tg.params(c).named()) == [
        "layers.0.layers.0.weight",
        "layers.0.layers.1.weight",
        "layers.0.layers.1.bias",
    ]
    x = jax.random.normal(K[2], (3, 10))

    # Only the first place is called: its gradient is jax.grad's, the second's None.
    def explicit(ws):
        w1, w2, b2 = ws
        return jnp.sum(jnp.sin((x @ w1.T) @ w2.T + b2))

    ws = [m[0].weight, m[1].weight, m[1].bias]
    (g,) = tg.gradient(lambda c: jnp.sum(jnp.sin(c[0](x))), c)
    ref = jax.grad(explicit)(ws)
    _close(g[0][0].weight, ref[0])
    _close(g[0][1].weight, ref[1])
    _close(g[0][1].bias, ref[2])
    assert g[1][0].weight is None


def test_params_gradient_through_trainables_inside_the_loss():
    # Flux "trainables gradient": gradient(m -> sum(norm, trainables(m)), m).
    m = {"x": jnp.array([1.0, 2.0]), "y": jnp.array([3.0])}
    (g,) = tg.gradient(lambda m: sum(jnp.linalg.norm(p) for p in tg.params(m)), m)
    _close(g["x"], [0.4472135954999579, 0.8944271909999159])
    _close(g["y"], [1.0])


@pytest.mark.parametrize("bias", [pytest.param(True, marks=pytest.mark.slow), False])
def test_destructure_round_trip_bias_types(bias):
    # Flux "destructure / Bias type": re(p) gives the same layers, bias or none.
    m = _dm(bias)
    p, re = tg.destructure(m)
    want = jnp.concatenate([jnp.ravel(a) for a in tg.params(m)])
    n = 15 + 20 + 12 + (5 + 4 + 3 if bias else 0)
    assert p.shape == (n,)
    _close(p, want, 0)
    r = re(p)
    for l1, l2 in zip(r, _dm(bias), strict=True):
        _close(l1.weight, l2.weight, 0)
        if bias:
            _close(l1.bias, l2.bias, 0)
        else:
            assert l1.bias is None and l2.bias is None
    x = jax.random.normal(K[3], (2, 3))
    _close(r(x), m(x))
    # A vector of other values lands at the right places.
    r2 = re(jnp.arange(n, dtype=jnp.float32))
    _close(r2[0].weight, jnp.arange(15, dtype=jnp.float32).reshape(5, 3), 0)


@pytest.mark.slow
def test_destructure_restructure_in_gradient():
    # Flux: ∇p = gradient(θ -> sum(re(θ)(x)), p) ≈ destructure(∇m)[1].
    x = jax.random.uniform(K[4], (1, 3))
    m = _dm(True)
    (gm,) = tg.gradient(lambda m: jnp.sum(m(x)), m)
    p, re = tg.destructure(m)
    gp = jax.grad(lambda t: jnp.sum(re(t)(x)))(p)
    _close(gp, tg.destructure(gm)[0])
    # Independent: jax.grad on the explicit function of the leaves.
    leaves = [(layer.weight, layer.bias) for layer in m]
    ref = jax.grad(lambda ls: jnp.sum(_apply(ls, x, [None] * 3)))(leaves)
    _close(gp, jnp.concatenate([jnp.ravel(a) for pair in ref for a in pair]))


@pytest.mark.slow
def test_destructure_unused_layer_gets_zero_gradient_of_full_length():
    # Flux issue 1601: a layer the model never calls is still in the vector.
    class TwoDenses(tg.Module):
        def __init__(self):
            self.dense = nn.Dense(3, 1, key=K[0])
            self.dense2 = nn.Dense(3, 2, key=K[1])

        def __call__(self, x):
            return self.dense(x)

    model = TwoDenses()
    p, re = tg.destructure(model)
    assert p.shape == (3 + 1 + 6 + 2,)
    x = jnp.array([1.0, 2.0, 3.0])
    _, back = jax.vjp(lambda x, p: re(p)(x), x, p)
    dx, dp = back(jnp.array([4.0]))
    assert dp.shape == p.shape
    _close(dp, jnp.concatenate([4 * x, jnp.array([4.0]), jnp.zeros(8)]))
    _close(dx, 4 * model.dense.weight[0])


@pytest.mark.slow
def test_destructure_shared_layer_gradient_is_the_sum():
    # Flux issue 1767: Model(d, d); the flat gradient is g.a + g.b.
    d = nn.Dense(1, 1, key=K[2])

    class Model(tg.Module):
        def __init__(self):
            self.a = d
            self.b = d

        def __call__(self, x):
            return self.a(x) + jnp.tanh(self.b(x))

    model = Model()
    x = jax.random.uniform(K[3], (1, 1))
    p, re = tg.destructure(model)
    assert p.shape == (2,)
    g2 = jax.grad(lambda p: jnp.sum(re(p)(x)))(p)

    def explicit(w, b):
        h = x @ w.T + b
        return jnp.sum(h + jnp.tanh(h))

    ref = jax.grad(explicit, argnums=(0, 1))(d.weight, d.bias)
    _close(g2, jnp.concatenate([ref[0].ravel(), ref[1].ravel()]))
    # Explicit mode: the total at the first place, None at the second (to_tree's rule).
    (g1,) = tg.gradient(lambda m: jnp.sum(m(x)), model)
    _close(g1.a.weight, ref[0])
    assert g1.b.weight is None and g1.b.bias is None
    # rebuild keeps the sharing: the rebuilt model holds one Dense at both places.
    r = re(p * 2)
    assert r.a is r.b
    _close(r.a.weight, 2 * d.weight)


@pytest.mark.slow
def test_destructure_split_model_forward_mode_matches_reverse():
    # Flux issue 1826: a Split layer; ForwardDiff through re(pv) == Zygote.
    class Split(tg.Module):
        def __init__(self, *paths):
            self.paths = list(paths)

        def __call__(self, x):
            return tuple(f(x) for f in self.paths)

    data = jax.random.uniform(K[4], (13, 5))
    model = nn.Chain(
        nn.Dense(5, 11, key=K[0]), Split(nn.Dense(11, 3, key=K[1]), nn.Dense(11, 7, key=K[2]))
    )
    pvec, re = tg.destructure(model)

    def loss(pv, idx):
        return jnp.sum(re(pv)(data)[idx] ** 2)

    for idx in (0, 1):
        fwd = jax.jacfwd(lambda pv, idx=idx: loss(pv, idx))(pvec)
        rev = jax.grad(loss)(pvec, idx)
        _close(fwd, rev, 1e-4)
        (g,) = tg.gradient(lambda m, idx=idx: jnp.sum(m(data)[idx] ** 2), model)
        other = 1 - idx
        assert g[1].paths[other].weight is None  # the other head does not reach the loss
        ps = tg.params(model)
        grads = tg.gradient(lambda idx=idx: jnp.sum(model(data)[idx] ** 2), ps)
        flat = [jnp.zeros_like(p) if grads[p] is None else grads[p] for p in ps]
        _close(rev, jnp.concatenate([jnp.ravel(a) for a in flat]), 1e-4)


@pytest.mark.slow
def test_destructure_ties_statics_integers_and_a_non_trainable_buffer():
    # A tie between two distinct layers, an integer array, a string, a buffer outside
    # __trainable__: the vector holds the tied array once and none of the others.
    class Net(tg.Module):
        __trainable__ = ("a", "b", "steps", "name")

        def __init__(self):
            self.a = nn.Dense(3, 3, jnp.tanh, key=K[0])
            self.b = nn.Dense(3, 3, key=K[1])
            self.b.weight = self.a.weight
            self.steps = jnp.array(7)
            self.name = "net"
            self.buffer = jnp.ones(3)

        def __call__(self, x):
            return self.b(self.a(x)) * self.buffer

    net = Net()
    p, re = tg.destructure(net)
    assert p.shape == (9 + 3 + 3,)
    r = re(p + 1)
    assert r.a.weight is r.b.weight
    _close(r.a.weight, net.a.weight + 1)
    assert r.steps is net.steps and r.name == "net" and r.buffer is net.buffer
    x = jax.random.normal(K[2], (4, 3))

    def explicit(w, b1, b2):
        return jnp.sum(jnp.tanh(x @ w.T + b1) @ w.T + b2)

    ref = jax.grad(explicit, argnums=(0, 1, 2))(net.a.weight, net.a.bias, net.b.bias)
    gp = jax.grad(lambda v: jnp.sum(re(v)(x)))(p)
    _close(gp, jnp.concatenate([r.ravel() for r in ref]))
    # The same under jax.jit, with rebuild passed as an argument.
    gj = jax.jit(jax.grad(lambda v, re: jnp.sum(re(v)(x))))(p, re)
    _close(gj, gp)


# ------------------------------------------------------- test/layers/basic.jl


@pytest.mark.slow
def test_dense_shapes_and_closed_forms():
    d = nn.Dense(10, 5, key=K[0])
    assert d.weight.shape == (5, 10) and d.bias.shape == (5,)
    for batch in [(), (2,), (2, 3), (2, 3, 4)]:
        assert d(jnp.ones((*batch, 10))).shape == (*batch, 5)
    # Flux "zeros": init = ones gives 10 * ones.
    o = nn.Dense(10, 2, key=K[0])
    o.weight = jnp.ones((2, 10))
    _close(o(jnp.stack([jnp.ones(10), 2 * jnp.ones(10)])), [[10, 10], [20, 20]], 0)
    # "type matching": integer and bool inputs give the float result of W x.
    d1 = nn.Dense(2, 3, key=K[1])
    d1.bias = jnp.arange(3.0)
    x3 = jnp.array([[-5, 3], [2, 0], [1, 1], [4, -2]])
    _close(d1(x3), x3 @ d1.weight.T + d1.bias)
    assert d1(x3).dtype == jnp.float32
    assert d1(x3 > 0).dtype == jnp.float32


def test_dense_wrong_input_features_names_the_layer():
    d = nn.Dense(10, 5, key=K[0])
    with pytest.raises(ValueError, match=r"Dense\(10 => 5\): expected input with 10 features"):
        d(jnp.ones(1))
    with pytest.raises(ValueError, match=r"got shape \(11, 2, 3\)|got shape \(2, 3, 11\)"):
        d(jnp.ones((2, 3, 11)))
    with pytest.raises(ValueError, match=r"10 features on axis -1, got a float, not an array"):
        d(1.0)
    with pytest.raises(TypeError, match=r"out_features must be a positive int, got 10\.5"):
        nn.Dense(10, 10.5, key=K[0])
    chain = nn.Chain(nn.Dense(10, 5, jax.nn.sigmoid, key=K[0]), nn.Dense(2, 1, key=K[1]))
    with pytest.raises(ValueError, match=r"Dense\(2 => 1\): expected input with 2 features"):
        chain(jnp.ones(10))


@pytest.mark.slow
def test_chain_indexing_slicing_and_nesting():
    c = nn.Chain(
        nn.Dense(10, 5, jax.nn.sigmoid, key=K[0]),
        nn.Dense(5, 2, key=K[1]),
        nn.Dense(2, 1, jax.nn.relu, key=K[2]),
    )
    assert c[0] is c.layers[0] and c[-1] is c.layers[2]
    s = c[1:]
    assert type(s) is nn.Chain and len(s) == 2 and s[0] is c[1]
    x = jax.random.normal(K[3], (4, 10))
    _close(s(c[0](x)), c(x))
    # Nested chains: the state mirrors them, and the gradient is jax.grad's.
    inner = nn.Chain(nn.Dense(3, 4, jnp.tanh, key=K[4]), jax.nn.relu)
    outer = nn.Chain(inner, nn.Dense(4, 2, key=K[5]))
    assert outer[0][1] is jax.nn.relu
    st = tg.setup(optax.sgd(0.1), outer)
    assert st[0][1] is None
    x = jax.random.normal(K[6], (5, 3))
    (g,) = tg.gradient(lambda m: jnp.sum(m(x) ** 2), outer)
    leaves = [(inner[0].weight, inner[0].bias), (outer[1].weight, outer[1].bias)]
    ref = jax.grad(
        lambda ls: jnp.sum(_apply(ls, x, [lambda h: jax.nn.relu(jnp.tanh(h)), None]) ** 2)
    )(leaves)
    _close(g[0][0].weight, ref[0][0])
    _close(g[1].bias, ref[1][1])
    # A sub-state of the nested chain is adjustable on its own.
    rule = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    st = tg.setup(rule, outer)
    tg.adjust_(st[0][0], learning_rate=0.5)
    _, new = tg.update(st, outer, g)
    _close(new[0][0].weight, inner[0].weight - 0.5 * ref[0][0])
    _close(new[1].weight, outer[1].weight - 0.1 * ref[1][0])


# ------------------------------------------------------------- test/train.jl


_RULES = {
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
    "adagrad": lambda: optax.adagrad(0.1),
    "rmsprop": lambda: optax.rmsprop(0.01),
    "sgd": lambda: optax.sgd(0.1),
    "nesterov": lambda: optax.sgd(0.01, momentum=0.9, nesterov=True),
    "adabelief": lambda: optax.adabelief(0.05),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_RULES))
def test_train_each_rule_is_plain_optax(name):
    # Flux "train! with each rule": a NamedTuple-like model with a `nothing` field.
    w = jax.random.normal(K[0], (10, 10))
    w2 = jax.random.normal(K[1], (10, 10))

    def loss(m, x):
        return tg.losses.mse(w @ x, m["weight"] @ x + m["bias"])

    model = {"weight": w2, "bias": jnp.zeros(10), "ignore": None}
    data = [(jax.random.uniform(jax.random.key(i), (10,)),) for i in range(20)]
    state = tg.setup(_RULES[name](), model)
    _, new, losses = tg.train(loss, model, data, state)
    ref, _ = _optax_run(
        _RULES[name](),
        lambda ls, x: tg.losses.mse(w @ x, ls[0] @ x + ls[1]),
        [w2, jnp.zeros(10)],
        data,
    )
    _close(new["weight"], ref[0], 1e-5)
    _close(new["bias"], ref[1], 1e-5)
    assert new["ignore"] is None and model["weight"] is w2  # the input is not modified
    assert losses[-1] < losses[0]


def _nan_setup():
    d = nn.Dense(1, 1, key=K[0])
    d.weight = jnp.zeros((1, 1))
    data = [(jnp.array(i),) for i in range(100)]

    def loss(m, i):
        return jnp.where(i == 50, jnp.nan, 1.0) * jnp.sum(m(jnp.ones(1)))

    return d, data, loss


def test_train_stops_on_nan_with_the_last_good_model_explicit():
    # Flux "Stop on NaN": 51 calls, weight ≈ -5, not corrupted.
    m, data, loss = _nan_setup()
    state = tg.setup(optax.sgd(0.1, momentum=0.9), m)
    seen = []
    with pytest.raises(tg.NonFiniteLossError, match=r"the loss is nan at epoch 0, step 50") as e:
        tg.train(loss, m, data, state, callbacks=[lambda s: seen.append(s.step)])
    err = e.value
    assert (err.epoch, err.step, len(err.losses), len(seen)) == (0, 50, 50, 50)
    # The user's model and state are untouched; the error holds step 49's.
    assert float(m.weight[0, 0]) == 0.0 and float(m.bias[0]) == 0.0
    ref_state, ref_model, ref_losses = tg.train(loss, m, data[:50], state)
    _close(err.model.weight, ref_model.weight, 0)
    _close(err.model.bias, ref_model.bias, 0)
    for a, b in zip(jax.tree.leaves(err.state), jax.tree.leaves(ref_state), strict=True):
        _close(a, b, 0)
    assert err.losses == ref_losses
    # Closed form, plain sgd with momentum on d(w + b)/dw = 1: the velocity sum.
    v, w = 0.0, 0.0
    for _ in range(50):
        v = 0.9 * v + 1.0
        w -= 0.1 * v
    _close(err.model.weight, [[w]], 1e-4)
    # Resuming from the error's model and state continues the run.
    _, resumed, _ = tg.train(loss, err.model, data[51:53], err.state)
    _, straight, _ = tg.train(loss, m, data[:50] + data[51:53], state)
    _close(resumed.weight, straight.weight, 0)


def test_train_stops_on_nan_and_puts_the_model_back_implicit():
    m, data, loss = _nan_setup()
    ps = tg.params(m)
    state = tg.setup(optax.sgd(0.1, momentum=0.9), ps)
    with pytest.raises(tg.NonFiniteLossError, match=r"the loss is nan at epoch 0, step 50") as e:
        tg.train(lambda i: loss(m, i), ps, data, state)
    assert e.value.model is m and e.value.state is state and len(e.value.losses) == 50
    ref = nn.Dense(1, 1, key=K[0])
    ref.weight = jnp.zeros((1, 1))
    ref_state, ref, _ = tg.train(loss, ref, data[:50], tg.setup(optax.sgd(0.1, momentum=0.9), ref))
    _close(m.weight, ref.weight, 0)
    _close(m.bias, ref.bias, 0)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        _close(a, b, 0)
    assert tg.params(m)[0] is m.weight  # the Params still follows the model


def test_train_nonfinite_gradient_names_the_path_and_keeps_the_model():
    model = {"w": jnp.ones(2), "v": jnp.ones(2)}
    data = [(jnp.array(1.0),), (jnp.array(1.0),), (jnp.array(0.0),)]

    def loss(m, i):  # finite loss 0 at i == 0, but d sqrt(w * 0)/dw = 0 * inf = nan
        return jnp.sum(jnp.sqrt(m["w"] * i)) + jnp.sum(m["v"])

    state = tg.setup(optax.sgd(0.1), model)
    with pytest.raises(
        tg.NonFiniteLossError,
        match=r"the gradient of 'w' is not finite \(the loss, 1.6, is\) at epoch 0, step 2",
    ) as e:
        tg.train(loss, model, data, state)
    _close(e.value.model["v"], [0.8, 0.8])
    _close(e.value.model["w"], 1 - 0.1 * 0.5 - 0.1 * 0.5 / jnp.sqrt(0.95))


def test_train_update_overflow_is_named():
    model = {"w": jnp.ones(2)}
    state = tg.setup(optax.sgd(1e38), model)
    with pytest.raises(tg.NonFiniteLossError, match=r"the update made a parameter not finite"):
        tg.train(lambda m, x: jnp.sum(m["w"] * x), model, [(jnp.full(2, 10.0),)], state)
    _close(model["w"], [1.0, 1.0], 0)


@pytest.mark.slow
def test_train_non_tuple_data_and_loss_measured_before_the_update():
    # Flux "non-tuple data": each batch a single array, passed as one argument.
    w = jax.random.normal(K[0], (4, 4))
    model = {"weight": jax.random.normal(K[1], (4, 4)), "bias": jnp.zeros(4)}

    def loss(m, x):
        return tg.losses.mse(w @ x, m["weight"] @ x + m["bias"])

    data = [jax.random.uniform(jax.random.key(i), (4,)) for i in range(5)]
    _, new, losses = tg.train(loss, model, data, tg.setup(optax.adamw(0.1), model))
    _close(losses[0], loss(model, data[0]), 1e-6)  # measured before the first update
    ref, _ = _optax_run(
        optax.adamw(0.1),
        lambda ls, x: tg.losses.mse(w @ x, ls[0] @ x + ls[1]),
        [model["weight"], model["bias"]],
        [(x,) for x in data],
    )
    _close(new["weight"], ref[0])


def test_train_callback_not_callable_is_refused_before_any_step():
    # Flux "callbacks give helpful error".
    m = nn.Dense(1, 1, key=K[0])
    state = tg.setup(optax.sgd(0.1), m)
    w0, leaves0 = m.weight, jax.tree.leaves(state)
    with pytest.raises(TypeError, match=r"callbacks\[0\] is a str, not a function"):
        tg.train(lambda m, x: jnp.sum(m(x)), m, [(jnp.ones(1),)], state, callbacks=["print"])
    assert m.weight is w0
    assert all(a is b for a, b in zip(jax.tree.leaves(state), leaves0, strict=True))


@pytest.mark.slow
def test_update_given_the_gradient_tuple_is_a_friendly_error():
    # Flux "update! features": update!(opt, m, gs) with the tuple gs.
    m = nn.Chain(nn.Dense(2, 3, jnp.tanh, key=K[0]), nn.Dense(3, 1, key=K[1]))
    x = jnp.ones(2)
    gs = tg.gradient(lambda m: jnp.sum(m(x)), m)
    state = tg.setup(optax.adam(1e-3), m)
    leaves0 = jax.tree.leaves(state)
    with pytest.raises(TypeError, match=r"got a 1-tuple of gradients.*grads\[0\]"):
        tg.update_(state, m, gs)
    with pytest.raises(TypeError, match=r"expected the optimiser state from tg.setup"):
        tg.update(optax.adam(1e-3), m, gs[0])
    assert all(a is b for a, b in zip(jax.tree.leaves(state), leaves0, strict=True))
    y1 = m(x)
    tg.update_(state, m, gs[0])
    assert float(m(x)[0]) < float(y1[0])


@pytest.mark.slow
def test_l2_regularisation_three_ways_agree_with_optax():
    # Flux "L2 regularisation": a penalty on named fields, a penalty over
    # trainables(m) inside the loss, and WeightDecay chained before Adam.
    data = _data(6)
    base = nn.Dense(3, 2, jnp.tanh, key=K[0])

    def run(loss, rule):
        m = nn.Dense(3, 2, jnp.tanh, key=K[0])
        _, m, _ = tg.train(loss, m, data, tg.setup(rule, m))
        return m

    m1 = run(
        lambda m, x, y: _mse(m, x, y) + 0.33 * (jnp.sum(m.weight**2) / 2 + jnp.sum(m.bias**2) / 2),
        optax.adam(0.1),
    )
    m2 = run(
        lambda m, x, y: _mse(m, x, y) + 0.33 * sum(jnp.sum(p**2) / 2 for p in tg.params(m)),
        optax.adam(0.1),
    )
    m3 = run(_mse, optax.chain(optax.add_decayed_weights(0.33), optax.adam(0.1)))
    ref, _ = _optax_run(
        optax.chain(optax.add_decayed_weights(0.33), optax.adam(0.1)),
        lambda ls, x, y: jnp.mean((jnp.tanh(x @ ls[0].T + ls[1]) - y) ** 2),
        [base.weight, base.bias],
        data,
    )
    for m in (m1, m2, m3):
        _close(m.weight, ref[0])
        _close(m.bias, ref[1])


def _tied_model():
    """Chain(d, d, a, b) with b.weight = a.weight: a layer twice and a tied array."""
    d = nn.Dense(3, 3, jnp.tanh, key=K[0])
    a = nn.Dense(3, 3, jnp.tanh, key=K[1])
    b = nn.Dense(3, 2, key=K[2])
    b.weight = a.weight[:2] * 0 + jax.random.normal(K[3], (2, 3))  # its own array...
    a2 = nn.Dense(3, 3, key=K[4])
    a2.weight = a.weight  # ...and a tied one
    return nn.Chain(d, d, a, a2, b)


def _tied_ref_leaves(m):
    return [m[0].weight, m[0].bias, m[2].weight, m[2].bias, m[3].bias, m[4].weight, m[4].bias]


def _tied_explicit(ls, x, y):
    wd, bd, wa, ba, b2, wb, bb = ls
    h = jnp.tanh(x @ wd.T + bd)
    h = jnp.tanh(h @ wd.T + bd)
    h = jnp.tanh(h @ wa.T + ba)
    h = h @ wa.T + b2
    return jnp.mean((h @ wb.T + bb - y) ** 2)


def _assert_ties(m):
    assert m.layers[0] is m.layers[1]
    assert m[2].weight is m[3].weight


@pytest.mark.slow
def test_train_tied_model_explicit_and_params_agree_with_optax_and_stay_tied():
    data = _data(5, nout=2)
    rule = lambda: optax.adamw(0.05, weight_decay=0.1)
    m = _tied_model()
    _, new, losses = tg.train(_mse, m, data, tg.setup(rule(), m), epochs=2)
    _assert_ties(new)
    _assert_ties(m)
    ref, _ = _optax_run(rule(), _tied_explicit, _tied_ref_leaves(m), data * 2)
    for got, want in zip(_tied_ref_leaves(new), ref, strict=True):
        _close(got, want)
    mi = _tied_model()
    ps = tg.params(mi)
    assert len(ps) == 7
    _, back, losses_i = tg.train(
        lambda x, y: _mse(mi, x, y), ps, data, tg.setup(rule(), ps), epochs=2
    )
    assert back is mi
    _assert_ties(mi)
    for got, want in zip(_tied_ref_leaves(mi), ref, strict=True):
        _close(got, want)
    _close(losses_i, losses, 1e-6)


@pytest.mark.slow
def test_freeze_then_thaw_matches_optax_with_the_moments_kept():
    # Optimisers.jl freeze!/thaw!: adamw on a two-layer chain; layer 0 frozen for two
    # steps (weight decay must not move it either), then thawed.
    data = _data(4, nout=2)
    m = nn.Chain(nn.Dense(3, 4, jnp.tanh, key=K[0]), nn.Dense(4, 2, key=K[1]))
    rule = optax.adamw(0.05, weight_decay=0.1)
    st = tg.setup(rule, m)
    f = lambda ls, x, y: jnp.mean(
        (_apply([(ls[0], ls[1]), (ls[2], ls[3])], x, [jnp.tanh, None]) - y) ** 2
    )
    leaves = [m[0].weight, m[0].bias, m[1].weight, m[1].bias]
    ref, ref_st = _optax_run(rule, f, leaves, data[:1])
    st, m = tg.update(st, m, tg.gradient(lambda m: _mse(m, *data[0]), m)[0])
    tg.freeze_(st[0])
    frozen = (m[0].weight, m[0].bias)
    mu0 = [ref_st[0].mu[0], ref_st[0].mu[1]]
    for x, y in data[1:3]:
        st, m = tg.update(st, m, tg.gradient(lambda m, x=x, y=y: _mse(m, x, y), m)[0])
    assert m[0].weight is frozen[0] and m[0].bias is frozen[1]
    # Reference: the unfrozen leaves trained by optax with the shared count advancing,
    # the frozen leaves' moments as they were.
    for x, y in data[1:3]:
        g = jax.grad(f)(ref, x, y)
        g = [jnp.zeros_like(g[0]), jnp.zeros_like(g[1]), g[2], g[3]]
        u, new_st = rule.update(g, ref_st, ref)
        u = [jnp.zeros_like(u[0]), jnp.zeros_like(u[1]), u[2], u[3]]
        adam = new_st[0]
        adam = adam._replace(
            mu=[ref_st[0].mu[0], ref_st[0].mu[1], adam.mu[2], adam.mu[3]],
            nu=[ref_st[0].nu[0], ref_st[0].nu[1], adam.nu[2], adam.nu[3]],
        )
        ref_st = (adam, *new_st[1:])
        ref = optax.apply_updates(ref, u)
    _close(ref_st[0].mu[0], mu0[0], 0)
    _close(m[1].weight, ref[2])
    tg.thaw_(st[0])
    st, m = tg.update(st, m, tg.gradient(lambda m: _mse(m, *data[3]), m)[0])
    ref, _ = _optax_run(rule, f, ref, data[3:], ref_st)
    for got, want in zip([m[0].weight, m[0].bias, m[1].weight, m[1].bias], ref, strict=True):
        _close(got, want)


@pytest.mark.slow
def test_adjust_sub_state_matches_optax_and_keeps_the_rest():
    # adjust!(state.layers[2], 0.0): that layer stops, the other carries on, and the
    # moments carry over (both parts continue from the joint optax state).
    data = _data(3, nout=2)
    m = nn.Chain(nn.Dense(3, 4, jnp.tanh, key=K[0]), nn.Dense(4, 2, key=K[1]))
    rule = lambda lr: optax.inject_hyperparams(optax.adam)(learning_rate=lr)
    st = tg.setup(rule(0.1), m)
    f = lambda ls, x, y: jnp.mean(
        (_apply([(ls[0], ls[1]), (ls[2], ls[3])], x, [jnp.tanh, None]) - y) ** 2
    )
    ref, ref_st = _optax_run(
        rule(0.1), f, [m[0].weight, m[0].bias, m[1].weight, m[1].bias], data[:1]
    )
    st, m = tg.update(st, m, tg.gradient(lambda m: _mse(m, *data[0]), m)[0])
    tg.adjust_(st[1], learning_rate=0.02)
    assert float(st[0].weight.state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    for x, y in data[1:]:
        st, m = tg.update(st, m, tg.gradient(lambda m, x=x, y=y: _mse(m, x, y), m)[0])
    # Reference: two copies of the joint optax state, one per learning rate, each
    # giving the update of its own leaves (adam is per leaf; the count is in both).
    hi = ref_st
    lo = ref_st._replace(hyperparams={**ref_st.hyperparams, "learning_rate": jnp.asarray(0.02)})
    opt = rule(0.1)
    for x, y in data[1:]:
        g = jax.grad(f)(ref, x, y)
        u_hi, hi = opt.update(g, hi, ref)
        u_lo, lo = opt.update(g, lo, ref)
        ref = optax.apply_updates(ref, [u_hi[0], u_hi[1], u_lo[2], u_lo[3]])
    for got, want in zip([m[0].weight, m[0].bias, m[1].weight, m[1].bias], ref, strict=True):
        _close(got, want)


@pytest.mark.slow
def test_train_callbacks_that_adjust_or_freeze_match_a_manual_loop():
    data = _data(6, nout=2)

    def mk():
        return nn.Chain(nn.Dense(3, 4, jnp.tanh, key=K[0]), nn.Dense(4, 2, key=K[1]))

    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    for action in ("adjust", "freeze"):

        def cb(info, action=action):
            if info.step == 2:
                if action == "adjust":
                    tg.adjust_(info.state[1], learning_rate=0.01)
                else:
                    tg.freeze_(info.state[1])

        m = mk()
        _, trained, _ = tg.train(_mse, m, data, tg.setup(rule, m), callbacks=[cb])
        mi = mk()
        ps = tg.params(mi)
        tg.train(lambda x, y, mi=mi: _mse(mi, x, y), ps, data, tg.setup(rule, ps), callbacks=[cb])
        m = mk()
        st = tg.setup(rule, m)
        for i, (x, y) in enumerate(data):
            st, m = tg.update(st, m, tg.gradient(lambda m, x=x, y=y: _mse(m, x, y), m)[0])
            cb(tg.StepInfo(0, i, 0.0, m, st))
        for got in (trained, mi):
            _close(got[0].weight, m[0].weight)
            _close(got[1].weight, m[1].weight)


# ----------------------------------------------------------- test/loading.jl


@pytest.mark.slow
def test_load_copies_arrays_and_keeps_the_like_models_static_data(tmp_path):
    # Flux loadmodel!(m1, m2): arrays copy over, the activation of m1 stays.
    m1 = nn.Chain(nn.Dense(10, 5, key=K[0]), nn.Dense(5, 2, jax.nn.relu, key=K[1]))
    m2 = nn.Chain(nn.Dense(10, 5, key=K[2]), nn.Dense(5, 2, key=K[3]))
    tg.save(tmp_path / "m2", m2)
    w1 = m1[0].weight
    out = tg.load(tmp_path / "m2", m1)
    _close(out[0].weight, m2[0].weight, 0)
    _close(out[1].bias, m2[1].bias, 0)
    assert out[1].activation is jax.nn.relu
    assert m1[0].weight is w1  # `like` is not modified


@pytest.mark.slow
def test_load_mismatches_name_the_path_and_shapes(tmp_path):
    m2 = nn.Chain(nn.Dense(10, 5, key=K[2]), nn.Dense(5, 2, key=K[3]))
    tg.save(tmp_path / "m2", m2)
    m4 = nn.Chain(nn.Dense(10, 6, key=K[0]), nn.Dense(6, 2, key=K[1]))
    with pytest.raises(
        ValueError, match=r"'layers.0.weight' is float32\[6, 10\] in the model but float32\[5, 10\]"
    ):
        tg.load(tmp_path / "m2", m4)
    # Absent bias, either way (Flux "loadmodel! & absent bias").
    m0 = nn.Chain(nn.Dense(10, 5, key=K[0], use_bias=False), nn.Dense(5, 2, key=K[1]))
    with pytest.raises(ValueError, match=r"has 'layers.0.bias', which the model lacks"):
        tg.load(tmp_path / "m2", m0)
    tg.save(tmp_path / "m0", m0)
    with pytest.raises(ValueError, match=r"the model has 'layers.0.bias' \(float32\[5\]\) but"):
        tg.load(tmp_path / "m0", m2)


@pytest.mark.slow
def test_load_tied_weights_come_back_tied_and_mismatched_ties_are_refused(tmp_path):
    # Flux "test shared weights": Chain(shared, Dense(shared.weight)).
    def tied(key_a, key_b):
        s = nn.Dense(10, 10, key=key_a)
        o = nn.Dense(10, 10, key=key_b)
        o.weight = s.weight
        return nn.Chain(s, o)

    m1, m2 = tied(K[0], K[1]), tied(K[2], K[3])
    tg.save(tmp_path / "t", m2)
    out = tg.load(tmp_path / "t", m1)
    assert out[0].weight is out[1].weight
    _close(out[0].weight, m2[1].weight, 0)
    _close(out[1].bias, m2[1].bias, 0)
    untied = nn.Chain(nn.Dense(10, 10, key=K[4]), nn.Dense(10, 10, key=K[5]))
    tg.save(tmp_path / "u", untied)
    with pytest.raises(
        ValueError,
        match=r"'layers.1.weight' and 'layers.0.weight' are one \(tied\) array in the model "
        r"but two different arrays in the checkpoint",
    ):
        tg.load(tmp_path / "u", m1)


def test_load_a_layer_held_twice_comes_back_one_object(tmp_path):
    # The same Dense at two places of a Chain: the model that was saved, and the one
    # tg.update returns, hold one object; so must the loaded one (an edit of one place
    # is then seen at the other, as in the model that was saved).
    d = nn.Dense(3, 3, jnp.tanh, key=K[0])
    m = nn.Chain(d, d, nn.Dense(3, 1, key=K[1]))
    tg.save(tmp_path / "m", m)
    e = nn.Dense(3, 3, jnp.tanh, key=K[2])
    like = nn.Chain(e, e, nn.Dense(3, 1, key=K[3]))
    out = tg.load(tmp_path / "m", like)
    assert out.layers[0] is out.layers[1]
    assert out.layers[2] is not out.layers[0]
    _close(out[0].weight, d.weight, 0)
    out[0].weight = out[0].weight * 0
    assert out[1].weight is out[0].weight  # the edit is seen at both places
    # A shared layer without arrays too, and a dict held twice.
    act = nn.Chain(jax.nn.relu)
    box = {"w": jnp.arange(2.0)}
    tree = {"a": act, "b": act, "p": box, "q": box}
    tg.save(tmp_path / "t", tree)
    back = tg.load(tmp_path / "t", tree)
    assert back["a"] is back["b"] and back["p"] is back["q"] and back["p"] is not box


@pytest.mark.slow
def test_load_a_layer_held_twice_then_training_equals_the_original(tmp_path):
    # With the state alongside, training after the load equals training the original.
    d = nn.Dense(3, 3, jnp.tanh, key=K[0])
    m = nn.Chain(d, d, nn.Dense(3, 1, key=K[1]))
    e = nn.Dense(3, 3, jnp.tanh, key=K[2])
    st = tg.setup(optax.adam(0.1), m)
    tg.save(tmp_path / "ms", {"m": m, "s": st})
    like_m = nn.Chain(e, e, nn.Dense(3, 1, key=K[3]))
    back = tg.load(tmp_path / "ms", {"m": like_m, "s": tg.setup(optax.adam(0.1), like_m)})
    x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    _, m1 = tg.update(st, m, tg.gradient(lambda m: _mse(m, x, y), m)[0])
    _, m2 = tg.update(back["s"], back["m"], tg.gradient(lambda m: _mse(m, x, y), back["m"])[0])
    assert m2.layers[0] is m2.layers[1]
    _close(m2[0].weight, m1[0].weight, 0)


def test_load_a_shared_layer_whose_saved_places_differ_stays_two_objects(tmp_path):
    # `like` holds one object at two places whose saved Python values differ: the
    # values are loaded as saved, each place its own (nothing silently dropped).
    saved = {"a": {"n": 1, "w": jnp.ones(2)}, "b": {"n": 2, "w": jnp.ones(2)}}
    shared = {"n": 0, "w": jnp.zeros(2)}
    tg.save(tmp_path / "s", saved)
    with pytest.raises(ValueError, match=r"one \(tied\) array in the model but two different"):
        tg.load(tmp_path / "s", {"a": shared, "b": shared})
    w = jnp.ones(2)
    saved = {"a": {"n": 1, "w": w}, "b": {"n": 2, "w": w}}
    tg.save(tmp_path / "t", saved)
    out = tg.load(tmp_path / "t", {"a": shared, "b": shared})
    assert (out["a"]["n"], out["b"]["n"]) == (1, 2)
    assert out["a"]["w"] is out["b"]["w"]


def test_load_preserves_saved_python_types(tmp_path):
    # Flux "state / preservation of saved types".
    m = {
        "num": 1,
        "cnum": 1.2 + 2j,
        "str": "hello",
        "arr": jnp.array([1, 2, 3]),
        "bool": True,
        "dict": {"a": 1, "b": 2},
        "tup": (1, 2, 3),
        "nth": None,
    }
    tg.save(tmp_path / "s", m)
    like = {
        "num": 0,
        "cnum": 0j,
        "str": "",
        "arr": jnp.zeros(3, jnp.int32),
        "bool": False,
        "dict": {"a": 0, "b": 0},
        "tup": (0, 0, 0),
        "nth": None,
    }
    out = tg.load(tmp_path / "s", like)
    assert {k: v for k, v in out.items() if k != "arr"} == {
        k: v for k, v in m.items() if k != "arr"
    }
    assert type(out["num"]) is int and type(out["bool"]) is bool and type(out["cnum"]) is complex
    np.testing.assert_array_equal(out["arr"], [1, 2, 3])


@pytest.mark.slow
def test_resume_after_save_load_with_ties_frozen_and_adjusted_parts(tmp_path):
    data = _data(4, nout=2)
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.05)

    def prepared(m):
        st = tg.setup(rule, m)
        tg.freeze_(st[0])  # the layer held twice
        tg.adjust_(st[4], learning_rate=0.01)
        return st

    m = _tied_model()
    st = prepared(m)
    st, m, _ = tg.train(_mse, m, data[:2], st)
    tg.save(tmp_path / "ck", {"m": m, "s": st})
    like_m = _tied_model()
    back = tg.load(tmp_path / "ck", {"m": like_m, "s": prepared(like_m)})
    _assert_ties(back["m"])
    _, straight, _ = tg.train(_mse, m, data[2:], st)
    _, resumed, _ = tg.train(_mse, back["m"], data[2:], back["s"])
    _assert_ties(resumed)
    for a, b in zip(_tied_ref_leaves(resumed), _tied_ref_leaves(straight), strict=True):
        _close(a, b, 0)
    assert resumed[0].weight is not None
    _close(resumed[0].weight, _tied_model()[0].weight, 0)  # frozen from the start


@pytest.mark.slow
def test_train_nan_in_params_style_puts_a_tied_model_back_tied():
    m = _tied_model()
    ps = tg.params(m)
    st = tg.setup(optax.adam(0.1), ps)
    data = _data(4, nout=2)
    data[2] = (data[2][0].at[0, 0].set(jnp.nan), data[2][1])
    with pytest.raises(tg.NonFiniteLossError, match=r"the loss is nan at epoch 0, step 2"):
        tg.train(lambda x, y: _mse(m, x, y), ps, data, st)
    _assert_ties(m)
    assert len(tg.params(m)) == 7
    ref = _tied_model()
    _, ref, _ = tg.train(_mse, ref, data[:2], tg.setup(optax.adam(0.1), ref))
    for a, b in zip(_tied_ref_leaves(m), _tied_ref_leaves(ref), strict=True):
        _close(a, b, 0)
