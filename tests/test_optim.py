"""The model-tree optimiser against plain optax, in both gradient styles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

from .helpers import MLP, assert_trees_close, mse

RULES = {
    "adam": lambda: optax.adam(1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-3),
    "chain": lambda: optax.chain(optax.clip(0.5), optax.scale_by_rms(), optax.scale(-1e-2)),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    # Not elementwise: the rule must see the whole model, as optax does.
    "global_norm_clip": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
}


def data():
    xs = jax.random.normal(jax.random.key(10), (16, 4))
    ys = jnp.sin(xs[:, :1])
    return xs, ys


@pytest.mark.parametrize("name", sorted(RULES))
def test_parity_with_plain_optax(name):
    xs, ys = data()
    model = MLP(jax.random.key(0))
    ref_model = model
    rule = RULES[name]()
    state = tg.setup(rule, model)
    opt_state = rule.init(ref_model)
    for _ in range(10):
        (g,) = tg.gradient(lambda m: mse(m, xs, ys), model)
        state, model = tg.update(state, model, g)
        rg = jax.grad(mse)(ref_model, xs, ys)
        updates, opt_state = rule.update(rg, opt_state, ref_model)
        ref_model = optax.apply_updates(ref_model, updates)
    assert_trees_close(model, ref_model, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_implicit_update_equals_explicit(name):
    xs, ys = data()
    m1, m2 = MLP(jax.random.key(0)), MLP(jax.random.key(0))
    s1 = tg.setup(RULES[name](), m1)
    ps = tg.params(m2)
    s2 = tg.setup(RULES[name](), ps)
    for _ in range(10):
        (g,) = tg.gradient(lambda m: mse(m, xs, ys), m1)
        s1, m1 = tg.update(s1, m1, g)
        grads = tg.gradient(lambda: mse(m2, xs, ys), ps)
        tg.update_(s2, ps, grads)
    for a, b in zip(jax.tree_util.tree_leaves(m1), jax.tree_util.tree_leaves(m2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_state_mirrors_model():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = nn.Chain(nn.Dense(2, 3, key=k1), nn.Dense(3, 1, key=k2))
    state = tg.setup(optax.adam(1e-3), model)
    assert isinstance(state[0].weight, tg.Leaf) and isinstance(state[1].bias, tg.Leaf)
    assert state[0].weight.state[0].mu.shape == (3, 2)


def test_none_gradient_skips_parameter_and_state():
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state = tg.setup(optax.adam(0.1), model)
    before = jax.tree_util.tree_leaves(state["b"])
    g = {"a": jnp.ones(2), "b": None}
    state, model = tg.update(state, model, g)
    np.testing.assert_array_equal(model["b"], np.ones(2))
    for x, y in zip(before, jax.tree_util.tree_leaves(state["b"]), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.allclose(model["a"], 1.0)


def test_tied_weights_share_state_and_stay_tied():
    w = jnp.array([1.0, 2.0])
    model = {"enc": w, "dec": w}
    state = tg.setup(optax.sgd(0.1), model)
    assert state["enc"] is state["dec"]
    g = {"enc": jnp.array([1.0, 1.0]), "dec": jnp.array([2.0, 0.0])}
    state, new = tg.update(state, model, g)
    assert new["enc"] is new["dec"]
    np.testing.assert_allclose(new["enc"], [0.7, 1.9])
    assert state["enc"] is state["dec"]
    # in place too
    tg.update_(state, model, g)
    assert model["enc"] is model["dec"]
    np.testing.assert_allclose(model["enc"], [0.7, 1.9])


def test_freeze_and_thaw():
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state = tg.setup(optax.sgd(0.5), model)
    g = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tg.freeze_(state["a"])
    tg.update_(state, model, g)
    np.testing.assert_array_equal(model["a"], [1.0, 1.0])
    np.testing.assert_array_equal(model["b"], [0.5, 0.5])
    tg.thaw_(state["a"])
    tg.update_(state, model, g)
    np.testing.assert_array_equal(model["a"], [0.5, 0.5])


def test_per_submodel_rules():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = nn.Chain(nn.Dense(2, 2, key=k1), nn.Dense(2, 1, key=k2))
    state = tg.setup(optax.sgd(1.0), model)
    state.layers[1] = tg.setup(optax.sgd(0.1), model[1])
    g = jax.tree_util.tree_map(jnp.ones_like, model)
    old = jax.tree_util.tree_map(lambda x: x, model)
    state, model = tg.update(state, model, g)
    np.testing.assert_allclose(model[0].bias, old[0].bias - 1.0)
    np.testing.assert_allclose(model[1].bias, old[1].bias - 0.1)


def test_adjust_keeps_moments_like_inject_hyperparams():
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    model = {"w": jnp.array([1.0, -1.0])}
    state = tg.setup(rule, model)
    ref_state = rule.init(model)
    ref = model
    g = {"w": jnp.array([0.5, 0.25])}
    for step in range(6):
        if step == 3:
            tg.adjust_(state, learning_rate=0.01)
            ref_state.hyperparams["learning_rate"] = jnp.asarray(0.01)
        state, model = tg.update(state, model, g)
        u, ref_state = rule.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    np.testing.assert_allclose(model["w"], ref["w"], rtol=1e-6)
    assert int(state["w"].state.count) == 6
    pure = tg.adjust(state, learning_rate=0.5)
    assert float(pure["w"].state.hyperparams["learning_rate"]) == 0.5
    assert float(state["w"].state.hyperparams["learning_rate"]) == pytest.approx(0.01)


def test_adjust_unadjustable_rule_says_how():
    state = tg.setup(optax.adam(0.1), {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="inject_hyperparams"):
        tg.adjust_(state, learning_rate=0.01)


def test_mismatched_gradient_names_path():
    model = {"a": jnp.ones(2), "b": {"c": jnp.ones(2)}}
    state = tg.setup(optax.sgd(0.1), model)
    with pytest.raises(ValueError, match=r"first difference at 'b\.d'|'b\.c'"):
        tg.update(state, model, {"a": jnp.ones(2), "b": {"d": jnp.ones(2)}})
    with pytest.raises(TypeError, match="unpack"):
        tg.update(state, model, (model,))


def test_failed_update_leaves_model_and_state():
    model = {"w": jnp.ones(2)}
    state = tg.setup(optax.adam(0.1), model)
    before_w = model["w"]
    before_state = jax.tree_util.tree_leaves(state)
    with pytest.raises(Exception, match=r"shape|broadcast|incompatible"):
        tg.update_(state, model, {"w": jnp.ones(3)})
    assert model["w"] is before_w
    assert all(a is b for a, b in zip(before_state, jax.tree_util.tree_leaves(state), strict=True))


def test_update_does_not_retrace():
    model = MLP(jax.random.key(0))
    xs, ys = data()
    state = tg.setup(optax.adam(1e-3), model)
    (g,) = tg.gradient(lambda m: mse(m, xs, ys), model)
    state, model = tg.update(state, model, g)
    n = tg._optim._step._cache_size()
    for _ in range(3):
        (g,) = tg.gradient(lambda m: mse(m, xs, ys), model)
        state, model = tg.update(state, model, g)
    assert tg._optim._step._cache_size() == n


def test_jit_training_step_traces_once():
    traces = []
    model = MLP(jax.random.key(0))
    xs, ys = data()
    state = tg.setup(optax.adam(1e-2), model)

    @tg.jit
    def step(state, model, x, y):
        traces.append(1)
        loss, (g,) = tg.withgradient(lambda m: mse(m, x, y), model)
        state, model = tg.update(state, model, g)
        return state, model, loss

    losses = []
    for _ in range(20):
        state, model, loss = step(state, model, xs, ys)
        losses.append(float(loss))
    assert len(traces) == 1
    assert losses[-1] < losses[0]


def test_destructure_round_trip_and_gradient():
    model = MLP(jax.random.key(0))
    flat, rebuild = tg.destructure(model)
    assert flat.shape == (49,)
    assert_trees_close(rebuild(flat), model)
    xs, ys = data()
    g = jax.grad(lambda v: mse(rebuild(v), xs, ys))(flat)
    ref, _ = tg.destructure(jax.grad(mse)(model, xs, ys))
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="shape"):
        rebuild(jnp.ones(3))


def test_skipped_parameter_keeps_its_own_count_afterwards():
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state = tg.setup(optax.adam(0.1), model)
    g_both = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state, model = tg.update(state, model, {"a": jnp.ones(2), "b": None})
    state, model = tg.update(state, model, g_both)
    assert int(state["a"].state[0].count) == 2 and int(state["b"].state[0].count) == 1
    # Same as plain optax on each array separately.
    ref_b = jnp.ones(2)
    opt = optax.adam(0.1)
    u, _ = opt.update(jnp.ones(2), opt.init(ref_b), ref_b)
    np.testing.assert_allclose(model["b"], optax.apply_updates(ref_b, u), rtol=1e-6)


def test_state_is_a_pytree_for_jit_and_checkpoints(tmp_path):
    model = MLP(jax.random.key(0))
    state = tg.setup(optax.adam(1e-2), model)
    tg.freeze_(state.layers[0])  # splits the group
    leaves = jax.tree_util.tree_leaves(state)
    assert len(leaves) == 2 * (1 + 2 + 2)  # two groups, each: one count, two mu, two nu
    f = tmp_path / "s.npz"
    tg.save(f, state)
    fresh = tg.setup(optax.adam(1e-2), model)
    tg.freeze_(fresh.layers[0])
    restored = tg.load(f, fresh)
    assert restored.layers[0].weight.frozen and not restored.layers[1].weight.frozen


def test_sub_state_views_and_errors():
    model = MLP(jax.random.key(0))
    state = tg.setup(optax.adam(1e-2), model)
    assert "layers.0" in repr(state.layers[0])
    with pytest.raises(AttributeError, match="mirrors the model"):
        _ = state.nonexistent
    with pytest.raises(TypeError, match=r"optimiser state from tg\.setup"):
        tg.update(model, model, model)


def test_donation_reuses_old_buffers_once_each():
    w = jnp.arange(4.0)
    model = {"enc": w, "dec": w, "b": jnp.ones(2)}
    state = tg.setup(optax.adam(0.1), model)
    g = {"enc": jnp.ones(4), "dec": jnp.ones(4), "b": jnp.ones(2)}
    _, ref_model = tg.update(state, model, g)
    _, model2 = tg.update(state, model, g, donate=True)  # tied: donated once, no error
    assert w.is_deleted() and model["b"].is_deleted()
    assert model2["enc"] is model2["dec"]
    np.testing.assert_allclose(model2["enc"], ref_model["enc"])


def test_jit_donate_argnums():
    model = MLP(jax.random.key(0))
    xs, ys = data()
    state = tg.setup(optax.adam(1e-2), model)

    @functools.partial(tg.jit, donate_argnums=(0, 1))
    def step(state, model, x, y):
        loss, (g,) = tg.withgradient(lambda m: mse(m, x, y), model)
        state, model = tg.update(state, model, g)
        return state, model, loss

    old = model.layers[0].weight
    losses = []
    for _ in range(5):
        state, model, loss = step(state, model, xs, ys)
        losses.append(float(loss))
    assert old.is_deleted() and not xs.is_deleted()
    assert losses[-1] < losses[0]
