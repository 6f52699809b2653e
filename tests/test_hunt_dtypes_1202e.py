"""Hunt: dtypes and special leaves across the whole API.

bfloat16 / float16 / float32 / float64 (x64 only inside `jax.enable_x64`), weak types,
Python and numpy scalars, 0-d and size-0 arrays, nan/inf, integer, bool and key leaves
(typed and raw), float0 tangents, ShapeDtypeStruct leaves. Every numeric result is
compared with an independent reference: `jax.grad` compiled by `jax.jit` (treegrad
compiles, and XLA's fusion may round bfloat16/float16 intermediates differently from
eager jax), plain optax on the same leaves, a closed form, or the saved bits.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

_TRAINED = ("b", "h", "f", "s", "e")


class Mixed(tg.Module):
    """Every kind of leaf a model may hold, in one Module."""

    def __init__(self):
        self.b = jnp.array([[1.5, -2.0, 0.25], [0.75, 3.0, -1.0]], jnp.bfloat16)
        self.h = jnp.array([0.5, 1.0, 3.0], jnp.float16)
        self.f = jnp.array([0.1, -0.2, 0.3], jnp.float32)
        self.s = jnp.asarray(2.0)  # weakly typed float32
        self.e = jnp.zeros((0, 3))  # size 0
        self.n = jnp.arange(3)
        self.flag = jnp.array([True, False, True])
        self.key = jax.random.key(0)
        self.raw = jax.random.PRNGKey(1)
        self.c = 3.0  # Python float: static


def mixed_loss(m):
    noise = jax.random.normal(m.key, (3,)) + jax.random.normal(m.raw, (3,))
    wb = m.b.astype(jnp.float32)
    return (
        jnp.sum(jnp.tanh(wb) ** 2)
        + jnp.sum(m.h.astype(jnp.float32) * m.f * noise)
        + m.s * jnp.sum(m.n * m.f)
        + jnp.sum(m.e)
        + m.c * jnp.sum(jnp.where(m.flag, m.f, 0.0))
    )


def _ref_grad(loss, model):
    """jax.grad, compiled, on the same model (allow_int: float0 at int/key leaves)."""
    return jax.jit(jax.grad(loss, allow_int=True))(model)


def _same(a, b):
    """Same dtype, weak type, shape and bits (nan equal to nan)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.weak_type == b.weak_type, (a.weak_type, b.weak_type)
    assert bool(jnp.array_equal(a, b, equal_nan=True)), (a, b)


def _close(a, b):
    """Same dtype and weak type; values within 2 ulps of the dtype (separate XLA
    programs may fuse bfloat16/float16 arithmetic differently)."""
    assert a.dtype == b.dtype and a.weak_type == b.weak_type, (a.dtype, b.dtype)
    eps = float(jnp.finfo(a.dtype).eps)
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2 * eps, atol=2 * eps
    )


def _non_trained_untouched(old, new):
    for k in ("n", "flag", "raw"):
        _same(getattr(new, k), getattr(old, k))
    assert new.key.dtype == old.key.dtype
    assert bool(jnp.array_equal(jax.random.key_data(new.key), jax.random.key_data(old.key)))
    assert new.c == old.c


# --- gradients --------------------------------------------------------------------------


def test_mixed_dtypes_explicit_gradient_equals_jax_grad():
    m = Mixed()
    ref = _ref_grad(mixed_loss, m)
    value, (g,) = tg.withgradient(mixed_loss, m)
    (g2,) = tg.gradient(mixed_loss, m)
    _same(value, jax.jit(mixed_loss)(m))
    for k in _TRAINED:
        _same(getattr(g, k), getattr(ref, k))
        _same(getattr(g2, k), getattr(ref, k))
    # Integer, bool and key leaves get None (jax.grad gives float0), static data stays.
    for k in ("n", "flag", "key", "raw"):
        assert getattr(g, k) is None
        assert getattr(ref, k).dtype in (jax.dtypes.float0,) or k == "key"
    assert g.c == 3.0
    assert list(tg.params(m).named()) == list(_TRAINED)


def test_mixed_dtypes_implicit_gradient_equals_jax_grad():
    m = Mixed()
    ps = tg.params(m)
    ref = _ref_grad(mixed_loss, m)
    grads = tg.gradient(lambda: mixed_loss(m), ps)
    assert list(grads.named()) == list(_TRAINED)
    for k, g in grads.named().items():
        _same(g, getattr(ref, k))
        _same(grads[getattr(m, k)], getattr(ref, k))
    tree = grads.to_tree(m)
    for k in _TRAINED:
        _same(getattr(tree, k), getattr(ref, k))
    assert tree.n is None and tree.key is None and tree.raw is None and tree.flag is None


def test_is_differentiable_one_rule_for_every_kind_of_leaf():
    diff = [
        jnp.ones(2, jnp.bfloat16),
        jnp.ones(2, jnp.float16),
        jnp.asarray(1.0),
        jnp.zeros((0, 3)),
        jnp.ones(2, jnp.complex64),
        np.ones(2, np.float32),
        np.ones(2, ml_dtypes.bfloat16),
        np.array(1.0, np.float32),  # numpy 0-d array
    ]
    not_diff = [
        jnp.arange(2),
        jnp.array([True]),
        jax.random.key(0),
        jax.random.PRNGKey(0),
        1.0,
        2,
        np.float32(1.0),  # numpy scalar: not an array
        jax.ShapeDtypeStruct((2,), jnp.float32),
        np.zeros(2, jax.dtypes.float0),
        None,
    ]
    assert all(tg.is_differentiable(x) for x in diff)
    assert not any(tg.is_differentiable(x) for x in not_diff)


@pytest.mark.slow
def test_numpy_leaves_follow_one_rule_in_gradient_params_setup_update():
    d = {
        "a": np.float32(2.0),  # numpy scalar: like a Python number, not differentiable
        "b": np.array(3.0, np.float32),  # numpy 0-d array: differentiable
        "h": np.array([0.5, 1.5], np.float16),
        "c": 1.5,
        "i": 2,
        "w": jnp.ones(2),
    }

    def f(d):
        return (jnp.sum(d["w"] * d["h"]) * d["a"] * d["b"] * d["c"] * d["i"]).astype(jnp.float32)

    (g,) = tg.gradient(f, d)
    ref = jax.jit(jax.grad(f, allow_int=True))(d)
    assert g["a"] is None and g["c"] is None and g["i"] is None
    for k in ("b", "h", "w"):
        _same(g[k], ref[k])
    opt = optax.adam(0.1)
    _, new = tg.update(tg.setup(opt, d), d, g)
    tr = {k: d[k] for k in ("b", "h", "w")}
    upd, _ = jax.jit(opt.update)({k: ref[k] for k in tr}, opt.init(tr), tr)
    want = jax.jit(optax.apply_updates)(tr, upd)
    for k in tr:
        assert isinstance(new[k], jax.Array)
        _close(new[k], want[k])
    assert new["a"] is d["a"] and new["c"] == 1.5 and new["i"] == 2
    # tg.params converts the numpy arrays in place (identity needs it), not the scalar.
    ps = tg.params(d)
    assert list(ps.named()) == ["b", "h", "w"]
    assert isinstance(d["b"], jax.Array) and isinstance(d["h"], jax.Array)
    assert type(d["a"]) is np.float32
    gi = tg.gradient(lambda: f(d), ps)
    for k in ("b", "h", "w"):
        _same(gi[d[k]], ref[k])


@pytest.mark.slow
def test_nan_and_inf_in_gradients_propagate_as_in_jax():
    m = {
        "a": jnp.array([-1.0, 0.0, 4.0]),
        "b": jnp.array(jnp.inf),
        "c": jnp.array([jnp.nan, 1.0]),
        "big": jnp.array([3e38, 1.0]),
    }
    losses = [
        lambda m: jnp.sum(jnp.where(m["a"] > 0, jnp.sqrt(m["a"]), 0.0)),  # nan where masked
        lambda m: jnp.sum(m["a"]) * 0.0 * m["b"],  # 0 * inf
        lambda m: jnp.sum(m["c"] * 2.0),
        lambda m: m["b"] * 2.0 + jnp.sum(jnp.sqrt(m["a"])),  # inf and nan gradients
        lambda m: jnp.sum(m["big"] ** 2),  # overflow to inf
        lambda m: jnp.max(m["c"]),  # nan max: as compiled jax (0/1 mask folded by XLA)
    ]
    ps = tg.params(m)
    for f in losses:
        ref = jax.jit(jax.grad(f))(m)
        value, (g,) = tg.withgradient(f, m)
        gi = tg.gradient(lambda f=f: f(m), ps)
        _same(value, jax.jit(f)(m))
        used = [k for k in m if g[k] is not None]
        assert used, "every loss reads a parameter"
        for k in m:
            if g[k] is None:
                assert gi[m[k]] is None
                assert not bool(jnp.any(ref[k] != 0))  # an unread leaf: jax gives zeros
            else:
                _same(g[k], ref[k])
                _same(gi[m[k]], ref[k])
    # Some gradients above really are nan / inf: the comparison was not vacuous.
    g_nan = tg.gradient(losses[0], m)[0]["a"]
    assert bool(jnp.isnan(g_nan[0])) and float(g_nan[2]) == 0.25
    assert bool(jnp.isinf(tg.gradient(losses[4], m)[0]["big"][0]))


@pytest.mark.slow
def test_weak_and_strong_scalars_are_not_confused_by_the_caches():
    """`bf16 * weak_f32` is bfloat16, `bf16 * f32` float32: weak_type is in every key."""
    w = jnp.array([1.5, 2.5], jnp.bfloat16)
    loss = lambda m: jnp.sum((m["w"] * m["s"]) ** 2).astype(jnp.float32)
    box = {}
    for weak in (True, False, True):
        s = jnp.asarray(1.1) if weak else jnp.float32(1.1)
        assert s.weak_type is weak
        m = {"w": w, "s": s}
        box["s"] = s
        ref_v, ref_g = jax.jit(jax.value_and_grad(loss))(m)
        v, (g,) = tg.withgradient(loss, m)
        _same(v, ref_v)
        for k in m:
            _same(g[k], ref_g[k])
        out = tg.jit(lambda w: w * box["s"])(w)  # a captured array, weak or not
        assert out.dtype == (jnp.bfloat16 if weak else jnp.float32)
        ps = tg.params(m)
        vi, gi = tg.withgradient(lambda m=m: loss(m), ps)
        _same(vi, ref_v)
        _same(gi[m["s"]], ref_g["s"])


@pytest.mark.slow
def test_typed_and_raw_keys_read_from_a_closure_are_fresh():
    w = jnp.array([1.5, 2.5, 3.0, 4.0])
    box = {}

    def f(w):
        return jnp.sum(w * jax.random.normal(box["k"], (4,)))

    keys = [
        jax.random.key(0),
        jax.random.key(1),
        jax.random.key(1, impl="rbg"),
        jax.random.PRNGKey(5),
        jax.random.PRNGKey(6),
        jax.random.key(7),
    ]
    ps = tg.params({"w": w})
    for k in keys:
        box["k"] = k
        noise = jax.random.normal(k, (4,))
        v, (g,) = tg.withgradient(f, w)
        np.testing.assert_allclose(v, jnp.sum(w * noise), rtol=1e-6)
        np.testing.assert_array_equal(g, noise)
        np.testing.assert_allclose(tg.jit(f)(w), jnp.sum(w * noise), rtol=1e-6)
        np.testing.assert_array_equal(tg.gradient(lambda: f(w), ps)[w], noise)


@pytest.mark.slow
def test_float0_tangents_through_tg_gradient_in_jax_transforms():
    n = jnp.array([1, 2, 3])
    k = jax.random.key(0)
    m = {"w": jnp.array([1.0, -2.0, 0.5]), "n": n, "k": k}

    def loss(m):
        return jnp.sum(m["w"] ** 3 * m["n"]) + jnp.sum(jax.random.normal(m["k"], (3,)) * m["w"])

    def ours(m):
        return tg.gradient(loss, m)[0]["w"]

    def ref(m):
        return jax.grad(loss, allow_int=True)(m)["w"]

    tan = {
        "w": jnp.ones(3),
        "n": np.zeros(3, jax.dtypes.float0),
        "k": np.zeros((), jax.dtypes.float0),
    }
    out, t = jax.jvp(ours, (m,), (tan,))
    out_r, t_r = jax.jvp(ref, (m,), (tan,))
    np.testing.assert_allclose(out, out_r, rtol=1e-6)
    np.testing.assert_allclose(t, t_r, rtol=1e-6)
    np.testing.assert_allclose(t, 6 * m["w"] * n)  # closed form: d/dw 3 w^2 n
    (ct,) = jax.vjp(ours, m)[1](jnp.ones(3))
    assert ct["n"].dtype == jax.dtypes.float0 and ct["k"].dtype == jax.dtypes.float0
    np.testing.assert_allclose(ct["w"], 6 * m["w"] * n)
    batch = jnp.stack([m["w"], 2 * m["w"]])
    np.testing.assert_allclose(
        jax.vmap(lambda w: ours({"w": w, "n": n, "k": k}))(batch),
        jax.vmap(lambda w: ref({"w": w, "n": n, "k": k}))(batch),
        rtol=1e-6,
    )


# --- optimiser --------------------------------------------------------------------------

_RULES = {
    "adam": lambda: optax.adam(0.1),
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: optax.adamw(0.1, weight_decay=0.1),
    "flatten_adam": lambda: optax.flatten(optax.adam(0.1)),
    "clip_then_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1)),
    "adafactor": lambda: optax.adafactor(0.1),
}


@pytest.mark.parametrize(
    "name", [n if n == "adam" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(_RULES)]
)
def test_update_on_mixed_dtypes_equals_plain_optax(name):
    opt = _RULES[name]()
    m = Mixed()
    old = m
    state = tg.setup(opt, m)
    p = {k: getattr(m, k) for k in _TRAINED}
    s = opt.init(p)
    grad_of = jax.jit(jax.grad(lambda p: mixed_loss(_with(old, p))))
    step = jax.jit(lambda g, s, p: _apply(opt, g, s, p))
    for _ in range(2):
        (g,) = tg.gradient(mixed_loss, m)
        state, m = tg.update(state, m, g)
        p, s = step(grad_of(p), s, p)
    for k in _TRAINED:
        _close(getattr(m, k), p[k])
    ours = sorted(str(x.dtype) + str(x.shape) for x in jax.tree_util.tree_leaves(state))
    theirs = sorted(str(x.dtype) + str(x.shape) for x in jax.tree_util.tree_leaves(s))
    assert ours == theirs
    _non_trained_untouched(old, m)
    assert m.n is old.n and m.key is old.key and m.raw is old.raw  # not rebuilt


def _with(model, p):
    new = jax.tree_util.tree_map(lambda x: x, model)
    for k, v in p.items():
        setattr(new, k, v)
    return new


def _apply(opt, g, s, p):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s


@pytest.mark.slow
def test_update_in_place_and_compiled_agree_bit_for_bit_and_keep_keys():
    """Implicit and explicit style, each compiled by tg.jit or not; a Dropout-style key
    split and an int counter stored back each step. Implicit equals explicit bit for
    bit, compiled with compiled and uncompiled with uncompiled (API.md §3); compiled
    and uncompiled differ only by XLA's fusion (ulps)."""

    def make():
        m = Mixed()
        m.count = jnp.array(0)
        return m

    results = {}
    for compiled in (False, True):
        m = make()
        ps = tg.params(m)
        state = tg.setup(optax.adam(0.1), ps)

        def step(m=m, ps=ps, state=state):
            grads = tg.gradient(lambda: mixed_loss(m), ps)
            tg.update_(state, ps, grads)
            m.key = jax.random.split(m.key)[0]
            m.count = m.count + 1

        run = tg.jit(step) if compiled else step
        for _ in range(3):
            run()
        results["implicit", compiled] = m
    for compiled in (False, True):
        m = make()
        state = tg.setup(optax.adam(0.1), m)

        def pure(state, m):
            (g,) = tg.gradient(mixed_loss, m)
            state, m = tg.update(state, m, g)
            m.key = jax.random.split(m.key)[0]
            m.count = m.count + 1
            return state, m

        run = tg.jit(pure) if compiled else pure
        for _ in range(3):
            state, m = run(state, m)
        results["explicit", compiled] = m
    first = results["implicit", False]
    for (_, compiled), other in results.items():
        for k in (*_TRAINED, "n", "flag", "raw", "count"):
            if compiled and k in _TRAINED:
                _same(getattr(other, k), getattr(results["implicit", True], k))
                _close(getattr(other, k), getattr(first, k))
            else:
                _same(getattr(other, k), getattr(first, k))
        assert other.key.dtype == first.key.dtype
        np.testing.assert_array_equal(
            jax.random.key_data(other.key), jax.random.key_data(first.key)
        )
    assert int(first.count) == 3
    want = jax.random.split(jax.random.split(jax.random.split(jax.random.key(0))[0])[0])[0]
    np.testing.assert_array_equal(jax.random.key_data(first.key), jax.random.key_data(want))


@pytest.mark.slow
def test_weak_typed_parameter_keeps_weak_type_when_skipped():
    """A None gradient leaves the parameter as it was: a weakly typed scalar stays
    weak (so `bf16 * s` stays bfloat16), in the pure and the in-place update."""
    m = {"w": jnp.array([1.5, -2.0], jnp.bfloat16), "s": jnp.asarray(2.0), "t": jnp.asarray(3.0)}

    def loss(m):
        return jnp.sum(m["w"].astype(jnp.float32) ** 2) * m["t"]

    (g,) = tg.gradient(loss, m)
    assert g["s"] is None
    _, new = tg.update(tg.setup(optax.adam(0.1), m), m, g)
    assert new["s"] is m["s"] and (new["w"] * new["s"]).dtype == jnp.bfloat16
    # The trained weak scalar: as plain optax leaves it (apply_updates casts: strong).
    u, _ = optax.adam(0.1).update({"t": g["t"]}, optax.adam(0.1).init({"t": m["t"]}), {"t": m["t"]})
    _close(new["t"], optax.apply_updates({"t": m["t"]}, u)["t"])
    s0 = m["s"]
    ps = tg.params(m)
    st = tg.setup(optax.adam(0.1), ps)
    tg.update_(st, ps, tg.gradient(lambda: loss(m), ps))
    assert m["s"] is s0


def test_update_accepts_jax_grad_float0_tree_as_none():
    class M(tg.Module):
        def __init__(self):
            self.w = jnp.array([1.0, 2.0])
            self.n = jnp.array([1, 2])
            self.key = jax.random.key(0)

    m = M()

    def loss(m):
        return jnp.sum(m.w * m.n)

    gj = jax.grad(loss, allow_int=True)(m)
    assert gj.n.dtype == jax.dtypes.float0
    state = tg.setup(optax.sgd(0.1), m)
    _, new = tg.update(state, m, gj)
    np.testing.assert_allclose(new.w, m.w - 0.1 * m.n)
    assert new.n is m.n and new.key is m.key


def test_dtype_kind_change_after_setup_is_refused_and_changes_nothing():
    class M(tg.Module):
        __trainable__ = ("w", "n")

        def __init__(self):
            self.w = jnp.array([1.0, 2.0])
            self.n = jnp.array([1, 2])

    m = M()
    state = tg.setup(optax.adam(0.1), m)
    m.n = jnp.array([1.0, 2.0])  # int -> float: it has no state
    (g,) = tg.gradient(lambda m: jnp.sum(m.w * m.n), m)
    before = dict(vars(m))
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    with pytest.raises(ValueError, match=r"'n' is float32\[2\].*was not floating-point"):
        tg.update_(state, m, g)
    assert all(vars(m)[k] is v for k, v in before.items())
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    assert all(np.array_equal(a, b) for a, b in zip(leaves, after, strict=True))
    m = M()
    state = tg.setup(optax.adam(0.1), m)
    (g,) = tg.gradient(lambda m: jnp.sum(m.w * m.n), m)
    m.w = jnp.array([1, 2])  # float -> int
    before = dict(vars(m))
    with pytest.raises(ValueError, match=r"'w' is int32\[2\] but was float32\[2\]"):
        tg.update_(state, m, g)
    assert all(vars(m)[k] is v for k, v in before.items())


def test_inject_hyperparams_on_bfloat16_and_float32_equals_plain_optax():
    """(A model mixing bfloat16 and float16 cannot use inject_hyperparams at all:
    plain optax's init refuses to order those two dtypes.)"""
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    m = {"b": jnp.array([1.5, -2.0], jnp.bfloat16), "f": jnp.array([0.1, 0.3])}

    def loss(m):
        return jnp.sum(m["b"].astype(jnp.float32) ** 2 * m["f"])

    state = tg.setup(opt, m)
    p, s = m, opt.init(m)
    step = jax.jit(lambda g, s, p: _apply(opt, g, s, p))
    for _ in range(2):
        (g,) = tg.gradient(loss, m)
        state, m = tg.update(state, m, g)
        p, s = step(jax.jit(jax.grad(loss))(p), s, p)
    for k in m:
        _close(m[k], p[k])
    ours = sorted(str(x.dtype) for x in jax.tree_util.tree_leaves(state))
    assert ours == sorted(str(x.dtype) for x in jax.tree_util.tree_leaves(s))


def test_gradient_dtype_differing_from_parameter_as_plain_optax():
    """A float32 gradient for a bfloat16 parameter (and the reverse): as plain optax,
    compiled (optax keeps the parameter's dtype, apply_updates casts)."""
    m = {"b": jnp.array([1.0, 2.0], jnp.bfloat16), "f": jnp.array([1.0, 2.0], jnp.float32)}
    g = {"b": jnp.array([0.3, 0.7], jnp.float32), "f": jnp.array([0.3, 0.7], jnp.bfloat16)}
    for opt in (optax.sgd(0.1), optax.adam(0.1)):
        state, new = tg.update(tg.setup(opt, m), m, g)
        want, s = jax.jit(lambda g, s, p, opt=opt: _apply(opt, g, s, p))(g, opt.init(m), m)
        for k in m:
            _close(new[k], want[k])
        ours = sorted(str(x.dtype) for x in jax.tree_util.tree_leaves(state))
        assert ours == sorted(str(x.dtype) for x in jax.tree_util.tree_leaves(s))
    with pytest.raises(ValueError, match=r"gradient at 'b' has dtype int32"):
        tg.update(tg.setup(optax.sgd(0.1), m), m, {"b": jnp.ones(2, jnp.int32), "f": None})
    with pytest.raises(ValueError, match=r"gradient at 'b' is complex but its parameter is real"):
        tg.update(tg.setup(optax.sgd(0.1), m), m, {"b": jnp.ones(2, jnp.complex64), "f": None})


@pytest.mark.slow
def test_train_mixed_dtypes_equals_a_manual_loop():
    m = Mixed()
    data = [(jnp.float32(1.0),), (jnp.float32(-0.5),), (jnp.float32(2.0),)]

    def loss(m, x):
        return mixed_loss(m) * x

    opt = optax.adam(0.05)
    _, new, losses = tg.train(loss, m, data, tg.setup(opt, m), epochs=2)
    p = {k: getattr(m, k) for k in _TRAINED}
    s = opt.init(p)
    vg = jax.jit(jax.value_and_grad(lambda p, x: loss(_with(m, p), x)))
    step = jax.jit(lambda g, s, p: _apply(opt, g, s, p))
    want = []
    for _ in range(2):
        for (x,) in data:
            v, g = vg(p, x)
            p, s = step(g, s, p)
            want.append(float(v))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    for k in _TRAINED:
        _close(getattr(new, k), p[k])
    _non_trained_untouched(m, new)


def test_train_stops_on_float16_overflow_with_the_last_good_model():
    m = {"h": jnp.array([200.0, 1.0], jnp.float16)}

    def loss(m, x):
        return jnp.sum((m["h"] * x) ** 2).astype(jnp.float32)  # 2000**2 overflows float16

    data = [(jnp.array([1.0, 1.0], jnp.float16),), (jnp.array([10.0, 1.0], jnp.float16),)]
    with pytest.raises(tg.NonFiniteLossError, match=r"loss is inf at epoch 0, step 1") as e:
        tg.train(loss, m, data, tg.setup(optax.sgd(1e-3), m))
    # Last good: one sgd step on the first batch, in float16 (closed form).
    np.testing.assert_array_equal(
        e.value.model["h"], (m["h"] - jnp.float16(1e-3) * 2 * m["h"]).astype(jnp.float16)
    )
    assert e.value.model["h"].dtype == jnp.float16
    assert e.value.losses == [float(jnp.float16(40001.0))]


# --- destructure ------------------------------------------------------------------------


@pytest.mark.slow
def test_destructure_mixed_dtypes_round_trips_and_differentiates():
    m = Mixed()
    flat, rebuild = tg.destructure(m)
    want, _ = jax.flatten_util.ravel_pytree([getattr(m, k) for k in _TRAINED])
    _same(flat, want)
    back = rebuild(flat)
    for k in _TRAINED:
        # Same dtype and bits; a weakly typed scalar comes back strongly typed, as
        # jax.flatten_util.ravel_pytree's unravel (and optax.apply_updates) give it.
        assert getattr(back, k).dtype == getattr(m, k).dtype
        assert _bits(getattr(back, k)) == _bits(getattr(m, k))
    assert back.n is m.n and back.key is m.key and back.raw is m.raw and back.c == 3.0
    g = jax.jit(jax.grad(lambda v, r: mixed_loss(r(v))))(flat, rebuild)
    ref = _ref_grad(mixed_loss, m)
    want_g, _ = jax.flatten_util.ravel_pytree([getattr(ref, k) for k in _TRAINED])
    np.testing.assert_allclose(g, want_g, rtol=1e-6)
    # An integer vector keeps each array's own dtype.
    ints = rebuild(jnp.ones(flat.shape, jnp.int32))
    assert ints.b.dtype == jnp.bfloat16 and ints.h.dtype == jnp.float16


# --- abstract models (ShapeDtypeStruct leaves) --------------------------------------------


def test_setup_and_destructure_refuse_an_abstract_model():
    """Was: tg.setup gave a state with no parameters (a ShapeDtypeStruct counted as a
    leaf not trained), so tg.load into it blamed "the optimiser rule" and tg.update of
    the real model said its weights "were not floating-point"; tg.destructure gave an
    empty vector."""

    def make():
        return nn.Chain(
            nn.Dense(2, 3, key=jax.random.key(0)), nn.Dense(3, 1, key=jax.random.key(1))
        )

    abstract = jax.eval_shape(make)
    before = jax.tree_util.tree_leaves(abstract)
    with pytest.raises(
        TypeError, match=r"tg.setup: 'layers.0.weight' is a jax.ShapeDtypeStruct.*eval_shape"
    ):
        tg.setup(optax.adam(0.1), abstract)
    with pytest.raises(TypeError, match=r"tg.destructure: 'layers.0.weight' is a jax.Shape"):
        tg.destructure(abstract)
    assert all(a is b for a, b in zip(before, jax.tree_util.tree_leaves(abstract), strict=True))
    # The documented way to an abstract state still works.
    like = jax.eval_shape(lambda: tg.setup(optax.adam(0.1), make()))
    assert isinstance(like, tg.OptState)
    mu = [x for x in jax.tree_util.tree_leaves(like) if x.shape == (3, 2)]
    assert mu and all(isinstance(x, jax.ShapeDtypeStruct) for x in mu)


def test_gradient_of_an_abstract_model_is_refused_clearly():
    # A ShapeDtypeStruct is no array, so the function gets it as static data (an unused
    # one is fine: the next test); the failure it causes names it, not only "no
    # attribute T" from the user's own line.
    abstract = jax.eval_shape(lambda: nn.Dense(2, 3, key=jax.random.key(0)))
    why = (
        r"\(AttributeError: 'ShapeDtypeStruct' object has no attribute 'T'\); its argument "
        r"{} holds a jax.ShapeDtypeStruct at 'weight', which has a shape and dtype but no "
        r"values \(a model from jax.eval_shape\?\)\. Pass real arrays"
    )
    with pytest.raises(TypeError, match=r"tg\.gradient: the function failed " + why.format(0)):
        tg.gradient(lambda m: jnp.sum(m(jnp.ones(2))), abstract)
    step = tg.jit(lambda x, m: m(x))
    with pytest.raises(TypeError, match=r"tg\.jit: the function failed " + why.format(1)):
        step(jnp.ones(2), abstract)
    with pytest.raises(TypeError, match=r"tg\.jit: the function failed " + why.format("'m'")):
        step(jnp.ones(2), m=abstract)
    # Another failure of the user's own keeps its own error.
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        tg.gradient(lambda m: 1 / 0, abstract)


def test_shape_dtype_struct_leaf_is_never_a_parameter():
    d = {"w": jnp.ones(2), "s": jax.ShapeDtypeStruct((2,), jnp.int32)}
    (g,) = tg.gradient(lambda d: jnp.sum(d["w"] ** 2), d)
    assert g["s"] is None
    np.testing.assert_array_equal(g["w"], 2 * d["w"])
    assert list(tg.params(d).named()) == ["w"]
    with pytest.raises(TypeError, match=r"'s' is a jax.ShapeDtypeStruct, which holds no data"):
        tg.save(os.path.join("/nonexistent-never-written", "x"), d)


def test_params_refuses_non_differentiable_arrays_with_the_right_hint():
    with pytest.raises(
        ValueError, match=r"key<fry> scalar array is not differentiable.*random key"
    ):
        tg.params(jax.random.key(0))
    with pytest.raises(ValueError, match=r"int32\[3\] array is not differentiable.*astype"):
        tg.params(jnp.arange(3))
    ps = tg.Params([jnp.ones(2)])
    with pytest.raises(ValueError, match=r"Params.add: a key<fry> scalar array.*random key"):
        ps.add(jax.random.key(0))
    assert len(ps) == 1
    with pytest.raises(TypeError, match=r"got a float32 .*parameters are arrays"):
        tg.params(np.float32(1.0))


# --- save / load --------------------------------------------------------------------------


def _bits(x):
    return np.asarray(x).reshape(-1).view(np.uint8).tobytes()


@pytest.mark.slow
def test_save_load_every_dtype_bit_exact(tmp_path):
    rs = np.random.RandomState(0)
    tree = {}
    for name in ("bfloat16", "float16", "float32", "complex64"):
        dtype = jnp.dtype(name)
        bits = rs.randint(0, 256, size=8 * dtype.itemsize).astype(np.uint8)
        arr = bits.view(dtype)  # arbitrary bits: nan payloads, -0, inf, subnormals
        tree[name] = jnp.asarray(arr)
        tree[name + "_np"] = arr
        tree[name + "_0d"] = jnp.asarray(arr[0])
        tree[name + "_empty"] = jnp.zeros((0, 3), dtype)
    for name in ("float8_e4m3fn", "float8_e5m2", "int4", "uint4", "int8", "uint32", "bool"):
        dtype = jnp.dtype(getattr(ml_dtypes, name, None) or name)
        tree[name] = jnp.asarray(np.arange(7).astype(dtype))
    tree["weak"] = jnp.asarray(1.5)
    tree["np_scalar"] = np.float32(2.5)
    tree["py"] = 0.1
    tree["key"] = jax.random.key(5)
    tree["keys_rbg"] = jax.random.split(jax.random.key(6, impl="rbg"), 3)
    tree["raw"] = jax.random.PRNGKey(3)
    path = str(tmp_path / "ck")
    tg.save(path, tree)
    back = tg.load(path, tree)
    for k, v in tree.items():
        b = back[k]
        if k.startswith("key"):
            assert b.dtype == v.dtype and b.shape == v.shape
            assert _bits(jax.random.key_data(b)) == _bits(jax.random.key_data(v))
        elif isinstance(v, float):
            assert b == v and type(b) is float
        else:
            assert type(b) is type(v), k
            assert b.dtype == v.dtype and b.shape == v.shape, k
            assert _bits(b) == _bits(v), k
    assert back["weak"].weak_type and not back["float32_0d"].weak_type
    # Into an abstract like (jax.eval_shape): the same bits.
    abstract = tg.load(path, jax.eval_shape(lambda: {k: v for k, v in tree.items()}))
    for k in ("bfloat16", "float16", "int4", "raw"):
        assert _bits(abstract[k]) == _bits(tree[k])


@pytest.mark.slow
def test_save_load_trained_mixed_model_and_state(tmp_path):
    m = Mixed()
    opt = optax.adam(0.1)
    state = tg.setup(opt, m)
    (g,) = tg.gradient(mixed_loss, m)
    state, m = tg.update(state, m, g)
    path = str(tmp_path / "ck")
    tg.save(path, (m, state))
    m2, s2 = tg.load(path, (Mixed(), tg.setup(opt, Mixed())))
    for k in (*_TRAINED, "n", "flag", "raw"):
        _same(getattr(m2, k), getattr(m, k))
    assert _bits(jax.random.key_data(m2.key)) == _bits(jax.random.key_data(m.key))
    for a, b in zip(jax.tree_util.tree_leaves(s2), jax.tree_util.tree_leaves(state), strict=True):
        _same(a, b)
    # The loaded pair trains on exactly as the saved one does.
    (g2,) = tg.gradient(mixed_loss, m2)
    _, after_loaded = tg.update(s2, m2, g2)
    _, after = tg.update(state, m, tg.gradient(mixed_loss, m)[0])
    for k in _TRAINED:
        _same(getattr(after_loaded, k), getattr(after, k))


def test_save_refuses_float0_leaves_naming_the_path(tmp_path):
    gj = jax.grad(lambda m: jnp.sum(m["w"] * m["n"]), allow_int=True)(
        {"w": jnp.ones(2), "n": jnp.arange(2)}
    )
    path = tmp_path / "g"
    with pytest.raises(TypeError, match=r"tg.save: 'n' is an array of dtype .*float0"):
        tg.save(str(path), gj)
    assert not path.exists()


# --- float64 (x64 on only inside the block) ----------------------------------------------


@pytest.mark.slow
def test_float64_mixed_model_gradient_update_save_load(tmp_path):
    with jax.enable_x64(True):
        m = {
            "d": jnp.array([1.0, 2.0], jnp.float64),
            "f": jnp.array([1.0, 2.0], jnp.float32),
            "b": jnp.array([1.0, 2.0], jnp.bfloat16),
            "nd": np.array([0.5, 1.5]),
            "s": jnp.asarray(1.0),  # weak float64
            "i": jnp.arange(2),  # int64
        }

        def loss(m):
            return (
                jnp.sum(m["d"] ** 2)
                + jnp.sum(m["f"] * m["d"])
                + jnp.sum(m["b"] * m["f"])
                + jnp.sum(m["nd"] ** 3)
                + m["s"] * jnp.sum(m["d"])
                + jnp.sum(m["i"])
            )

        (g,) = tg.gradient(loss, m)
        ref = jax.jit(jax.grad(loss, allow_int=True))(m)
        assert g["i"] is None
        tr = [k for k in m if k != "i"]
        for k in tr:
            _same(g[k], ref[k])
        assert g["d"].dtype == jnp.float64 and g["nd"].dtype == jnp.float64
        opt = optax.adam(0.1)
        state, new = tg.update(tg.setup(opt, m), m, g)
        p = {k: m[k] for k in tr}
        want, s = jax.jit(lambda g, s, p: _apply(opt, g, s, p))(
            {k: g[k] for k in tr}, opt.init(p), p
        )
        for k in tr:
            _close(new[k], want[k])
        ours = sorted(str(x.dtype) for x in jax.tree_util.tree_leaves(state))
        assert ours == sorted(str(x.dtype) for x in jax.tree_util.tree_leaves(s))
        path = str(tmp_path / "x64")
        tg.save(path, new)
        back = tg.load(path, new)
        for k in new:
            assert back[k].dtype == new[k].dtype and _bits(back[k]) == _bits(new[k])


def test_load_of_64_bit_arrays_with_x64_off(tmp_path):
    """A 64-bit ShapeDtypeStruct in `like` with x64 off was silently truncated to 32
    bits (an int64 step 2**40 + 3 loaded as 3); now refused. As numpy it is exact."""
    with jax.enable_x64(True):
        big = {"step": jnp.asarray(2**40 + 3, jnp.int64), "w": jnp.asarray([1 + 1e-12, 2.0])}
        tg.save(str(tmp_path / "big"), big)
    assert jnp.asarray(1.0).dtype == jnp.float32  # x64 off again
    exact = tg.load(str(tmp_path / "big"), {"step": np.int64(0), "w": np.zeros(2)})
    assert int(exact["step"]) == 2**40 + 3 and exact["w"][0] == 1 + 1e-12
    like = {
        "step": jax.ShapeDtypeStruct((), np.int64),
        "w": jax.ShapeDtypeStruct((2,), np.float64),
    }
    with pytest.raises(
        ValueError, match=r"tg.load: 'step' is int64\[\] in `like`.*jax_enable_x64.*int32"
    ):
        tg.load(str(tmp_path / "big"), like)
    assert like["step"].dtype == np.int64
    with pytest.raises(ValueError, match=r"'step' is int32\[\] in the model but int64\[\]"):
        tg.load(str(tmp_path / "big"), {"step": jnp.int32(0), "w": jnp.zeros(2)})


def test_x64_toggle_does_not_reuse_programs_across_modes():
    x = jnp.ones(3, jnp.float32)

    def f(x):
        return jnp.sum(x.astype(jnp.float64) * 0.1)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # float64 requested with x64 off
            v, (g,) = tg.withgradient(f, x)
            j = tg.jit(f)(x)
            vi = tg.withgradient(lambda: f(x), tg.params({"x": x}))[0]
        return v.dtype, g.dtype, j.dtype, vi.dtype

    assert run() == (jnp.float32,) * 4
    with jax.enable_x64(True):
        assert run() == (jnp.float64, jnp.float32, jnp.float64, jnp.float64)
    assert run() == (jnp.float32,) * 4
