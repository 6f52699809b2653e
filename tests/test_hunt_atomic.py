"""Hunt: bad input to everything that changes something is a clear error, and nothing is lost.

The rule under test: "Bad input gets a clear error naming what was wrong and how
to fix it, and nothing the user had is lost (a failed update leaves model and
state as they were; a failed save leaves the previous checkpoint)."

Each row (1) asserts the exception type and the words that say what was wrong
and how to fix it, (2) checks that the model, the optimiser state and the
Params are as before (every leaf's value against a snapshot, and identity where
the API works in place), and (3) that the next correct call works and equals
plain optax (`optax.update`/`apply_updates` with `jax.grad`). Bugs found are kept
as strict xfails named `test_bug_*`, asserting the correct behaviour.
"""

import enum
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import _io, nn

X = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)
Y = jnp.arange(4.0).reshape(4, 1) / 4

# ~18 s in all: the slow run (CI), so the default run stays under 3 minutes.
pytestmark = pytest.mark.slow


def make_model():
    return nn.Chain(nn.Dense(2, 3, key=jax.random.key(0)), nn.Dense(3, 1, key=jax.random.key(1)))


def loss(m, x=X, y=Y):
    return jnp.mean((m(x) - y) ** 2)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def snap(*trees):
    """Values and objects of every leaf of `trees`."""
    out = []
    for t in trees:
        ls = leaves(t)
        out.append(([np.array(x) for x in ls], list(ls)))
    return out


def assert_unchanged(before, *trees):
    for (values, objects), t in zip(before, trees, strict=True):
        now = leaves(t)
        assert len(now) == len(objects)
        for v, o, n in zip(values, objects, now, strict=True):
            assert n is o, "a leaf was rebound"
            np.testing.assert_array_equal(np.asarray(n), v)


def optax_step(rule, model, opt_state=None, g=None):
    """Plain optax: one step of `rule` from `opt_state` (fresh if None)."""
    if opt_state is None:
        opt_state = rule.init(model)
    if g is None:
        g = jax.grad(loss)(model)
    updates, opt_state = rule.update(g, opt_state, model)
    return optax.apply_updates(model, updates), opt_state


def assert_model_equal(a, b):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


RULE = optax.adam(1e-2)


# --------------------------------------------------------------- bad gradients


def _leaked():
    out = []
    jax.jit(lambda a: out.append(a) or a)(jnp.ones((3, 2)))
    return out[0]


def _tm(fn):
    return lambda g, m: jax.tree_util.tree_map(fn, g)


def _swap_first(value):
    def make(g, m):
        g = jax.tree_util.tree_map(lambda a: a, g)
        g[0].weight = value() if callable(value) else value
        return g

    return make


def _other_model_grads(g, m):
    other = nn.Chain(nn.Dense(2, 4, key=jax.random.key(0)), nn.Dense(4, 1, key=jax.random.key(1)))
    return tg.gradient(loss, other)[0]


def _extra_key(g, m):
    return {"layers": list(g.layers), "extra": jnp.ones(2)}


FIX = r"take (it|them) with tg\.gradient of this model"
MISMATCH = r"gradient tree does not match the model.*Pass the gradient of this model"
BAD_GRADS = {
    "shape": (_tm(lambda a: a[..., None]), ValueError, r"'layers\.0\.weight' has shape.*" + FIX),
    "transposed": (_swap_first(jnp.ones((2, 3))), ValueError, r"has shape \(2, 3\).*" + FIX),
    "int": (_tm(lambda a: a.astype(jnp.int32)), ValueError, r"dtype int32.*" + FIX),
    "bool": (_tm(lambda a: a > 0), ValueError, r"dtype bool.*" + FIX),
    "complex": (
        _tm(lambda a: a.astype(jnp.complex64)),
        ValueError,
        r"complex but its parameter is real.*jnp\.real\(g\)",
    ),
    # a Module attribute that is not an array is static data: the tree differs
    "python-float": (_swap_first(1.0), ValueError, r"first difference at 'layers\.0\.weight'"),
    "string": (_swap_first("g"), ValueError, MISMATCH),
    "scalar-array": (_swap_first(jnp.float32(1)), ValueError, r"shape \(\).*never broadcast"),
    "another-model": (_other_model_grads, ValueError, r"shape \(4, 2\).*" + FIX),
    "plain-list": (lambda g, m: list(g.layers), ValueError, MISMATCH),
    "extra-key": (_extra_key, ValueError, MISMATCH),
    "missing-layer": (
        lambda g, m: nn.Chain(g.layers[0]),
        ValueError,
        MISMATCH,
    ),
    "one-tuple": (lambda g, m: (g,), TypeError, r"1-tuple of gradients.*\(g,\) = tg\.gradient"),
    "text": (lambda g, m: "grads", ValueError, MISMATCH),
}


@pytest.fixture(scope="module")
def base():
    model = make_model()
    (g,) = tg.gradient(loss, model)
    return model, g


@pytest.mark.parametrize("name", list(BAD_GRADS))
def test_bad_gradient_changes_nothing_and_next_step_is_optax(base, name):
    make_bad, exc, words = BAD_GRADS[name]
    model = make_model()
    g = base[1]
    state = tg.setup(RULE, model)
    tg.update_(state, model, g)  # a state with moments, not a fresh one
    ref_model, ref_state = optax_step(RULE, make_model(), g=g)
    assert_model_equal(model, ref_model)
    bad = make_bad(g, model)
    before = snap(model, state)
    with pytest.raises(exc, match=r"tg\.update: .*" + words):
        tg.update(state, model, bad)
    assert_unchanged(before, model, state)
    with pytest.raises(exc, match=r"tg\.update_: .*" + words):
        tg.update_(state, model, bad)
    assert_unchanged(before, model, state)
    # the next correct call is plain optax's second step
    (g2,) = tg.gradient(loss, model)
    tg.update_(state, model, g2)
    ref_model, _ = optax_step(RULE, ref_model, ref_state)
    assert_model_equal(model, ref_model)


def test_leaked_tracer_gradient_changes_nothing(base):
    model = make_model()
    state = tg.setup(RULE, model)
    g = jax.tree_util.tree_map(lambda a: a, base[1])
    g[0].weight = _leaked()
    before = snap(model, state)
    # Was jax's own UnexpectedTracerError, naming neither tg.update_ nor the path.
    words = r"tg\.update_: the gradient of 'layers\.0\.weight' is a traced value that escaped"
    with pytest.raises(ValueError, match=words + r".*Return the gradients"):
        tg.update_(state, model, g)
    assert_unchanged(before, model, state)
    tg.update_(state, model, base[1])
    assert_model_equal(model, optax_step(RULE, make_model(), g=base[1])[0])


def test_nan_gradient_is_not_checked_by_update_but_by_train(base):
    # Not documented as an error for update (only tg.train stops): the step runs.
    model = make_model()
    state = tg.setup(optax.sgd(0.1), model)
    bad = jax.tree_util.tree_map(lambda a: a * jnp.nan, base[1])
    _, new = tg.update(state, model, bad)
    assert np.isnan(np.asarray(new[0].weight)).all()
    data = [(X, Y), (X * jnp.nan, Y)]
    state = tg.setup(optax.sgd(0.1), model)
    with pytest.raises(tg.NonFiniteLossError, match=r"loss is nan at epoch 0, step 1") as e:
        tg.train(loss, model, data, state)
    assert_model_equal(e.value.model, optax_step(optax.sgd(0.1), make_model())[0])


# ----------------------------------------------------- implicit update_ with Params


def _implicit():
    model = make_model()
    ps = tg.params(model)
    state = tg.setup(RULE, ps)
    return model, ps, state


def _grads(model, ps):
    return tg.gradient(lambda: loss(model), ps)


def _stale(model, ps):
    grads = _grads(model, ps)
    model[0].weight = model[0].weight + 0  # replaced after the gradients were taken
    return grads


def _for_another_model(model, ps):
    other = make_model()
    return tg.gradient(lambda: loss(other), tg.params(other))


def _explicit_wrong_shape(model, ps):
    g = tg.gradient(loss, model)[0]
    g[1].bias = jnp.ones(5)
    return g


BAD_IMPLICIT = {
    "stale": (_stale, ValueError, r"not this model's parameters.*Take the gradients again"),
    "another-model": (
        _for_another_model,
        ValueError,
        r"none of which is a parameter of this model \(e\.g\. 'layers\.0\.weight'\).*or for "
        r"another model's parameters",
    ),
    "explicit-wrong-shape": (
        _explicit_wrong_shape,
        ValueError,
        r"'layers\.1\.bias' has shape \(5,\).*" + FIX,
    ),
    "grads-times-int": (
        lambda m, ps: _grads(m, ps).map(lambda a: a.astype(jnp.int32)),
        ValueError,
        r"dtype int32.*" + FIX,
    ),
}


@pytest.mark.parametrize("name", list(BAD_IMPLICIT))
def test_bad_implicit_update_changes_nothing(name):
    make_bad, exc, words = BAD_IMPLICIT[name]
    model, ps, state = _implicit()
    bad = make_bad(model, ps)
    arrays = list(ps)
    before = snap(model, state)
    with pytest.raises(exc, match=r"tg\.update_: .*" + words):
        tg.update_(state, ps, bad)
    assert_unchanged(before, model, state)
    assert all(a is b for a, b in zip(ps, arrays, strict=True))
    tg.update_(state, ps, _grads(model, ps))  # ("stale" replaced an array by an equal one)
    assert_model_equal(model, optax_step(RULE, make_model())[0])


def test_failed_implicit_update_then_correct_one_equals_optax():
    model, ps, state = _implicit()
    ref = make_model()
    with pytest.raises(ValueError, match="another model's parameters"):
        tg.update_(state, ps, _for_another_model(model, ps))
    for _ in range(2):
        tg.update_(state, ps, _grads(model, ps))
    ref_model, ref_state = optax_step(RULE, ref)
    ref_model, _ = optax_step(RULE, ref_model, ref_state)
    assert_model_equal(model, ref_model)


# ------------------------------------------------ a state for another model / changed model


def _gained_attr(model):
    model.extra = jnp.ones(2)


def _lost_layer(model):
    model.layers.pop()


def _reshaped(model):
    model[0].weight = jnp.ones((3, 5))


def _retyped(model):
    model[0].bias = model[0].bias.astype(jnp.float16)


CHANGED = {
    "gained-param": (_gained_attr, r"optimiser state does not match the model.*tg\.setup\(rule"),
    "lost-param": (_lost_layer, r"optimiser state does not match the model.*tg\.setup\(rule"),
    "reshaped": (_reshaped, r"'layers\.0\.weight' is float32\[3×5\].*tg\.setup\(rule, model\)"),
}


@pytest.mark.parametrize("name", list(CHANGED))
def test_model_changed_since_setup_is_refused_and_changes_nothing(name):
    edit, words = CHANGED[name]
    model = make_model()
    state = tg.setup(RULE, model)
    edit(model)
    before = snap(model, state)
    for api, call in [
        ("tg.update", lambda g: tg.update(state, model, g)),
        ("tg.update_", lambda g: tg.update_(state, model, g)),
    ]:
        g = jax.tree_util.tree_map(jnp.ones_like, model)
        with pytest.raises(ValueError, match=rf"{api}: .*" + words):
            call(g)
        assert_unchanged(before, model, state)
    # setting the state up again, as the message says, works
    state = tg.setup(RULE, model)
    tg.update_(state, model, jax.tree_util.tree_map(jnp.ones_like, model))


def test_param_of_another_dtype_since_setup_steps_like_optax():
    # Not refused: optax itself steps a float16 parameter with a float32 state.
    model = make_model()
    state = tg.setup(RULE, model)
    opt_state = RULE.init(make_model())
    _retyped(model)
    g = jax.tree_util.tree_map(jnp.ones_like, model)
    tg.update_(state, model, g)
    ref = make_model()
    _retyped(ref)
    ref, _ = optax_step(RULE, ref, opt_state, g)
    assert model[0].bias.dtype == ref[0].bias.dtype == jnp.float16
    assert_model_equal(model, ref)


def test_state_of_another_model_is_refused():
    model = make_model()
    state = tg.setup(RULE, {"w": jnp.ones(3)})
    before = snap(model, state)
    with pytest.raises(ValueError, match=r"tg\.update_: the optimiser state does not match"):
        tg.update_(state, model, tg.gradient(loss, model)[0])
    assert_unchanged(before, model, state)


def test_tie_made_after_setup_names_both_places():
    model = {"enc": jnp.ones(2), "dec": jnp.zeros(2)}
    state = tg.setup(optax.sgd(0.1), model)
    model["dec"] = model["enc"]
    before = snap(model, state)
    with pytest.raises(ValueError, match=r"'dec' and 'enc'|'enc' and 'dec'.*tg\.setup"):
        tg.update_(state, model, {"enc": jnp.ones(2), "dec": jnp.ones(2)})
    assert_unchanged(before, model, state)


def test_params_gained_an_array_after_setup():
    model, ps, state = _implicit()
    ps.add(jnp.ones(2))
    before = snap(model, state)
    with pytest.raises(ValueError, match=r"tg\.update_: .*does not match.*tg\.setup"):
        tg.update_(state, ps, tg.gradient(lambda: loss(model), ps))
    assert_unchanged(before, model, state)


def test_wrong_first_arguments():
    model = make_model()
    state = tg.setup(RULE, model)
    g = tg.gradient(loss, model)[0]
    before = snap(model, state)
    with pytest.raises(TypeError, match=r"not a part of it"):
        tg.update_(state[0], model[0], g[0])
    with pytest.raises(TypeError, match=r"Call it as tg\.update_\(state, model, grads\)"):
        tg.update_(model, state, g)
    with pytest.raises(TypeError, match=r"standalone array.*tg\.update"):
        tg.update_(tg.setup(RULE, jnp.ones(2)), jnp.ones(2), jnp.ones(2))
    assert_unchanged(before, model, state)


def test_update_in_place_of_a_tuple_model_changes_nothing():
    model = (jnp.ones(2), jnp.ones(3))
    state = tg.setup(RULE, model)
    before = snap(model, state)
    with pytest.raises(TypeError, match=r"only tuples hold it.*pure tg\.update"):
        tg.update_(state, model, (jnp.ones(2), jnp.ones(3)))
    assert_unchanged(before, model, state)


# ------------------------------------------------------------- adjust, freeze, rules

INJ = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

BAD_ADJUST = {
    "unknown": (
        dict(learning_rate=0.1, lr=1),
        TypeError,
        r"unknown hyperparameter\(s\) \['lr'\]; this rule has \[.*'learning_rate'",
    ),
    "wrong-shape": (dict(learning_rate=jnp.ones(2)), ValueError, r"must have shape \(\)"),
    "second-wrong-shape": (
        dict(learning_rate=0.1, b1=jnp.ones(3)),
        ValueError,
        r"b1 must have shape \(\)",
    ),
    "string": (dict(learning_rate="1e-3"), TypeError, r"is a str.*learning_rate=1e-4"),
    "complex": (dict(learning_rate=1j), TypeError, r"is a complex.*a number"),
    "bool-array": (
        dict(learning_rate=jnp.array(True)),
        TypeError,
        r"float32 in the rule, got bool",
    ),
    "nothing": ({}, TypeError, r"name the hyperparameters to change"),
}


@pytest.mark.parametrize("sub", [False, True], ids=["whole", "sub-state"])
@pytest.mark.parametrize("name", list(BAD_ADJUST))
def test_bad_adjust_changes_nothing(name, sub):
    hyper, exc, words = BAD_ADJUST[name]
    model = make_model()
    state = tg.setup(INJ, model)
    target = state[1] if sub else state
    before = snap(model, state)
    config = state._config
    for api, fn in [("tg.adjust_", tg.adjust_), ("tg.adjust", tg.adjust)]:
        with pytest.raises(exc, match=rf"{api}: .*{words}"):
            fn(target, **hyper)
        assert_unchanged(before, model, state)
        assert state._config is config
    tg.update_(state, model, tg.gradient(loss, model)[0])
    assert_model_equal(model, optax_step(INJ, make_model())[0])


def test_adjust_of_a_rule_without_hyperparameters_says_how_to_build_one():
    model = make_model()
    state = tg.setup(RULE, model)
    before = snap(state)
    with pytest.raises(TypeError, match=r"no adjustable hyperparameters.*inject_hyperparams"):
        tg.adjust_(state, learning_rate=0.1)
    assert_unchanged(before, state)


def test_good_adjust_after_a_failed_one_equals_optax():
    model = make_model()
    state = tg.setup(INJ, model)
    with pytest.raises(
        TypeError, match=r"tg\.adjust_: unknown hyperparameter\(s\) \['nope'\]; this rule has \["
    ):
        tg.adjust_(state, learning_rate=0.5, nope=1)
    tg.adjust_(state, learning_rate=0.05)
    tg.update_(state, model, tg.gradient(loss, model)[0])
    ref_rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.05)
    assert_model_equal(model, optax_step(ref_rule, make_model())[0])


@pytest.mark.parametrize("fn", [tg.freeze_, tg.thaw_])
@pytest.mark.parametrize("bad", ["model", "rule", "optax-state"])
def test_freeze_and_thaw_of_something_else(fn, bad):
    # (None, the state at a place with no trainable array, is a no-op as Optimisers.jl's
    # freeze!(()) is: tests/test_hunt_optimisers_jl_1202c.py.)
    model = make_model()
    state = tg.setup(INJ, model)
    value = {
        "model": model,
        "rule": INJ,
        "optax-state": state[0].weight.state,
    }[bad]
    before = snap(model, state)
    config = state._config
    with pytest.raises(TypeError, match=rf"tg\.{fn.__name__} expects an optimiser state"):
        fn(value)
    assert_unchanged(before, model, state)
    assert state._config is config


def _assign(state, model):
    return {
        "wrong-shape": lambda: state.__setitem__(1, tg.setup(optax.sgd(0.1), model[0])),
        "not-a-state": lambda: state.__setitem__(1, optax.sgd(0.1)),
        "a-leaf-for-a-layer": lambda: state.__setitem__(1, tg.setup(optax.sgd(0.1), jnp.ones(3))),
    }


BAD_ASSIGN = {
    "wrong-shape": (ValueError, r"set up for a different model|set up for a float32.*tg\.setup"),
    "not-a-state": (TypeError, r"assign a state from tg\.setup.*got Gradient"),
    "a-leaf-for-a-layer": (ValueError, r"set up for a different model.*tg\.setup\(rule, sub_model"),
}


@pytest.mark.parametrize("name", list(BAD_ASSIGN))
def test_bad_rule_assignment_changes_nothing(name):
    exc, words = BAD_ASSIGN[name]
    model = make_model()
    state = tg.setup(RULE, model)
    tg.update_(state, model, tg.gradient(loss, model)[0])
    before = snap(model, state)
    config = state._config
    with pytest.raises(exc, match=words):
        _assign(state, model)[name]()
    assert_unchanged(before, model, state)
    assert state._config is config


def test_assigning_to_a_name_the_model_lacks():
    model = make_model()
    state = tg.setup(RULE, model)
    config = state._config
    with pytest.raises(AttributeError, match=r"no 'l9' here; it mirrors the model"):
        state.l9 = tg.setup(optax.sgd(0.1), model[1])
    assert state._config is config


# ---------------------------------------------------------- Params and Module edits

BAD_ADD = {
    "numpy": (np.ones(3, np.float32), TypeError, r"numpy array.*jnp\.asarray\(W\)"),
    "int-array": (jnp.arange(3), ValueError, r"not differentiable.*astype\(jnp\.float32\)"),
    "python-float": (1.5, TypeError, r"parameters are arrays.*Pass a model"),
    "int-model": ({"n": jnp.arange(2)}, ValueError, r"no differentiable arrays.*Cast"),
}


@pytest.mark.parametrize("name", list(BAD_ADD))
def test_bad_params_add_changes_nothing(name):
    value, exc, words = BAD_ADD[name]
    model, ps, state = _implicit()
    arrays, names = list(ps), list(ps.named())
    with pytest.raises(exc, match=r"Params\.add.*" + words):
        ps.add(value)
    assert list(ps.named()) == names
    assert all(a is b for a, b in zip(ps, arrays, strict=True)) and len(ps) == len(arrays)
    tg.update_(state, ps, _grads(model, ps))
    assert_model_equal(model, optax_step(RULE, make_model())[0])


def test_params_remove_of_a_stranger_changes_nothing():
    model, ps, state = _implicit()
    arrays = list(ps)
    with pytest.raises(KeyError, match=r"not one of the parameters.*use discard"):
        ps.remove(jnp.ones((3, 2)))
    assert all(a is b for a, b in zip(ps, arrays, strict=True)) and len(ps) == len(arrays)
    ps.discard(jnp.ones(2))
    assert len(ps) == len(arrays)
    tg.update_(state, ps, _grads(model, ps))
    assert_model_equal(model, optax_step(RULE, make_model())[0])


def test_params_add_half_converts_numpy_leaves_before_refusing():
    # A numpy float leaf is converted in place to a jax.Array (documented); when a
    # later leaf cannot be (immutable all the way up), the error is clear.
    inner = [np.ones(2, np.float32)]
    tree = (inner, np.ones(3, np.float32))
    ps = tg.Params([])
    with pytest.raises(TypeError, match=r"Params\.add: '1' is a numpy array inside an immutable"):
        ps.add(tree)
    assert len(ps) == 0
    np.testing.assert_array_equal(np.asarray(inner[0]), np.ones(2))  # the values are kept


def test_module_cycle_assignment_changes_nothing():
    model = make_model()
    before = snap(model)
    with pytest.raises(ValueError, match=r"cannot set Dense\.sub.*cycle.*Hold a reference outside"):
        model[0].sub = [model]
    assert "sub" not in vars(model[0])
    assert_unchanged(before, model)
    state = tg.setup(RULE, model)
    tg.update_(state, model, tg.gradient(loss, model)[0])
    assert_model_equal(model, optax_step(RULE, make_model())[0])


# ------------------------------------------------------------------ compiled steps


@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError])
@pytest.mark.parametrize("where", ["in-loss", "after-update"])
def test_interrupted_jit_step_changes_nothing(exc, where):
    model, ps, state = _implicit()

    def inner_loss(x):
        if where == "in-loss" and x.shape[0] == 5:
            raise exc("interrupted")
        return loss(model, x, Y if x.shape[0] == 4 else jnp.zeros((5, 1)))

    @tg.jit
    def step(x):
        grads = tg.gradient(lambda: inner_loss(x), ps)
        tg.update_(state, ps, grads)
        if where == "after-update" and x.shape[0] == 5:
            raise exc("interrupted")

    step(X)  # one good step, compiled
    ref_model, ref_state = optax_step(RULE, make_model())
    assert_model_equal(model, ref_model)
    before = snap(model, state)
    arrays = list(ps)
    with pytest.raises(exc, match="interrupted"):
        step(jnp.ones((5, 2)))
    assert_unchanged(before, model, state)
    assert all(a is b for a, b in zip(ps, arrays, strict=True))
    assert all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in ps)
    step(X)
    ref_model, _ = optax_step(RULE, ref_model, ref_state)
    assert_model_equal(model, ref_model)


def _train_data():
    return [(X, Y), (X * 2, Y), (jnp.ones((5, 2)), jnp.zeros((5, 1)))]


def _interrupting_loss(m, x, y):
    if x.shape[0] == 5:
        raise KeyboardInterrupt
    return loss(m, x, y)


def test_keyboard_interrupt_in_train_explicit_leaves_inputs():
    model = make_model()
    state = tg.setup(RULE, model)
    before = snap(model, state)
    with pytest.raises(KeyboardInterrupt):
        tg.train(_interrupting_loss, model, _train_data(), state)
    assert_unchanged(before, model, state)
    _new_state, new_model, _ = tg.train(loss, model, _train_data()[:1], state)
    assert_model_equal(new_model, optax_step(RULE, make_model())[0])


def test_keyboard_interrupt_in_train_implicit_keeps_the_last_good_step():
    model, ps, state = _implicit()
    with pytest.raises(KeyboardInterrupt):
        tg.train(lambda x, y: _interrupting_loss(model, x, y), ps, _train_data(), state)
    ref = make_model()
    opt_state = None
    for x, y in _train_data()[:2]:
        ref, opt_state = optax_step(RULE, ref, opt_state, jax.grad(loss)(ref, x, y))
    assert_model_equal(model, ref)  # two good steps, model and state agree
    assert int(state[0].weight.state[0].count) == 2
    tg.update_(state, ps, _grads(model, ps))
    ref, _ = optax_step(RULE, ref, opt_state)
    assert_model_equal(model, ref)


# ------------------------------------------------------------------------ files


@pytest.fixture
def quiet_absl():
    logging.disable(logging.CRITICAL)  # orbax logs a failed save's traceback from its threads
    yield
    logging.disable(logging.NOTSET)


def _saved(tmp_path):
    model = make_model()
    state = tg.setup(RULE, model)
    tg.update_(state, model, tg.gradient(loss, model)[0])
    path = tmp_path / "ck"
    tg.save(path, (model, state))
    return path, model, state


def _like():
    m = make_model()
    return (m, tg.setup(RULE, m))


def _assert_loads_as(path, model, state):
    got = tg.load(path, _like())
    for a, b in zip(leaves(got), leaves((model, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _orbax_then_fail(exc):
    real = _io._orbax_save

    def fail(where, arrays):
        real(where, arrays)  # the arrays are written, then the save dies
        raise exc("disk full")

    return fail


def _fail_on_call(n, exc, real=os.fsync):
    calls = [0]

    def fsync(*args):
        calls[0] += 1
        if calls[0] == n:
            raise exc("disk full")
        return real(*args)

    return fsync


MIDWAY = {
    "after-orbax-oserror": ("_orbax_save", lambda: _orbax_then_fail(OSError)),
    "after-orbax-interrupt": ("_orbax_save", lambda: _orbax_then_fail(KeyboardInterrupt)),
    "hashing": ("_hash_files", lambda: _fail_on_call(1, OSError)),
    "first-fsync": ("fsync", lambda: _fail_on_call(1, OSError)),
    "third-fsync": ("fsync", lambda: _fail_on_call(3, OSError)),
    "os-replace": ("replace", lambda: _fail_on_call(1, OSError, os.replace)),
}


@pytest.mark.parametrize("name", list(MIDWAY))
def test_save_failing_midway_keeps_the_previous_checkpoint(tmp_path, monkeypatch, name, quiet_absl):
    path, model, state = _saved(tmp_path)
    what, make = MIDWAY[name]
    new_model = make_model()
    new_model[0].weight = new_model[0].weight + 1
    if what in ("_orbax_save", "_hash_files"):
        if what == "_hash_files":
            real = _io._hash_files

            def hashing(folder, data, sync):
                real(folder, data, sync)
                raise OSError("disk full")

            monkeypatch.setattr(_io, "_hash_files", hashing)
        else:
            monkeypatch.setattr(_io, "_orbax_save", make())
    else:
        monkeypatch.setattr(_io.os, what, make())
    exc = KeyboardInterrupt if "interrupt" in name else OSError
    with pytest.raises(exc):
        tg.save(path, (new_model, tg.setup(RULE, new_model)))
    monkeypatch.undo()
    _assert_loads_as(path, model, state)
    tg.save(path, (new_model, state))  # the next save works and cleans up
    _assert_loads_as(path, new_model, state)
    assert sorted(e for e in os.listdir(path) if e != "treegrad.json")[0].startswith("data-")
    assert len(os.listdir(path)) == 2


BAD_SAVE_PATHS = {
    "a-file": (lambda p: (p.write_text("x"), p)[1], FileExistsError, r"is a file.*Remove the file"),
    "foreign-folder": (
        lambda p: (p.mkdir(), (p / "notes").write_text("x"))[0] or p,
        FileExistsError,
        r"holding files that tg\.save did not write.*new path",
    ),
}


@pytest.mark.parametrize("name", list(BAD_SAVE_PATHS))
def test_bad_save_paths_touch_nothing(tmp_path, name):
    make, exc, words = BAD_SAVE_PATHS[name]
    p = make(tmp_path / "target")
    listing = sorted(os.listdir(tmp_path))
    with pytest.raises(exc, match=r"tg\.save: .*target.*" + words):
        tg.save(p, {"w": jnp.ones(2)})
    assert sorted(os.listdir(tmp_path)) == listing


def test_save_into_missing_folders_creates_them(tmp_path):
    path = tmp_path / "a" / "b" / "ck"
    tg.save(path, {"w": jnp.arange(2.0)})
    np.testing.assert_array_equal(tg.load(path, {"w": jnp.zeros(2)})["w"], [0.0, 1.0])


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_save_into_read_only_parent_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        with pytest.raises(PermissionError, match="ro"):
            tg.save(ro / "ck", {"w": jnp.ones(2)})
    finally:
        os.chmod(ro, 0o755)


def _truncate_data(path):
    data = next(p for p in path.iterdir() if p.name.startswith("data-"))
    biggest = max((f for f in data.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def _corrupt_manifest(path):
    m = path / "treegrad.json"
    m.write_bytes(m.read_bytes()[:-7])


BAD_LOADS = {
    "truncated-data": (_truncate_data, tg.CheckpointError, r"not a valid"),
    "truncated-manifest": (_corrupt_manifest, tg.CheckpointError, r"not a valid"),
}


@pytest.mark.parametrize("name", list(BAD_LOADS))
def test_damaged_checkpoint_is_refused_and_like_is_untouched(tmp_path, name):
    path, model, state = _saved(tmp_path)
    damage, exc, words = BAD_LOADS[name]
    damage(path)
    like = _like()
    before = snap(like)
    with pytest.raises(exc, match=rf"{path}.*{words}"):
        tg.load(path, like)
    assert_unchanged(before, like)
    # saving again over the damaged one works
    tg.save(path, (model, state))
    _assert_loads_as(path, model, state)


def test_load_into_another_model_names_the_path_and_leaves_like(tmp_path):
    path, _model, _state = _saved(tmp_path)
    other = nn.Chain(nn.Dense(2, 4, key=jax.random.key(0)), nn.Dense(4, 1, key=jax.random.key(1)))
    like = (other, tg.setup(RULE, other))
    before = snap(like)
    with pytest.raises(ValueError, match=r"tg\.load: .*layers\.0\.weight.*float32\[4, 2\]"):
        tg.load(path, like)
    assert_unchanged(before, like)


# ---------------------------------------------- found by this hunt (fixed) ---------


class Color(enum.IntEnum):
    RED = 1


def test_update_in_place_with_numpy_int_dict_key_half_updates():
    model = {"a": jnp.ones(2), "b": {np.int64(1): jnp.ones(3)}}
    state = tg.setup(optax.sgd(0.1), model)
    g = jax.tree_util.tree_map(jnp.ones_like, model)
    _expected_state, expected = tg.update(state, model, g)  # the pure update works
    try:
        tg.update_(state, model, g)
    finally:
        # whatever happens, never a half-updated model: both or neither moved
        a_moved = bool(model["a"][0] != 1.0)
        b_moved = bool(model["b"][np.int64(1)][0] != 1.0)
        assert a_moved == b_moved, "model half updated"
    assert_model_equal(model, expected)


@pytest.mark.parametrize("key", [np.int64(0), Color.RED], ids=["np-int64", "int-enum"])
def test_update_in_place_with_non_literal_dict_key(key):
    model = {key: jnp.ones(2)}
    state = tg.setup(optax.sgd(0.1), model)
    tg.update_(state, model, {key: jnp.ones(2)})
    np.testing.assert_allclose(np.asarray(model[key]), [0.9, 0.9])


def test_jit_implicit_step_with_numpy_int_dict_key():
    k = np.int64(1)
    model = {"a": jnp.ones(2), "b": {k: jnp.ones(3)}}
    ps = tg.params(model)
    state = tg.setup(optax.sgd(0.1), ps)

    @tg.jit
    def step():
        g = tg.gradient(lambda: jnp.sum(model["a"]) + jnp.sum(model["b"][k]), ps)
        tg.update_(state, ps, g)

    step()
    np.testing.assert_allclose(np.asarray(model["b"][k]), [0.9, 0.9, 0.9])


def test_deleted_parameter_after_donate_is_named():
    model = make_model()
    (g,) = tg.gradient(loss, model)
    new_state, _ = tg.update(tg.setup(RULE, model), model, g, donate=True)
    before = snap(new_state)
    words = (
        r"tg\.update_: the parameter 'layers\.0\.weight' is an array that was deleted.*donate=True"
    )
    with pytest.raises(ValueError, match=words):
        tg.update_(new_state, model, g)  # the old model: its arrays were donated
    assert_unchanged(before, new_state)
