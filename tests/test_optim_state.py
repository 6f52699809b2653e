"""The optimiser state: views, ties, per-sub-model rules, adjust, freeze, checkpoints.

References are plain optax: the same rule on the same tree, `optax.multi_transform`
for per-sub-model rules, a hand-edited `inject_hyperparams` state for adjust.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

from .helpers import MLP, assert_trees_close

X = jax.random.normal(jax.random.key(3), (5, 2))


def chain_model():
    k1, k2 = jax.random.split(jax.random.key(0))
    return nn.Chain(nn.Dense(2, 3, key=k1), nn.Dense(3, 1, key=k2))


def loss_chain(m):
    return jnp.mean((m(X) - 1.0) ** 2)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def assert_same_arrays(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


# --- the model-shaped view ----------------------------------------------------------


def test_state_mirrors_model():
    model = chain_model()
    state = tg.setup(optax.adam(1e-3), model)
    assert isinstance(state[0].weight, tg.Leaf) and isinstance(state.layers[1].bias, tg.Leaf)
    assert state[0].weight.state[0].mu.shape == (3, 2)
    assert state[0].weight.path == "layers.0.weight"
    assert state[0].activation is None  # not an array: no state
    assert "layers.0" in repr(state[0]) and "adam" not in repr(state[0].weight)
    with pytest.raises(AttributeError, match="mirrors the model"):
        _ = state.nonexistent
    with pytest.raises(TypeError, match="iterate over the model"):
        iter(state)


def test_leaf_view_of_a_masked_rule():
    model = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    rule = optax.masked(optax.adam(0.1), {"w": True, "b": False})
    state = tg.setup(rule, model)
    inner = state["w"].state.inner_state[0]
    assert inner.mu.shape == (2, 2)
    assert isinstance(state["b"].state.inner_state[0].mu, optax.MaskedNode)


def test_checkpoint_names_are_model_paths():
    model = chain_model()
    state = tg.setup(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), model)
    names = [
        jax.tree_util.keystr(p, simple=True)
        for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    # optax.adam is itself a chain: its state is a tuple, hence "1.0".
    assert "1.0.mu.layers.0.weight" in names and "1.0.count" in names
    assert len(names) == len(set(names)) == 9


# --- None gradients, checkpoints -------------------------------------------------------


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_save_after_a_none_step_then_load_into_fresh_setup_continues_identically(tmp_path):
    rule = lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    model = chain_model()
    state = tg.setup(rule(), model)
    (g,) = tg.gradient(loss_chain, model)
    state, model = tg.update(state, model, g)
    (g,) = tg.gradient(loss_chain, model)
    g.layers[0] = None  # a whole sub-model skipped
    state, model = tg.update(state, model, g)
    f = tmp_path / "ckpt.npz"
    tg.save(f, (model, state))
    fresh = chain_model()
    m2, s2 = tg.load(f, (fresh, tg.setup(rule(), fresh)))
    for _ in range(3):
        (g,) = tg.gradient(loss_chain, model)
        state, model = tg.update(state, model, g)
        (g2,) = tg.gradient(loss_chain, m2)
        s2, m2 = tg.update(s2, m2, g2)
    assert_trees_close(m2, model, rtol=0, atol=0)
    for a, b in zip(leaves(s2), leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_none_for_a_branch_of_a_dict():
    model = {"alpha": {"w": jnp.ones(2)}, "beta": jnp.ones(2)}
    state = tg.setup(optax.sgd(0.5), model)
    state, new = tg.update(state, model, {"alpha": None, "beta": jnp.ones(2)})
    np.testing.assert_array_equal(new["alpha"]["w"], [1.0, 1.0])
    np.testing.assert_array_equal(new["beta"], [0.5, 0.5])


# --- ties ----------------------------------------------------------------------------


def test_tied_array_one_state_summed_gradients_one_object():
    w = jnp.array([1.0, 2.0])
    model = {"enc": w, "dec": w, "b": jnp.ones(2)}
    rule = optax.adam(0.1)
    state = tg.setup(rule, model)
    assert state["enc"] is state["dec"]
    assert len(leaves(state)) == 1 + 2 * 2  # count, mu and nu of w and b: w once
    g = {"enc": jnp.array([1.0, 1.0]), "dec": jnp.array([2.0, 0.0]), "b": jnp.ones(2)}
    # Plain optax on the distinct arrays, the tied gradient summed.
    ref = {"w": w, "b": model["b"]}
    u, _ = rule.update({"w": g["enc"] + g["dec"], "b": g["b"]}, rule.init(ref), ref)
    ref = optax.apply_updates(ref, u)
    s1, new = tg.update(state, model, g)
    assert new["enc"] is new["dec"]
    np.testing.assert_allclose(new["enc"], ref["w"], rtol=1e-6)
    # The total at the first place and None at the others: the same step.
    _, new2 = tg.update(state, model, {"enc": g["enc"] + g["dec"], "dec": None, "b": g["b"]})
    np.testing.assert_array_equal(new2["enc"], new["enc"])
    tg.update_(state, model, g)
    assert model["enc"] is model["dec"]
    np.testing.assert_array_equal(model["enc"], new["enc"])
    assert_same_arrays(state, s1)


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_shared_submodel_stays_one_object():
    block = nn.Dense(2, 2, key=jax.random.key(0))
    model = {"a": block, "b": block, "head": jnp.ones(2)}

    def f(m):
        return jnp.sum(m["b"](jnp.tanh(m["a"](X))) * m["head"])

    rule = optax.adam(0.1)
    state = tg.setup(rule, model)
    assert state["a"].weight is state["b"].weight
    (g,) = tg.gradient(f, model)
    _, new = tg.update(state, model, g)
    assert new["a"] is new["b"] and new["a"] is not block

    # Plain optax on (block, head): the total gradient of the shared block.
    def f_ref(p):
        return f({"a": p["block"], "b": p["block"], "head": p["head"]})

    ref = {"block": block, "head": model["head"]}
    u, _ = rule.update(jax.grad(f_ref)(ref), rule.init(ref), ref)
    ref = optax.apply_updates(ref, u)
    assert_trees_close(new["a"], ref["block"], rtol=1e-5, atol=1e-6)
    # In place: the same Module object, updated once.
    tg.update_(state, model, g)
    assert model["a"] is model["b"] is block
    assert_trees_close(block, ref["block"], rtol=1e-5, atol=1e-6)
    # Implicit style, with Params.
    block2 = nn.Dense(2, 2, key=jax.random.key(0))
    m2 = {"a": block2, "b": block2, "head": jnp.ones(2)}
    ps = tg.params(m2)
    s2 = tg.setup(rule, ps)
    tg.update_(s2, ps, tg.gradient(lambda: f(m2), ps))
    assert m2["a"] is m2["b"] is block2
    assert_trees_close(block2, ref["block"], rtol=1e-5, atol=1e-6)


# --- per-sub-model rules ---------------------------------------------------------------


@pytest.mark.slow  # over ~2 s: the default run stays under 3 minutes
def test_assigned_rule_equals_optax_multi_transform():
    model = chain_model()
    root = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    other = optax.sgd(0.1, momentum=0.9)
    state = tg.setup(root, model)
    state[1] = tg.setup(other, model[1])  # Chain's own __getitem__ picks layers[1]
    assert state[1].weight.rule is other and state[0].weight.rule is root

    def labels(params):  # a function: optax would call a Chain given as the label tree
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "other" if p[1].idx == 1 else "root", params
        )

    ref_rule = optax.multi_transform({"root": root, "other": other}, labels)
    ref, ref_state = model, ref_rule.init(model)
    for _ in range(5):
        (g,) = tg.gradient(loss_chain, model)
        state, model = tg.update(state, model, g)
        u, ref_state = ref_rule.update(jax.grad(loss_chain)(ref), ref_state, ref)
        ref = optax.apply_updates(ref, u)
    assert_trees_close(model, ref, rtol=1e-5, atol=1e-6)
    names = [
        jax.tree_util.keystr(p, simple=True)
        for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    assert "layers.1:0.trace.weight" in names  # the assigned rule's state, named by its place


def test_assigning_a_state_for_another_model_is_an_error():
    model = chain_model()
    state = tg.setup(optax.adam(1e-2), model)
    with pytest.raises(ValueError, match=r"'layers\.1' was set up for a different model"):
        state[1] = tg.setup(optax.sgd(0.1), model[0])
    flat = {"a": jnp.ones(2), "b": jnp.ones(3)}
    fstate = tg.setup(optax.adam(1e-2), flat)
    with pytest.raises(ValueError, match=r"'a'.*float32\[3\] array at 'a'.*float32\[2\]"):
        fstate["a"] = tg.setup(optax.sgd(0.1), flat["b"])
    with pytest.raises(TypeError, match=r"state\.l1 = tg\.setup"):
        state[1] = optax.sgd(0.1)
    with pytest.raises(ValueError, match="different model"):
        state[1] = tg.setup(optax.sgd(0.1), {"w": jnp.ones(2)})


# --- adjust ------------------------------------------------------------------------------


def test_adjust_inject_hyperparams_nested_in_a_chain():
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    rule = optax.chain(optax.clip(1.0), inner)
    model = {"w": jnp.array([1.0, -1.0])}
    state = tg.setup(rule, model)
    ref, ref_state = model, rule.init(model)
    g = {"w": jnp.array([0.5, 0.25])}
    for step in range(6):
        if step == 3:
            tg.adjust_(state, learning_rate=0.01)
            ref_state[1].hyperparams["learning_rate"] = jnp.asarray(0.01)
        state, model = tg.update(state, model, g)
        u, ref_state = rule.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    np.testing.assert_allclose(model["w"], ref["w"], rtol=1e-6)
    assert int(state["w"].state[1].count) == 6
    pure = tg.adjust(state, learning_rate=0.5)
    assert float(pure["w"].state[1].hyperparams["learning_rate"]) == 0.5
    assert float(state["w"].state[1].hyperparams["learning_rate"]) == pytest.approx(0.01)


def test_adjust_a_sub_state_gives_it_its_own_copy():
    rule = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    model = chain_model()
    state = tg.setup(rule, model)
    (g,) = tg.gradient(loss_chain, model)
    state, model = tg.update(state, model, g)
    tg.adjust_(state[0], learning_rate=0.0)
    assert float(state[0].weight.state.hyperparams["learning_rate"]) == 0.0
    assert float(state[1].weight.state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    before = model
    (g,) = tg.gradient(loss_chain, model)
    state, model = tg.update(state, model, g)
    assert_trees_close(model[0], before[0], rtol=0, atol=0)  # learning rate 0
    # model[1] moves as plain optax with the momentum carried over.
    assert not np.allclose(model[1].weight, before[1].weight)
    assert int(state[0].weight.state.count) == int(state[1].weight.state.count) == 2


def test_adjust_errors():
    state = tg.setup(optax.adam(0.1), {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="inject_hyperparams"):
        tg.adjust_(state, learning_rate=0.01)
    state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), {"w": jnp.ones(2)})
    with pytest.raises(
        TypeError, match=r"learning_rate='fast' is a str; a hyperparameter is a number"
    ):
        tg.adjust(state, learning_rate="fast")
    with pytest.raises(TypeError, match=r"unknown hyperparameter\(s\) \['lr'\].*'learning_rate'"):
        tg.adjust(state, lr=0.1)
    sched = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.1, 0.0, 10))
    state = tg.setup(sched, {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="follows a schedule"):
        tg.adjust_(state, learning_rate=0.5)
    with pytest.raises(TypeError, match="expects an optimiser state"):
        tg.adjust_({"w": 1}, learning_rate=0.5)


# --- freeze ------------------------------------------------------------------------------


def test_freeze_and_thaw_like_none_gradients():
    model = chain_model()
    rule = optax.adam(1e-2)
    frozen_state = tg.setup(rule, model)
    none_state = tg.setup(rule, model)
    tg.freeze_(frozen_state[0])
    assert frozen_state[0].weight.frozen and not frozen_state[1].weight.frozen
    m1 = m2 = model
    for _ in range(3):
        (g,) = tg.gradient(loss_chain, m1)
        frozen_state, m1 = tg.update(frozen_state, m1, g)
        (g,) = tg.gradient(loss_chain, m2)
        g.layers[0] = None
        none_state, m2 = tg.update(none_state, m2, g)
    assert_trees_close(m1[0], model[0], rtol=0, atol=0)
    assert_trees_close(m1, m2, rtol=0, atol=0)
    assert_same_arrays(frozen_state, none_state)
    tg.thaw_(frozen_state[0])
    (g,) = tg.gradient(loss_chain, m1)
    _, m3 = tg.update(frozen_state, m1, g)
    assert not np.allclose(m3[0].weight, model[0].weight)


def test_state_round_trips_through_tg_jit_with_frozen_parts():
    model = MLP(jax.random.key(0), sizes=(2, 4, 1))
    state = tg.setup(optax.adam(1e-2), model)
    tg.freeze_(state.layers[0])

    @tg.jit
    def step(state, model):
        (g,) = tg.gradient(lambda m: jnp.mean(m(X) ** 2), model)
        return tg.update(state, model, g)

    new_state, new = step(state, model)
    assert new_state.layers[0].weight.frozen
    assert_trees_close(new.layers[0], model.layers[0], rtol=0, atol=0)
    assert not np.allclose(new.layers[1].weight, model.layers[1].weight)


def test_rule_for_a_single_array_and_copies():
    import copy

    model = {"w": jnp.ones(2), "b": jnp.ones(2)}
    state = tg.setup(optax.sgd(1.0), model)
    state["b"] = tg.setup(optax.sgd(0.1), model["b"])
    twin = copy.deepcopy(state)
    state, model = tg.update(state, model, {"w": jnp.ones(2), "b": jnp.ones(2)})
    np.testing.assert_allclose(model["w"], [0.0, 0.0])
    np.testing.assert_allclose(model["b"], [0.9, 0.9])
    assert twin["b"].rule is state["b"].rule and copy.copy(twin)["w"].rule is twin["w"].rule


def test_adjust_reaches_inject_hyperparams_inside_multi_transform():
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    inject = optax.inject_hyperparams
    rule = optax.multi_transform(
        {"x": inject(optax.sgd)(learning_rate=0.1), "y": inject(optax.adam)(learning_rate=0.1)},
        {"a": "x", "b": "y"},
    )
    state = tg.setup(rule, model)
    tg.adjust_(state, learning_rate=0.0)
    _, new = tg.update(state, model, {"a": jnp.ones(2), "b": jnp.ones(2)})
    assert_trees_close(new, model, rtol=0, atol=0)


class Scaled(tg.Module):
    __trainable__ = ("weight",)

    def __init__(self):
        self.weight = jnp.ones(2)
        self.bias = jnp.ones(2)  # a float array left out of training
        self.steps = jnp.array(0)  # an integer array: never trained


def test_untrained_leaves_are_none_in_the_tree_the_rule_sees():
    model = Scaled()
    seen = []
    adam = optax.adam(0.1)
    rule = optax.GradientTransformation(lambda p: seen.append(p) or adam.init(p), adam.update)
    state = tg.setup(rule, model)
    assert seen[0].bias is None and seen[0].steps is None and seen[0].weight is model.weight
    assert state.bias is None and state.steps is None and isinstance(state.weight, tg.Leaf)
    (g,) = tg.gradient(lambda m: jnp.sum(m.weight * m.bias), model)
    assert g.bias is not None  # explicit mode differentiates it; the optimiser ignores it
    _, new = tg.update(state, model, g)
    assert new.bias is model.bias and new.steps is model.steps
    assert not np.allclose(new.weight, model.weight)


def test_equal_configs_stay_equal_and_unequal_ones_unequal():
    """Configs are compared by jax on every step (they key the compiled step); the
    memo of configs found equal must not make unequal ones equal."""
    import gc

    opt = optax.adam(1e-3)

    def model():
        return {"a": jnp.ones(2), "b": jnp.zeros(3)}

    a, b = tg.setup(opt, model())._config, tg.setup(opt, model())._config
    assert a is not b
    assert a == b and a == b and b == a  # the second time from the memo
    other = tg.setup(opt, {"a": jnp.ones(2), "c": jnp.zeros(3)})._config
    assert a != other
    del b
    gc.collect()
    for _ in range(50):  # new objects, some perhaps at the freed address
        c = tg.setup(opt, {"a": jnp.ones(2), "z": jnp.zeros(3)})._config
        assert a != c
