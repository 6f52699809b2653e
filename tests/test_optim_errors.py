"""Bad input to the optimiser: a clear error naming the path, and nothing changed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn


def model_and_state():
    model = {"w": jnp.array([1.0, 2.0, 3.0]), "layer": nn.Dense(2, 2, key=jax.random.key(0))}
    return model, tg.setup(optax.adam(0.1), model)


def good(model):
    return jax.tree_util.tree_map(jnp.ones_like, model)


def with_w(model, g_w):
    g = good(model)
    g["w"] = g_w
    return g


# (id, call(state, model), exception type, regex for the words that matter)
ROWS = [
    (
        "column_gradient_for_vector",
        lambda s, m: tg.update(s, m, with_w(m, jnp.ones((3, 1)))),
        ValueError,
        r"tg\.update: the gradient at 'w' has shape \(3, 1\) but its parameter has shape \(3,\) "
        r"\(expected float32\[3\], got float32\[3×1\]\).*never broadcast",
    ),
    (
        "too_long_gradient",
        lambda s, m: tg.update_(s, m, with_w(m, jnp.ones(4))),
        ValueError,
        r"tg\.update_: the gradient at 'w' has shape \(4,\)"
        r".*expected float32\[3\], got float32\[4\]",
    ),
    (
        "string_leaf",
        lambda s, m: tg.update(s, m, with_w(m, "a")),
        TypeError,
        r"the gradient at 'w' is a str \('a'\); expected a float32\[3\] array or None",
    ),
    (
        "python_float_leaf",
        lambda s, m: tg.update(s, m, with_w(m, 0.5)),
        TypeError,
        r"the gradient at 'w' is a float.*expected a float32\[3\] array",
    ),
    (
        "complex_gradient_for_real_parameter",
        lambda s, m: tg.update(s, m, with_w(m, jnp.ones(3, jnp.complex64))),
        ValueError,
        r"the gradient at 'w' is complex but its parameter is real.*jnp\.real",
    ),
    (
        "integer_gradient",
        lambda s, m: tg.update(s, m, with_w(m, jnp.ones(3, jnp.int32))),
        ValueError,
        r"the gradient at 'w' has dtype int32.*floating point",
    ),
    (
        "nested_gradient_shape_in_a_layer",
        lambda s, m: tg.update(
            s, m, {"w": jnp.ones(3), "layer": nn.Dense(2, 3, key=jax.random.key(1))}
        ),
        ValueError,
        # the same paths (a layer differing in static data): named by its first misfit
        r"the gradient at 'layer.weight' has shape \(3, 2\) but its parameter has shape",
    ),
    (
        "wrong_structure",
        lambda s, m: tg.update_(s, m, {"w": jnp.ones(3)}),
        ValueError,
        r"tg\.update_: the gradient tree does not match the model \(first difference at 'layer",
    ),
    (
        "array_for_a_sub_model",
        lambda s, m: tg.update(s, m, {"w": jnp.ones(3), "layer": jnp.ones(2)}),
        ValueError,
        r"the gradient tree does not match the model",
    ),
    (
        "one_tuple",
        lambda s, m: tg.update(s, m, (good(m),)),
        TypeError,
        r"1-tuple of gradients.*\(g,\) = tg\.gradient",
    ),
    (
        "state_for_another_model",
        lambda s, m: tg.update(s, {"w": m["w"]}, {"w": jnp.ones(3)}),
        ValueError,
        r"the optimiser state does not match the model.*tg\.setup\(rule, model\)",
    ),
    (
        "sub_state",
        lambda s, m: tg.update(s["layer"], m["layer"], good(m["layer"])),
        TypeError,
        r"pass the whole optimiser state from tg\.setup, not a part of it",
    ),
    (
        "not_a_state",
        lambda s, m: tg.update(m, m, good(m)),
        TypeError,
        r"expected the optimiser state from tg\.setup as the first argument, got dict",
    ),
    (
        "stale_grads",
        "stale",
        ValueError,
        r"tg\.update_: the Grads hold gradients for arrays that are not this model's parameters "
        r"\(e\.g\. 'layer\.weight'\): they were taken before the parameters were replaced",
    ),
]


def stale_call(state, model):
    ps = tg.params(model)
    grads = tg.gradient(lambda: jnp.sum(model["w"] ** 2) + jnp.sum(model["layer"].weight), ps)
    state2 = tg.setup(optax.sgd(0.1), ps)
    tg.update_(state2, ps, grads)  # replaces the arrays
    # Snapshot after the first, legitimate update: the second must change nothing.
    return lambda s, m: tg.update_(s, ps, grads)


@pytest.mark.parametrize(("call", "exc", "match"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_update_is_a_clear_error_and_changes_nothing(call, exc, match):
    model, state = model_and_state()
    if call == "stale":
        call = stale_call(state, model)
        state = tg.setup(optax.adam(0.1), model)
    model_leaves = jax.tree_util.tree_leaves(model)
    model_w, layer = model["w"], model["layer"]
    state_leaves, config = state._leaves, state._config
    before = [np.asarray(x) for x in state_leaves]
    with pytest.raises(exc, match=match):
        call(state, model)
    assert all(a is b for a, b in zip(model_leaves, jax.tree_util.tree_leaves(model), strict=True))
    assert model["w"] is model_w and model["layer"] is layer
    assert state._leaves is state_leaves and state._config is config
    for a, b in zip(before, state._leaves, strict=True):
        np.testing.assert_array_equal(a, b)


def test_update_in_place_through_a_tuple_changes_nothing():
    # Issue 10, item 6: `a` was rebound before the tuple at the root refused.
    w, v = jnp.ones(2), jnp.ones(3)
    model = ({"a": w}, v)
    state = tg.setup(optax.sgd(0.1), model)
    state_leaves = state._leaves
    with pytest.raises(TypeError, match=r"cannot update '1' in place: only tuples hold it"):
        tg.update_(state, model, ({"a": jnp.ones(2)}, jnp.ones(3)))
    assert model[0]["a"] is w and state._leaves is state_leaves
    # Frozen, the tuple's own leaf is never rebound: the update goes through.
    tg.freeze_(state[1])
    tg.update_(state, model, ({"a": jnp.ones(2)}, jnp.ones(3)))
    np.testing.assert_allclose(model[0]["a"], [0.9, 0.9])


def test_grads_for_a_subset_of_the_parameters_skip_the_rest():
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state = tg.setup(optax.sgd(0.5), tg.params(model))
    grads = tg.gradient(lambda: jnp.sum(model["a"]), tg.Params([model["a"]]))
    tg.update_(state, tg.params(model), grads)
    np.testing.assert_array_equal(model["a"], [0.5, 0.5])
    np.testing.assert_array_equal(model["b"], [1.0, 1.0])


def test_other_misuse():
    with pytest.raises(TypeError, match="optax GradientTransformation"):
        tg.setup("adam", {"w": jnp.ones(2)})
    w = jnp.ones(2)
    ps = tg.Params(w)
    state = tg.setup(optax.sgd(0.1), ps)
    with pytest.raises(TypeError, match="standalone array in place"):
        tg.update_(state, ps, tg.gradient(lambda: jnp.sum(w), ps))
    model = {"w": jnp.ones(2)}
    state = tg.setup(optax.sgd(0.1), model)
    with pytest.raises(TypeError, match="one element at a time"):
        _ = state[0:1]


def test_indexing_the_state_by_a_key_the_model_lacks_names_what_it_has():
    model = {"a": jnp.ones(2), "b": [jnp.ones(1)]}
    state = tg.setup(optax.adam(0.1), model)
    words = r"the optimiser state has no \['zzz'\] here; it mirrors the model, whose dict has "
    words += r"keys 'a', 'b'"
    with pytest.raises(KeyError, match=words):
        _ = state["zzz"]
    before = state._leaves
    with pytest.raises(KeyError, match=words):
        state["zzz"] = optax.sgd(0.1)  # assigning a rule to a part the model lacks
    assert state._leaves is before
    with pytest.raises(IndexError, match=r"no \[3\] here.*list has length 1"):
        _ = state["b"][3]
