"""Hunt: which inputs get `None` from the backward pass (gradient, pullback,
jacobian, hessian), checked against jax.grad / jax.vjp / jax.jacrev / jax.jacfwd.

`None` is right only where jax's result is zero by construction; a `None` where
jax gives a non-zero value is a silent wrong result.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg

# The default run stays under 3 minutes; CI runs this file in the slow run.
pytestmark = pytest.mark.slow

X = jnp.array([1.0, 2.0])
Y = jnp.array([3.0, -1.0])
ONES = jnp.ones(2)


def close(a, b, tol=1e-5):
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a.astype(np.complex128), b.astype(np.complex128), rtol=tol, atol=tol)


def same_or_none(got, ref, tol=1e-5):
    """`got` equals jax's `ref`; a None in `got` is allowed only where `ref` is all zero."""
    if got is None:
        assert not np.any(np.asarray(ref)), f"None where jax gives {ref}"
    else:
        close(got, ref, tol)


def vjp_ref(f, args, dy):
    return jax.vjp(f, *args)[1](dy)


# --- custom rules -------------------------------------------------------------


@jax.custom_vjp
def _const_rule(x, y):
    return x * y


_const_rule.defvjp(lambda x, y: (x * y, (x, y)), lambda r, g: (jnp.ones_like(r[0]), None))


@jax.custom_vjp
def _ste(x):
    return jnp.round(x)


_ste.defvjp(lambda x: (jnp.round(x), None), lambda r, g: (g,))


@jax.custom_vjp
def _zero_rule(x, y):
    return x + y


_zero_rule.defvjp(lambda x, y: (x + y, None), lambda r, g: (g, jnp.zeros_like(g)))


@jax.custom_vjp
def _residual_rule(x, y):
    return x


_residual_rule.defvjp(lambda x, y: (x, y), lambda r, g: (g, r * 2))


@jax.custom_vjp
def _const_for_ignored(x, y):
    return x


_const_for_ignored.defvjp(lambda x, y: (x, None), lambda r, g: (g, jnp.full_like(g, 0.5)))


@jax.custom_jvp
def _jvp_ignored(x, y):
    return x


@_jvp_ignored.defjvp
def _jvp_ignored_rule(primals, tangents):
    x, y = primals
    dx, dy = tangents
    return x, dx + dy * y


def _scan_fn(x, y):
    def body(c, t):
        return c * t + y, None

    return jax.lax.scan(body, x, jnp.arange(3.0))[0]


CASES = {
    "plain": lambda x, y: jnp.sin(x) * y,
    "unused": lambda x, y: x * 2.0,
    "stop_gradient": lambda x, y: x * jax.lax.stop_gradient(y),
    "cond_static_branch": lambda x, y: jax.lax.cond(x[0] > 0, lambda: x * 2, lambda: x * y),
    "switch": lambda x, y: jax.lax.switch(1, [lambda: x, lambda: y * x, lambda: y]),
    "scan": _scan_fn,
    "fori": lambda x, y: jax.lax.fori_loop(0, 3, lambda i, c: c * y, x),
    "map": lambda x, y: jax.lax.map(lambda t: t[0] * t[1], (x, y)),
    "remat": jax.checkpoint(lambda x, y: jnp.sin(x) * y),
    "remat_sg": jax.checkpoint(lambda x, y: jnp.sin(x) * jax.lax.stop_gradient(y)),
    "nested_jit": jax.jit(lambda x, y: jax.jit(lambda a: a * 3)(x) + jax.jit(jnp.cos)(y) * 0),
    "jit_sg": jax.jit(lambda x, y: jnp.sin(x) * jax.lax.stop_gradient(y)),
    "cvjp_const_none": lambda x, y: _const_rule(x, y),
    "cvjp_zero_rule": lambda x, y: _zero_rule(x, y),
    "cvjp_residual": lambda x, y: _residual_rule(x, y),
    "cvjp_const_ignored": lambda x, y: _const_for_ignored(x, y),
    "cvjp_ste": lambda x, y: _ste(x) + y,
    "cjvp_ignored": lambda x, y: _jvp_ignored(x, y),
    "zero_times": lambda x, y: x + 0.0 * y,
    "where": lambda x, y: jnp.where(x > 1.5, x, y),
}

# Which inputs must be None (zero by construction in jax's backward pass).
EXPECT_NONE = {
    "unused": (False, True),
    "stop_gradient": (False, True),
    "remat_sg": (False, True),
    "jit_sg": (False, True),
    "cvjp_const_none": (False, True),
    "cvjp_zero_rule": (False, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pullback_matches_vjp(name):
    f = CASES[name]
    y, back = tg.pullback(f, X, Y)
    close(y, f(X, Y))
    dy = jnp.array([1.0, -2.0])
    got = back(dy)
    ref = vjp_ref(f, (X, Y), dy)
    for g, r in zip(got, ref, strict=True):
        same_or_none(g, r)
    want = EXPECT_NONE.get(name, (False, False))
    assert tuple(g is None for g in got) == want
    # called twice, with another cotangent (a constant rule is not linear in dy)
    got2 = back(2 * dy)
    ref2 = vjp_ref(f, (X, Y), 2 * dy)
    for g, g2, r2 in zip(got, got2, ref2, strict=True):
        assert (g is None) == (g2 is None)
        same_or_none(g2, r2)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
@pytest.mark.parametrize("name", sorted(CASES))
def test_jacobian_matches_jacrev(name):
    f = CASES[name]
    got = tg.jacobian(f, X, Y)
    ref = jax.jacrev(f, argnums=(0, 1))(X, Y)
    for g, r in zip(got, ref, strict=True):
        same_or_none(g, r)
    assert tuple(g is None for g in got) == EXPECT_NONE.get(name, (False, False))


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_grad(name):
    f = CASES[name]

    def loss(x, y):
        return jnp.sum(f(x, y) * jnp.array([1.0, 3.0]))

    got = tg.gradient(loss, X, Y)
    ref = jax.grad(loss, argnums=(0, 1))(X, Y)
    for g, r in zip(got, ref, strict=True):
        same_or_none(g, r)
    assert tuple(g is None for g in got) == EXPECT_NONE.get(name, (False, False))
    # back(1.0) of a scalar function is its gradient, None included
    _, back = tg.pullback(loss, X, Y)
    pb = back(1.0)
    assert tuple(g is None for g in pb) == tuple(g is None for g in got)
    for g, p in zip(got, pb, strict=True):
        if g is not None:
            close(p, g)


@pytest.mark.parametrize("name", ["plain", "stop_gradient", "cvjp_residual", "cvjp_const_none"])
def test_implicit_forms_match_explicit(name):
    f = CASES[name]
    w = jnp.array([1.0, 2.0])
    b = jnp.array([3.0, -1.0])
    ps = tg.Params([w, b])
    dy = jnp.array([1.0, -2.0])
    _, back = tg.pullback(lambda: f(w, b), ps)
    g = back(dy)
    ref = vjp_ref(f, (w, b), dy)
    want = EXPECT_NONE.get(name, (False, False))
    assert (g[w] is None, g[b] is None) == want
    same_or_none(g[w], ref[0])
    same_or_none(g[b], ref[1])
    J = tg.jacobian(lambda: f(w, b), ps)
    jref = jax.jacrev(f, argnums=(0, 1))(w, b)
    assert (J[w] is None, J[b] is None) == want
    same_or_none(J[w], jref[0])
    same_or_none(J[b], jref[1])


def test_hessian_custom_jvp_ignored_value():
    # The value ignores y but the rule's tangent is dy * y: d2/dy2 = 1.
    def f(x, y):
        return _jvp_ignored(x, y)

    hx, hy = tg.hessian(f, jnp.array(2.0), jnp.array(3.0))
    close(hy, jax.hessian(f, argnums=1)(jnp.array(2.0), jnp.array(3.0)))
    close(hx, 0.0)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit])
def test_hessian_custom_rules_vs_jax(wrap):
    # value ignores y; the rules give y a derivative that depends on y
    for rule in (_residual_rule, _jvp_ignored):
        f = wrap(lambda x, y, rule=rule: jnp.sum(rule(x, y) ** 2))
        got = tg.hessian(f, X, Y)
        for k in (0, 1):
            same_or_none(got[k], jax.hessian(f, argnums=k)(X, Y))


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_hessian_tree_int_and_tied_leaves():
    def f(d):
        return jnp.sum(d["a"] ** 3 * d["n"]) + jnp.sum(d["b"] * d["a"])

    d = {"a": X, "b": Y, "n": jnp.array(2)}
    (H,) = tg.hessian(f, d)
    ref = jax.hessian(lambda a, b: f({"a": a, "b": b, "n": jnp.array(2)}), argnums=(0, 1))(X, Y)
    close(H["a"]["a"], ref[0][0])
    close(H["a"]["b"], ref[0][1])
    close(H["b"]["a"], ref[1][0])
    close(H["b"]["b"], ref[1][1])
    assert H["n"] is None and H["a"]["n"] is None
    # tied: the block at the first place only
    (Ht,) = tg.hessian(lambda t: jnp.sum(t["p"] * t["q"] ** 2), {"p": X, "q": X})
    close(Ht["p"]["p"], jax.hessian(lambda a: jnp.sum(a**3))(X))
    assert Ht["q"] is None and Ht["p"]["q"] is None


def test_hessian_stop_gradient_and_unused():
    def f(x, y, z):
        return jnp.sum(x**3 * jax.lax.stop_gradient(y))

    hx, hy, hz = tg.hessian(f, X, Y, Y)
    close(hx, jax.hessian(f)(X, Y, Y))
    same_or_none(hy, jax.hessian(f, argnums=1)(X, Y, Y))
    assert hz is None


def test_tied_in_one_tree_and_as_two_args():
    f = lambda d: d["a"] * d["b"] ** 2
    (g,) = tg.pullback(f, {"a": X, "b": X})[1](ONES)
    close(g["a"], jax.vjp(lambda a: a * a**2, X)[1](ONES)[0])
    assert g["b"] is None
    (J,) = tg.jacobian(f, {"a": X, "b": X})
    close(J["a"], jax.jacrev(lambda a: a * a**2)(X))
    assert J["b"] is None
    ga, gb = tg.pullback(lambda a, b: a * b**2, X, X)[1](ONES)
    ra, rb = jax.vjp(lambda a, b: a * b**2, X, X)[1](ONES)
    close(ga, ra)
    close(gb, rb)


def test_mixed_leaves_and_static_data():
    t = {"w": X, "n": 3, "s": "a", "z": None, "i": jnp.array([1, 2]), "f": 0.5}

    def f(t):
        return t["w"] * t["n"] * t["f"] * t["i"] if t["s"] == "a" else t["w"]

    y, back = tg.pullback(f, t)
    close(y, f(t))
    (g,) = back(ONES)
    close(g["w"], 3 * 0.5 * jnp.array([1.0, 2.0]))
    assert g["n"] is None and g["s"] is None and g["z"] is None and g["i"] is None
    assert g["f"] is None
    (J,) = tg.jacobian(f, t)
    close(J["w"], jnp.diag(1.5 * jnp.array([1.0, 2.0])))
    assert J["i"] is None


def test_integer_input_and_int_bool_outputs():
    n = jnp.array([1, 2])
    ga, gn = tg.pullback(lambda a, k: a * k, X, n)[1](ONES)
    close(ga, jnp.array([1.0, 2.0]))
    assert gn is None
    y, back = tg.pullback(lambda a: (a * 2, a > 1, jnp.int32(3)), X)
    assert y[1].dtype == jnp.bool_ and int(y[2]) == 3
    (g,) = back((jnp.array([1.0, 5.0]), None, None))
    close(g, jnp.array([2.0, 10.0]))
    with pytest.raises(TypeError, match=r"tg\.jacobian.*bool.*astype"):
        tg.jacobian(lambda a: a > 1, X)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_low_precision(dt):
    x = X.astype(dt)
    f = lambda a: jnp.sin(a) * a
    (J,) = tg.jacobian(f, x)
    ref = jax.jacrev(f)(x)
    assert J.dtype == ref.dtype
    close(J, ref, tol=2e-2)
    _, back = tg.pullback(f, x)
    (g,) = back(jnp.ones(2, jnp.float32))  # another floating dtype: cast
    assert g.dtype == dt
    close(g, jax.vjp(f, x)[1](jnp.ones(2, dt))[0], tol=2e-2)
    # f32 input, low-precision output
    (J2,) = tg.jacobian(lambda a: (a**2).astype(dt), X)
    close(J2, jax.jacrev(lambda a: (a**2).astype(dt))(X), tol=2e-2)


def test_complex_pullback_and_jacobian_conventions():
    z = jnp.array([1 + 2j, 3 - 1j])
    f = lambda z: jnp.abs(z) ** 2
    (J,) = tg.jacobian(f, z)
    close(J, jnp.conj(jax.jacrev(f)(z)))  # steepest ascent: jax's conjugate
    _, back = tg.pullback(lambda z: z**2, z)
    dy = jnp.array([1 - 1j, 2j])
    (g,) = back(dy)
    close(g, jnp.conj(jax.vjp(lambda z: z**2, z)[1](jnp.conj(dy))[0]))
    # complex output of real inputs: dy/dx
    g2 = lambda x, y: jnp.sin(x) * (1 + 2j) + y * 0
    Jx, Jy = tg.jacobian(g2, X, Y)
    rx, ry = jax.jacfwd(g2, argnums=(0, 1))(X, Y)
    close(Jx, rx)
    same_or_none(Jy, ry)
    with pytest.raises(ValueError, match=r"dtype complex64.*float32.*astype"):
        tg.pullback(lambda a: a * 2, X)[1](jnp.ones(2, jnp.complex64))
    with pytest.raises(TypeError, match=r"complex.*real and imaginary"):
        tg.hessian(lambda z: jnp.sum(jnp.abs(z) ** 2), z)
    with pytest.raises(TypeError, match=r"complex input.*holomorphic"):
        tg.jacobian(lambda z: z**2, z)


def test_zero_size_inputs_and_outputs():
    e = jnp.zeros((0,))
    f = lambda a, b: jnp.sum(a) + b
    Ja, Jb = tg.jacobian(f, e, Y)
    ra, rb = jax.jacrev(f, argnums=(0, 1))(e, Y)
    assert Ja is None or Ja.shape == ra.shape
    close(Jb, rb)
    ga, gb = tg.pullback(f, e, Y)[1](ONES)
    assert ga is None or ga.shape == (0,)
    close(gb, ONES)
    (J0,) = tg.jacobian(lambda a: a[:0] * 2, X)
    assert J0.shape == (0, 2)
    y, back = tg.pullback(lambda a: (a[:0], jnp.sum(a)), X)
    assert y[0].shape == (0,)
    (g,) = back((jnp.zeros((0,)), 2.0))
    close(g, 2 * ONES)
    (J,) = tg.jacobian(lambda a: jnp.sum(a**2), X)  # scalar output
    close(J, 2 * X)


def test_dict_tuple_outputs_and_none_leaves():
    f = lambda a, b: {"u": a * 2, "v": (b**2, jnp.sum(a * b)), "s": "tag"}
    y, back = tg.pullback(f, X, Y)
    assert y["s"] == "tag"
    dy = {"u": jnp.array([1.0, 2.0]), "v": (None, 3.0), "s": "tag"}
    ga, gb = back(dy)
    ref = jax.vjp(lambda a, b: (a * 2, b**2, jnp.sum(a * b)), X, Y)[1](
        (dy["u"], jnp.zeros(2), jnp.array(3.0))
    )
    close(ga, ref[0])
    close(gb, ref[1])
    assert back(None) == (None, None)
    assert back({"u": None, "v": (None, None), "s": "tag"}) == (None, None)
    with pytest.raises(ValueError, match=r"structure of the output"):
        back(jnp.ones(2))
    with pytest.raises(ValueError, match=r"dy 0 has shape \(3,\).*shape \(2,\)"):
        back({"u": jnp.ones(3), "v": (None, 1.0), "s": "tag"})


def test_dy_dtypes():
    _, back = tg.pullback(lambda a: a * 2, X)
    (g,) = back(np.ones(2, np.float64))
    assert g.dtype == jnp.float32
    close(g, 2 * ONES)
    (g16,) = tg.pullback(lambda a: a * 2, X.astype(jnp.float16))[1](jnp.ones(2))
    assert g16.dtype == jnp.float16
    _, sback = tg.pullback(lambda a: jnp.sum(a * 3), X)
    close(sback(1)[0], 3 * ONES)
    close(sback(np.float64(2.0))[0], 6 * ONES)


def test_back_through_jit_and_vmap():
    f = lambda a, b: jnp.sin(a) * jax.lax.stop_gradient(b)
    y, back = jax.jit(lambda a, b: tg.pullback(f, a, b))(X, Y)
    close(y, f(X, Y))
    ga, gb = back(ONES)
    close(ga, jnp.cos(X) * Y)
    assert gb is None
    ga2, _ = jax.jit(lambda bk, d: bk(d))(back, 2 * ONES)
    close(ga2, 2 * ga)
    # vmap over dy: the Jacobian's rows
    _, b2 = tg.pullback(jnp.sin, X)
    (rows,) = jax.vmap(b2)(jnp.eye(2))
    close(rows, jax.jacrev(jnp.sin)(X))
    # vmap around pullback / jacobian
    got = jax.vmap(lambda a, b: tg.pullback(f, a, b)[1](1.0))(X, Y)
    close(got[0], jnp.cos(X) * Y)
    assert got[1] is None
    Jv = jax.vmap(lambda a, b: tg.jacobian(lambda p, q: p * jnp.sin(q), a, b))(X, Y)
    close(Jv[0], jnp.sin(Y))
    close(Jv[1], X * jnp.cos(Y))
    Jj = jax.jit(lambda a, b: tg.jacobian(lambda p, q: p * q, a, b))(X, Y)
    close(Jj[1], jnp.diag(X))


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_grad_around_pullback_and_jacobian():
    def outer(x, y):
        return jnp.sum(tg.pullback(lambda a, b: jnp.sum(a * b**2), x, y)[1](1.0)[1])

    def outer_ref(x, y):
        return jnp.sum(jax.vjp(lambda a, b: jnp.sum(a * b**2), x, y)[1](1.0)[1])

    for k in (0, 1):
        close(jax.grad(outer, argnums=k)(X, Y), jax.grad(outer_ref, argnums=k)(X, Y))

    def outer_j(x, y):
        return jnp.sum(tg.jacobian(lambda a, b: a * b**2, x, y)[1])

    def outer_j_ref(x, y):
        return jnp.sum(jax.jacrev(lambda a, b: a * b**2, argnums=1)(x, y))

    for k in (0, 1):
        close(jax.grad(outer_j, argnums=k)(X, Y), jax.grad(outer_j_ref, argnums=k)(X, Y))
    # around an inner None (stop_gradient) and a custom rule of residuals, as jax does
    for inner in (CASES["stop_gradient"], CASES["cvjp_residual"], CASES["cvjp_const_ignored"]):

        def outer_sg(x, y, inner=inner):
            g = tg.pullback(inner, x, y)[1](ONES)
            return sum(jnp.sum(jnp.sin(t)) for t in g if t is not None)

        def outer_sg_ref(x, y, inner=inner):
            return sum(jnp.sum(jnp.sin(t)) for t in jax.vjp(inner, x, y)[1](ONES))

        for k in (0, 1):
            close(jax.grad(outer_sg, argnums=k)(X, Y), jax.grad(outer_sg_ref, argnums=k)(X, Y))


_FLAG = {"use": False}


def _flag_f(x, y):
    return x * y if _flag_f_use() else x * 2.0


def _flag_f_use():
    return _FLAG["use"]


@pytest.mark.parametrize("api", ["pullback", "jacobian", "gradient", "implicit"])
@pytest.mark.parametrize("order", [(False, True, False), (True, False, True)])
def test_cache_hit_after_input_flips_used_unused(api, order):
    w = jnp.array([1.0, 2.0])
    b = jnp.array([3.0, -1.0])
    ps = tg.Params([w, b])
    for use in order:
        _FLAG["use"] = use
        if api == "pullback":
            got = tg.pullback(_flag_f, w, b)[1](ONES)
            ref = vjp_ref(_flag_f, (w, b), ONES)
        elif api == "jacobian":
            got = tg.jacobian(_flag_f, w, b)
            ref = jax.jacrev(_flag_f, argnums=(0, 1))(w, b)
        elif api == "gradient":
            got = tg.gradient(lambda a, c: jnp.sum(_flag_f(a, c)), w, b)
            ref = jax.grad(lambda a, c: jnp.sum(_flag_f(a, c)), argnums=(0, 1))(w, b)
        else:
            g = tg.pullback(lambda: _flag_f(w, b), ps)[1](ONES)
            got = (g[w], g[b])
            ref = vjp_ref(_flag_f, (w, b), ONES)
        same_or_none(got[0], ref[0])
        same_or_none(got[1], ref[1])
        assert (got[1] is None) == (not use)
    _FLAG["use"] = False


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match=r"tg\.jacobian"):
        tg.gradient(lambda a: a * 2, X)
    with pytest.raises(TypeError, match=r"one array.*jnp\.stack"):
        tg.jacobian(lambda a: {"u": a}, X)
    with pytest.raises(TypeError, match=r"tg\.Params|explicit"):
        tg.hessian(lambda: jnp.sum(X), tg.Params([X]))


# --- found by this hunt (silent wrong results, now fixed) -------------------------


def test_complex_jacobian_custom_jvp_ignored_input():
    # jax.jacfwd uses the rule's tangent dy * y: the Jacobian in y is (1+1j) * y.
    # tg.jacobian read which inputs are used from the primal value (x only) and
    # gave None for y; it reads them from the linearised function now.
    def f(x, y):
        return _jvp_ignored(x, y) * (1 + 1j)

    got = tg.jacobian(f, X, Y)
    ref = jax.jacfwd(f, argnums=(0, 1))(X, Y)
    assert got[1] is not None
    close(got[1], ref[1])


def test_complex_jacobian_stop_gradient_is_not_none():
    # Real output: None (zero by construction); complex output: was an array of zeros.
    Jr = tg.jacobian(lambda x, y: x * jax.lax.stop_gradient(y), X, Y)
    assert Jr[1] is None
    Jc = tg.jacobian(lambda x, y: (x + jax.lax.stop_gradient(y)) * (1 + 1j), X, Y)
    assert Jc[1] is None


_RULE_SCALE = 2.0


@jax.custom_vjp
def _scaled_rule(x):
    return x


_scaled_rule.defvjp(lambda x: (x, None), lambda r, g: (g * _RULE_SCALE,))


def test_custom_vjp_rule_global_number_stale():
    global _RULE_SCALE
    try:
        for s in (2.0, 5.0):
            _RULE_SCALE = s
            ref = jax.grad(lambda a: jnp.sum(_scaled_rule(a)))(X)
            close(ref, s * ONES)
            close(tg.gradient(lambda a: jnp.sum(_scaled_rule(a)), X)[0], ref)
            close(tg.pullback(_scaled_rule, X)[1](ONES)[0], ref)
    finally:
        _RULE_SCALE = 2.0


_PASS = {"on": False}


@jax.custom_vjp
def _gated(x, y):
    return x


def _gated_bwd(r, g):
    return g, (g * 2 if _PASS["on"] else jnp.zeros_like(g))


_gated.defvjp(lambda x, y: (x, None), _gated_bwd)


def test_custom_vjp_rule_flag_flips_unused_to_used():
    # First call: the rule gives y zeros (None). After the flag flips the rule
    # gives y 2*g; the cached program answered None (the rules were not walked).
    try:
        for on in (False, True):
            _PASS["on"] = on
            ref = vjp_ref(_gated, (X, Y), ONES)
            got = tg.pullback(_gated, X, Y)[1](ONES)
            same_or_none(got[1], ref[1])
    finally:
        _PASS["on"] = False


_RULE_ARRAY = jnp.array(2.0)


@jax.custom_vjp
def _array_rule(x):
    return x


_array_rule.defvjp(lambda x: (x, None), lambda r, g: (g * _RULE_ARRAY,))


def test_pullback_custom_vjp_rule_global_array_stale():
    # tg.gradient noticed the array (RetraceWarning, re-traced, fresh); tg.pullback
    # kept the first array's value. The rule is walked now (the array an input, no
    # re-trace, no warning) and back(dy) runs the backward pass traced with it.
    global _RULE_ARRAY
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tg.RetraceWarning)
            for s in (2.0, 5.0):
                _RULE_ARRAY = jnp.array(s)
                ref = jax.vjp(_array_rule, X)[1](ONES)[0]
                close(ref, s * ONES)
                close(tg.gradient(lambda a: jnp.sum(_array_rule(a)), X)[0], ref)
                close(tg.pullback(_array_rule, X)[1](ONES)[0], ref)
    finally:
        _RULE_ARRAY = jnp.array(2.0)
