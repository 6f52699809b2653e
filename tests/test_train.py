"""tg.train and the losses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

from .helpers import MLP, assert_trees_close, mse


def regression_data(n_batches=10):
    key = jax.random.key(0)
    batches = []
    for i in range(n_batches):
        x = jax.random.normal(jax.random.fold_in(key, i), (16, 4))
        batches.append((x, jnp.sum(x, axis=1, keepdims=True) * 0.5))
    return batches


def test_train_loss_falls_and_inputs_untouched():
    model = MLP(jax.random.key(0))
    before = jax.tree_util.tree_leaves(model)
    state = tg.setup(optax.adam(1e-2), model)
    seen = []
    state, _, losses = tg.train(
        mse, model, regression_data(), state, epochs=5, callbacks=[seen.append]
    )
    assert len(losses) == 50 and len(seen) == 50
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    for a, b in zip(before, jax.tree_util.tree_leaves(model), strict=True):
        assert a is b


def test_train_stops_on_nan_keeping_last_good():
    data = regression_data(4)
    x, y = data[2]
    data[2] = (x.at[0, 0].set(jnp.nan), y)
    model = MLP(jax.random.key(0))
    state = tg.setup(optax.sgd(1e-2), model)
    with pytest.raises(tg.NonFiniteLossError, match="epoch 0, step 2") as info:
        tg.train(mse, model, data, state)
    err = info.value
    assert len(err.losses) == 2
    # The last good model is the one after two steps: replay them by hand.
    s, m = state, model
    for xb, yb in data[:2]:
        (g,) = tg.gradient(lambda mm: mse(mm, xb, yb), m)  # noqa: B023
        s, m = tg.update(s, m, g)
    assert_trees_close(err.model, m)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(err.model))


def test_losses_against_closed_forms():
    yhat = jnp.array([1.0, 2.0, 3.0])
    y = jnp.array([1.5, 2.0, 1.0])
    np.testing.assert_allclose(
        tg.losses.mse(yhat, y), np.mean((np.asarray(yhat) - np.asarray(y)) ** 2)
    )
    np.testing.assert_allclose(
        tg.losses.mae(yhat, y), np.mean(np.abs(np.asarray(yhat) - np.asarray(y)))
    )
    logits = jnp.array([[1.0, 2.0, 0.5]])
    p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum()
    np.testing.assert_allclose(
        tg.losses.logitcrossentropy(logits, jnp.array([1])), -np.log(p[0, 1]), rtol=1e-6
    )
    np.testing.assert_allclose(
        tg.losses.crossentropy(jnp.asarray(p), jnp.array([1])), -np.log(p[0, 1]), rtol=1e-5
    )
    z = jnp.array([0.3])
    s = 1 / (1 + np.exp(-0.3))
    np.testing.assert_allclose(
        tg.losses.logitbinarycrossentropy(z, jnp.array([1.0])), -np.log(s), rtol=1e-6
    )
    np.testing.assert_allclose(
        tg.losses.binarycrossentropy(jnp.array([s]), jnp.array([1.0])), -np.log(s), rtol=1e-5
    )
    np.testing.assert_allclose(tg.losses.huber(jnp.array([3.0]), jnp.array([0.0])), 2.5)


def test_dense_train_end_to_end():
    model = nn.Chain(
        nn.Dense(4, 16, jax.nn.relu, key=jax.random.key(1)), nn.Dense(16, 1, key=jax.random.key(2))
    )
    state = tg.setup(optax.adam(1e-2), model)
    _, _, losses = tg.train(
        lambda m, x, y: tg.losses.mse(m(x), y), model, regression_data(), state, epochs=3
    )
    assert losses[-1] < losses[0]
