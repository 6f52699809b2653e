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


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
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


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_dense_train_end_to_end():
    model = nn.Chain(
        nn.Dense(4, 16, jax.nn.relu, key=jax.random.key(1)), nn.Dense(16, 1, key=jax.random.key(2))
    )
    state = tg.setup(optax.adam(1e-2), model)
    _, _, losses = tg.train(
        lambda m, x, y: tg.losses.mse(m(x), y), model, regression_data(), state, epochs=3
    )
    assert losses[-1] < losses[0]


def _two_leaf_loss(m, x):
    # Finite everywhere, but at x == 0 the gradient of sqrt(a * x) in `a` is 0/0.
    return jnp.sum(m["b"] ** 2) + jnp.sum(jnp.sqrt(m["a"] * x))


def test_train_stops_on_nonfinite_gradient_with_finite_loss():
    model = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([0.5, -0.5])}
    data = [(jnp.array([1.0, 2.0]),), (jnp.array([0.5, 1.0]),), (jnp.zeros(2),), (jnp.ones(2),)]
    state = tg.setup(optax.sgd(0.1), model)
    assert np.isfinite(float(_two_leaf_loss(model, jnp.zeros(2))))
    with pytest.raises(
        tg.NonFiniteLossError,
        match=r"the gradient of 'a' is not finite \(the loss, .*, is\) at epoch 0, step 2; stopped",
    ) as info:
        tg.train(_two_leaf_loss, model, data, state)
    err = info.value
    assert (err.epoch, err.step, len(err.losses)) == (0, 2, 2)
    # Replay the two good steps by hand with plain optax: the error carries exactly that.
    opt = optax.sgd(0.1)
    params, opt_state = dict(model), opt.init(dict(model))
    for (x,) in data[:2]:
        g = jax.grad(_two_leaf_loss)(params, x)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert_trees_close(err.model, params, rtol=1e-6, atol=0)
    s, m = state, model
    for (x,) in data[:2]:
        (g,) = tg.gradient(lambda mm: _two_leaf_loss(mm, x), m)  # noqa: B023
        s, m = tg.update(s, m, g)
    for a, b in zip(
        jax.tree_util.tree_leaves(err.state), jax.tree_util.tree_leaves(s), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree_util.tree_leaves(err.model))


def test_train_nonfinite_in_later_epoch_names_it():
    model = {"a": jnp.array([1.0]), "b": jnp.array([0.5])}
    calls = []

    def data():
        calls.append(1)
        x = jnp.zeros(1) if len(calls) == 2 else jnp.ones(1)
        return [(jnp.ones(1),), (x,)]

    with pytest.raises(tg.NonFiniteLossError, match="at epoch 1, step 1;") as info:
        tg.train(_two_leaf_loss, model, data, tg.setup(optax.sgd(0.1), model), epochs=3)
    assert len(info.value.losses) == 3


def test_generator_data_with_several_epochs_is_an_error():
    model = {"w": jnp.zeros(())}
    state = tg.setup(optax.sgd(0.1), model)
    batches = regression_scalar()
    gen = (b for b in batches)
    with pytest.raises(
        TypeError, match=r"data is an iterator \(generator\).*epochs=2.*pass a list"
    ):
        tg.train(scalar_loss, model, gen, state, epochs=2)
    # One pass over a generator is fine; a function giving a fresh one each epoch is
    # the same as a list, step for step.
    _, _, l1 = tg.train(scalar_loss, model, (b for b in batches), state)
    assert len(l1) == len(batches)
    _, m_list, l_list = tg.train(scalar_loss, model, batches, state, epochs=3)
    _, m_fn, l_fn = tg.train(scalar_loss, model, lambda: iter(batches), state, epochs=3)
    assert l_fn == l_list and len(l_list) == 3 * len(batches)
    np.testing.assert_array_equal(m_fn["w"], m_list["w"])


def test_epoch_without_batches_is_an_error():
    model = {"w": jnp.zeros(())}
    state = tg.setup(optax.sgd(0.1), model)

    class OnceOnly:
        """Re-iterable in name only: the second pass is empty (a common loader bug)."""

        def __init__(self, items):
            self.it = iter(items)

        def __iter__(self):
            return (b for b in self.it)

    with pytest.raises(ValueError, match=r"epoch 1 of data gave no batches \(epoch 0 gave 3\)"):
        tg.train(scalar_loss, model, OnceOnly(regression_scalar()), state, epochs=2)
    with pytest.raises(ValueError, match="epoch 0 of data gave no batches; pass the batches"):
        tg.train(scalar_loss, model, [], state)
    state2, model2, losses = tg.train(scalar_loss, model, [], state, epochs=0)
    assert losses == [] and model2 is model and state2 is state


def regression_scalar():
    return [(jnp.array([1.0, 2.0]) * k, jnp.array([2.0, 4.0]) * k) for k in (1.0, 0.5, 2.0)]


def scalar_loss(m, x, y):
    return tg.losses.mse(m["w"] * x, y)
