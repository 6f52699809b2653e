"""Hostile hunt: optax wrappers that need a model-shaped tree, and optimiser state over
time, through treegrad's model-tree optimiser (`tg.setup`, `tg.update`, `tg.update_`,
`tg.adjust`, `tg.freeze_`, `tg.jit`, `tg.train`, `tg.save`/`tg.load`).

Every numerical check runs plain optax by hand (`rule.init`, `rule.update`,
`optax.apply_updates`, compiled with `jax.jit`) on the trainable tree a plain optax
user would hold: the model with `None` where treegrad does not train (an integer
leaf, an attribute outside `__trainable__`, the second place of a tied array), given
the same gradient numbers (`jax.grad` of the same loss). The implicit style is given
the same gradients as the explicit one (a `Grads` and its `to_tree`), so the two must
agree bit for bit.

Defects found here (fixed; each test fails without its fix):
- a learning-rate schedule given as a bound method (`optax.sgd(sched.rate)`) or as a
  `functools.partial` of a user function with a dict argument was baked into the
  compiled step: editing `sched.lr` / `cfg["lr"]` changed nothing (plain optax reads it
  every step). Likewise `optax.MultiSteps(rule, every_k_fn).gradient_transformation()`
  (bound methods of an optax object) hid `every_k_fn` from the guard.
  `_reach.user_functions` now hands such callables to the guard whole, and looks into
  the object of a library's bound method.
- a labels tree built from a Module (`jax.tree.map(f, model)`) is callable, so
  `optax.multi_transform` ran the model on the parameters and failed with the model's
  shape error; `_optbuild._init` now says so and gives the fix (`lambda _: labels`).
- `tg.setup` with a rule that cannot take `None` leaves (optax.contrib.galore) on a
  model with a non-trainable leaf or a tie failed with a bare AttributeError from
  inside optax; `_optbuild._init` now names the rule, the place and why it is `None`.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

tree_map = jax.tree_util.tree_map


def _is_none(x):
    return x is None


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def assert_close(a, b, rtol=2e-5, atol=1e-6):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def assert_bits(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.array_equal(np.asarray(x), np.asarray(y)), (x, y)


def snapshot(tree):
    return [np.array(x, copy=True) for x in leaves(tree)]


def unchanged(tree, snap):
    now = leaves(tree)
    return len(now) == len(snap) and all(
        np.array_equal(np.asarray(x), y) for x, y in zip(now, snap, strict=True)
    )


# --- models -------------------------------------------------------------------------------


class Net(tg.Module):
    """Two layers, an integer step counter and a float table outside `__trainable__`:
    the trainable tree has `None` at `steps` and at `table`."""

    __trainable__ = ("l1", "l2", "steps")

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.l1 = nn.Dense(3, 4, key=k1)
        self.l2 = nn.Dense(4, 2, key=k2)
        self.steps = jnp.array(0)
        self.table = jax.random.normal(k3, (2,))
        self.act = jnp.tanh

    def __call__(self, x):
        return self.l2(self.act(self.l1(x))) * self.table


X = jax.random.normal(jax.random.key(1), (6, 3))
Y = jax.random.normal(jax.random.key(2), (6, 2))


def net_loss(m, x=X, y=Y):
    return jnp.mean((m(x) - y) ** 2)


def net_tree(m):
    t = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(m), leaves(m))
    t.steps = None
    t.table = None
    return t


def net_fill(p, m):
    """The model `p` stands for: its holes filled from `m`."""
    full = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(m), leaves(m))
    full.l1, full.l2 = p.l1, p.l2
    return full


def net_ref_grad(m):
    p = net_tree(m)
    return p, jax.grad(lambda p: net_loss(net_fill(p, m)))(p)


def tied():
    k = jax.random.split(jax.random.key(3), 3)
    e = jax.random.normal(k[0], (4, 3))
    return {
        "emb": e,
        "out": e,
        "b": jax.random.normal(k[1], (4,)),
        "c": jax.random.normal(k[2], (3,)),
    }


V = jax.random.normal(jax.random.key(4), (3,))


def tied_loss(m):
    return jnp.sum(jnp.tanh(m["emb"] @ V + m["b"]) ** 2) + 3 * jnp.sum(
        (m["out"].T @ m["b"]) * m["c"]
    )


def untied(m):
    return {"emb": m["emb"], "b": m["b"], "c": m["c"]}


def untied_loss(p):
    return tied_loss({"emb": p["emb"], "out": p["emb"], "b": p["b"], "c": p["c"]})


@functools.partial(jax.jit, static_argnums=0)
def optax_step(rule, params, state, grads):
    updates, state = rule.update(grads, state, params)
    return optax.apply_updates(params, updates), state


# --- masked / multi_transform with model-shaped trees ------------------------------------


def _net_rules():
    def mask_of(m):
        return tree_map(lambda x: x.ndim > 1, m)

    def labels_by_path(p):
        return jax.tree_util.tree_map_with_path(
            lambda k, _: "slow" if "l1" in jax.tree_util.keystr(k) else "fast", p
        )

    model = Net(jax.random.key(0))
    labels = tree_map(lambda x: "a" if x.ndim > 1 else "z", model)
    return {
        # A Module-shaped mask built from the whole model: a bool at `steps` and `table`
        # too, where the trainable tree has None.
        "masked-module": optax.masked(optax.adam(0.05), mask_of(model)),
        "masked-callable": optax.masked(optax.adam(0.05), mask_of),
        "multi-path-callable": optax.multi_transform(
            {"slow": optax.sgd(0.01, momentum=0.9), "fast": optax.adam(0.05)}, labels_by_path
        ),
        # A labels tree built from the model is a Module, callable: passed through a
        # function, or optax would call it on the parameters.
        "multi-module": optax.multi_transform(
            {"a": optax.adam(0.05), "z": optax.set_to_zero()},
            lambda _: labels,
        ),
        "clip-adamw": optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(0.05)),
        "ema-sgd": optax.chain(optax.ema(0.8), optax.sgd(0.1)),
        "inject-schedule": optax.inject_hyperparams(optax.adam)(
            learning_rate=optax.exponential_decay(0.1, 1, 0.7)
        ),
        "finite-adam": optax.apply_if_finite(optax.adam(0.05), 3),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_net_rules()))
def test_model_shaped_wrappers_on_a_module_with_holes_equal_plain_optax(name):
    rule = _net_rules()[name]
    model = Net(jax.random.key(0))
    state = tg.setup(rule, model)
    p = net_tree(model)
    ostate = rule.init(p)
    for _ in range(4):
        _, g = net_ref_grad(model)
        state, model = tg.update(state, model, g)
        p, ostate = optax_step(rule, p, ostate, g)
        assert_close(net_tree(model), p)
    assert int(model.steps) == 0  # an integer leaf is never stepped
    assert_close(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ostate))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_net_rules()))
def test_implicit_style_is_bit_identical_to_explicit_for_each_wrapper(name):
    rule = _net_rules()[name]
    me, mi = Net(jax.random.key(0)), Net(jax.random.key(0))
    ps = tg.params(mi)
    se, si = tg.setup(rule, me), tg.setup(rule, ps)
    for _ in range(3):
        grads = tg.gradient(lambda: net_loss(mi), ps)
        se, me = tg.update(se, me, grads.to_tree(mi))
        tg.update_(si, ps, grads)
        assert_bits(me, mi)
        assert_bits(se, si)


MASKS = {
    # The labels of a tied weight are read at its first place, as its state is.
    "masked-tied": (
        optax.masked(optax.adam(0.1), {"emb": True, "out": True, "b": False, "c": True}),
        optax.masked(optax.adam(0.1), {"emb": True, "b": False, "c": True}),
    ),
    "masked-callable-tied": (
        optax.masked(optax.adam(0.1), lambda p: tree_map(lambda x: x.ndim > 1, p)),
        optax.masked(optax.adam(0.1), lambda p: tree_map(lambda x: x.ndim > 1, p)),
    ),
    "multi-tied": (
        optax.multi_transform(
            {"a": optax.adam(0.1), "b": optax.sgd(0.3)},
            {"emb": "a", "out": "a", "b": "b", "c": "a"},
        ),
        optax.multi_transform(
            {"a": optax.adam(0.1), "b": optax.sgd(0.3)}, {"emb": "a", "b": "b", "c": "a"}
        ),
    ),
    "clip-tied": (
        optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0)),
        optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0)),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MASKS))
def test_wrappers_on_a_dict_with_a_tied_array_equal_plain_optax_on_the_untied_dict(name):
    rule, ref_rule = MASKS[name]
    model = tied()
    p = untied(model)
    state, ostate = tg.setup(rule, model), ref_rule.init(p)
    for _ in range(4):
        # jax.grad of the tied dict: a cotangent at each place, summed by treegrad.
        g = jax.grad(tied_loss)(model)
        state, model = tg.update(state, model, g)
        p, ostate = optax_step(ref_rule, p, ostate, jax.grad(untied_loss)(p))
        assert model["emb"] is model["out"]
        assert_close(untied(model), p)


def test_clip_by_global_norm_leaves_a_frozen_parameter_out_of_the_norm():
    rule = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0))
    model = tied()
    state = tg.setup(rule, model)
    tg.freeze_(state["c"])
    before_c = model["c"]
    p = {"emb": model["emb"], "b": model["b"]}
    ostate = rule.init(p)
    for _ in range(3):
        g = jax.grad(tied_loss)(model)
        assert float(jnp.linalg.norm(g["c"])) > 0.1  # it would dominate the norm
        state, model = tg.update(state, model, g)
        pg = jax.grad(untied_loss)({**p, "c": before_c})
        p, ostate = optax_step(rule, p, ostate, {"emb": pg["emb"], "b": pg["b"]})
        assert_close({"emb": model["emb"], "b": model["b"]}, p)
        assert model["c"] is before_c


@pytest.mark.slow
def test_multi_transform_with_a_frozen_part_keeps_its_moments_and_counts_on():
    labels = {"emb": "a", "out": "a", "b": "b", "c": "b"}
    rule = optax.multi_transform({"a": optax.adam(0.1), "b": optax.adam(0.2)}, labels)
    model = tied()
    state = tg.setup(rule, model)
    g = jax.grad(tied_loss)(model)
    state, model = tg.update(state, model, g)
    tg.freeze_(state["b"])
    mu_b = np.array(state["b"].state.inner_states["b"].inner_state[0].mu)
    b0 = model["b"]
    for _ in range(2):
        state, model = tg.update(state, model, jax.grad(tied_loss)(model))
    assert model["b"] is b0
    assert np.array_equal(np.asarray(state["b"].state.inner_states["b"].inner_state[0].mu), mu_b)
    # The shared counter of label "b" advanced (c is stepped, and a frozen parameter
    # counts as a None gradient), as optax's count does.
    assert int(state["c"].state.inner_states["b"].inner_state[0].count) == 3
    # Thawed: b steps again, from its kept moments.
    tg.thaw_(state["b"])
    state, model = tg.update(state, model, jax.grad(tied_loss)(model))
    assert not np.array_equal(np.asarray(model["b"]), np.asarray(b0))


# --- MultiSteps, schedules, state over time -----------------------------------------------


def _chain_model():
    k1, k2 = jax.random.split(jax.random.key(5))
    return nn.Chain(nn.Dense(3, 4, jax.nn.tanh, key=k1), nn.Dense(4, 1, key=k2))


XS = jax.random.normal(jax.random.key(6), (6, 8, 3))
YS = jax.random.normal(jax.random.key(7), (6, 8, 1))


def chain_loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def _multisteps_reference(rule, n):
    p = _chain_model()
    s = rule.init(p)
    out = []
    for i in range(n):
        g = jax.grad(chain_loss)(p, XS[i], YS[i])
        p, s = optax_step(rule, p, s, g)
        out.append(p)
    return out


def _changed(a, b):
    return any(
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves(a), leaves(b), strict=True)
    )


@pytest.mark.slow
@pytest.mark.parametrize("style", ["explicit", "implicit", "jit", "jit-implicit"])
def test_multisteps_changes_the_model_only_every_k_steps_like_plain_optax(style):
    rule = optax.MultiSteps(optax.adam(0.1), 3)
    refs = _multisteps_reference(rule, 6)
    model = _chain_model()
    if style in ("implicit", "jit-implicit"):
        ps = tg.params(model)
        state = tg.setup(rule, ps)

        def istep(x, y):
            tg.update_(state, ps, tg.gradient(lambda: chain_loss(model, x, y), ps))

        step = tg.jit(istep) if style == "jit-implicit" else istep
    else:
        state = tg.setup(rule, model)

        def estep(state, model, x, y):
            (g,) = tg.gradient(lambda m: chain_loss(m, x, y), model)
            return tg.update(state, model, g)

        run = tg.jit(estep) if style == "jit" else estep
    prev = tg.destructure(model)[0]
    for i in range(6):
        if style in ("implicit", "jit-implicit"):
            step(XS[i], YS[i])
        else:
            state, model = run(state, model, XS[i], YS[i])
        now = tg.destructure(model)[0]
        assert _changed([now], [prev]) == (i % 3 == 2), i
        prev = now
        assert_close(model, refs[i])
    assert int(state[0].weight.state.mini_step) == 0


@pytest.mark.slow
def test_multisteps_through_train_stops_mid_accumulation_like_plain_optax():
    rule = optax.MultiSteps(optax.adam(0.1), 3)
    refs = _multisteps_reference(rule, 5)
    model = _chain_model()
    state = tg.setup(rule, model)
    state, model, losses = tg.train(chain_loss, model, [(XS[i], YS[i]) for i in range(5)], state)
    assert len(losses) == 5
    assert_close(model, refs[4])
    assert int(state[0].weight.state.mini_step) == 2
    # Implicit train, same run.
    m2 = _chain_model()
    ps = tg.params(m2)
    s2 = tg.setup(rule, ps)
    tg.train(lambda x, y: chain_loss(m2, x, y), ps, [(XS[i], YS[i]) for i in range(5)], s2)
    assert_bits(m2, model)
    assert_bits(s2, state)


def _sched_rule():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=lambda c: 0.2 * 0.5**c)


def _count(state):
    return int(state[0].weight.state.count)


@pytest.mark.slow
def test_a_schedule_advances_once_per_update_through_jit_train_and_save_load(tmp_path):
    rule = _sched_rule()
    model = _chain_model()
    state = tg.setup(rule, model)

    @tg.jit
    def step(state, model, x, y):
        (g,) = tg.gradient(lambda m: chain_loss(m, x, y), model)
        return tg.update(state, model, g)

    for i in range(2):
        state, model = step(state, model, XS[i], YS[i])
    assert _count(state) == 2
    path = os.fspath(tmp_path / "state.tg")
    tg.save(path, state)
    state = tg.load(path, tg.setup(rule, model))
    assert _count(state) == 2
    state, model, _ = tg.train(chain_loss, model, [(XS[i], YS[i]) for i in (2, 3)], state, epochs=2)
    assert _count(state) == 6
    # The same run in plain optax: the rate at each step is 0.2 * 0.5**step.
    p = _chain_model()
    s = rule.init(p)
    for i in (0, 1, 2, 3, 2, 3):
        p, s = optax_step(rule, p, s, jax.grad(chain_loss)(p, XS[i], YS[i]))
    assert_close(model, p)
    assert float(state[0].weight.state.hyperparams["learning_rate"]) == pytest.approx(0.2 * 0.5**5)


@pytest.mark.slow
def test_adjust_mid_run_equals_editing_the_optax_state_in_both_styles():
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    me, mi = _chain_model(), _chain_model()
    ps = tg.params(mi)
    se, si = tg.setup(rule, me), tg.setup(rule, ps)
    p = _chain_model()
    s = rule.init(p)
    for i in range(4):
        if i == 2:
            se = tg.adjust(se, learning_rate=0.01)
            tg.adjust_(si, learning_rate=0.01)
            s.hyperparams["learning_rate"] = jnp.asarray(0.01)
        grads = tg.gradient(lambda i=i: chain_loss(mi, XS[i], YS[i]), ps)
        g = grads.to_tree(mi)
        se, me = tg.update(se, me, g)
        tg.update_(si, ps, grads)
        p, s = optax_step(rule, p, s, g)
        assert_bits(me, mi)
        assert_close(me, p)
    assert int(s.count) == 4 == int(se[0].weight.state.count)
    # adjust kept the moments: a fresh setup at the new rate gives another model.
    fresh = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.01), me)
    assert not np.array_equal(
        np.asarray(fresh[0].weight.state.inner_state[0].mu),
        np.asarray(se[0].weight.state.inner_state[0].mu),
    )


@pytest.mark.slow
def test_adjust_inside_jit_with_a_traced_rate_is_never_stale():
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    model = _chain_model()
    state = tg.setup(rule, model)

    @tg.jit
    def step(state, model, lr):
        (g,) = tg.gradient(lambda m: chain_loss(m, XS[0], YS[0]), model)
        return tg.update(tg.adjust(state, learning_rate=lr), model, g)

    _, m0 = step(state, model, 0.0)
    assert not _changed(m0, model)
    _, m1 = step(state, model, 0.1)
    ref, _ = optax_step(rule, model, rule.init(model), jax.grad(chain_loss)(model, XS[0], YS[0]))
    assert_close(m1, ref)


def test_adjust_of_a_scheduled_hyperparameter_is_refused_and_changes_nothing():
    model = _chain_model()
    state = tg.setup(_sched_rule(), model)
    snap = snapshot(state)
    with pytest.raises(TypeError, match="learning_rate follows a schedule"):
        tg.adjust_(state, learning_rate=0.0)
    assert unchanged(state, snap)


@pytest.mark.slow
def test_freeze_and_adjust_between_compiled_steps_take_effect():
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    model = _chain_model()
    ps = tg.params(model)
    state = tg.setup(rule, ps)

    @tg.jit
    def step(x, y):
        tg.update_(state, ps, tg.gradient(lambda: chain_loss(model, x, y), ps))

    step(XS[0], YS[0])
    tg.freeze_(state[0])
    w0 = model[0].weight
    step(XS[1], YS[1])
    assert np.array_equal(np.asarray(model[0].weight), np.asarray(w0))
    tg.thaw_(state[0])
    tg.adjust_(state[1], learning_rate=0.0)
    w1 = model[1].weight
    step(XS[2], YS[2])
    assert np.array_equal(np.asarray(model[1].weight), np.asarray(w1))
    assert _changed([model[0].weight], [w0])


# --- apply_if_finite ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("style", ["update", "update_", "jit"])
def test_apply_if_finite_skips_a_nan_step_leaving_the_model_bit_identical(style):
    rule = optax.apply_if_finite(optax.adam(0.1), 2)
    model = _chain_model()
    state = tg.setup(rule, model)
    ynan = YS[1].at[0, 0].set(jnp.nan)

    def one(state, model, y):
        (g,) = tg.gradient(lambda m: chain_loss(m, XS[1], y), model)
        if style == "update_":
            tg.update_(state, model, g)
            return state, model
        return tg.update(state, model, g)

    run = tg.jit(one) if style == "jit" else one
    state, model = run(state, model, YS[0])
    p = _chain_model()
    s = rule.init(p)
    p, s = optax_step(rule, p, s, jax.grad(chain_loss)(p, XS[1], YS[0]))
    snap_m, snap_mu = snapshot(model), np.array(state[0].weight.state.inner_state[0].mu)
    state, model = run(state, model, ynan)
    p, s = optax_step(rule, p, s, jax.grad(chain_loss)(p, XS[1], ynan))
    assert unchanged(model, snap_m)
    assert np.array_equal(np.asarray(state[0].weight.state.inner_state[0].mu), snap_mu)
    assert int(state[0].weight.state.notfinite_count) == 1 == int(s.notfinite_count)
    state, model = run(state, model, YS[0])
    p, s = optax_step(rule, p, s, jax.grad(chain_loss)(p, XS[1], YS[0]))
    assert int(state[0].weight.state.notfinite_count) == 0
    assert_close(model, p)


# --- optax.contrib rules, lookahead -------------------------------------------------------


CONTRIB = {
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(0.05),
    "prodigy": lambda: optax.contrib.prodigy(),
    "mechanize": lambda: optax.contrib.mechanize(optax.adam(0.05)),
    "sam": lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2),
    "muon": lambda: optax.contrib.muon(0.05),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(),
    "ademamix": lambda: optax.contrib.ademamix(0.05),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONTRIB))
def test_contrib_rules_on_a_module_with_holes_equal_plain_optax(name):
    rule = CONTRIB[name]()
    model = Net(jax.random.key(0))
    state = tg.setup(rule, model)
    p = net_tree(model)
    s = rule.init(p)
    for _ in range(3):
        _, g = net_ref_grad(model)
        state, model = tg.update(state, model, g)
        p, s = optax_step(rule, p, s, g)
    assert_close(net_tree(model), p, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("which", ["int-leaf", "tie"])
def test_a_rule_that_cannot_take_none_leaves_is_refused_by_name_at_setup(which):
    # optax.contrib.galore reads every leaf of the parameter tree as an array; the
    # trainable tree has None where treegrad does not train.
    e = jnp.ones((4, 3))
    model = {"w": e, "i": jnp.arange(2)} if which == "int-leaf" else {"a": e, "b": e}
    where = r"'i': int32\[2\], not floating-point" if which == "int-leaf" else r"'b'.*tied array"
    with pytest.raises(
        TypeError, match=rf"rule chain failed to initialise.*first at {where}"
    ) as info:
        tg.setup(optax.contrib.galore(0.1), model)
    assert "does not accept None in a parameter tree" in str(info.value)
    assert "state.sub = tg.setup(rule, model.sub)" in str(info.value)
    # The same rule on a model without holes works, and equals plain optax.
    full = {"w": jnp.arange(12.0).reshape(4, 3)}
    rule = optax.contrib.galore(0.1)
    state = tg.setup(rule, full)
    g = {"w": jnp.cos(full["w"])}
    state, new = tg.update(state, full, g)
    ref, _ = optax_step(rule, full, rule.init(full), g)
    assert_close(new, ref)


def test_a_rule_failing_at_init_for_another_reason_keeps_optax_message():
    def bad_mask(p):
        raise TypeError("my mask is broken")

    with pytest.raises(TypeError, match="my mask is broken"):
        tg.setup(optax.masked(optax.adam(0.1), bad_mask), {"w": jnp.ones(2), "i": jnp.arange(2)})


def test_a_callable_module_as_labels_tree_is_refused_with_the_fix():
    model = Net(jax.random.key(0))
    labels = tree_map(lambda x: "a" if x.ndim > 1 else "z", model)
    rule = optax.multi_transform({"a": optax.adam(0.1), "z": optax.set_to_zero()}, labels)
    with pytest.raises(TypeError, match=r"partition failed to initialise.*holds a Net") as info:
        tg.setup(rule, model)
    assert "param_labels=lambda _: labels" in str(info.value)
    # Plain optax fails too (it calls the Net on the parameters), with the model's error.
    with pytest.raises(ValueError, match="got a Net, not an array"):
        rule.init(net_tree(model))


def test_lookahead_is_refused_at_setup_by_name():
    with pytest.raises(TypeError, match=r"optax\.lookahead updates a pair"):
        tg.setup(optax.lookahead(optax.adam(0.1), 2, 0.5), _chain_model())


# --- one rule, two models; a state with the wrong model ----------------------------------


@pytest.mark.slow
def test_one_rule_instance_for_two_models_keeps_their_states_apart():
    rule = optax.MultiSteps(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), 2)
    a, b = _chain_model(), _chain_model()
    sa, sb = tg.setup(rule, a), tg.setup(rule, b)
    pa, pb = _chain_model(), _chain_model()
    oa, ob = rule.init(pa), rule.init(pb)
    for i in range(4):
        ga = jax.grad(chain_loss)(a, XS[i], YS[i])
        sa, a = tg.update(sa, a, ga)
        pa, oa = optax_step(rule, pa, oa, ga)
        if i % 2 == 0:  # b steps half as often, with other data
            gb = jax.grad(chain_loss)(b, XS[i + 1], YS[i + 1])
            sb, b = tg.update(sb, b, gb)
            pb, ob = optax_step(rule, pb, ob, gb)
    assert_close(a, pa)
    assert_close(b, pb)
    assert int(sa[0].weight.state.gradient_step) == 2 and int(sb[0].weight.state.gradient_step) == 1


@pytest.mark.parametrize("api", ["update", "update_"])
def test_a_state_used_with_another_model_raises_and_changes_nothing(api):
    rule = optax.masked(optax.adam(0.1), lambda p: tree_map(lambda x: x.ndim > 1, p))
    model = _chain_model()
    state = tg.setup(rule, model)
    ks = jax.random.split(jax.random.key(9), 3)
    deeper = nn.Chain(
        nn.Dense(3, 4, jax.nn.tanh, key=ks[0]), nn.Dense(4, 1, key=ks[1]), nn.Dense(1, 1, key=ks[2])
    )
    wider = nn.Chain(nn.Dense(3, 5, jax.nn.tanh, key=ks[0]), nn.Dense(5, 1, key=ks[1]))
    for other, match in (
        (
            deeper,
            "optimiser state does not match the model \\(first difference at 'layers.2.weight'\\)",
        ),
        (
            wider,
            "'layers.0.weight' is float32\\[5×3\\] but was float32\\[4×3\\] when the optimiser",
        ),
    ):
        (g,) = tg.gradient(lambda m: chain_loss(m, XS[0], YS[0]), other)
        snap_s, snap_m, objs = snapshot(state), snapshot(other), leaves(other)
        with pytest.raises(ValueError, match=f"tg.{api}: .*{match}"):
            getattr(tg, api)(state, other, g)
        assert unchanged(state, snap_s) and unchanged(other, snap_m)
        assert all(x is y for x, y in zip(leaves(other), objs, strict=True))


def test_a_layer_added_or_removed_after_setup_raises_and_changes_nothing():
    rule = optax.multi_transform(
        {"a": optax.adam(0.1), "b": optax.sgd(0.1)},
        lambda p: tree_map(lambda x: "a" if x.ndim > 1 else "b", p),
    )
    model = _chain_model()
    state = tg.setup(rule, model)
    model.layers.append(nn.Dense(1, 1, key=jax.random.key(10)))
    (g,) = tg.gradient(lambda m: chain_loss(m, XS[0], YS[0]), model)
    snap_s, snap_m = snapshot(state), snapshot(model)
    with pytest.raises(
        ValueError, match=r"tg\.update_: the optimiser state does not match the model"
    ):
        tg.update_(state, model, g)
    assert unchanged(state, snap_s) and unchanged(model, snap_m)
    model.layers.pop()
    model.layers.pop()
    (g,) = tg.gradient(lambda m: chain_loss(m, XS[0], YS[0][:, :1] @ jnp.ones((1, 4))), model)
    snap_m = snapshot(model)
    with pytest.raises(ValueError, match="does not match the model"):
        tg.update_(state, model, g)
    assert unchanged(state, snap_s) and unchanged(model, snap_m)


# --- what a rule's user functions read: never stale ---------------------------------------


class _Rate:
    def __init__(self):
        self.lr = 0.1

    def rate(self, count):
        return self.lr


def _two_steps(rule, edit, compiled):
    model = {"w": jnp.ones(3)}
    g = {"w": jnp.ones(3)}
    state = tg.setup(rule, model)
    run = tg.jit(lambda s, m, g: tg.update(s, m, g)) if compiled else tg.update
    state, m1 = run(state, model, g)
    edit()
    state, m2 = run(state, m1, g)
    return float(model["w"][0] - m1["w"][0]), float(m1["w"][0] - m2["w"][0])


@pytest.mark.parametrize("compiled", [False, True], ids=["update", "jit"])
@pytest.mark.parametrize("kind", ["bound-method", "inject-bound-method", "partial-dict"])
def test_a_schedule_reading_a_changed_value_is_read_again_like_plain_optax(kind, compiled):
    if kind == "partial-dict":
        cfg = {"lr": 0.1}
        sched = functools.partial(lambda count, cfg: cfg["lr"], cfg=cfg)
        edit = functools.partial(cfg.__setitem__, "lr", 0.5)
    else:
        holder = _Rate()
        sched = holder.rate
        edit = functools.partial(setattr, holder, "lr", 0.5)
    if kind == "inject-bound-method":
        rule = optax.inject_hyperparams(optax.sgd)(learning_rate=sched)
    else:
        rule = optax.sgd(sched)
    first, second = _two_steps(rule, edit, compiled)
    # Plain optax calls the schedule at each update: 0.1 then 0.5.
    assert first == pytest.approx(0.1) and second == pytest.approx(0.5)


@pytest.mark.slow
def test_multisteps_every_k_read_through_its_gradient_transformation_is_fresh():
    k = {"k": 1}

    def every(step):
        return k["k"]

    rule = optax.MultiSteps(optax.sgd(0.1), every).gradient_transformation()
    first, second = _two_steps(rule, functools.partial(k.__setitem__, "k", 2), False)
    # k=1: the first update applies; k=2 from then on: the second only accumulates.
    assert first == pytest.approx(0.1) and second == 0.0
