"""Optimisers.jl's test suite (test/runtests.jl, test/destructure.jl), ported to treegrad's
optimiser and `tg.destructure`, each case against an independent reference: plain optax
on plain arrays, `jax.grad` of an explicit function, a closed form, or a hand-written
Adam.

Fixes found by the port (each test below fails without its fix):

- A sub-model held at two places that holds no array (an activation layer used twice)
  came back as two objects from a pure `tg.update` and from `destructure`'s `rebuild`:
  the tie detection looked at leaves only (`_optbuild.shares_nodes`).
- `tg.freeze_`/`tg.thaw_` of the state at a place with no trainable array (`None`:
  an activation layer, an integer array) said "got NoneType"; now a no-op, as
  Optimisers.jl's `freeze!` of such a place (`()`) is.
- `tg.setup` and `tg.destructure` of a `tg.Params` took every array of its model, the
  ones removed from the Params too: the vector was longer than the Params, and a rule
  looking across parameters (weight decay feeding a global-norm clip) saw them.
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), tol, tol)


class Act(tg.Module):
    """A layer with no arrays: every attribute static."""

    def __init__(self):
        self.fn = jax.nn.relu
        self.slope = 0.0

    def __call__(self, x):
        return self.fn(x) + self.slope * x


class TwoThirds(tg.Module):
    __trainable__ = ("a",)

    def __init__(self, a, b, c):
        self.a, self.b, self.c = a, b, c


class MutTwo(tg.Module):
    def __init__(self, x, y):
        self.x, self.y = x, y


# --- fixes --------------------------------------------------------------------------------


def _chain_with_a_shared_activation():
    act = Act()
    k1, k2 = jax.random.split(jax.random.key(0))
    return nn.Chain(nn.Dense(2, 3, key=k1), act, nn.Dense(3, 2, key=k2), act)


@pytest.mark.slow  # over ~0.5 s (a few compiles)
def test_a_shared_sub_model_with_no_arrays_stays_one_object_after_update_and_rebuild():
    # Once: model[1] and model[3] came back as two Act objects, so setting
    # `new[1].slope` afterwards changed one place of the layer only.
    model = _chain_with_a_shared_activation()
    x = jnp.array([[1.0, -2.0]])
    loss = lambda m: jnp.sum(m(x) ** 2)
    state = tg.setup(optax.sgd(0.1), model)
    (g,) = tg.gradient(loss, model)
    state, new = tg.update(state, model, g)
    assert new[1] is new[3] and new[1] is not model[1]
    _, again = tg.update(state, new, g)  # the usual step's fast path, from the second on
    assert again[1] is again[3]

    def explicit(p):  # the same network on plain arrays
        h = jax.nn.relu(x @ p["w0"].T + p["b0"])
        return jnp.sum(jax.nn.relu(h @ p["w2"].T + p["b2"]) ** 2)

    p = {"w0": model[0].weight, "b0": model[0].bias, "w2": model[2].weight, "b2": model[2].bias}
    ref = jax.jit(jax.grad(explicit))(p)
    close(new[0].weight, p["w0"] - 0.1 * ref["w0"])
    close(new[2].bias, p["b2"] - 0.1 * ref["b2"])
    flat, rebuild = tg.destructure(model)
    rebuilt = rebuild(flat)
    assert rebuilt[1] is rebuilt[3]
    # the same for a dict holding it twice, beside an array
    d = {"a": model[1], "b": model[1], "w": jnp.ones(2)}
    _, d2 = tg.update(tg.setup(optax.sgd(0.1), d), d, {"a": None, "b": None, "w": jnp.ones(2)})
    assert d2["a"] is d2["b"]
    close(d2["w"], [0.9, 0.9])


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_freeze_and_thaw_of_a_place_without_trainable_arrays_is_a_no_op():
    model = _chain_with_a_shared_activation()
    model[0].steps = jnp.arange(3)  # an integer array: no state either
    state = tg.setup(optax.sgd(0.1), model)
    assert state[1] is None and state[0].steps is None
    before = state._config
    for place in (state[1], state[3], state[0].steps):
        tg.freeze_(place)
        tg.thaw_(place)
    assert state._config is before  # nothing changed, nothing frozen
    tg.freeze_(state[1])
    x = jnp.ones((1, 2))
    loss = lambda m: jnp.sum(m(x))
    (g,) = tg.gradient(loss, model)
    _, new = tg.update(state, model, g)
    # still trained, as plain sgd on the same network written on plain arrays
    w2 = model[2].weight
    ref = jax.jit(
        jax.grad(lambda w: jnp.sum(model[3](model[1](model[0](x)) @ w.T + model[2].bias)))
    )(w2)
    close(new[2].weight, w2 - 0.1 * ref)
    # adjust has nothing to change there: it says what None is, and changes nothing
    istate = tg.setup(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), model)
    with pytest.raises(TypeError, match=r"tg\.adjust_ got None: .* no trainable array"):
        tg.adjust_(istate[1], learning_rate=1.0)
    assert float(istate[0].weight.state.hyperparams["learning_rate"]) == pytest.approx(0.1)


@pytest.mark.slow  # over ~0.5 s (a few compiles)
def test_a_model_arrays_removed_from_its_params_are_neither_in_the_state_nor_the_vector():
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.full(3, 20.0), "c": jnp.array([3.0])}
    ps = tg.params(m)
    ps.remove(m["b"])
    # destructure: the Params' arrays only, b kept as it is by rebuild
    flat, rebuild = tg.destructure(ps)
    close(flat, [1.0, 2.0, 3.0])
    new = rebuild(jnp.array([4.0, 5.0, 6.0]))
    assert new["b"] is m["b"]
    close(new["a"], [4.0, 5.0])
    f = lambda d: jnp.sum(d["a"] ** 2 * d["b"][:2]) + jnp.sum(d["c"] ** 3)
    close(jax.jit(jax.grad(lambda v: f(rebuild(v))))(flat), [40.0, 80.0, 27.0])
    # setup: a rule looking across parameters sees the Params' arrays, as plain optax on them
    rule = optax.chain(
        optax.add_decayed_weights(0.1), optax.clip_by_global_norm(1.0), optax.sgd(1.0)
    )
    state = tg.setup(rule, ps)
    assert state["b"] is None
    loss = lambda d: jnp.sum(d["a"] ** 2) + jnp.sum(d["c"] ** 2)
    p = {"a": m["a"], "c": m["c"]}
    opt = rule.init(p)
    grad = jax.jit(jax.grad(loss))
    for _ in range(2):
        tg.update_(state, ps, tg.gradient(lambda: loss(m), ps))
        u, opt = rule.update(grad(p), opt, p)
        p = optax.apply_updates(p, u)
    close(m["a"], p["a"])
    close(m["c"], p["c"])
    close(m["b"], [20.0] * 3)
    # added back after setup: it has no state; said so, and nothing changes
    ps.add(m["b"])
    grads = tg.gradient(lambda: loss(m) + jnp.sum(m["b"]), ps)
    was = dict(m)
    with pytest.raises(ValueError, match=r"gradient for 'b', an array of the model that was not"):
        tg.update_(state, ps, grads)
    assert all(m[k] is was[k] for k in m)


# --- Optimisers.jl runtests.jl: features ----------------------------------------------------


def test_very_basics_pure_update_changes_nothing_and_in_place_rebinds():
    m = [jnp.array([1.0, 2.0])]
    g = [jnp.array([25.0, 33.0])]
    s = tg.setup(optax.sgd(0.1, momentum=0.9), m)
    s2, m2 = tg.update(s, m, g)
    close(m[0], [1.0, 2.0])  # not mutated
    close(m2[0], [1 - 2.5, 2 - 3.3])
    close(s2[0].state[0].trace, [25.0, 33.0])
    close(s[0].state[0].trace, [0.0, 0.0])  # the old state not mutated either
    tg.update_(s, m, g)
    close(m[0], m2[0])
    close(s[0].state[0].trace, [25.0, 33.0])


def test_trainable_subset_ignores_the_gradient_jax_grad_gives_for_other_attributes():
    mt = TwoThirds(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), jnp.array([5.0, 6.0]))
    st = tg.setup(optax.sgd(0.1, momentum=0.9), mt)
    assert st.b is None and st.c is None
    g = jax.jit(jax.grad(lambda m: jnp.sum(m.a**2) + 100 * jnp.sum(m.b**2) + jnp.sum(m.c)))(mt)
    assert float(jnp.sum(g.b)) != 0  # jax.grad gives one: it must be ignored
    _, new = tg.update(st, mt, g)
    close(new.a, [0.8, 1.6])
    assert new.b is mt.b and new.c is mt.c
    tg.update_(st, mt, g)
    close(mt.a, [0.8, 1.6])
    close(mt.b, [3.0, 4.0])


def test_freeze_a_sub_tree_then_adjust_and_thaw_like_optimisers_jl():
    m = {"x": jnp.array([1.0, 2.0]), "y": (jnp.array([3.0, 4.0]), jnp.sin)}
    st = tg.setup(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), m)
    tg.freeze_(st["y"])
    g = {"x": jnp.array([1.0, 10.0]), "y": (jnp.array([100.0, 1000.0]), None)}
    st, m = tg.update(st, m, g)
    close(m["x"], [0.9, 1.0])
    close(m["y"][0], [3.0, 4.0])
    st = tg.adjust(st, learning_rate=0.2)
    tg.thaw_(st)
    st, m = tg.update(st, m, g)
    close(m["y"][0], [-17.0, -196.0])
    close(m["x"], [0.7, -1.0])
    with pytest.raises(TypeError, match=r"expects an optimiser state from tg\.setup.*got dict"):
        tg.freeze_(m)


@pytest.mark.slow  # over ~0.5 s (a few compiles)
def test_tied_weights_in_tuples_sum_once_and_stay_one_object():
    twice = jnp.array([1.0, 2.0])
    mtup = (twice, (jnp.array(twice, copy=True), twice))  # (tied, (not tied, tied))
    rule = optax.adam(0.1)  # rule(g1) + rule(g2) != rule(g1 + g2)
    s = tg.setup(rule, mtup)
    assert s[0] is s[1][1] and s[0] is not s[1][0]
    g3, g10, g7 = jnp.full(2, 3.0), jnp.full(2, 10.0), jnp.full(2, 7.0)

    def ref(g_tied, g_other):
        p = {"t": twice, "o": twice}
        u, _ = rule.update({"t": g_tied, "o": g_other}, rule.init(p), p)
        return optax.apply_updates(p, u)

    _, new = tg.update(s, mtup, (g3, (g10, g7)))
    want = ref(g3 + g7, g10)
    close(new[0], want["t"])
    close(new[1][0], want["o"])
    assert new[1][1] is new[0]
    _, new = tg.update(s, mtup, (g3, None))  # only the first place has a gradient
    close(new[0], ref(g3, g10)["t"])
    assert new[1][1] is new[0] and new[1][0] is mtup[1][0]
    _, new = tg.update(s, mtup, (None, (g10, g7)))  # only the second place
    close(new[0], ref(g7, g10)["t"])


@pytest.mark.slow  # over ~0.5 s (a few compiles)
def test_mutable_containers_tied_as_optimisers_jl_shared_struct_and_arrays():
    tmp = MutTwo(jnp.array([1.0]), jnp.array([2.0]))
    model = {"a": tmp, "b": tmp, "c": MutTwo(tmp.x, tmp.y)}
    state = tg.setup(optax.adam(0.1), model)
    assert state["a"].x is state["b"].x is state["c"].x
    mgrad = {
        "a": MutTwo(jnp.array([1.0]), jnp.array([10.0])),
        "b": MutTwo(jnp.array([100.0]), jnp.array([1000.0])),
        "c": MutTwo(jnp.array([1 / 3]), jnp.array([1 / 30])),
    }
    _, new = tg.update(state, model, mgrad)
    assert new["a"] is new["b"] and new["a"] is not new["c"]  # no new tie of the structs
    assert new["c"].x is new["a"].x  # but the arrays are one
    rule = optax.adam(0.1)
    p = {"x": tmp.x, "y": tmp.y}
    total = {"x": jnp.array([101 + 1 / 3]), "y": jnp.array([1010 + 1 / 30])}
    u, _ = rule.update(total, rule.init(p), p)
    want = optax.apply_updates(p, u)
    close(new["a"].x, want["x"])
    close(new["c"].y, want["y"])
    tg.update_(state, model, mgrad)
    assert model["a"] is tmp and tmp.x is model["c"].x
    close(tmp.y, want["y"])


@pytest.mark.slow  # over ~0.5 s (a few compiles)
def test_nested_chain_adjust_reaches_every_injected_part_and_keeps_moments():
    m = {"w": jnp.array([4.0, 3.0, 2.0])}
    g = {"w": jnp.array([1.0, 10.0, 100.0])}

    def rule(lr, delta):
        clip = optax.inject_hyperparams(optax.clip)(max_delta=delta)
        return optax.chain(optax.chain(clip, optax.inject_hyperparams(optax.adam)(lr)))

    st = tg.setup(rule(0.1, 2.0), m)
    st, m1 = tg.update(st, m, g)
    st2 = tg.adjust(st, learning_rate=0.2, max_delta=2.5)
    _, m2 = tg.update(st2, m1, g)
    # plain optax: the same run, the hyperparameters edited in its state
    r = rule(0.1, 2.0)
    o = r.init(m)
    u, o = r.update(g, o, m)
    p = optax.apply_updates(m, u)
    o[0][0].hyperparams["max_delta"] = jnp.asarray(2.5)
    o[0][1].hyperparams["learning_rate"] = jnp.asarray(0.2)
    u, o = r.update(g, o, p)
    close(m2["w"], optax.apply_updates(p, u)["w"])
    close(st2["w"].state[0][1].inner_state[0].mu, st["w"].state[0][1].inner_state[0].mu)


# --- a hand-written Adam over random models: ties, __trainable__, None, freeze -------------


class R(tg.Module):
    __trainable__ = ("a", "b")

    def __init__(self, a, b, c):
        self.a, self.b, self.c = a, b, c


def _random_model(rng):
    dtypes = [jnp.float32, jnp.float32, jnp.float16]
    pool = [
        jnp.asarray(rng.normal(size=int(rng.integers(1, 4))), dtypes[int(rng.integers(0, 3))])
        for _ in range(4)
    ]
    shared = []

    def leaf():
        r = rng.random()
        if r < 0.6:
            return pool[int(rng.integers(0, 4))]  # ties
        return jnp.arange(2) if r < 0.75 else 1.5 if r < 0.85 else jnp.ones(2)

    def node(depth):
        if depth == 0 or rng.random() < 0.3:
            return leaf()
        kind = int(rng.integers(0, 5))
        n = int(rng.integers(1, 3))
        if kind == 0:
            return {f"k{i}": node(depth - 1) for i in range(n)}
        if kind == 1:
            return [node(depth - 1) for _ in range(n)]
        if kind == 2:
            return tuple(node(depth - 1) for _ in range(n))
        if kind == 3:
            return R(node(depth - 1), node(depth - 1), node(depth - 1))
        if not shared:
            shared.append(MutTwo(node(depth - 1), node(depth - 1)))
        return shared[0]  # a sub-model at two places

    return {f"r{i}": node(2) for i in range(3)}


def _places(model):
    from treegrad._paramsource import trainable_leaves_with_path

    return [
        (p, x) for p, x in trainable_leaves_with_path(model) if tg.is_differentiable(x)
    ]  # one entry per place, tied arrays at each


def _at(state, path):
    """The state at a model key path, navigated as the model is."""
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            state = getattr(state, key.name)
        else:
            state = state[key.key if isinstance(key, jax.tree_util.DictKey) else key.idx]
    return state


def _adam_reference(places, steps, frozen, clip):
    val = {id(x): np.asarray(x, np.float64) for _, x in places}
    mu = {k: 0 * v for k, v in val.items()}
    nu = {k: 0 * v for k, v in val.items()}
    for t, grads in enumerate(steps, start=1):
        total = {}
        for (_, x), g in zip(places, grads, strict=True):
            if g is not None and id(x) not in frozen:
                total[id(x)] = total.get(id(x), 0) + np.asarray(g, np.float64)
        norm = np.sqrt(sum(np.sum(g**2) for g in total.values()))
        scale = clip / norm if norm > clip else 1.0
        for k, g in total.items():
            mu[k] = 0.9 * mu[k] + 0.1 * g * scale
            nu[k] = 0.999 * nu[k] + 0.001 * (g * scale) ** 2
            mh, vh = mu[k] / (1 - 0.9**t), nu[k] / (1 - 0.999**t)
            val[k] = val[k] - 0.1 * mh / (np.sqrt(vh) + 1e-8)
    return val


@pytest.mark.slow  # a few compiles per model
@pytest.mark.parametrize("seed", range(4))
def test_random_models_with_ties_and_none_steps_equal_a_hand_written_adam(seed):
    for in_place in (False, True):
        rng = np.random.default_rng(seed)
        model = _random_model(rng)
        places = _places(model)
        state = tg.setup(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1)), model)
        frozen = set()
        if rng.random() < 0.5 and places:
            path, x = places[int(rng.integers(0, len(places)))]
            tg.freeze_(_at(state, path))  # one place of it: the array is frozen
            frozen.add(id(x))
        steps = []
        current = model
        for _ in range(3):
            grads = [
                None if rng.random() < 0.3 else jnp.asarray(rng.normal(size=x.shape), x.dtype)
                for _, x in places
            ]
            steps.append(grads)
            by_path = {p: g for (p, _), g in zip(places, grads, strict=True)}
            tree = jax.tree_util.tree_map_with_path(lambda p, _, at=by_path: at.get(p), current)
            if in_place:
                tg.update_(state, current, tree)
            else:
                state, current = tg.update(state, current, tree)
        want = _adam_reference(places, steps, frozen, 0.5)
        after = _places(current)
        first = {}
        for (p, x), (q, y) in zip(places, after, strict=True):
            assert p == q
            tol = 2e-2 if x.dtype == jnp.float16 else 1e-5
            close(y, want[id(x)], tol)
            assert first.setdefault(id(x), y) is y  # a tie is one object again


# --- Optimisers.jl destructure.jl ---------------------------------------------------------

M1 = jnp.arange(1.0, 4.0)


def test_flatten_and_rebuild_of_ties_shared_models_bools_and_functions():
    m3 = {"x": M1, "y": jnp.sin, "z": jnp.arange(4.0, 7.0)}
    m4 = {"x": M1, "y": M1, "z": jnp.arange(4.0, 7.0)}
    m5 = {"a": (m3, True), "b": (M1, False), "c": (m4, True)}
    flat, rebuild = tg.destructure(m5)
    close(flat, [1, 2, 3, 4, 5, 6, 4, 5, 6])  # M1 once
    new = rebuild(jnp.arange(9.0, 0.0, -1.0))
    assert new["a"][0]["x"] is new["b"][0] is new["c"][0]["y"]
    assert new["b"][1] is False and new["a"][0]["y"] is jnp.sin
    close(new["a"][0]["x"], [9, 8, 7])
    close(new["c"][0]["z"], [3, 2, 1])
    # m8: a Module holding one array twice, bools, an empty tuple, nested lists
    m8 = [MutTwo(M1, M1), {"a": True, "b": MutTwo(jnp.array([4.0]), False), "c": ()}, [[5.0]]]
    flat, rebuild = tg.destructure(m8)
    close(flat, [1, 2, 3, 4])  # 5.0 is a Python number: not a parameter
    g = jax.jit(jax.grad(lambda v: jnp.sum(rebuild(v)[0].y ** 2) + rebuild(v)[2][0][0]))(flat)
    close(g, [2, 4, 6, 0])


def test_gradient_of_flatten_counts_a_tie_once_with_tg_gradient():
    (g,) = tg.gradient(lambda m: tg.destructure(m)[0][2], (M1, M1))
    close(g[0], [0, 0, 1])
    assert g[1] is None  # the tie's total at its first place, as Optimisers.jl gives
    # second derivatives through destructure
    inner = lambda v: tg.gradient(
        lambda m: jnp.sum(tg.destructure(m)[0]) ** 3, (v, jnp.array([4.0, 5, 6]))
    )[0][0]
    close(jax.grad(lambda v: jnp.sum(inner(v)))(M1), [378.0] * 3)


def test_gradient_of_rebuild_flux_issue_1826_and_jit_vmap_of_a_tied_model():
    sh = jnp.array([7.0, 7.0])
    v, rebuild = tg.destructure({"x": sh, "y": jnp.array([3.0, 4.0]), "z": sh})
    close(v, [7, 7, 3, 4])
    f = lambda w: 3 * jnp.sum(rebuild(w)["x"]) + 13 * jnp.sum(rebuild(w)["z"])
    close(jax.jit(jax.grad(f))(jnp.zeros(4)), [16, 16, 0, 0])  # Flux gave [3, 3, 13, 13]
    g = lambda w: (
        4 * (jnp.sum(rebuild(w)["x"]) + jnp.sum(rebuild(w)["y"]))
        + 13 * jnp.sum(rebuild(w)["z"] ** 2)
    )
    batch = jnp.stack([jnp.zeros(4), jnp.arange(4.0)])
    got = jax.jit(jax.vmap(jax.grad(g)))(batch)
    for row, w in zip(got, batch, strict=True):  # closed form: 4 + 26 x at the tie, 4 at y
        close(row, [4 + 26 * w[0], 4 + 26 * w[1], 4, 4])
    # jax.jit given rebuild as an argument: its model's arrays are inputs
    close(jax.jit(lambda r, w: r(w)["z"])(rebuild, jnp.arange(4.0)), [0, 1])


def test_empty_model_and_small_floats_are_not_promoted():
    v0, re0 = tg.destructure((None, "a", jnp.sin))
    assert v0.shape == (0,)
    assert re0(jnp.zeros(0)) == (None, "a", jnp.sin)
    with pytest.raises(ValueError, match=r"rebuild expects a vector of shape \(0,\), got \(1,\)"):
        re0(jnp.ones(1))
    m01 = [
        {"x": None, "y": 0},
        {"x": jnp.array([1.0, 2.0], jnp.float16), "y": jnp.ones(1, jnp.float16)},
    ]
    v01, _ = tg.destructure(m01)
    assert v01.dtype == jnp.float16
    close(v01, [1, 2, 1])


# --- float64 and complex128 (x64 is a process-wide setting: in a subprocess) -------------

_X64 = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, numpy as np, optax, treegrad as tg
    m = {"d": jnp.array([1.0, 2.0]), "f": jnp.array([3.0], jnp.float32),
         "h": jnp.array([0.5], jnp.bfloat16), "z": jnp.array([1 + 2j]), "i": jnp.arange(2)}
    assert m["d"].dtype == jnp.float64 and m["z"].dtype == jnp.complex128
    def loss(m):
        return (jnp.sum(m["d"] ** 2) + jnp.sum(m["f"].astype(jnp.float64) ** 3)
                + jnp.sum(m["h"].astype(jnp.float64) ** 2) + jnp.sum(jnp.abs(m["z"]) ** 2))
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    s, mm = tg.setup(rule, m), m
    p = {k: v for k, v in m.items() if k != "i"}
    o = rule.init(p)
    for _ in range(3):
        (g,) = tg.gradient(loss, mm)
        s, mm = tg.update(s, mm, g)
        gp = jax.grad(lambda p: loss({**p, "i": m["i"]}))(p)
        gp["z"] = jnp.conj(gp["z"])  # the steepest-ascent convention
        u, o = rule.update(gp, o, p)
        p = optax.apply_updates(p, u)
    for k in p:
        assert mm[k].dtype == m[k].dtype, k
        np.testing.assert_allclose(np.asarray(mm[k], np.complex128),
                                   np.asarray(p[k], np.complex128), rtol=1e-6)
    flat, rebuild = tg.destructure(m)
    assert flat.dtype == jnp.complex128 and flat.shape == (5,)
    assert all(v.dtype == m[k].dtype for k, v in rebuild(flat * 2).items())
    gv = jax.grad(lambda v: loss(rebuild(v)))(jnp.real(flat))
    np.testing.assert_allclose(gv, [2.0, 4.0, 27.0, 1.0, 2.0], rtol=1e-6)
    print("ok")
    """
)


@pytest.mark.slow  # a fresh interpreter
def test_float64_and_complex128_models_with_x64_equal_plain_optax():
    out = subprocess.run([sys.executable, "-c", _X64], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
