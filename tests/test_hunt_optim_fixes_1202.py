"""Fixes of 2026-12-02 to the optimiser and checkpoints, each against an independent
reference (plain optax on the equivalent dict of arrays, the uncompiled step, closed
forms) or an exact message.

- `tg.adjust`/`tg.adjust_` of a sub-state that shares its optax state with others,
  inside a compiled step (tg.jit, jax.jit): once a silent no-op leaving a tracer in
  the state (implicit tg.jit), or a split the uncompiled step would not make (an
  adjust to the value already there); now a clear error at trace time.
- A `None` gradient or `tg.freeze_` with a rule `optax.tree_map_params` cannot map
  (optax.sm3, optax.flatten anywhere in it): every state entry was taken as shared,
  so even Adam's moments of a skipped parameter decayed.
- `tg.save` of a `tg.Params` stored nothing; frozen flags were lost through a
  checkpoint; two `tg.load` messages misled.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import treegrad as tg
from treegrad import nn

from .helpers import assert_leaves_equal

SUB_IN_STEP = re.escape("inside a compiled step (tg.jit, jax.jit)")


def _no_tracers(state):
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(state))


# --- adjust of a sub-state inside a compiled step --------------------------------------


def _implicit():
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    ps = tg.params(m)
    return m, ps, tg.setup(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), ps)


def _loss(m):
    return jnp.sum(m["a"] ** 2) + jnp.sum(m["b"])


def test_adjust_of_a_shared_sub_state_inside_implicit_tg_jit_is_refused_cleanly():
    # Once: the call returned, the model was not updated, the state held a
    # DynamicJaxprTracer, and the next call raised UnexpectedTracerError.
    m, ps, st = _implicit()

    @tg.jit
    def step(lr):
        tg.adjust_(st["a"], learning_rate=lr)
        tg.update_(st, ps, tg.gradient(lambda: _loss(m), ps))

    for _ in range(2):  # the same clear error each time, nothing left traced
        with pytest.raises(TypeError, match=r"tg\.adjust_ of the sub-state at 'a' inside a comp"):
            step(jnp.float32(0.5))
        assert _no_tracers(st) and len(st._config.parts) == 1
        assert_leaves_equal(m, {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])})


def test_adjust_of_a_sub_state_with_its_own_part_inside_tg_jit_equals_uncompiled():
    # The way the error says: give it a part of its own outside the step first.
    lrs = [0.5, 0.25, 0.25]
    m, ps, st = _implicit()
    tg.adjust_(st["a"], learning_rate=0.3)  # a new value: its own part
    for lr in lrs:
        tg.adjust_(st["a"], learning_rate=lr)
        tg.update_(st, ps, tg.gradient(lambda: _loss(m), ps))
    ref_m, ref_st = dict(m), st

    m, ps, st = _implicit()
    tg.adjust_(st["a"], learning_rate=0.3)

    @tg.jit
    def step(lr):
        tg.adjust_(st["a"], learning_rate=lr)
        tg.update_(st, ps, tg.gradient(lambda: _loss(m), ps))

    for lr in lrs:
        step(jnp.float32(lr))
    assert_leaves_equal(m, ref_m)
    assert_leaves_equal(st, ref_st)
    # Closed form for a: a <- a - lr * 2a, each step.
    a = np.array([1.0, 2.0], np.float32)
    for lr in lrs:
        a = a - np.float32(lr) * 2 * a
    np.testing.assert_allclose(m["a"], a, rtol=1e-6)


CLIP = lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
)
M0 = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0])}
G0 = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}  # joint norm 13


def _noop_step(st, m, lr):
    st = tg.adjust(st["a"], learning_rate=lr)  # 1.0 is already there: changes nothing
    return tg.update(st, m, G0)


@pytest.mark.slow  # ~1.5 s with tg.jit: the default run stays under 3 minutes
@pytest.mark.parametrize("compile_", [tg.jit, jax.jit], ids=["tg.jit", "jax.jit"])
def test_noop_sub_state_adjust_inside_jit_is_refused_not_split(compile_):
    # Once: compiled, the no-op adjust split the state, so the global norm was taken
    # per part (a -> [2.4, 3.2]); uncompiled it is joint, as plain optax.
    opt = CLIP()
    u, _ = opt.update(G0, opt.init(M0), M0)
    ref = optax.apply_updates(M0, u)
    np.testing.assert_allclose(ref["a"], [3 - 3 / 13, 4 - 4 / 13], rtol=1e-6)
    _, m = _noop_step(tg.setup(CLIP(), M0), M0, 1.0)  # uncompiled: as plain optax
    assert_leaves_equal(m, ref)
    with pytest.raises(TypeError, match=r"tg\.adjust of the sub-state at 'a' " + SUB_IN_STEP):
        compile_(_noop_step)(tg.setup(CLIP(), M0), M0, jnp.float32(1.0))


def test_adjust_of_the_whole_state_inside_jax_jit_still_works():
    # A whole state never splits: the traced value only changes the value.
    st = tg.setup(CLIP(), M0)
    st, m = jax.jit(lambda s, m, lr: tg.update(tg.adjust(s, learning_rate=lr), m, G0))(
        st, M0, jnp.float32(0.5)
    )
    np.testing.assert_allclose(m["a"], [3 - 1.5 / 13, 4 - 2 / 13], rtol=1e-6)


def test_adjust_in_place_with_a_traced_value_on_a_state_jax_jit_captures_is_refused():
    # Once a tracer was left in the user's state (the state is a constant of the trace).
    st = tg.setup(CLIP(), M0)
    before = jax.tree_util.tree_leaves(st)

    @jax.jit
    def f(lr):
        tg.adjust_(st, learning_rate=lr)
        return lr

    with pytest.raises(TypeError, match=r"the traced value would leak into the state"):
        f(jnp.float32(0.5))
    assert all(x is y for x, y in zip(jax.tree_util.tree_leaves(st), before, strict=True))


# --- None gradients and freeze_ with rules tree_map_params cannot map -------------------

P2 = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
G2 = {"a": jnp.array([0.5, -0.5]), "b": jnp.array([1.0])}


def _optax_on_a_alone(rule, steps):
    """Plain optax on {"a": P2["a"]} with gradient G2["a"]: a's value after `steps`."""
    pa = {"a": P2["a"]}
    sa = rule.init(pa)
    for _ in range(steps):
        u, sa = rule.update({"a": G2["a"]}, sa, pa)
        pa = optax.apply_updates(pa, u)
    return pa["a"]


def test_none_gradient_keeps_adam_moments_beside_sm3_in_a_multi_transform():
    # Once: sm3 made the whole rule unmappable, so b's Adam moments decayed on a skip.
    rule = lambda: optax.multi_transform(
        {"x": optax.sm3(0.1), "y": optax.adam(0.1)}, {"a": "x", "b": "y"}
    )
    st, m = tg.update(tg.setup(rule(), P2), P2, G2)
    st2, m2 = tg.update(st, m, {"a": G2["a"], "b": None})
    adam = lambda s: s.inner_states["y"].inner_state[0]
    before, after = adam(st["b"].state), adam(st2["b"].state)
    assert_leaves_equal((before.mu["b"], before.nu["b"]), (after.mu["b"], after.nu["b"]))
    assert int(after.count) == int(before.count) + 1  # shared: advances, as in optax
    assert_leaves_equal(m2["b"], m["b"])
    # a: plain optax sm3 on a alone, two steps.
    np.testing.assert_allclose(m2["a"], _optax_on_a_alone(optax.sm3(0.1), 2), rtol=1e-6)


def test_none_gradient_keeps_sm3_accumulators_of_the_skipped_parameter():
    st, m = tg.update(tg.setup(optax.sm3(0.1), P2), P2, G2)
    before = jax.tree_util.tree_leaves(st["b"].state[0].nu["b"])
    st2, m2 = tg.update(st, m, {"a": G2["a"], "b": None})
    assert_leaves_equal(before, jax.tree_util.tree_leaves(st2["b"].state[0].nu["b"]))
    assert_leaves_equal(m2["b"], m["b"])


def test_flatten_keeps_a_skipped_parameters_slice_of_its_vector():
    # Once: flatten(adam)'s one moment vector decayed for the skipped b (0.19 -> 0.181).
    # Its vector is the parameters raveled in tree order (ravel_pytree): b's slice is
    # kept, a's steps as plain optax's with a zero gradient for b.
    rule = optax.flatten(optax.adam(0.1))
    st, m = tg.update(tg.setup(rule, P2), P2, G2)
    ref_s = rule.update(G2, rule.init(P2), P2)[1]
    none_b = {"a": G2["a"], "b": None}
    st2, m2 = tg.update(st, m, none_b)
    zero_b = {"a": G2["a"], "b": jnp.zeros_like(G2["b"])}
    u, new_s = rule.update(zero_b, ref_s, m)
    mask = ravel_pytree({"a": jnp.zeros(P2["a"].shape, bool), "b": jnp.ones(P2["b"].shape, bool)})[
        0
    ]
    new_s = jax.tree_util.tree_map(
        lambda o, n: jnp.where(mask, o, n) if n.shape == mask.shape else n, ref_s, new_s
    )
    assert_leaves_equal(jax.tree_util.tree_leaves(st2), jax.tree_util.tree_leaves(new_s))
    assert_leaves_equal(m2["b"], m["b"])
    np.testing.assert_allclose(m2["a"], optax.apply_updates(m, u)["a"], rtol=1e-6)
    # Frozen: the same.
    tg.freeze_(st["b"])
    st3, _ = tg.update(st, m, G2)
    assert_leaves_equal(jax.tree_util.tree_leaves(st3), jax.tree_util.tree_leaves(new_s))


def test_flatten_on_a_sub_model_of_its_own_can_be_frozen_and_matches_optax():
    # The way the message says: b gets a rule of its own; frozen whole, its vector is kept.
    model = {"a": P2["a"], "b": P2["b"]}
    st = tg.setup(optax.adam(0.1), model)
    st["b"] = tg.setup(optax.flatten(optax.adam(0.1)), model["b"])
    st, model = tg.update(st, model, G2)
    kept = jax.tree_util.tree_leaves(st["b"].state)
    tg.freeze_(st["b"])
    st, model = tg.update(st, model, G2)
    assert_leaves_equal(jax.tree_util.tree_leaves(st["b"].state)[1:], kept[1:])
    # a: plain optax adam on a alone.
    np.testing.assert_allclose(model["a"], _optax_on_a_alone(optax.adam(0.1), 2), rtol=1e-6)


# --- checkpoints -----------------------------------------------------------------------


@pytest.mark.slow  # ~1.1 s (orbax): the default run stays under 3 minutes
def test_save_of_params_is_refused_and_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ck"
    model = nn.Dense(2, 2, key=jax.random.key(0))
    tg.save(path, model)
    with pytest.raises(TypeError, match=r"tg\.save: got a tg\.Params.*tg\.save\(path, model\)"):
        tg.save(path, tg.params(nn.Dense(2, 2, key=jax.random.key(1))))
    assert_leaves_equal(tg.load(path, nn.Dense(2, 2, key=jax.random.key(2))), model)
    with pytest.raises(TypeError, match=r"tg\.load: got a tg\.Params.*tg\.save\(path, model\)"):
        tg.load(path, tg.params(model))


def _chain():
    return nn.Chain(nn.Dense(2, 3, key=jax.random.key(0)), nn.Dense(3, 1, key=jax.random.key(1)))


@pytest.mark.slow  # ~3.5 s (orbax, four compiled steps): the default run stays under 3 minutes
def test_frozen_flags_survive_a_checkpoint_and_the_run_resumes_bit_for_bit(tmp_path):
    # Once: frozen came from `like`, so the loaded state trained the frozen layer.
    x = jnp.ones((4, 2))
    rule = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1)

    def steps(st, m, n):
        for _ in range(n):
            (g,) = tg.gradient(lambda m: jnp.sum(m(x) ** 2), m)
            st, m = tg.update(st, m, g)
        return st, m

    m = _chain()
    st = tg.setup(rule(), m)
    st, m = steps(st, m, 1)
    tg.freeze_(st[0])
    st, m = steps(st, m, 1)
    tg.save(tmp_path / "ck", (m, st))
    ref_st, ref_m = steps(st, m, 2)
    like_st = tg.setup(rule(), _chain())
    tg.freeze_(like_st[1])  # `like`'s own flags do not stand: the checkpoint's do
    m2, st2 = tg.load(tmp_path / "ck", (_chain(), like_st))
    assert st2[0].weight.frozen and not st2[1].weight.frozen
    assert like_st[1].weight.frozen and not like_st[0].weight.frozen  # `like` unchanged
    st2, m2 = steps(st2, m2, 2)
    assert_leaves_equal((ref_m, ref_st), (m2, st2))
    np.testing.assert_array_equal(m2[0].weight, m[0].weight)  # frozen: never moved


def test_loading_a_state_of_another_rule_says_the_rule_differs(tmp_path):
    path = tmp_path / "ck"
    tg.save(path, tg.setup(optax.adam(0.1), P2))
    with pytest.raises(
        ValueError,
        match=r"the optimiser state in `like` has '0\.trace\.a' \(float32\[2\]\) but the state "
        r"in the checkpoint .* \(it has '0\.count', '0\.mu\.a', '0\.mu\.b', \.\.\.\): the "
        r"optimiser rule differs",
    ):
        tg.load(path, tg.setup(optax.sgd(0.1, momentum=0.9), P2))
    with pytest.raises(
        ValueError, match=r"has '0\.count', which the model lacks\. It is an entry "
    ):
        tg.load(path, tg.setup(optax.sgd(0.1), P2))


def test_loading_keys_that_print_alike_shows_both(tmp_path):
    path = os.fspath(tmp_path / "ck")
    tg.save(path, {1: jnp.ones(2)})
    with pytest.raises(
        ValueError, match=r"the model has \['1'\] \(float32\[2\]\) but the checkpoint .* has \[1\]"
    ):
        tg.load(path, {"1": jnp.ones(2)})


def test_a_sub_rule_assigned_inside_a_compiled_implicit_step_is_refused_state_kept():
    # Once: the step returned normally, the model updated, and the state held the new
    # part's leaves as tracers (UnexpectedTracerError at its next use).
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    ps = tg.params(m)
    st = tg.setup(optax.sgd(0.1), ps)
    loss = lambda: jnp.sum(m["a"] ** 2) + jnp.sum(m["b"])

    @tg.jit
    def step():
        st["a"] = tg.setup(optax.adam(0.5), m["a"])
        tg.update_(st, ps, tg.gradient(loss, ps))

    before_m, before_st = dict(m), jax.tree_util.tree_leaves(st)
    msg = (
        r"tg\.jit: the function changed the structure of an optimiser state it captures "
        r"\(OptState: a rule assigned to a sub-state.*the state is left as it was\. Assign "
        r"the rule before calling the compiled function"
    )
    with pytest.raises(TypeError, match=msg):
        step()
    assert all(m[k] is before_m[k] for k in m)  # nothing written back
    assert jax.tree_util.tree_leaves(st) == before_st == []
    assert len(st._config.parts) == 1  # no part of its own for a
    # What the message says: the rule assigned once, outside; then the compiled step
    # equals the uncompiled one.
    st["a"] = tg.setup(optax.adam(0.5), m["a"])

    @tg.jit
    def step2():
        tg.update_(st, ps, tg.gradient(loss, ps))

    m2 = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    ps2 = tg.params(m2)
    st2 = tg.setup(optax.sgd(0.1), ps2)
    st2["a"] = tg.setup(optax.adam(0.5), m2["a"])
    for _ in range(2):
        step2()
        tg.update_(st2, ps2, tg.gradient(lambda: jnp.sum(m2["a"] ** 2) + jnp.sum(m2["b"]), ps2))
    assert_leaves_equal(m, m2)
    assert_leaves_equal(jax.tree_util.tree_leaves(st), jax.tree_util.tree_leaves(st2))
