"""The model-tree optimiser against plain optax, in both gradient styles.

The reference for every rule is plain optax on the same tree: `jax.grad`
(zeros where the loss does not depend on a parameter) through `rule.update`,
then, for the parameters a step skipped (a `None` gradient), their old values
and their own optax state entries put back; shared entries (the step count)
advance as in optax.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import treegrad as tg
from treegrad import _optstep, nn

from .helpers import MLP, assert_trees_close, mse, restore_own_entries


def make_net(key):
    # A dict at the top: optax.multi_transform would call a callable label tree.
    k1, k2 = jax.random.split(key)
    return {
        "enc": nn.Dense(3, 4, key=k1),
        "dec": nn.Dense(4, 2, key=k2),
        "scale": jnp.array(1.5, jnp.float32),  # jnp.array(1.5) would be weakly typed
    }


def net(m, x):
    return m["dec"](jnp.tanh(m["enc"](x))) * m["scale"]


XS = jax.random.normal(jax.random.key(1), (8, 3))
YS = jnp.stack([jnp.sin(XS[:, 0]), XS[:, 1] * XS[:, 2]], axis=1)
H = jax.random.normal(jax.random.key(2), (8, 4))
SKIP_STEPS = (3, 6)
# At a skip step the loss uses neither `enc` nor `scale`: their gradients are None.
SKIPPED = {"enc.weight", "enc.bias", "scale"}


def loss(m):
    return jnp.mean((net(m, XS) - YS) ** 2)


def loss_skip(m):
    return jnp.mean((m["dec"](H) - YS) ** 2)


def by_top_key(model, labels):
    return jax.tree_util.tree_map_with_path(lambda p, _: labels[p[0].key], model)


RULES = {
    "adam": lambda m: optax.adam(1e-2),
    "sgd_momentum": lambda m: optax.sgd(1e-2, momentum=0.9),
    "adamw": lambda m: optax.adamw(1e-2, weight_decay=0.1),
    "rmsprop": lambda m: optax.rmsprop(1e-2),
    "lion": lambda m: optax.lion(1e-3),
    "clip_by_global_norm_adam": lambda m: optax.chain(
        optax.clip_by_global_norm(0.05), optax.adam(1e-2)
    ),
    "masked": lambda m: optax.masked(
        optax.adam(1e-2), jax.tree_util.tree_map(lambda x: x.ndim == 2, m)
    ),
    "multi_transform_label_tree": lambda m: optax.multi_transform(
        {"slow": optax.sgd(1e-2, momentum=0.9), "fast": optax.adam(1e-2)},
        by_top_key(m, {"enc": "slow", "dec": "fast", "scale": "fast"}),
    ),
    "flatten_adam": lambda m: optax.flatten(optax.adam(1e-2)),
    "inject_hyperparams_in_chain": lambda m: optax.chain(
        optax.clip(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    ),
}


def path_set(tree):
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in paths]


def reference_step(rule, opt_state, params, grads, skipped):
    """Plain optax, then the skipped parameters' values and own state entries put back."""
    updates, new_state = rule.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    names = path_set(params)
    skip = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(params), [n in skipped for n in names]
    )
    new_params = jax.tree_util.tree_map(
        lambda s, new, old: old if s else new, skip, new_params, params
    )
    try:
        return new_params, restore_own_entries(rule, opt_state, new_state, skip)
    except ValueError:
        # optax.flatten: its state is one vector, the parameters raveled in tree order
        # (jax.flatten_util.ravel_pytree): the skipped ones' slices are put back.
        mask = ravel_pytree(
            jax.tree_util.tree_map(lambda s, p: jnp.full(p.shape, s), skip, params)
        )[0]
        return new_params, jax.tree_util.tree_map(
            lambda old, new: jnp.where(mask, old, new) if new.shape == mask.shape else new,
            opt_state,
            new_state,
        )


def run_reference(make_rule, steps=10):
    params = make_net(jax.random.key(0))
    rule = make_rule(params)
    opt_state = rule.init(params)
    for step in range(1, steps + 1):
        skip = step in SKIP_STEPS
        grads = jax.grad(loss_skip if skip else loss)(params)
        params, opt_state = reference_step(rule, opt_state, params, grads, SKIPPED if skip else ())
    return params, opt_state


def run_explicit(make_rule, steps=10):
    model = make_net(jax.random.key(0))
    state = tg.setup(make_rule(model), model)
    traces = []
    for step in range(1, steps + 1):
        if step in SKIP_STEPS:
            (g,) = tg.gradient(loss_skip, model)
            assert g["scale"] is None and g["enc"].weight is None
            g["enc"] = None  # None for the whole sub-model, as Optimisers.jl users write it
        else:
            (g,) = tg.gradient(loss, model)
        state, model = tg.update(state, model, g)
        traces.append(_optstep.step._cache_size())
    return model, state, traces


def run_implicit(make_rule, steps=10):
    model = make_net(jax.random.key(0))
    ps = tg.params(model)
    state = tg.setup(make_rule(model), ps)
    traces = []
    for step in range(1, steps + 1):
        if step in SKIP_STEPS:
            grads = tg.gradient(lambda: loss_skip(model), ps)
        else:
            grads = tg.gradient(lambda: loss(model), ps)
        tg.update_(state, ps, grads)
        traces.append(_optstep.step._cache_size())
    return model, state, traces


@pytest.mark.parametrize(
    "style",
    # The implicit half in the slow run (CI): the default run stays under 3 minutes.
    [run_explicit, pytest.param(run_implicit, marks=pytest.mark.slow)],
    ids=["explicit", "implicit"],
)
@pytest.mark.parametrize("name", list(RULES))
def test_rule_table_equals_plain_optax_with_none_steps(name, style):
    ref_params, ref_state = run_reference(RULES[name])
    model, state, traces = style(RULES[name])
    assert_trees_close(model, ref_params, rtol=1e-5, atol=1e-6)
    ours = jax.tree_util.tree_leaves(state)
    theirs = jax.tree_util.tree_leaves(ref_state)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # No re-trace after the first step, None steps included.
    assert traces[1:] == [traces[0]] * (len(traces) - 1)


def test_none_steps_matter_for_the_reference():
    # Guard against a table that cannot fail: skipping changes the result, and
    # the per-parameter state put back differs from plain optax's.
    rule = RULES["clip_by_global_norm_adam"]
    ref_params, _ = run_reference(rule)
    params = make_net(jax.random.key(0))
    r = rule(params)
    s = r.init(params)
    for step in range(1, 11):
        g = jax.grad(loss_skip if step in SKIP_STEPS else loss)(params)
        u, s = r.update(g, s, params)
        params = optax.apply_updates(params, u)
    assert not np.allclose(params["scale"], ref_params["scale"])
    assert not np.allclose(params["dec"].weight, ref_params["dec"].weight)


def test_global_norm_clip_sees_whole_model_after_a_none_step():
    # Issue 10, item 1: after a None step, one clip over every parameter.
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    rule = optax.chain(optax.clip_by_global_norm(0.6), optax.sgd(1.0))
    state = tg.setup(rule, model)
    state, model = tg.update(state, model, {"a": jnp.ones(2), "b": None})
    before = model["a"]
    state, model = tg.update(state, model, {"a": jnp.ones(2), "b": jnp.ones(2)})
    # Plain optax: the global norm of four ones is 2, clipped to 0.6: each entry moves 0.3.
    np.testing.assert_allclose(before - model["a"], [0.3, 0.3], rtol=1e-6)


def test_implicit_update_is_bit_identical_to_explicit():
    m1, m2 = MLP(jax.random.key(0)), MLP(jax.random.key(0))
    xs, ys = XS[:, :3], YS[:, :1]
    m1, m2 = MLP(jax.random.key(0), sizes=(3, 8, 1)), MLP(jax.random.key(0), sizes=(3, 8, 1))
    s1 = tg.setup(optax.adam(1e-2), m1)
    ps = tg.params(m2)
    s2 = tg.setup(optax.adam(1e-2), ps)
    for _ in range(5):
        (g,) = tg.gradient(lambda m: mse(m, xs, ys), m1)
        s1, m1 = tg.update(s1, m1, g)
        tg.update_(s2, ps, tg.gradient(lambda: mse(m2, xs, ys), ps))
    for a, b in zip(jax.tree_util.tree_leaves(m1), jax.tree_util.tree_leaves(m2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_none_keeps_value_and_own_state_but_count_advances():
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state = tg.setup(optax.adam(0.1), model)
    state, model = tg.update(state, model, {"a": jnp.ones(2), "b": jnp.ones(2)})
    before_b, mu_b = model["b"], state["b"].state[0].mu
    state, model = tg.update(state, model, {"a": jnp.ones(2), "b": None})
    assert model["b"] is before_b  # the same object, not only the same value
    np.testing.assert_array_equal(state["b"].state[0].mu, mu_b)
    assert int(state["b"].state[0].count) == 2  # shared, as in optax
    # A whole state of None gradients: the rule sees zeros, nothing moves.
    old = model
    state, model = tg.update(state, model, {"a": None, "b": None})
    assert_trees_close(model, old, rtol=0, atol=0)


def test_update_does_not_retrace():
    model = MLP(jax.random.key(0))
    xs, ys = XS[:, :3], YS[:, :1]
    model = MLP(jax.random.key(0), sizes=(3, 8, 1))
    state = tg.setup(optax.adam(1e-3), model)
    (g,) = tg.gradient(lambda m: mse(m, xs, ys), model)
    state, model = tg.update(state, model, g)
    n = _optstep.step._cache_size()
    for _ in range(3):
        (g,) = tg.gradient(lambda m: mse(m, xs, ys), model)
        state, model = tg.update(state, model, g)
    assert _optstep.step._cache_size() == n


def test_a_schedule_reading_a_changed_value_is_read_fresh_as_plain_optax_does():
    # The optimiser's step is compiled once per configuration; a schedule of the
    # user's reading a dict entry (or a global) is guarded like a closure: plain optax,
    # run eagerly, reads the new value at the next step, and so does tg.update(_).
    cfg = {"lr": 0.1}
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=lambda count: cfg["lr"])
    grads = {"w": jnp.array([1.0, -2.0, 0.5])}
    ref, ref_state = {"w": jnp.ones(3)}, opt.init({"w": jnp.ones(3)})
    pure = {"w": jnp.ones(3)}
    held = {"w": jnp.ones(3)}
    pure_state, held_state = tg.setup(opt, pure), tg.setup(opt, held)
    sizes = []
    for lr in (0.1, 0.1, 1.0, 1.0, 0.01):
        cfg["lr"] = lr
        u, ref_state = opt.update(grads, ref_state, ref)
        ref = optax.apply_updates(ref, u)
        pure_state, pure = tg.update(pure_state, pure, grads)
        tg.update_(held_state, held, grads)
        sizes.append(_optstep.step._cache_size())
        np.testing.assert_allclose(pure["w"], ref["w"], rtol=1e-6)
        np.testing.assert_allclose(held["w"], ref["w"], rtol=1e-6)
    # Traced again only when the value changed: not on the repeated rates.
    assert sizes[1] == sizes[0] and sizes[3] == sizes[2]


def test_jit_training_step_traces_once_and_matches_eager():
    traces = []
    xs, ys = XS[:, :3], YS[:, :1]
    model = MLP(jax.random.key(0), sizes=(3, 8, 1))
    eager_model = MLP(jax.random.key(0), sizes=(3, 8, 1))
    state = tg.setup(optax.adam(1e-2), model)
    eager_state = tg.setup(optax.adam(1e-2), eager_model)

    @tg.jit
    def step(state, model, x, y):
        traces.append(1)
        loss, (g,) = tg.withgradient(lambda m: mse(m, x, y), model)
        state, model = tg.update(state, model, g)
        return state, model, loss

    for _ in range(5):
        state, model, _ = step(state, model, xs, ys)
        (g,) = tg.gradient(lambda m: mse(m, xs, ys), eager_model)
        eager_state, eager_model = tg.update(eager_state, eager_model, g)
    assert len(traces) == 1
    assert_trees_close(model, eager_model, rtol=1e-5, atol=1e-6)


def test_update_inside_jax_jit_with_tracers():
    model = {"w": jnp.array([1.0, 2.0])}
    state = tg.setup(optax.sgd(0.5), model)

    @jax.jit
    def step(state, model):
        fresh = tg.setup(optax.sgd(0.5), model)  # setup works on tracers too
        _, m2 = tg.update(fresh, model, {"w": jnp.ones(2)})
        return tg.update(state, m2, {"w": jnp.ones(2)})

    state, model = step(state, model)
    np.testing.assert_allclose(model["w"], [0.0, 1.0])


def test_donation_reuses_old_buffers_once_each():
    w = jnp.arange(4.0)
    model = {"enc": w, "dec": w, "b": jnp.ones(2), "f": jnp.ones(3)}
    state = tg.setup(optax.adam(0.1), model)
    tg.freeze_(state["f"])
    g = {"enc": jnp.ones(4), "dec": jnp.ones(4), "b": None, "f": jnp.ones(3)}
    _, ref_model = tg.update(state, model, g)
    # Copies: "b" is model's own array, and a zero-copy numpy view would block its donation.
    ref_model = jax.tree_util.tree_map(np.array, ref_model)
    _, model2 = tg.update(state, model, g, donate=True)  # tied: donated once, no error
    assert w.is_deleted() and model["b"].is_deleted()
    assert not model["f"].is_deleted()  # frozen: not an output, so not donated
    assert model2["enc"] is model2["dec"]
    np.testing.assert_allclose(model2["enc"], ref_model["enc"])
    np.testing.assert_allclose(model2["b"], ref_model["b"])


def test_jit_donate_argnums():
    xs, ys = XS[:, :3], YS[:, :1]
    model = MLP(jax.random.key(0), sizes=(3, 8, 1))
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


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_complex_parameters_like_plain_optax():
    # The optimiser applies whatever gradient it is given; with API.md's
    # steepest-ascent gradient (conj of jax.grad's) adam descends to the target.
    target = jnp.array([1.0 + 2.0j, -0.5j])
    f = lambda m: jnp.sum(jnp.abs(m["z"] - target) ** 2)
    model = {"z": jnp.zeros(2, jnp.complex64)}
    rule = optax.adam(0.1)
    state = tg.setup(rule, model)
    ref, ref_state = model, rule.init(model)
    for _ in range(100):
        g = jax.tree_util.tree_map(jnp.conj, jax.grad(f)(model))
        state, model = tg.update(state, model, g)
        u, ref_state = rule.update(jax.tree_util.tree_map(jnp.conj, jax.grad(f)(ref)), ref_state)
        ref = optax.apply_updates(ref, u)
    np.testing.assert_allclose(model["z"], ref["z"], rtol=1e-5)
    np.testing.assert_allclose(model["z"], target, atol=0.05)


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_destructure_round_trip_and_gradient():
    model = MLP(jax.random.key(0))
    flat, rebuild = tg.destructure(model)
    assert flat.shape == (49,)
    assert_trees_close(rebuild(flat), model)
    xs, ys = jnp.ones((2, 4)), jnp.zeros((2, 1))
    g = jax.grad(lambda v: mse(rebuild(v), xs, ys))(flat)
    ref, _ = tg.destructure(jax.grad(mse)(model, xs, ys))
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"shape \(49,\)"):
        rebuild(jnp.ones(3))


def test_destructure_counts_a_tie_once_and_rebuilds_shared():
    block = nn.Dense(2, 2, key=jax.random.key(0))
    model = {"a": block, "b": block, "w": block.weight}
    flat, rebuild = tg.destructure(model)
    assert flat.shape == (6,)
    new = rebuild(flat + 1)
    assert new["a"] is new["b"] and new["w"] is new["a"].weight
    np.testing.assert_allclose(new["w"], block.weight + 1)


def test_none_gradients_inside_tg_jit_trace_once_and_match_eager():
    model = make_net(jax.random.key(0))
    eager = make_net(jax.random.key(0))
    state = tg.setup(optax.adam(1e-2), model)
    eager_state = tg.setup(optax.adam(1e-2), eager)
    traces = []

    @tg.jit
    def step(state, model):
        traces.append(1)
        (g,) = tg.gradient(loss_skip, model)  # None for enc and scale
        return tg.update(state, model, g)

    for _ in range(3):
        state, model = step(state, model)
        (g,) = tg.gradient(loss_skip, eager)
        eager_state, eager = tg.update(eager_state, eager, g)
    assert len(traces) == 1
    assert_trees_close(model, eager, rtol=1e-6, atol=1e-7)
    assert_trees_close(model["enc"], make_net(jax.random.key(0))["enc"], rtol=0, atol=0)
