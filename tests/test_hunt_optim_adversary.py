"""Adversarial hunt on the optimiser: silent wrong results against plain optax, and
results that depend on the run's history.

Angles not covered by tests/test_hunt_optim.py, test_hunt_history.py, test_optim*.py
and test_hunt_api.py: a whole gradient tree of `None`; a model whose leaves change
kind after `tg.setup` (a non-trainable leaf becoming a float array and back); a layer
appended or removed; hyperparameters changed at two depths of a chain, inside
`MultiSteps` and inside `masked`; checkpoints taken mid-accumulation of `MultiSteps`
and mid-schedule; a failed update in the middle of a count-dependent run; tied weights
frozen or adjusted through one of their places; bfloat16 / float16 / float64-numpy
parameters and bfloat16 gradients; `float0` gradients from `jax.grad(allow_int=True)`;
five styles of the same step (pure, in place, `Params`, `Grads.to_tree`, donated) on a
model with a tie, a grafted rule, a frozen part and `None` steps; a state reused with
another model of the same structure; `tg.update_` inside the user's own `jax.jit`.

Every numerical check compares with plain optax run by hand (`opt.init`,
`opt.update`, `optax.apply_updates`) on the equivalent dict of arrays; a skipped
parameter (`None` gradient, frozen) keeps its value and its own optax state entries
while shared counters advance, as API.md section 4 defines. Between treegrad's own
styles, which run the same compiled step, the comparison is bit for bit.

Bugs are strict xfails whose test asserts the correct behaviour.
"""

import copy
import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

from .helpers import restore_own_entries
from .test_hunt_optim import assert_unchanged, grads_for, snapshot, start

pytestmark = pytest.mark.slow

tree_map = jax.tree_util.tree_map
leaves = jax.tree_util.tree_leaves


# --- references and comparisons ---------------------------------------------------------


def _is_none(x):
    return x is None


def ref_step(rule, state, params, grads):
    """Plain optax on a pytree; a `None` gradient (a leaf or a whole sub-tree) skips those
    parameters: value and own state entries kept, shared counters advance."""
    skip = tree_map(lambda g, p: tree_map(lambda _: g is None, p), grads, params, is_leaf=_is_none)
    filled = tree_map(
        lambda g, p: tree_map(jnp.zeros_like, p) if g is None else g,
        grads,
        params,
        is_leaf=_is_none,
    )
    updates, new_state = rule.update(filled, state, params)
    moved = optax.apply_updates(params, updates)
    new_params = tree_map(lambda s, n, o: o if s else n, skip, moved, params)
    return new_params, restore_own_entries(rule, state, new_state, skip)


# Compiled, as treegrad's step is (and eager MultiSteps costs seconds a step here).
ref_jit = jax.jit(ref_step, static_argnums=0)


def close(a, b, rtol=1e-6, atol=1e-7):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=rtol, atol=atol)


def same_bits(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ==========================================================================================
# None gradients: the whole tree
# ==========================================================================================


@pytest.mark.parametrize("style", ["update", "update_"])
def test_a_gradient_tree_that_is_none_skips_everything_and_the_count_advances(style):
    rule = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1))
    ref, ref_state = start(), rule().init(start())
    model = start()
    state = tg.setup(rule(), model)
    opt = rule()
    for i, whole_none in enumerate([False, True, True, False]):
        g = None if whole_none else grads_for(ref, "abc", i)
        ref, ref_state = ref_jit(
            opt, ref_state, ref, grads_for(ref, "" if whole_none else "abc", i)
        )
        before = dict(model)
        if style == "update":
            state, model = tg.update(state, model, g)
        else:
            tg.update_(state, model, g)
        if whole_none:
            assert all(model[k] is before[k] for k in model)  # the same objects
        close(model, ref)
    close(state, ref_state)
    assert int(state["a"].state[1][0].count) == 4


# ==========================================================================================
# Freeze / thaw through one place of a tied weight; freeze everything
# ==========================================================================================


def test_freezing_one_place_of_a_tied_weight_freezes_the_array_then_thaw_equals_optax():
    w = jnp.array([1.0, 2.0])
    model = {"dec": w, "enc": w, "b": jnp.array([0.5])}
    state = tg.setup(optax.adam(0.1), model)
    tg.freeze_(state["enc"])
    assert state["dec"].frozen  # one array, one state: both places
    opt = optax.adam(0.1)
    ref = {"w": w, "b": model["b"]}
    ref_state = opt.init(ref)
    for i in range(5):
        if i == 3:
            tg.thaw_(state["dec"])
        g = {
            "dec": jnp.array([1.0, -1.0]) * (i + 1),
            "enc": jnp.array([0.5, 0.5]),
            "b": jnp.ones(1),
        }
        total = g["dec"] + g["enc"]
        ref, ref_state = ref_jit(opt, ref_state, ref, {"w": total if i >= 3 else None, "b": g["b"]})
        state, model = tg.update(state, model, g)
        assert model["dec"] is model["enc"]
        if i < 3:
            assert model["dec"] is w  # frozen: the same object
        close({"b": model["b"], "w": model["dec"]}, ref)
    close(state, ref_state)


def test_freezing_every_parameter_equals_a_none_tree_and_counts():
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    frozen, skipped = start(), start()
    fs, ss = tg.setup(opt, frozen), tg.setup(opt, skipped)
    tg.freeze_(fs)
    for i in range(3):
        fs, frozen = tg.update(fs, frozen, grads_for(frozen, "abc", i))
        ss, skipped = tg.update(ss, skipped, None)
    same_bits(frozen, start())
    same_bits(fs, ss)
    assert int(fs["a"].state.inner_state[0].count) == 3


# ==========================================================================================
# The model's structure changes between steps
# ==========================================================================================


def chain2():
    k1, k2 = jax.random.split(jax.random.key(0))
    return nn.Chain(nn.Dense(2, 3, jax.nn.tanh, key=k1), nn.Dense(3, 2, key=k2))


XS = jax.random.normal(jax.random.key(7), (6, 2))


def chain_loss(m):
    return jnp.mean(m(XS) ** 2)


@pytest.mark.parametrize("change", ["append", "pop"])
def test_a_layer_added_or_removed_is_a_clear_error_then_a_fresh_setup_trains_like_optax(change):
    model = chain2()
    state = tg.setup(optax.adam(0.05), model)
    (g,) = tg.gradient(chain_loss, model)
    tg.update_(state, model, g)
    if change == "append":
        model.layers.append(nn.Dense(2, 2, key=jax.random.key(3)))
        where = r"layers\.2\.weight"
    else:
        model.layers.pop()
        where = r"layers\.1"
    (g,) = tg.gradient(chain_loss, model)
    snap = snapshot(state, model)
    with pytest.raises(
        ValueError, match=rf"does not match the model \(first difference at '{where}"
    ):
        tg.update_(state, model, g)
    with pytest.raises(ValueError, match=r"tg\.setup\(rule, model\)"):
        tg.update(state, model, g)
    assert_unchanged(snap, state, model)
    # The API's answer: set the state up again; then it is plain optax from scratch.
    opt = optax.adam(0.05)
    state = tg.setup(opt, model)
    ref, ref_state = model, opt.init(model)
    for _ in range(3):
        ref, ref_state = ref_jit(opt, ref_state, ref, jax.grad(chain_loss)(ref))
        (g,) = tg.gradient(chain_loss, model)
        tg.update_(state, model, g)
    close(model, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("was", ["python_float", "int_array"])
@pytest.mark.parametrize("style", ["explicit", "implicit"])
def test_a_leaf_that_became_a_float_array_after_setup_is_a_clear_error(was, style):
    # Once: m = {"w": jnp.ones(2), "s": 2.0}; st = tg.setup(optax.sgd(0.5), m)
    #        m["s"] = jnp.array(2.0); (g,) = tg.gradient(lambda m: jnp.sum(m["w"]) * m["s"], m)
    #        tg.update_(st, m, g)  ->  no error; g["s"] == 2.0 is dropped, m["s"] stays 2.0.
    # Like a tie made after setup or a reshaped parameter, the state has no entry for the
    # new parameter: a clear error naming it, and nothing changed.
    model = {"w": jnp.ones(2), "s": 2.0 if was == "python_float" else jnp.array(2)}
    ps = tg.params(model)
    state = tg.setup(optax.sgd(0.5), ps if style == "implicit" else model)
    model["s"] = jnp.array(2.0)

    def loss(m):
        return jnp.sum(m["w"]) * m["s"]

    if style == "implicit":
        g = tg.gradient(lambda: loss(model), ps)
        call = lambda: tg.update_(state, ps, g)
    else:
        (g,) = tg.gradient(loss, model)
        assert g["s"] is not None
        call = lambda: tg.update_(state, model, g)
    snap = snapshot(state, model)
    with pytest.raises(ValueError, match=r"'s' .*(trainable|was not).*tg\.setup\(rule, model\)"):
        call()
    assert_unchanged(snap, state, model)


@pytest.mark.parametrize("grad", ["float", "none"])
def test_a_parameter_that_became_an_int_array_after_setup_is_a_clear_error(grad):
    # Once (before the step checked dtype kinds while tracing):
    #        m = {"w": jnp.ones(2), "v": jnp.ones(2)}; st = tg.setup(optax.sgd(0.5), m)
    #        m["v"] = jnp.array([3, 3]); tg.update(st, m, {"w": jnp.ones(2), "v": jnp.ones(2)})
    #        -> m["v"] == [2, 2] int32 (3 - 0.5 truncated): an integer leaf trained.
    #        With {"v": None}: ValueError "the gradient at 'v' has dtype int32 (expected
    #        int32[2], got int32[2])" -- there is no gradient at 'v'; the parameter changed.
    model = {"w": jnp.ones(2), "v": jnp.ones(2)}
    state = tg.setup(optax.sgd(0.5), model)
    model["v"] = jnp.array([3, 3])
    g = {"w": jnp.ones(2), "v": jnp.ones(2) if grad == "float" else None}
    snap = snapshot(state, model)
    with pytest.raises(ValueError, match=r"'v' is int32\[2\] but was float32\[2\] when the opt"):
        tg.update_(state, model, g)
    assert_unchanged(snap, state, model)


def test_a_parameter_cast_to_bfloat16_after_setup_trains_like_optax():
    # A dtype change that keeps the leaf trainable: optax keeps float32 moments and
    # casts the update to the parameter's dtype; so does treegrad.
    opt = optax.sgd(0.1, momentum=0.9)
    model = {"w": jnp.array([1.0, -0.5, 0.25]), "b": jnp.array([0.1])}
    state = tg.setup(opt, model)
    ref, ref_state = dict(model), opt.init(model)
    for i in range(4):
        if i == 2:
            model = {**model, "w": model["w"].astype(jnp.bfloat16)}
            ref = {**ref, "w": ref["w"].astype(jnp.bfloat16)}
        g = {"w": jnp.array([0.5, 1.0, -1.0]) * (i + 1), "b": jnp.ones(1)}
        ref, ref_state = ref_jit(opt, ref_state, ref, g)
        state, model = tg.update(state, model, g)
    assert model["w"].dtype == jnp.bfloat16
    close(model, ref)
    close(state, ref_state)


# ==========================================================================================
# Hyperparameters changed mid-run inside combinators
# ==========================================================================================


def nested_inject():
    return optax.chain(
        optax.inject_hyperparams(optax.scale_by_adam)(b1=0.9),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.5),
    )


def multisteps_inject():
    return optax.MultiSteps(
        optax.inject_hyperparams(optax.adam)(learning_rate=0.1), every_k_schedule=2
    )


def masked_inject():
    return optax.chain(
        optax.masked(
            optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
            {"a": True, "b": False, "c": True},
        ),
        optax.masked(optax.sgd(0.1), {"a": False, "b": True, "c": False}),
    )


def _hp_nested(s):
    s[0].hyperparams["b1"] = jnp.asarray(0.5)
    s[1].hyperparams["learning_rate"] = jnp.asarray(0.02)
    s[1].hyperparams["momentum"] = jnp.asarray(0.8)


def _hp_multisteps(s):
    s.inner_opt_state.hyperparams["learning_rate"] = jnp.asarray(0.02)


def _hp_masked(s):
    s[0].inner_state.hyperparams["learning_rate"] = jnp.asarray(0.02)


ADJUST_CASES = {
    "two_depths_of_a_chain": (
        nested_inject,
        dict(learning_rate=0.02, b1=0.5, momentum=0.8),
        _hp_nested,
    ),
    "inside_multisteps_mid_accumulation": (
        multisteps_inject,
        dict(learning_rate=0.02),
        _hp_multisteps,
    ),
    "inside_masked": (masked_inject, dict(learning_rate=0.02), _hp_masked),
}


@pytest.mark.parametrize("name", list(ADJUST_CASES))
def test_adjust_mid_run_inside_combinators_equals_editing_the_optax_state(name):
    make, hyper, edit = ADJUST_CASES[name]
    opt = make()
    ref, ref_state = start(), opt.init(start())
    model = start()
    state = tg.setup(make(), model)
    patterns = ["abc", "ab", "abc", "c", "abc", "abc"]
    for i, present in enumerate(patterns):
        if i == 3:  # MultiSteps: after an odd number of steps, mid-accumulation
            tg.adjust_(state, **hyper)
            edit(ref_state)
        g = grads_for(ref, present, i)
        ref, ref_state = ref_jit(opt, ref_state, ref, g)
        state, model = tg.update(state, model, g)
        close(model, ref, rtol=1e-5, atol=1e-6)
    close(state, ref_state, rtol=1e-5, atol=1e-6)


def test_adjust_of_a_sub_state_to_its_current_value_changes_nothing():
    # Once: rule = optax.chain(optax.clip_by_global_norm(0.5),
    #                           optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    #        m = {"enc": jnp.array([3., 0.]), "dec": jnp.array([0., 4.])}; g = the same values
    #        st = tg.setup(rule, m); tg.adjust_(st["enc"], learning_rate=0.1)
    #        tg.update(st, m, g)[1] -> enc [2.95, 0], dec [0, 3.95] (norms 3 and 4 clipped
    #        apart); plain optax, and tg without the no-op adjust_: enc [2.97, 0], dec [0, 3.96].
    # A sub-state adjusted to a new value gets its own part (docs/optimiser.md); to the
    # value it has, it stays one part with the rest.
    # (tests/test_hunt_api.py and test_hunt_optim.py encode a sub-state adjust as a copy of
    # the whole rule for that part; with the value unchanged that copy still moves results.)
    def rule():
        return optax.chain(
            optax.clip_by_global_norm(0.5), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        )

    model = {"enc": jnp.array([3.0, 0.0]), "dec": jnp.array([0.0, 4.0])}
    g = {"enc": jnp.array([3.0, 0.0]), "dec": jnp.array([0.0, 4.0])}
    opt = rule()
    u, _ = opt.update(g, opt.init(model), model)
    ref = optax.apply_updates(model, u)
    np.testing.assert_allclose(ref["enc"], [2.97, 0.0], rtol=1e-6)  # norm 5 clipped to 0.5
    state = tg.setup(rule(), model)
    config = state._config
    tg.adjust_(state["enc"], learning_rate=0.1)  # the value it has
    tg.adjust_(state["enc"], learning_rate=np.float32(0.1))
    assert state._config is config
    _, new = tg.update(state, model, g)
    close(new, ref)
    # Names and values are still checked when nothing would change.
    with pytest.raises(TypeError, match=r"unknown hyperparameter\(s\) \['lr'\]"):
        tg.adjust_(state["enc"], lr=0.1)
    # A new value: the part is its own, its learning rate the new one, the other's kept.
    tg.adjust_(state["enc"], learning_rate=0.2)
    assert state._config is not config
    lr = lambda k: float(state[k].state[1].hyperparams["learning_rate"])
    assert (lr("enc"), lr("dec")) == (pytest.approx(0.2), pytest.approx(0.1))


def test_editing_hyperparams_through_the_leaf_view_is_refused_with_the_way_to_do_it():
    # Once silently dropped: st["w"].state.hyperparams["learning_rate"] = 1.0, no error,
    # and tg.update still stepped by 0.1 where optax's idiom steps by 1.0.
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    model = {"w": jnp.ones(2)}
    state = tg.setup(opt, model)
    hp = state["w"].state.hyperparams
    words = r"view of one parameter's optimiser state.*change nothing.*tg\.adjust_\(state"
    for edit in [
        lambda: hp.__setitem__("learning_rate", jnp.asarray(1.0)),
        lambda: hp.update(learning_rate=1.0),
        lambda: hp.pop("learning_rate"),
        lambda: hp.setdefault("momentum", 0.9),
        lambda: hp.clear(),
    ]:
        with pytest.raises(TypeError, match=words):
            edit()
    with pytest.raises(TypeError, match=words):
        hp |= {"learning_rate": 1.0}
    # A copy of the view is the user's own, a plain dict (copying once refused).
    for copied in (
        copy.copy(hp),
        copy.deepcopy(state["w"].state).hyperparams,
        pickle.loads(pickle.dumps(state["w"].state)).hyperparams,
    ):
        assert type(copied) is dict
        copied["learning_rate"] = 1.0
    # Read, and mapped over, the view is the optax state's values.
    assert float(state["w"].state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    doubled = jax.tree.map(lambda x: 2 * x, state["w"].state)
    assert type(doubled.hyperparams) is dict
    close(doubled.hyperparams["learning_rate"], jnp.asarray(0.2))
    # The way the message gives, against optax's idiom on its own state.
    tg.adjust_(state, learning_rate=1.0)
    ref_state = opt.init(model)
    ref_state.hyperparams["learning_rate"] = jnp.asarray(1.0)
    u, _ = opt.update({"w": jnp.ones(2)}, ref_state, model)
    _, new = tg.update(state, model, {"w": jnp.ones(2)})
    close(new, optax.apply_updates(model, u))


# ==========================================================================================
# Count-dependent rules through a checkpoint, and through a failed update
# ==========================================================================================

COUNTED = {
    "multisteps_every_3": lambda: optax.MultiSteps(optax.adam(0.1), every_k_schedule=3),
    "inject_linear_schedule": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(0.1, 0.0, 6)
    ),
    "apply_every_3": lambda: optax.chain(optax.adam(0.1), optax.apply_every(3)),
    "warmup_cosine_adamw": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 7), weight_decay=0.1
    ),
}


@pytest.mark.parametrize("name", list(COUNTED))
def test_checkpoints_mid_accumulation_and_mid_schedule_equal_the_uninterrupted_run(name, tmp_path):
    make = COUNTED[name]
    opt = make()
    ref, ref_state = start(), opt.init(start())
    model = start()
    state = tg.setup(make(), model)
    patterns = ["abc", "ab", "abc", "abc", "abc", "ab", "abc"]
    for i, present in enumerate(patterns):
        if i in (2, 4):  # after 2 and 4 steps: mid-accumulation for every_k=3
            where = tmp_path / f"ckpt{i}"
            tg.save(where, (model, state))
            tg.clear_cache()
            fresh = tree_map(lambda x: x * 0, start())
            model, state = tg.load(where, (fresh, tg.setup(make(), fresh)))
        g = grads_for(ref, present, i)
        ref, ref_state = ref_jit(opt, ref_state, ref, g)
        state, model = tg.update(state, model, g)
    close(model, ref, rtol=1e-5, atol=1e-6)
    close(state, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "style"),
    [
        ("multisteps_every_3", "update"),
        ("multisteps_every_3", "params"),
        ("inject_linear_schedule", "update_"),
        ("inject_linear_schedule", "params"),
    ],
)
def test_a_failed_update_mid_run_changes_nothing_and_the_run_goes_on_like_optax(name, style):
    make = COUNTED[name]
    opt = make()
    ref, ref_state = start(), opt.init(start())
    model = start()
    ps = tg.params(model)
    state = tg.setup(make(), ps if style == "params" else model)

    def call(g):
        nonlocal state, model
        if style == "update":
            state, model = tg.update(state, model, g)
        elif style == "update_":
            tg.update_(state, model, g)
        else:
            tg.update_(state, ps, g)

    api = "tg.update" if style == "update" else "tg.update_"
    bad = [
        ({"b": jnp.ones((2, 1))}, ValueError, r"gradient at 'b' has shape \(2, 1\)"),
        ({"a": jnp.ones(2, jnp.int32)}, ValueError, r"gradient at 'a' has dtype int32"),
        ({"c": "0.1"}, TypeError, r"gradient at 'c' is a str"),
        ({"d": jnp.ones(1)}, ValueError, r"gradient tree does not match the model"),
    ]
    for i in range(5):
        if i in (1, 2, 4):  # mid-accumulation and mid-schedule
            for change, exc, msg in bad:
                g = {**grads_for(model, "abc", i), **change}
                snap = snapshot(state, model)
                with pytest.raises(exc, match=rf"{api}: .*{msg}"):
                    call(g)
                assert_unchanged(snap, state, model)
        g = grads_for(ref, "abc" if i % 2 == 0 else "ac", i)
        ref, ref_state = ref_jit(opt, ref_state, ref, g)
        call(g)
        close(model, ref, rtol=1e-5, atol=1e-6)
    close(state, ref_state, rtol=1e-5, atol=1e-6)


# ==========================================================================================
# Tied weights
# ==========================================================================================


def test_adjust_through_one_place_of_a_tied_weight_sets_the_arrays_rate_like_optax():
    inj = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    w = jnp.array([1.0, 2.0])
    model = {"dec": w, "enc": w, "b": jnp.array([0.5])}
    state = tg.setup(inj(), model)
    # Reference: one array w; its own copy of the rule once adjusted (a part of its own).
    labels = {"w": "w", "b": "b"}
    opt = optax.multi_transform({"w": inj(), "b": inj()}, labels)
    ref = {"w": w, "b": model["b"]}
    ref_state = opt.init(ref)
    for i in range(4):
        if i == 2:
            tg.adjust_(state["enc"], learning_rate=0.01)
            ref_state.inner_states["w"].inner_state.hyperparams["learning_rate"] = jnp.asarray(0.01)
        g = {
            "dec": jnp.array([1.0, -1.0]),
            "enc": jnp.array([0.5, 2.0]) * (i + 1),
            "b": jnp.ones(1),
        }
        ref, ref_state = ref_jit(opt, ref_state, ref, {"w": g["dec"] + g["enc"], "b": g["b"]})
        tg.update_(state, model, g)
        assert model["dec"] is model["enc"]
        close({"b": model["b"], "w": model["enc"]}, ref)
    assert float(state["dec"].state.hyperparams["learning_rate"]) == pytest.approx(0.01)
    assert float(state["b"].state.hyperparams["learning_rate"]) == pytest.approx(0.1)


def test_tied_weight_with_none_at_every_place_keeps_its_object_and_moments():
    w = jnp.array([1.0, 2.0])
    model = {"dec": w, "enc": w, "b": jnp.array([0.5])}
    opt = optax.chain(optax.clip_by_global_norm(0.7), optax.adam(0.1))
    state = tg.setup(opt, model)
    ref = {"w": w, "b": model["b"]}
    ref_state = opt.init(ref)
    steps = [
        ({"dec": jnp.ones(2), "enc": jnp.ones(2), "b": jnp.ones(1)}, True),
        ({"dec": None, "enc": None, "b": jnp.ones(1)}, False),
        ({"dec": None, "enc": jnp.array([2.0, 0.0]), "b": None}, True),
    ]
    for g, w_seen in steps:
        total = None
        if w_seen:
            total = sum(x for x in (g["dec"], g["enc"]) if x is not None)
        ref, ref_state = ref_jit(opt, ref_state, ref, {"w": total, "b": g["b"]})
        before = model["enc"]
        state, model = tg.update(state, model, g)
        assert model["dec"] is model["enc"]
        assert (model["enc"] is before) == (not w_seen)
        close({"b": model["b"], "w": model["enc"]}, ref)
    close(state, ref_state)


# ==========================================================================================
# Mixed dtypes, numpy parameters, integer leaves and float0 gradients
# ==========================================================================================

DTYPE_RULES = {
    "adam": lambda: optax.adam(1e-2),
    "inject_adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "adafactor": lambda: optax.adafactor(1e-2),
}
TOL = {jnp.bfloat16: 8e-3, jnp.float16: 1e-3, jnp.float32: 1e-6}


@pytest.mark.parametrize("name", list(DTYPE_RULES))
def test_bfloat16_float16_float32_parameters_equal_compiled_plain_optax(name):
    w = jax.random.normal(jax.random.key(0), (3, 4))
    model = {"bf": w.astype(jnp.bfloat16), "h": w[0].astype(jnp.float16), "f": w[1]}
    opt = DTYPE_RULES[name]()

    @jax.jit
    def ref_update(s, p, g):  # compiled, as treegrad's step is: the same low-precision maths
        u, s = opt.update(g, s, p)
        return s, optax.apply_updates(p, u)

    ref, ref_state = dict(model), opt.init(model)
    state = tg.setup(DTYPE_RULES[name](), model)
    for i in range(4):
        g = {
            k: jax.random.normal(jax.random.key(10 + i), v.shape).astype(v.dtype)
            for k, v in model.items()
        }
        ref_state, ref = ref_update(ref_state, ref, g)
        state, model = tg.update(state, model, g)
    for k, dtype in (("bf", jnp.bfloat16), ("h", jnp.float16), ("f", jnp.float32)):
        assert model[k].dtype == dtype
        tol = TOL[dtype]
        close(model[k], ref[k], rtol=tol, atol=tol * 1e-2)
    for x, y in zip(leaves(state), leaves(ref_state), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        tol = TOL.get(x.dtype.type, 1e-6)
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol * 1e-2
        )


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_bfloat16_gradients_for_float32_parameters_equal_plain_optax(name):
    opt = DTYPE_RULES[name]()
    model = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([0.25])}
    ref, ref_state = dict(model), opt.init(model)
    state = tg.setup(DTYPE_RULES[name](), model)
    # ref_jit is compiled, as treegrad's step is: eagerly, (1 - b1) * g rounds to bfloat16
    # before it meets the float32 moment; inside XLA it need not (6e-5 apart in 4 steps).
    for i in range(4):
        g = {
            "w": (jnp.array([0.3, -0.7, 1.1]) * (i + 1)).astype(jnp.bfloat16),
            "b": None if i == 1 else jnp.array([0.5], jnp.bfloat16),
        }
        ref, ref_state = ref_jit(opt, ref_state, ref, g)
        state, model = tg.update(state, model, g)
    assert model["w"].dtype == jnp.float32
    close(model, ref)
    close(state, ref_state)


@pytest.mark.parametrize("np_dtype", [np.float32, np.float64])
def test_numpy_parameters_train_like_optax_on_the_same_numpy_arrays(np_dtype):
    # float64 with x64 off: both sides compute in float32, as jnp does.
    opt = optax.adam(0.1)
    host = {"w": np.array([1.0, -2.0], np_dtype), "b": np.array([0.5], np_dtype)}
    ref, ref_state = dict(host), opt.init(host)
    model = dict(host)
    state = tg.setup(optax.adam(0.1), model)
    assert state["w"] is not None  # a float numpy array is a parameter (API.md section 1)
    for i in range(3):
        g = {"w": np.array([0.5, 1.0], np_dtype) * (i + 1), "b": None if i == 1 else np.ones(1)}
        ref, ref_state = ref_jit(opt, ref_state, ref, g)
        tg.update_(state, model, g)
    close(tree_map(jnp.asarray, model), tree_map(jnp.asarray, ref))
    close(state, ref_state)


def test_integer_bool_key_leaves_and_float0_gradients_from_jax_grad():
    model = {
        "w": jnp.array([1.0, -1.0]),
        "n": jnp.array(3),
        "flag": jnp.array([True, False]),
        "key": jax.random.key(1),
    }

    def loss(m):
        return jnp.sum(m["w"] ** 2) * m["n"] + jnp.sum(jnp.where(m["flag"], m["w"], 0.0))

    opt = optax.adam(0.1)
    ref = {"w": model["w"]}
    ref_state = opt.init(ref)
    state = tg.setup(optax.adam(0.1), model)
    ints = {k: model[k] for k in ("n", "flag", "key")}
    for _ in range(3):
        g = jax.grad(loss, allow_int=True)(model)  # float0 at the integer and bool leaves
        assert g["n"].dtype == jax.dtypes.float0
        ref, ref_state = ref_jit(opt, ref_state, ref, {"w": g["w"]})
        state, model = tg.update(state, model, g)
        assert all(model[k] is v for k, v in ints.items())
        close(model["w"], ref["w"])
    close(state, ref_state)


# ==========================================================================================
# The same five steps in every style: bit for bit, and equal to plain optax
# ==========================================================================================


class Net(tg.Module):
    def __init__(self, key):
        k0, k1, k2 = jax.random.split(key, 3)
        self.emb = 0.5 * jax.random.normal(k0, (4, 3))
        self.enc = nn.Dense(3, 5, key=k1)
        self.head = nn.Dense(5, 3, key=k2)
        self.out = self.emb  # tied
        self.steps = jnp.array(0)  # an integer leaf, never trained

    def __call__(self, x, use_head=True):
        h = jnp.tanh(self.enc(jnp.tanh(x @ self.emb)))
        h = self.head(h) if use_head else h[..., :3]
        return h @ self.out.T


XN = jax.random.normal(jax.random.key(11), (8, 4))
YN = jnp.cos(XN)


def net_loss(m, use_head=True):
    return jnp.mean((m(XN, use_head) - YN) ** 2)


def flat_loss(p, use_head=True):
    h = jnp.tanh(jnp.tanh(XN @ p["emb"]) @ p["enc.weight"].T + p["enc.bias"])
    h = h @ p["head.weight"].T + p["head.bias"] if use_head else h[..., :3]
    return jnp.mean((h @ p["emb"].T - YN) ** 2)


def root_rule():
    return optax.chain(
        optax.clip_by_global_norm(0.5), optax.inject_hyperparams(optax.adam)(learning_rate=0.05)
    )


def head_rule():
    return optax.sgd(0.1, momentum=0.9)


# One pair of rule objects for every style: equal configurations share a compiled step.
ROOT_RULE, HEAD_RULE = root_rule(), head_rule()


def net_and_state():
    model = Net(jax.random.key(0))
    state = tg.setup(ROOT_RULE, model)
    state.head = tg.setup(HEAD_RULE, model.head)
    return model, state


FROZEN_AT, THAWED_AT, NO_HEAD_AT, STEPS = 1, 3, (1, 2), 4


def run_style(style):
    model, state = net_and_state()
    ps = tg.params(model)
    for i in range(STEPS):
        if i == FROZEN_AT:
            tg.freeze_(state.enc)
        if i == THAWED_AT:
            tg.thaw_(state.enc)
        use_head = i not in NO_HEAD_AT  # head's gradient None on these steps
        if style in ("params", "to_tree"):
            grads = tg.gradient(lambda: net_loss(model, use_head), ps)  # noqa: B023
            if style == "params":
                tg.update_(state, ps, grads)
            else:
                state, model = tg.update(state, model, grads.to_tree(model))
                ps = tg.params(model)
            continue
        (g,) = tg.gradient(lambda m: net_loss(m, use_head), model)  # noqa: B023
        if style == "pure":
            state, model = tg.update(state, model, g)
        elif style == "donate":
            state, model = tg.update(state, model, g, donate=True)
        else:
            tg.update_(state, model, g)
    assert model.emb is model.out
    return model, state


def test_five_styles_of_the_same_run_are_bit_identical_and_equal_plain_optax():
    runs = {s: run_style(s) for s in ("pure", "in_place", "params", "to_tree", "donate")}
    m0, s0 = runs["pure"]
    for m, s in runs.values():
        same_bits(m, m0)
        same_bits(s, s0)
    # Plain optax: the grafted head rule is multi_transform, the tie one array whose
    # gradient is the sum over both places, freeze and use_head=False are None gradients.
    init = Net(jax.random.key(0))
    p = {
        "emb": init.emb,
        "enc.weight": init.enc.weight,
        "enc.bias": init.enc.bias,
        "head.weight": init.head.weight,
        "head.bias": init.head.bias,
    }
    labels = {k: "head" if k.startswith("head") else "root" for k in p}
    opt = optax.multi_transform({"root": root_rule(), "head": head_rule()}, labels)
    s = opt.init(p)
    for i in range(STEPS):
        use_head = i not in NO_HEAD_AT
        g = jax.grad(flat_loss)(p, use_head)
        if not use_head:
            g["head.weight"] = g["head.bias"] = None
        if FROZEN_AT <= i < THAWED_AT:
            g["enc.weight"] = g["enc.bias"] = None
        p, s = ref_jit(opt, s, p, g)
    got = {
        "emb": m0.emb,
        "enc.weight": m0.enc.weight,
        "enc.bias": m0.enc.bias,
        "head.weight": m0.head.weight,
        "head.bias": m0.head.bias,
    }
    close(got, p, rtol=2e-5, atol=1e-6)
    assert int(m0.steps) == 0


# ==========================================================================================
# A state reused with another model of the same structure
# ==========================================================================================


@pytest.mark.parametrize("style", ["update", "params"])
def test_a_state_reused_with_another_model_of_the_same_structure_equals_optax(style):
    opt = optax.chain(optax.clip_by_global_norm(0.3), optax.adam(0.05))
    a, b = chain2(), chain2()
    b.layers[0].weight = b.layers[0].weight * -2.0
    b.layers[1].bias = b.layers[1].bias + 1.0
    state = tg.setup(opt, a)
    (g,) = tg.gradient(chain_loss, a)
    state, a = tg.update(state, a, g)
    _, ref_state = ref_jit(opt, opt.init(chain2()), chain2(), jax.grad(chain_loss)(chain2()))
    # The same state, now used with b, as plain optax allows.
    ref = b
    for _ in range(3):
        ref, ref_state = ref_jit(opt, ref_state, ref, jax.grad(chain_loss)(ref))
        if style == "update":
            (g,) = tg.gradient(chain_loss, b)
            state, b = tg.update(state, b, g)
        else:
            ps = tg.params(b)
            tg.update_(state, ps, tg.gradient(lambda: chain_loss(b), ps))  # noqa: B023
    close(b, ref, rtol=1e-5, atol=1e-6)
    close(state, ref_state, rtol=1e-5, atol=1e-6)


# ==========================================================================================
# Grads arithmetic with None entries
# ==========================================================================================


def test_accumulated_grads_with_none_entries_equal_optax_on_the_sum():
    x1, x2 = jnp.array([1.0, 2.0]), jnp.array([-1.0, 0.5])

    def mk():
        return {"w": jnp.array([0.3, -0.2]), "b": jnp.array([0.1]), "u": jnp.array([2.0])}

    def l1(p):
        return jnp.sum(p["w"] * x1) ** 2

    def l2(p):
        return jnp.sum(p["w"] * x2 + p["b"]) ** 2

    model = mk()
    ps = tg.params(model)
    state = tg.setup(optax.adam(0.1), ps)
    opt = optax.adam(0.1)
    ref, ref_state = mk(), opt.init(mk())
    for _ in range(4):
        g = (tg.gradient(lambda: l1(model), ps) + tg.gradient(lambda: l2(model), ps)) * 0.5
        assert g[model["u"]] is None  # None + None: still a skip
        tg.update_(state, ps, g)
        r1, r2 = jax.grad(l1)(ref), jax.grad(l2)(ref)
        rg = {"w": (r1["w"] + r2["w"]) * 0.5, "b": (r1["b"] + r2["b"]) * 0.5, "u": None}
        ref, ref_state = ref_jit(opt, ref_state, ref, rg)
    close(model, ref)
    close(state, ref_state)


# ==========================================================================================
# In place inside compiled code
# ==========================================================================================


def test_tg_jit_step_that_raises_after_update_leaves_model_and_state_as_they_were():
    model = {"w": jnp.ones(2), "v": jnp.ones(3)}
    ps = tg.params(model)
    state = tg.setup(optax.adam(0.1), ps)
    snap = snapshot(state, model)

    @tg.jit
    def step(x):
        tg.update_(
            state, ps, tg.gradient(lambda: jnp.sum(model["w"] * x) + jnp.sum(model["v"]), ps)
        )
        tg.update_(state, model, {"w": jnp.ones(5), "v": jnp.ones(3)})  # fails while tracing

    with pytest.raises(ValueError, match=r"tg\.update_: the gradient at 'w' has shape \(5,\)"):
        step(jnp.ones(2))
    assert_unchanged(snap, state, model)
    # and the run goes on like optax
    opt = optax.adam(0.1)
    ref, ref_state = {"w": jnp.ones(2), "v": jnp.ones(3)}, opt.init(model)
    g = tg.gradient(lambda: jnp.sum(model["w"] ** 2) + jnp.sum(model["v"]), ps)
    tg.update_(state, ps, g)
    ref, ref_state = ref_jit(opt, ref_state, ref, {"w": 2 * jnp.ones(2), "v": jnp.ones(3)})
    close(model, ref)
    close(state, ref_state)


def test_update_in_place_inside_jax_jit_on_an_outside_model_is_a_clear_error():
    # Once: m = {"w": jnp.ones(2)}; st = tg.setup(optax.sgd(0.1), m)
    #        jax.jit(lambda x: tg.update_(st, m, {"w": x}) or x)(jnp.ones(2))
    #        m["w"] -> JitTracer(float32[2]); tg.gradient(lambda m: m["w"].sum(), m)
    #        -> UnexpectedTracerError "created on line treegrad/_optim.py ... (_run)".
    # Now an error that says to use tg.jit (or the pure tg.update and return the
    # model), with the model and state unchanged.
    model = {"w": jnp.ones(2)}
    state = tg.setup(optax.adam(0.1), model)
    w0 = model["w"]
    snap = snapshot(state, model)

    @jax.jit
    def step(x):
        tg.update_(state, model, {"w": x})
        return x

    try:
        with pytest.raises(
            TypeError,
            match=r"tg\.update_ inside jax\.jit .* does not trace.*left unchanged.*tg\.jit.*"
            r"tg\.update\(state, model, grads\)",
        ):
            step(jnp.ones(2))
    finally:
        leaked = model["w"] is not w0
        model["w"] = w0  # never leave a tracer behind for other tests
    assert not leaked
    assert_unchanged(snap, state, model)
    # The same step under tg.jit trains as uncompiled.
    tg.jit(step.__wrapped__)(jnp.ones(2))
    ref_state = tg.setup(optax.adam(0.1), {"w": jnp.ones(2)})
    ref_model = {"w": jnp.ones(2)}
    tg.update_(ref_state, ref_model, {"w": jnp.ones(2)})
    close(model, ref_model)
    close(state, ref_state)


# A frozen dataclass registered with keys is a foreign pytree: rebound attribute by
# attribute, as the API says of other libraries' models.
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Frozen:
    w: jax.Array


def test_update_in_place_of_a_foreign_frozen_dataclass_equals_optax():
    model = {"a": jnp.array([1.0, 2.0]), "z": Frozen(w=jnp.array([0.5, -0.5]))}
    state = tg.setup(optax.adam(0.1), model)
    opt = optax.adam(0.1)
    ref, ref_state = (
        {"a": model["a"], "z": {"w": model["z"].w}},
        opt.init({"a": model["a"], "z": {"w": model["z"].w}}),
    )
    holder = model["z"]
    for i in range(3):
        tg.update_(state, model, {"a": jnp.ones(2) * (i + 1), "z": Frozen(w=jnp.ones(2))})
        ref, ref_state = ref_jit(
            opt, ref_state, ref, {"a": jnp.ones(2) * (i + 1), "z": {"w": jnp.ones(2)}}
        )
    assert model["z"] is holder
    close({"a": model["a"], "z": {"w": model["z"].w}}, ref)
