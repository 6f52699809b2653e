"""Layers: forward passes against plain-jnp/numpy references, gradients against jax.grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg
from treegrad import nn

K = jax.random.key(0)


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


def ref_dense(m, x):
    return np.asarray(x) @ np.asarray(m.weight).T + np.asarray(m.bias)


def ref_conv2d(m, x):
    x, w, b = np.asarray(x), np.asarray(m.weight), np.asarray(m.bias)
    kh, kw, _, cout = w.shape
    n, h, wd, _ = x.shape
    out = np.zeros((n, h - kh + 1, wd - kw + 1, cout), np.float32)
    for i in range(out.shape[1]):
        for j in range(out.shape[2]):
            patch = x[:, i : i + kh, j : j + kw, :]
            out[:, i, j, :] = np.einsum("nhwc,hwco->no", patch, w)
    return out + b


def ref_conv1d(m, x):
    x, w, b = np.asarray(x), np.asarray(m.weight), np.asarray(m.bias)
    k = w.shape[0]
    out = np.stack(
        [np.einsum("nkc,kco->no", x[:, t : t + k], w) for t in range(x.shape[1] - k + 1)], axis=1
    )
    return out + b


def ref_layernorm(m, x):
    x = np.asarray(x)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + m.eps) * np.asarray(m.scale) + np.asarray(m.bias)


def ref_batchnorm_train(m, x):
    x = np.asarray(x)
    mu, var = x.mean(0), x.var(0)
    return (x - mu) / np.sqrt(var + m.eps) * np.asarray(m.scale) + np.asarray(m.bias)


def ref_embedding(m, idx):
    return np.asarray(m.weight)[np.asarray(idx)]


x2 = jax.random.normal(jax.random.key(1), (5, 4))
LAYERS = {
    "dense": (lambda: nn.Dense(4, 3, key=K), x2, ref_dense),
    "conv2d": (
        lambda: nn.Conv((2, 3), 2, 4, key=K),
        jax.random.normal(K, (2, 5, 6, 2)),
        ref_conv2d,
    ),
    "conv1d": (lambda: nn.Conv(3, 2, 4, key=K), jax.random.normal(K, (2, 7, 2)), ref_conv1d),
    "layernorm": (lambda: nn.LayerNorm(4), x2 * 3 + 1, ref_layernorm),
    "batchnorm": (lambda: nn.BatchNorm(4), x2 * 3 + 1, ref_batchnorm_train),
    "embedding": (lambda: nn.Embedding(10, 4, key=K), jnp.array([1, 5, 9]), ref_embedding),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_forward_matches_reference(name):
    make, x, ref = LAYERS[name]
    layer = make()
    np.testing.assert_allclose(layer(x), ref(layer, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        jax.jit(lambda m, v: m(v))(layer, x), ref(layer, x), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_gradient_matches_jax_grad(name):
    make, x, _ = LAYERS[name]
    layer = make()
    loss = lambda m: jnp.sum(jnp.sin(m(x)))
    (g,) = tg.gradient(loss, layer)
    ref = jax.jit(jax.grad(loss))(layer)
    got = jax.tree_util.tree_leaves(g, is_leaf=lambda v: v is None)
    for a, b in zip(got, jax.tree_util.tree_leaves(ref, is_leaf=lambda v: v is None), strict=True):
        if a is None:  # a structural zero: e.g. BatchNorm's running stats in training mode
            assert b is None or not np.any(np.asarray(b))
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert set(tg.params(layer).named()) == set(type(layer).__trainable__ or ())


def test_wrong_feature_size_names_layer_and_shapes():
    with pytest.raises(
        ValueError, match=r"Dense\(4 => 3\): expected input with 4 features.*\(5, 3\)"
    ):
        nn.Dense(4, 3, key=K)(jnp.ones((5, 3)))
    with pytest.raises(ValueError, match=r"Conv\(\(3, 3\), 1 => 2\).*got shape \(4, 4, 2\)"):
        nn.Conv((3, 3), 1, 2, key=K)(jnp.ones((4, 4, 2)))
    with pytest.raises(ValueError, match=r"LSTMCell\(2 => 3\).*2 features"):
        cell = nn.LSTMCell(2, 3, key=K)
        cell(cell.initial_state(), jnp.ones(5))


def test_conv_same_padding_stride_and_unbatched():
    conv = nn.Conv((3, 3), 1, 2, key=K, padding="SAME", stride=2)
    assert conv(jnp.ones((1, 8, 8, 1))).shape == (1, 4, 4, 2)
    assert conv(jnp.ones((8, 8, 1))).shape == (4, 4, 2)


def test_batchnorm_train_and_test_modes():
    bn = nn.BatchNorm(4, momentum=0.5)
    x = x2 * 3 + 1
    _, bn2 = nn.with_batch_stats(bn, bn, x)
    np.testing.assert_allclose(bn2.running_mean, 0.5 * np.asarray(x).mean(0), rtol=1e-5)
    np.testing.assert_allclose(bn2.running_var, 0.5 + 0.5 * np.asarray(x).var(0), rtol=1e-5)
    assert "running_mean" not in tg.params(bn).named()
    test = nn.testmode(bn2)
    assert test.training is False and bn2.training is True
    expected = (np.asarray(x) - np.asarray(bn2.running_mean)) / np.sqrt(
        np.asarray(bn2.running_var) + bn.eps
    )
    np.testing.assert_allclose(test(x), expected, rtol=1e-5, atol=1e-5)
    assert nn.trainmode(test).training is True


def test_batchnorm_stats_inside_loss_and_jit():
    model = nn.Chain(nn.Dense(4, 4, key=K), nn.BatchNorm(4))

    @tg.jit
    def step(m, x):
        def loss(m):
            y, new = nn.with_batch_stats(m, m, x)
            return jnp.mean(y**2), new

        (value, new), (g,) = tg.withgradient(loss, m)
        return value, new, g

    _, new, g = step(model, x2)
    assert g[1].running_mean is None  # data the loss does not depend on in training mode
    assert not np.allclose(new[1].running_mean, 0.0)
    assert g[1].scale is not None


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_dropout_modes_and_key():
    d = nn.Dropout(0.3)
    x = jnp.ones((2000,))
    y = d(x, key=K)
    assert abs(float(jnp.mean(y == 0)) - 0.3) < 0.05
    np.testing.assert_allclose(float(jnp.max(y)), 1 / 0.7, rtol=1e-6)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        d(x)
    np.testing.assert_array_equal(nn.testmode(d)(x), x)
    chain = nn.Chain(nn.Dense(3, 3, key=K), nn.Dropout(0.5))
    assert chain(jnp.ones((4, 3)), key=K).shape == (4, 3)
    np.testing.assert_array_equal(nn.testmode(chain)(jnp.ones((4, 3))), chain[0](jnp.ones((4, 3))))


def np_rnn_step(c, h, x):
    return np.tanh(np.asarray(c.Wi) @ x + np.asarray(c.Wh) @ h + np.asarray(c.b))


def np_lstm_step(c, state, x):
    h, cc = state
    gates = np.asarray(c.Wi) @ x + np.asarray(c.Wh) @ h + np.asarray(c.b)
    i, f, g, o = np.split(gates, 4)
    cc = sigmoid(f) * cc + sigmoid(i) * np.tanh(g)
    return sigmoid(o) * np.tanh(cc), cc


def np_gru_step(c, h, x):
    xr, xz, xn = np.split(np.asarray(c.Wi) @ x + np.asarray(c.bi), 3)
    hr, hz, hn = np.split(np.asarray(c.Wh) @ h + np.asarray(c.bh), 3)
    r, z = sigmoid(xr + hr), sigmoid(xz + hz)
    n = np.tanh(xn + r * hn)
    return (1 - z) * n + z * h


def test_recurrent_cells_against_numpy_over_a_sequence():
    xs = np.asarray(jax.random.normal(jax.random.key(3), (4, 2)))
    rnn = nn.Recurrence(nn.RNNCell(2, 3, key=K))
    h, ys = rnn(rnn.cell.initial_state(), jnp.asarray(xs))
    ref = np.zeros(3)
    for t in range(4):
        ref = np_rnn_step(rnn.cell, ref, xs[t])
        np.testing.assert_allclose(ys[t], ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-6)

    lstm = nn.Recurrence(nn.LSTMCell(2, 3, key=K))
    (h, c), ys = lstm(lstm.cell.initial_state(), jnp.asarray(xs))
    state = (np.zeros(3), np.zeros(3))
    for t in range(4):
        state = np_lstm_step(lstm.cell, state, xs[t])
    np.testing.assert_allclose(h, state[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c, state[1], rtol=1e-5, atol=1e-6)

    gru = nn.Recurrence(nn.GRUCell(2, 3, key=K))
    h, ys = gru(gru.cell.initial_state(), jnp.asarray(xs))
    ref = np.zeros(3)
    for t in range(4):
        ref = np_gru_step(gru.cell, ref, xs[t])
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
@pytest.mark.parametrize("cell_type", [nn.RNNCell, nn.LSTMCell, nn.GRUCell])
def test_recurrence_gradients_match_jax_grad(cell_type):
    rnn = nn.Recurrence(cell_type(2, 3, key=K))
    xs = jax.random.normal(jax.random.key(4), (5, 6, 2))  # time, batch, features

    def loss(m):
        _, ys = m(m.cell.initial_state((6,)), xs)
        return jnp.mean(ys**2)

    (g,) = tg.gradient(loss, rnn)
    ref = jax.jit(jax.grad(loss))(rnn)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    grads = tg.gradient(lambda: loss(rnn), tg.params(rnn))
    assert all(name.startswith("cell.") for name in grads.named())
