"""Hostile-user hunt on `tg.train`, the `nn` layers and `tg.losses`.

Every numerical check has an independent reference: plain optax on a dict of the
trainable arrays with a loss written in plain jnp, a hand-written
`tg.withgradient` + `tg.update` loop, `jax.grad`, a hand-written `lax.scan`, or
numpy. Known bugs are kept as strict xfails with a minimal reproduction.
"""

import collections
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

K = jax.random.key(0)
RULE = optax.adam(0.05)


def rnd(seed, *shape):
    """Test data from numpy: no eager XLA op (and no compile) to make it."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def assert_leaves_equal(a, b, rtol=1e-6, atol=1e-7):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# --- tg.train against plain optax and a hand-written loop ---------------------------


def make_model():
    return nn.Chain(
        nn.Dense(3, 4, jnp.tanh, key=jax.random.key(1)), nn.Dense(4, 1, key=jax.random.key(2))
    )


def make_data(n=4):
    out = []
    for i in range(n):
        x = rnd(10 + i, 8, 3)
        out.append((x, jnp.sum(x, axis=1, keepdims=True) * 0.5))
    return out


def model_loss(m, x, y):
    return tg.losses.mse(m(x), y)


def plain_loss(p, x, y):
    """The same loss written in plain jnp on the named parameters."""
    h = jnp.tanh(x @ p["layers.0.weight"].T + p["layers.0.bias"])
    return jnp.mean((h @ p["layers.1.weight"].T + p["layers.1.bias"] - y) ** 2)


@functools.partial(jax.jit, static_argnums=0)
def optax_step(rule, params, state, x, y):
    value, g = jax.value_and_grad(plain_loss)(params, x, y)
    updates, state = rule.update(g, state, params)
    return value, optax.apply_updates(params, updates), state


def optax_run(model, data, epochs, rule=RULE):
    """Plain optax: per-step losses and per-step parameters after each update."""
    params = dict(tg.params(model).named())
    state = rule.init(params)
    losses, trajectory = [], []
    for _ in range(epochs):
        for x, y in data:
            value, params, state = optax_step(rule, params, state, x, y)
            losses.append(float(value))
            trajectory.append(params)
    return losses, trajectory


def snapshot(model):
    return {k: np.asarray(v) for k, v in tg.params(model).named().items()}


@pytest.mark.slow
def test_train_explicit_equals_plain_optax_and_hand_loop_step_by_step():
    data = make_data()
    model = make_model()
    state0 = tg.setup(RULE, model)
    seen = []
    state, trained, losses = tg.train(
        model_loss,
        model,
        data,
        state0,
        epochs=2,
        callbacks=[lambda info: seen.append((info.epoch, info.step, info.loss, info.model))],
    )
    ref_losses, ref_traj = optax_run(make_model(), data, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert [(e, s) for e, s, _, _ in seen] == [(e, s) for e in range(2) for s in range(4)]
    assert [v for _, _, v, _ in seen] == losses
    for (_, _, _, m), ref in zip(seen, ref_traj, strict=True):
        for k, v in snapshot(m).items():
            np.testing.assert_allclose(v, ref[k], rtol=1e-5, atol=1e-6)
    # The hand-written loop gives the same model and the same optimiser state.
    s, m = state0, make_model()
    hand = []
    for _ in range(2):
        for x, y in data:
            value, (g,) = tg.withgradient(lambda mm: model_loss(mm, x, y), m)  # noqa: B023
            s, m = tg.update(s, m, g)
            hand.append(float(value))
    np.testing.assert_allclose(losses, hand, rtol=1e-6)
    assert_leaves_equal(trained, m)
    assert_leaves_equal(state, s)
    assert isinstance(trained, nn.Chain) and trained[0].activation is jnp.tanh


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_train_implicit_equals_plain_optax_and_hand_loop():
    data = make_data()
    model = make_model()
    ps = tg.params(model)
    state = tg.setup(RULE, ps)
    per_step = []
    out_state, out_model, losses = tg.train(
        lambda x, y: model_loss(model, x, y),
        ps,
        data,
        state,
        epochs=2,
        callbacks=[lambda info: per_step.append(snapshot(model))],
    )
    assert out_model is model and out_state is state
    ref_losses, ref_traj = optax_run(make_model(), data, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, ref in zip(per_step, ref_traj, strict=True):
        for k, v in got.items():
            np.testing.assert_allclose(v, ref[k], rtol=1e-5, atol=1e-6)
    # Hand-written implicit loop.
    m2 = make_model()
    ps2 = tg.params(m2)
    s2 = tg.setup(RULE, ps2)
    for _ in range(2):
        for x, y in data:
            grads = tg.gradient(lambda: model_loss(m2, x, y), ps2)  # noqa: B023
            tg.update_(s2, ps2, grads)
    assert_leaves_equal(model, m2)
    assert_leaves_equal(state, s2)


class XY(NamedTuple):
    x: jax.Array
    y: jax.Array


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_every_form_of_data_gives_the_same_run_as_a_list():
    data = make_data(3)
    model = make_model()
    state = tg.setup(RULE, model)
    ref_losses, ref_traj = optax_run(make_model(), data, 2)
    np_data = [(np.asarray(x), np.asarray(y)) for x, y in data]

    def gen():
        yield from data

    forms = {
        "tuple of tuples": (tuple(data), 2),
        "numpy batches": (np_data, 2),
        "namedtuple batches": ([XY(x, y) for x, y in data], 2),
        "generator function": (gen, 2),
        "lambda giving an iterator": (lambda: iter(data), 2),
        "zip, one epoch": (zip([x for x, _ in data], [y for _, y in data], strict=True), 1),
        "generator, one epoch": (gen(), 1),
    }
    for name, (d, epochs) in forms.items():
        _, m, losses = tg.train(model_loss, model, d, state, epochs=epochs)
        n = 3 * epochs
        assert len(losses) == n, name
        np.testing.assert_allclose(losses, ref_losses[:n], rtol=1e-5, err_msg=name)
        for k, v in snapshot(m).items():
            np.testing.assert_allclose(v, ref_traj[n - 1][k], rtol=1e-5, atol=1e-6)


def test_single_array_batches_are_one_argument():
    xs = [rnd(i, 5, 2) for i in range(3)]
    model = {"w": jnp.ones(2)}
    state = tg.setup(optax.sgd(0.1), model)
    _, m, losses = tg.train(lambda mm, x: jnp.mean((x @ mm["w"]) ** 2), model, xs, state)
    w = np.ones(2)
    ref = []
    for x in xs:
        x = np.asarray(x, np.float64)
        ref.append(np.mean((x @ w) ** 2))
        w = w - 0.1 * (2 * x.T @ (x @ w) / len(x))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    np.testing.assert_allclose(m["w"], w, rtol=1e-5)


def test_iterator_data_with_several_epochs_names_the_type():
    model = {"w": jnp.zeros(())}
    state = tg.setup(optax.sgd(0.1), model)
    xs = [(jnp.ones(2),)] * 2
    loss = lambda m, x: jnp.sum(m["w"] * x)
    with pytest.raises(TypeError, match=r"data is an iterator \(zip\).*epochs=3"):
        tg.train(loss, model, zip(xs), state, epochs=3)
    with pytest.raises(TypeError, match=r"data is an iterator \(map\).*epochs=2"):
        tg.train(loss, model, map(lambda b: b, xs), state, epochs=2)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_python_numbers_in_batches_and_closures_are_never_stale():
    model = {"w": jnp.ones(())}
    state = tg.setup(optax.sgd(0.1), model)
    data = [(jnp.ones(2), 1.0), (jnp.ones(2), 3.0), (jnp.ones(2), 5.0)]
    _, m, losses = tg.train(lambda mm, x, s: s * jnp.sum(mm["w"] * x), model, data, state)
    # By hand: loss = 2 s w, grad = 2 s; w: 1 -> 0.8 -> 0.2 -> -0.8.
    np.testing.assert_allclose(losses, [2.0, 4.8, 2.0], rtol=1e-6)
    np.testing.assert_allclose(m["w"], -0.8, rtol=1e-6)

    def scaled(s):
        return lambda mm, x: s * jnp.sum(mm["w"] * x)

    for s in (1.0, 2.0, 3.0):
        _, m, losses = tg.train(scaled(s), model, [(jnp.ones(2),)], state)
        np.testing.assert_allclose(losses, [2 * s])
        np.testing.assert_allclose(m["w"], 1 - 0.2 * s, rtol=1e-6)


# --- non-finite losses and gradients ------------------------------------------------


def nan_data():
    data = make_data(3)
    x, y = data[1]
    return data, (x.at[0, 0].set(jnp.nan), y)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_nonfinite_in_second_epoch_explicit_keeps_last_good_by_value():
    data, bad = nan_data()
    calls = []

    def batches():
        calls.append(1)
        return data if len(calls) == 1 else [data[0], bad, data[2]]

    model = make_model()
    state = tg.setup(RULE, model)
    before = [np.asarray(v) for v in leaves(model)]
    with pytest.raises(tg.NonFiniteLossError, match=r"the loss is nan at epoch 1, step 1;") as e:
        tg.train(model_loss, model, batches, state, epochs=2)
    err = e.value
    assert (err.epoch, err.step) == (1, 1)
    good = [*data, data[0]]
    ref_losses, ref_traj = optax_run(make_model(), good, 1)
    np.testing.assert_allclose(err.losses, ref_losses, rtol=1e-5)
    for k, v in snapshot(err.model).items():
        np.testing.assert_allclose(v, ref_traj[-1][k], rtol=1e-5, atol=1e-6)
    s, m = state, model
    for x, y in good:
        (g,) = tg.gradient(lambda mm: model_loss(mm, x, y), m)  # noqa: B023
        s, m = tg.update(s, m, g)
    assert_leaves_equal(err.state, s)
    # The caller's model was not touched.
    for a, b in zip(before, leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_nonfinite_implicit_puts_model_and_state_back_by_value_and_can_resume():
    data, bad = nan_data()
    model = make_model()
    ps = tg.params(model)
    state = tg.setup(RULE, ps)
    with pytest.raises(tg.NonFiniteLossError, match=r"the loss is nan at epoch 0, step 2;") as e:
        tg.train(lambda x, y: model_loss(model, x, y), ps, [data[0], data[2], bad], state)
    assert len(e.value.losses) == 2 and e.value.model is model and e.value.state is state
    ref_losses, ref_traj = optax_run(make_model(), [data[0], data[2]], 1)
    np.testing.assert_allclose(e.value.losses, ref_losses, rtol=1e-5)
    for k, v in snapshot(model).items():
        np.testing.assert_allclose(v, ref_traj[-1][k], rtol=1e-5, atol=1e-6)
    m2 = make_model()
    ps2 = tg.params(m2)
    s2 = tg.setup(RULE, ps2)
    for x, y in [data[0], data[2]]:
        tg.update_(s2, ps2, tg.gradient(lambda: model_loss(m2, x, y), ps2))  # noqa: B023
    assert_leaves_equal(state, s2)
    # Resuming from what was left equals continuing the clean run.
    _, _, more = tg.train(lambda x, y: model_loss(model, x, y), ps, [data[1]], state)
    ref_losses, ref_traj = optax_run(make_model(), [data[0], data[2], data[1]], 1)
    np.testing.assert_allclose(more, ref_losses[-1:], rtol=1e-5)
    for k, v in snapshot(model).items():
        np.testing.assert_allclose(v, ref_traj[-1][k], rtol=1e-5, atol=1e-6)


def sqrt_loss(m, x):
    # Finite everywhere; at x == 0 the gradient of sqrt(w * x) in the weight is 0/0.
    return jnp.sum(jnp.sqrt(m(x) ** 2 * x[..., :1]))


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_nonfinite_gradient_names_the_parameter_path_as_params_names_it():
    model = nn.Chain(nn.Dense(2, 2, key=K))
    data = [(jnp.ones((1, 2)),), (jnp.zeros((1, 2)),)]
    names = list(tg.params(model).named())
    assert "layers.0.weight" in names
    with pytest.raises(
        tg.NonFiniteLossError,
        match=r"gradient of 'layers\.0\.weight'.* is not finite.*at epoch 0, step 1",
    ) as e:
        tg.train(sqrt_loss, model, data, tg.setup(optax.sgd(0.1), model))
    assert len(e.value.losses) == 1


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_nonfinite_gradient_implicit_names_the_step_and_restores():
    model = nn.Chain(nn.Dense(2, 2, key=K))
    ps = tg.params(model)
    state = tg.setup(optax.sgd(0.1, momentum=0.9), ps)
    data = [(jnp.ones((1, 2)),), (jnp.zeros((1, 2)),)]
    ref = make_ref_sgd_after_one(model, data[0][0])
    with pytest.raises(
        tg.NonFiniteLossError, match=r"a gradient is not finite at epoch 0, step 1; stopped"
    ):
        tg.train(lambda x: sqrt_loss(model, x), ps, data, state)
    for k, v in snapshot(model).items():
        np.testing.assert_allclose(v, ref[k], rtol=1e-6, atol=1e-7)
        assert np.isfinite(v).all()


def make_ref_sgd_after_one(model, x):
    rule = optax.sgd(0.1, momentum=0.9)
    p = dict(tg.params(model).named())

    def f(p):
        y = x @ p["layers.0.weight"].T + p["layers.0.bias"]
        return jnp.sum(jnp.sqrt(y**2 * x[..., :1]))

    @jax.jit
    def step(p):
        updates, _ = rule.update(jax.grad(f)(p), rule.init(p), p)
        return optax.apply_updates(p, updates)

    return {k: np.asarray(v) for k, v in step(p).items()}


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_update_that_makes_the_model_nonfinite_is_not_last_good():
    model = {"w": jnp.ones(())}
    data = [(jnp.array([1e30]),), (jnp.array([1.0]),)]
    with pytest.raises(
        tg.NonFiniteLossError,
        match=r"the update made a parameter not finite .* at epoch 0, step 0; stopped.*"
        r"lower the learning rate",
    ) as e:
        tg.train(lambda m, x: jnp.sum(m["w"] * x), model, data, tg.setup(optax.sgd(1e10), model))
    assert e.value.model["w"] is model["w"]  # the last good model: the one given
    # Implicit style: the model is put back in place.
    d = {"w": jnp.ones(())}
    ps = tg.params(d)
    with pytest.raises(tg.NonFiniteLossError, match=r"at epoch 0, step 0"):
        tg.train(lambda x: jnp.sum(d["w"] * x), ps, data, tg.setup(optax.sgd(1e10), ps))
    assert float(d["w"]) == 1.0


def test_loss_returning_a_tuple_gives_a_clear_error():
    model = {"w": jnp.ones(())}
    with pytest.raises(
        TypeError,
        match=r"tg\.train: the loss returned a tuple of 2 .* needs "
        r"a real scalar loss",
    ):
        tg.train(
            lambda m, x: (jnp.sum(m["w"] * x), 0.0),
            model,
            [(jnp.ones(2),)],
            tg.setup(optax.sgd(0.1), model),
        )


def test_list_batch_error_says_it_is_a_list():
    model = make_model()
    x, y = make_data(1)[0]
    with pytest.raises(TypeError, match=r"The batch is a list; only a tuple is unpacked"):
        tg.train(model_loss, model, [[x, y]], tg.setup(RULE, model))


def test_data_as_one_tuple_of_arrays_error_points_at_the_data():
    model = make_model()
    x, y = make_data(1)[0]
    with pytest.raises(TypeError, match=r"Each batch is a single array .* pass data=\[\(X, Y\)\]"):
        tg.train(model_loss, model, (x, y), tg.setup(RULE, model))


# --- nn layers against plain references ------------------------------------------


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_dense_shapes_dtypes_and_values_against_numpy():
    layer = nn.Dense(3, 5, jax.nn.relu, key=K)
    assert layer.weight.shape == (5, 3) and layer.bias.shape == (5,)
    assert layer.weight.dtype == jnp.float32
    limit = math.sqrt(6 / (3 + 5))  # Glorot uniform
    assert np.abs(np.asarray(layer.weight)).max() <= limit
    np.testing.assert_array_equal(nn.Dense(3, 5, key=K).weight, layer.weight)
    assert not np.allclose(nn.Dense(3, 5, key=jax.random.key(7)).weight, layer.weight)
    layer.bias = jnp.asarray(np.arange(5.0, dtype=np.float32) - 2)
    w, b = np.asarray(layer.weight), np.asarray(layer.bias)
    xs = [rnd(len(shape), *shape) for shape in [(3,), (4, 3), (2, 4, 3)]]
    half = nn.Dense(3, 2, key=K, dtype=jnp.bfloat16)
    assert half.weight.dtype == jnp.bfloat16 and half.bias.dtype == jnp.bfloat16
    nobias = nn.Dense(3, 2, key=K, use_bias=False)
    assert nobias.bias is None and list(tg.params(nobias).named()) == ["weight"]
    ys, y_half, y_nobias = jax.jit(
        lambda: ([layer(x) for x in xs], half(xs[0].astype(jnp.bfloat16)), nobias(xs[0]))
    )()
    for x, y in zip(xs, ys, strict=True):
        assert y.shape == (*x.shape[:-1], 5)
        np.testing.assert_allclose(y, np.maximum(np.asarray(x) @ w.T + b, 0), rtol=1e-5, atol=1e-6)
    assert y_half.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        y_nobias, np.asarray(xs[0]) @ np.asarray(nobias.weight).T, rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_chain_indexing_slicing_names_and_key_splitting():
    d1, d2 = nn.Dense(2, 3, key=K), nn.Dense(3, 1, key=jax.random.key(1))
    chain = nn.Chain(d1, jax.nn.relu, d2)
    assert chain[0] is d1 and chain[-1] is d2 and len(chain) == 3
    assert isinstance(chain[1:], nn.Chain) and chain[1:][1] is d2
    assert list(tg.params(chain).named()) == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.2.weight",
        "layers.2.bias",
    ]
    x = rnd(1, 4, 2)
    ref = np.maximum(np.asarray(x) @ np.asarray(d1.weight).T, 0) @ np.asarray(d2.weight).T
    # The key is split, in order, among the layers that take one.
    drop = nn.Chain(nn.Dropout(0.5), jnp.tanh, nn.Dropout(0.25))
    v = jnp.asarray(np.arange(1.0, 65.0, dtype=np.float32) / 64)

    def masks():
        k, s1 = jax.random.split(K)
        _, s2 = jax.random.split(k)
        return jax.random.bernoulli(s1, 0.5, v.shape), jax.random.bernoulli(s2, 0.75, v.shape)

    y, y_drop, (m1, m2) = jax.jit(lambda: (chain(x), drop(v, key=K), masks()))()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    ref = np.where(m2, np.tanh(np.where(m1, np.asarray(v) / 0.5, 0)) / 0.75, 0)
    np.testing.assert_allclose(y_drop, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_dropout_mask_scale_gradient_and_modes():
    d = nn.Dropout(0.4)
    x = rnd(5, 500) + 3.0
    k = jax.random.key(5)
    c = jnp.asarray(np.arange(500.0, dtype=np.float32))
    f = lambda v: jnp.sum(d(v, key=k) * c)
    back = nn.trainmode(nn.testmode(d))
    y, y_again, y_other, y_back, ref_g = jax.jit(
        lambda: (
            d(x, key=k),
            d(x, key=k),
            d(x, key=jax.random.key(6)),
            back(x, key=k),
            jax.grad(f)(x),
        )
    )()
    y = np.asarray(y)
    kept = y != 0
    assert 0.5 < kept.mean() < 0.7
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / 0.6, rtol=1e-6)
    np.testing.assert_array_equal(y_again, y)
    np.testing.assert_array_equal(y_back, y)
    assert not np.array_equal(np.asarray(y_other), y)
    # Gradient in x: the mask over (1 - rate), equal to jax.grad.
    (g,) = tg.gradient(f, x)
    np.testing.assert_allclose(g, np.where(kept, np.arange(500.0) / 0.6, 0), rtol=1e-5)
    np.testing.assert_allclose(g, ref_g, rtol=1e-6)
    # Test mode is the identity even when a key is given; rate 0 needs no key.
    assert nn.testmode(d)(x, key=k) is x
    assert nn.Dropout(0.0)(x) is x
    assert nn.Dropout(0.4, training=False)(x) is x


class Parts(NamedTuple):
    bn: object


@pytest.mark.parametrize("wrap", ["namedtuple", "ordereddict"])
def test_testmode_reaches_layers_in_every_container(wrap):
    bn = nn.BatchNorm(2)
    model = Parts(bn) if wrap == "namedtuple" else collections.OrderedDict(bn=bn)
    x = jnp.array([[1.0, 2.0], [3.0, 6.0]])
    test = nn.testmode(model)
    layer = test.bn if wrap == "namedtuple" else test["bn"]
    # Running stats are zeros and ones: test mode is x / sqrt(1 + eps).
    np.testing.assert_allclose(layer(x), np.asarray(x) / np.sqrt(1 + 1e-5), rtol=1e-5)


def test_testmode_in_a_module_list_and_dict():
    class M(tg.Module):
        def __init__(self):
            self.blocks = [nn.BatchNorm(2)]
            self.named = {"d": nn.Dropout(0.5)}

    test = nn.testmode(M())
    x = jnp.array([[1.0, 2.0], [3.0, 6.0]])
    np.testing.assert_allclose(test.blocks[0](x), np.asarray(x) / np.sqrt(1 + 1e-5), rtol=1e-5)
    np.testing.assert_array_equal(test.named["d"](x), x)


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_embedding_out_of_range_index_is_an_error():
    emb = nn.Embedding(10, 4, key=K)
    with pytest.raises(
        IndexError,
        match=r"Embedding\(10 => 4\): index 10 is out of range; "
        r"indices go from 0 to 9",
    ):
        emb(jnp.array([3, 10]))
    with pytest.raises(IndexError, match=r"index -1 is out of range"):
        emb(jnp.array([-1]))
    # Traced, the index cannot be checked: its row is NaN, never another row's values.
    out = tg.jit(lambda e, i: e(i))(emb, jnp.array([3, 10]))
    np.testing.assert_array_equal(out[0], emb.weight[3])
    assert bool(jnp.all(jnp.isnan(out[1])))


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_embedding_gradient_sums_repeated_indices_both_styles():
    emb = nn.Embedding(6, 3, key=K)
    idx_np = np.array([[1, 4], [1, 1]])
    idx = jnp.asarray(idx_np)
    c = rnd(2, 2, 2, 3)
    f = lambda m: jnp.sum(m(idx) * c)
    expected = np.zeros((6, 3), np.float32)
    for i, j in np.ndindex(2, 2):
        expected[idx_np[i, j]] += np.asarray(c)[i, j]
    (g,) = tg.gradient(f, emb)
    np.testing.assert_allclose(g.weight, expected, rtol=1e-6, atol=1e-7)
    grads = tg.gradient(lambda: f(emb), tg.params(emb))
    np.testing.assert_allclose(grads[emb.weight], expected, rtol=1e-6, atol=1e-7)
    assert jax.eval_shape(emb, idx).shape == (2, 2, 3)


def np_conv1d(x, w, b, stride, dilation, pad):
    x = np.pad(np.asarray(x, np.float64), ((0, 0), pad, (0, 0)))
    w = np.asarray(w, np.float64)
    k = w.shape[0]
    span = (k - 1) * dilation + 1
    outs = []
    for t in range(0, x.shape[1] - span + 1, stride):
        patch = x[:, t : t + span : dilation]
        outs.append(np.einsum("nkc,kco->no", patch, w))
    return np.stack(outs, 1) + np.asarray(b)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_conv1d_stride_dilation_padding_against_numpy():
    conv = nn.Conv(3, 2, 4, key=K, stride=2, dilation=2, padding=[(1, 2)])
    assert conv.weight.shape == (3, 2, 4) and conv.bias.shape == (4,)
    conv.bias = jnp.asarray(np.arange(4.0, dtype=np.float32))
    x = rnd(3, 2, 11, 2)
    ref = np_conv1d(x, conv.weight, conv.bias, 2, 2, (1, 2))
    got = conv(x)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_batchnorm_nhwc_and_layernorm_without_affine_against_numpy():
    x = np.asarray(rnd(4, 2, 3, 3, 4)) * 2 + 1
    bn = nn.BatchNorm(4, momentum=0.25)
    (y, new), y_ln = jax.jit(
        lambda: (nn.with_batch_stats(bn, bn, jnp.asarray(x)), nn.LayerNorm(4, affine=False)(x))
    )()
    mu, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
    np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.running_mean, 0.25 * mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.running_var, 0.75 + 0.25 * var, rtol=1e-5)
    np.testing.assert_array_equal(bn.running_mean, np.zeros(4))  # pure: the input is unchanged
    ln = nn.LayerNorm(4, affine=False)
    with pytest.raises(ValueError, match=r"found no floating-point arrays in the LayerNorm"):
        tg.params(ln)
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y_ln, ref, rtol=1e-4, atol=1e-5)


# --- recurrent cells over sequences against a hand-written scan -------------------


def ref_rnn(p, h, x, act=jnp.tanh):
    return act(x @ p["Wi"].T + h @ p["Wh"].T + p["b"])


def ref_lstm(p, state, x):
    h, c = state
    z = x @ p["Wi"].T + h @ p["Wh"].T + p["b"]
    n = z.shape[-1] // 4
    i, f, g, o = (z[..., k * n : (k + 1) * n] for k in range(4))
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def ref_gru(p, h, x):
    a, b = x @ p["Wi"].T + p["bi"], h @ p["Wh"].T + p["bh"]
    n = h.shape[-1]
    r = jax.nn.sigmoid(a[..., :n] + b[..., :n])
    z = jax.nn.sigmoid(a[..., n : 2 * n] + b[..., n : 2 * n])
    cand = jnp.tanh(a[..., 2 * n :] + r * b[..., 2 * n :])
    return (1 - z) * cand + z * h


def scan_ref(kind, p, s0, xs):
    def body(s, x):
        if kind == "lstm":
            h, c = ref_lstm(p, s, x)
            return (h, c), h
        h = ref_gru(p, s, x) if kind == "gru" else ref_rnn(p, s, x, jax.nn.relu)
        return h, h

    return jax.lax.scan(body, s0, xs)


CELLS = {
    "rnn": lambda: nn.RNNCell(2, 3, jax.nn.relu, key=K),
    "lstm": lambda: nn.LSTMCell(2, 3, key=K),
    "gru": lambda: nn.GRUCell(2, 3, key=K),
}


@pytest.mark.slow
def test_recurrences_batched_from_a_nonzero_state_equal_hand_scan_and_grads():
    xs = rnd(4, 5, 6, 2)  # time, batch, features
    # Built under jit: one compile for all the initialisers.
    model = jax.jit(lambda: {kind: nn.Recurrence(make()) for kind, make in CELLS.items()})()
    s0 = {
        kind: jax.tree_util.tree_map(
            lambda z: z + rnd(9, *z.shape),
            model[kind].cell.initial_state((6,)),
        )
        for kind in CELLS
    }
    assert all(z.shape == (6, 3) for z in leaves(s0))
    p = {kind: dict(tg.params(model[kind].cell).named()) for kind in CELLS}

    def run(m):
        return {kind: m[kind](s0[kind], xs) for kind in CELLS}

    def run_ref(q):
        return {kind: scan_ref(kind, q[kind], s0[kind], xs) for kind in CELLS}

    def loss(m):
        out = run(m)
        return sum(jnp.mean(o[1] ** 2) for o in out.values()), out

    def ref_loss(q):
        out = run_ref(q)
        return sum(jnp.mean(o[1] ** 2) for o in out.values()), out

    (ref_value, ref), ref_g = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(p)
    # Explicit style; the whole output (value, sequences) comes back with the gradient.
    (value, got), (g,) = tg.withgradient(loss, model)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for kind in CELLS:
        (s, ys), (rs, rys) = got[kind], ref[kind]
        assert ys.shape == (5, 6, 3)
        np.testing.assert_allclose(ys, rys, rtol=1e-5, atol=1e-6, err_msg=kind)
        assert_leaves_equal(s, rs, rtol=1e-5, atol=1e-6)
    grads = tg.gradient(lambda: loss(model)[0], tg.params(model))
    for kind in CELLS:
        for name, r in ref_g[kind].items():
            where = f"{kind}.cell.{name}"
            np.testing.assert_allclose(
                getattr(g[kind].cell, name), r, rtol=1e-4, atol=1e-6, err_msg=where
            )
            np.testing.assert_allclose(grads.named()[where], r, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(
                grads[getattr(model[kind].cell, name)], r, rtol=1e-4, atol=1e-6
            )


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_cell_parameter_shapes_and_initialisation():
    rnn, lstm, gru = jax.jit(
        lambda: (nn.RNNCell(2, 3, key=K), nn.LSTMCell(2, 3, key=K), nn.GRUCell(2, 3, key=K))
    )()
    assert (rnn.Wi.shape, rnn.Wh.shape, rnn.b.shape) == ((3, 2), (3, 3), (3,))
    np.testing.assert_allclose(np.asarray(rnn.Wh) @ np.asarray(rnn.Wh).T, np.eye(3), atol=1e-5)
    assert (lstm.Wi.shape, lstm.Wh.shape, lstm.b.shape) == ((12, 2), (12, 3), (12,))
    np.testing.assert_array_equal(lstm.b, [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    assert (gru.Wi.shape, gru.Wh.shape, gru.bi.shape, gru.bh.shape) == (
        (9, 2),
        (9, 3),
        (9,),
        (9,),
    )


# --- every layer differentiated in both styles equals jax.grad ----------------------

X2 = jnp.asarray(np.asarray(rnd(1, 5, 4)) * 2 + 0.5)
LAYERS = {
    "dense": (lambda: nn.Dense(4, 3, jnp.tanh, key=K), X2, {}),
    "conv2d": (
        lambda: nn.Conv((2, 2), 2, 3, jnp.tanh, key=K, padding=1, stride=(1, 2)),
        rnd(0, 2, 5, 6, 2),
        {},
    ),
    "layernorm": (lambda: nn.LayerNorm(4), X2, {}),
    "batchnorm": (lambda: nn.BatchNorm(4), X2, {}),
    "embedding": (lambda: nn.Embedding(10, 4, key=K), jnp.array([1, 5, 9, 5]), {}),
    "chain-dropout": (
        lambda: nn.Chain(nn.Dense(4, 6, jax.nn.relu, key=K), nn.Dropout(0.5)),
        X2,
        {"key": jax.random.key(3)},
    ),
}


class AllLayers(tg.Module):
    def __init__(self):
        self.layers = {name: make() for name, (make, _, _) in LAYERS.items()}

    def __call__(self):
        total = 0.0
        for i, (name, (_, x, kw)) in enumerate(LAYERS.items()):
            y = self.layers[name](x, **kw)
            total = total + jnp.sum(jnp.sin(y) * jnp.cos((i + 1) * y))
        return total


@pytest.mark.slow
def test_every_layer_gradient_both_styles_equals_jax_grad():
    model = jax.jit(AllLayers)()
    assert isinstance(model, AllLayers) and isinstance(model.layers["dense"], nn.Dense)
    named = tg.params(model).named()
    # Move every parameter off its initial value so each gradient entry matters.
    for i, (path, v) in enumerate(named.items()):
        obj = model
        *head, last = path.split(".")
        for part in head:
            obj = (
                obj[int(part)]
                if part.isdigit()
                else obj[part]
                if part in LAYERS
                else (getattr(obj, part))
            )
        setattr(obj, last, jnp.asarray(np.asarray(v) + 0.1 * np.asarray(rnd(100 + i, *v.shape))))
    named = tg.params(model).named()
    assert len(named) == 11
    loss = lambda m: m()
    ref = jax.jit(jax.grad(loss))(model)
    ref_by_name = {
        jax.tree_util.keystr(p, simple=True, separator="."): r
        for p, r in jax.tree_util.tree_flatten_with_path(ref)[0]
    }
    (g,) = tg.gradient(loss, model)
    got_by_name = {
        jax.tree_util.keystr(p, simple=True, separator="."): r
        for p, r in jax.tree_util.tree_flatten_with_path(g)[0]
    }
    grads = tg.gradient(lambda: model(), tg.params(model))
    assert set(grads.named()) == set(named) and set(named) <= set(ref_by_name)
    for name, p in named.items():
        r = ref_by_name[name]
        assert np.abs(np.asarray(r)).max() > 0, name
        np.testing.assert_allclose(got_by_name[name], r, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(grads.named()[name], r, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(grads[p], r, rtol=1e-5, atol=1e-6, err_msg=name)


# --- losses against optax / numpy ---------------------------------------------------


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_losses_against_optax_and_numpy_with_gradients():
    yhat, y, logits = rnd(0, 6, 3), rnd(1, 6, 3), rnd(2, 2, 3, 5)
    labels = jnp.asarray(np.random.default_rng(3).integers(0, 5, (2, 3)), jnp.int32)
    e = np.exp(np.asarray(rnd(4, 2, 3, 5), np.float64))
    soft = jnp.asarray(e / e.sum(-1, keepdims=True), jnp.float32)
    z = jnp.asarray(np.asarray(rnd(5, 7)) * 3)
    t = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    s = jnp.asarray(1 / (1 + np.exp(-np.asarray(z, np.float64))), jnp.float32)
    edge = jnp.array([1.0, 0.0])
    L = tg.losses

    @jax.jit
    def all_losses():
        return {
            "mse": L.mse(yhat, y),
            "dmse": jax.grad(L.mse)(yhat, y),
            "huber": L.huber(yhat, y, delta=0.5),
            "mae": L.mae(yhat, y),
            "lce-int": L.logitcrossentropy(logits, labels),
            "lce-soft": L.logitcrossentropy(logits, soft),
            "ce-int": L.crossentropy(jax.nn.softmax(logits), labels),
            "ce-soft": L.crossentropy(jax.nn.softmax(logits), soft),
            "lbce": L.logitbinarycrossentropy(z, t),
            "dlbce": jax.grad(L.logitbinarycrossentropy)(z, t),
            "bce": L.binarycrossentropy(s, t),
            "bce-edge": jax.value_and_grad(L.binarycrossentropy)(edge, edge),
        }

    got = all_losses()
    a, b = np.asarray(yhat, np.float64), np.asarray(y, np.float64)
    d = np.abs(a - b)
    np.testing.assert_allclose(got["mse"], np.mean((a - b) ** 2), rtol=1e-5)
    np.testing.assert_allclose(got["dmse"], 2 * (a - b) / a.size, rtol=1e-5)
    hub = np.where(d <= 0.5, 0.5 * d**2, 0.5 * (d - 0.25))
    np.testing.assert_allclose(got["huber"], hub.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["mae"], d.mean(), rtol=1e-5)
    # Cross-entropies over a (batch, time, classes) tensor: integer and soft labels.
    lg = np.asarray(logits, np.float64)
    lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    hard = -np.take_along_axis(lp, np.asarray(labels)[..., None], -1).mean()
    ref_soft = -(np.asarray(soft) * lp).sum(-1).mean()
    np.testing.assert_allclose(got["lce-int"], hard, rtol=1e-5)
    np.testing.assert_allclose(got["lce-soft"], ref_soft, rtol=1e-5)
    np.testing.assert_allclose(got["ce-int"], hard, rtol=1e-4)
    np.testing.assert_allclose(got["ce-soft"], ref_soft, rtol=1e-4)
    sn = 1 / (1 + np.exp(-np.asarray(z, np.float64)))
    tn = np.asarray(t)
    bce = -(tn * np.log(sn) + (1 - tn) * np.log(1 - sn)).mean()
    np.testing.assert_allclose(got["lbce"], bce, rtol=1e-5)
    np.testing.assert_allclose(got["dlbce"], (sn - tn) / 7, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(got["bce"], bce, rtol=1e-4)
    # Saturated probabilities stay finite (clipped), value and gradient.
    value, ge = got["bce-edge"]
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(ge)).all()


def test_crossentropy_does_not_renormalise_probabilities():
    p = jnp.array([[0.2, 0.2, 0.2]])
    value = jax.jit(tg.losses.crossentropy)(p, jnp.array([2]))
    np.testing.assert_allclose(value, -np.log(0.2), rtol=1e-5)


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_mse_on_integer_arrays_works_or_is_clear():
    yhat, y = jnp.array([1, 2, 3]), jnp.array([1, 1, 1])
    np.testing.assert_allclose(tg.losses.mae(yhat, y), 1.0)
    with pytest.raises(
        TypeError,
        match=r"tg.losses.mse: yhat has dtype int32; predictions "
        r"must be floating point",
    ):
        tg.losses.mse(yhat, y)
    np.testing.assert_allclose(tg.losses.mse(yhat.astype(jnp.float32), y), 5 / 3, rtol=1e-6)
