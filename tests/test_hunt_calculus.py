"""Hostile-user hunt: the calculus front ends and how they compose.

Hunts silent wrong results and unclear errors in `tg.pullback` (several, pytree,
Module, static and integer outputs; `back` called twice; cotangents of the wrong
structure, shape or dtype; `None` parts; complex outputs), `tg.jacobian` and
`tg.hessian` (pytrees, Modules, several and integer arguments, ties, 0-d and
empty arrays, complex), `tg.withgradient`'s auxiliary outputs, the transforms
called inside `jax.jit`, `jax.vmap`, `jax.grad`/`jax.jvp`, `lax.scan`,
`lax.cond` and `jax.checkpoint`, functions holding `custom_vjp`/`custom_jvp`,
`stop_gradient`, `pure_callback` and the `jnp.where` NaN trap, implicit mode
under `jax.jit`/`jax.vmap`, gradients of gradient norms, `tg.destructure`, and
the losses of `treegrad.losses` on edge cases.

Every value is compared with an independent reference: jax.grad / jax.vjp /
jax.jacrev / jax.jacfwd / jax.hessian, optax, finite differences or a closed
form. Bugs found are kept as strict xfails (`test_bug_*`) asserting the correct
behaviour.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treegrad as tg
from treegrad import nn

from .helpers import assert_trees_close, mse

# The default run stays under 3 minutes; CI runs this file in the slow run.
pytestmark = pytest.mark.slow

X = jnp.array([0.5, -1.0, 2.0])
W = jnp.array([1.0, 2.0, 3.0])
Z = jnp.array([1.0 + 2.0j, 3.0 - 1.0j], jnp.complex64)
S = jnp.array(0.7)
BX = jax.random.normal(jax.random.key(1), (5, 4))
BY = jax.random.normal(jax.random.key(2), (5, 1))


def wavy(v):
    return jnp.sum(jnp.sin(v) * v**2)


def dense():
    return nn.Dense(3, 2, key=jax.random.key(0))


# ================================================================ pullback


def test_pullback_pytree_outputs_back_called_twice_equals_jax_vjp():
    f = lambda a, t: {"p": (a * t["s"], jnp.sum(a**2)), "q": [jnp.outer(a, a)]}
    t = {"s": S, "n": 4}
    y, back = tg.pullback(f, X, t)
    ry, rback = jax.vjp(lambda a, s: f(a, {"s": s, "n": 4}), X, S)
    assert_trees_close(y, ry)
    dys = [
        {"p": (jnp.array([1.0, -2.0, 0.5]), jnp.array(3.0)), "q": [jnp.ones((3, 3))]},
        {"p": (jnp.zeros(3), jnp.array(-1.0)), "q": [jnp.eye(3)]},
    ]
    first = back(dys[0])
    for dy in [*dys, dys[0]]:  # a second and a third call, and the first again
        ga, gt = back(dy)
        ra, rs = rback(dy)
        np.testing.assert_allclose(ga, ra, rtol=1e-6)
        np.testing.assert_allclose(gt["s"], rs, rtol=1e-6)
        assert gt["n"] is None
    assert_trees_close(back(dys[0]), first)


def test_pullback_module_in_module_out_equals_jax_vjp():
    d = dense()

    def f(m):
        out = nn.Dense(3, 2, key=jax.random.key(9))
        out.weight = jnp.tanh(m.weight) * 3.0
        out.bias = m.bias**2
        return out

    y, back = tg.pullback(f, d)
    ry, rback = jax.vjp(f, d)
    assert type(y) is nn.Dense and y.in_features == 3
    assert_trees_close(y, ry)
    ct = nn.Dense(3, 2, key=jax.random.key(5))
    (g,) = back(ct)
    (r,) = rback(ct)
    assert type(g) is nn.Dense and g.out_features == 2
    assert_trees_close(g, r, rtol=1e-6)
    # A gradient tree (None at the non-array places) is a valid cotangent too.
    half = nn.Dense(3, 2, key=jax.random.key(5))
    half.bias = None
    (g2,) = back(half)
    zero_bias = nn.Dense(3, 2, key=jax.random.key(5))
    zero_bias.bias = jnp.zeros_like(ct.bias)
    (r2,) = rback(zero_bias)
    assert_trees_close(g2, r2, rtol=1e-6)


def test_pullback_static_integer_and_key_outputs_take_none_cotangents():
    k = jax.random.key(3)
    f = lambda a: (a * 2.0, "tag", jnp.argmax(a), jax.random.split(k)[0], jnp.sum(a**3))
    y, back = tg.pullback(f, X)
    assert y[1] == "tag" and int(y[2]) == 2
    _, rback = jax.vjp(lambda a: (a * 2.0, jnp.sum(a**3)), X)
    dy = jnp.array([1.0, 0.5, -1.0])
    (g,) = back((dy, "tag", None, None, 2.0))
    np.testing.assert_allclose(g, rback((dy, jnp.array(2.0)))[0], rtol=1e-6)
    (g,) = back((None, None, None, None, 1.0))
    np.testing.assert_allclose(g, 3 * np.asarray(X) ** 2, rtol=1e-6)
    assert back((None, None, None, None, None)) == (None,)


@pytest.mark.parametrize(
    "dy",
    [
        [jnp.ones(3), jnp.array(1.0)],
        (jnp.ones(3),),
        (jnp.ones(3), jnp.array(1.0), jnp.array(1.0)),
        {"a": jnp.ones(3)},
        jnp.ones(3),
    ],
    ids=["list-for-tuple", "short", "long", "dict", "bare-array"],
)
def test_pullback_cotangent_of_wrong_structure_is_a_clear_error(dy):
    _, back = tg.pullback(lambda a: (a * 2.0, jnp.sum(a)), X)
    with pytest.raises(
        ValueError, match=r"tg\.pullback: the cotangent does not have the structure"
    ):
        back(dy)


def test_pullback_wrong_shape_in_one_output_names_which():
    _, back = tg.pullback(lambda a: (a * 2.0, jnp.sum(a)), X)
    with pytest.raises(
        ValueError, match=r"dy 1 has shape \(3,\) where the output 1 has shape \(\)"
    ):
        back((jnp.ones(3), jnp.ones(3)))
    with pytest.raises(ValueError, match=r"dy 0 has type list"):
        back(([1.0, 1.0, 1.0], 1.0))


@pytest.mark.parametrize("kind", ["holomorphic", "real-to-complex"])
def test_pullback_complex_output_breaks_the_chain_rule(kind):
    # Minimal: f(z) = z**2 (or x * (1+2j)), g(y) = sum|y - t|^2, both in tg's convention.
    if kind == "holomorphic":
        x, f, t = Z, lambda z: z**2, jnp.array([0.5 - 1j, 1j], jnp.complex64)
    else:
        x, f, t = X, lambda v: v * (1 + 2j), jnp.array([1j, 2.0, 0.5 + 0.5j], jnp.complex64)
    g = lambda y: jnp.sum(jnp.abs(y - t) ** 2)
    y, back = tg.pullback(f, x)
    (dy,) = tg.gradient(g, y)
    np.testing.assert_allclose(dy, np.conj(jax.grad(g)(y)), rtol=1e-6)  # tg's convention
    ref = jax.grad(lambda v: g(f(v)))(x)
    ref = np.conj(ref) if jnp.iscomplexobj(x) else ref
    np.testing.assert_allclose(tg.gradient(lambda v: g(f(v)), x)[0], ref, rtol=1e-5)
    np.testing.assert_allclose(back(dy)[0], ref, rtol=1e-5)


def test_pullback_cotangent_dtype_error_names_pullback():
    _, back = tg.pullback(lambda a: (a * 2).astype(jnp.float16), X)
    (g,) = back(jnp.ones(3, jnp.float16))
    np.testing.assert_allclose(g, [2.0, 2.0, 2.0])
    # a float32 dy for the float16 output: the same values at another precision
    (g32,) = back(jnp.ones(3, jnp.float32))
    np.testing.assert_allclose(g32, [2.0, 2.0, 2.0])
    with pytest.raises(
        ValueError,
        match=r"tg\.pullback: the cotangent dy has dtype complex64 where the output has dtype "
        r"float16; pass dy of the output's dtype",
    ):
        back(jnp.ones(3, jnp.complex64))


def test_pullback_back_can_be_returned_from_jax_jit():
    def make(s):
        return tg.pullback(lambda w: jnp.sin(w * s), W)

    def make_ref(s):
        return jax.vjp(lambda w: jnp.sin(w * s), W)

    dy = jnp.array([1.0, -1.0, 2.0])
    np.testing.assert_allclose(jax.jit(make_ref)(S)[1](dy)[0], make_ref(S)[1](dy)[0], rtol=1e-6)
    _, back = jax.jit(make)(S)
    np.testing.assert_allclose(back(dy)[0], make_ref(S)[1](dy)[0], rtol=1e-6)


def test_pullback_back_after_the_model_changed_uses_the_old_point():
    d = dense()
    w0 = d.weight
    f = lambda m: jnp.tanh(m(X))
    _, back = tg.pullback(f, d)
    _, rback = jax.vjp(f, d)
    d.weight = w0 * 5.0  # rebinding after the call: back keeps the old residuals
    assert_trees_close(back(jnp.ones(2))[0], rback(jnp.ones(2))[0], rtol=1e-6)
    d.weight = w0
    _, back = tg.pullback(lambda: f(d), tg.params(d))
    d.weight = w0 * 3.0
    g = back(jnp.ones(2))
    np.testing.assert_allclose(g[w0], rback(jnp.ones(2))[0].weight, rtol=1e-6)
    with pytest.raises(KeyError, match=r"not a registered parameter.*may have been replaced"):
        g[d.weight]


def test_implicit_jacobian_and_pullback_under_jit_and_vmap_match_jax():
    b = jnp.array(0.5)
    ps = tg.Params([W, b])
    f = lambda w, b, x: jnp.tanh(w * x + b)
    J = tg.jacobian(lambda: f(W, b, X), ps)
    rw, rb = jax.jacrev(f, argnums=(0, 1))(W, b, X)
    np.testing.assert_allclose(J[W], rw, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(J[b], rb, rtol=1e-5, atol=1e-7)
    got = jax.jit(lambda x: tg.jacobian(lambda: f(W, b, x), ps)[W])(X)
    np.testing.assert_allclose(got, rw, rtol=1e-5, atol=1e-7)
    xs = jnp.stack([X, 2 * X])
    got = jax.vmap(lambda x: tg.pullback(lambda: f(W, b, x), ps)[1](jnp.ones(3))[W])(xs)
    ref = jax.vmap(lambda x: jax.vjp(lambda w: f(w, b, x), W)[1](jnp.ones(3))[0])(xs)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match=r"tg\.hessian takes explicit arguments.*not a tg\.Params"):
        tg.hessian(lambda: jnp.sum(W**2), ps)


def test_back_composes_with_jax_transforms_and_gives_hessian_vector_products():
    v = jnp.array([1.0, 0.5, -1.0])
    _, hvp = tg.pullback(lambda a: tg.gradient(wavy, a)[0], X)
    x = np.asarray(X, np.float64)  # (sin x x^2)'' = (2 - x^2) sin x + 4 x cos x
    np.testing.assert_allclose(
        hvp(v)[0], ((2 - x**2) * np.sin(x) + 4 * x * np.cos(x)) * v, rtol=1e-5
    )
    _, back = tg.pullback(jnp.sin, X)
    np.testing.assert_allclose(jax.vmap(lambda dy: back(dy)[0])(jnp.eye(3)), jnp.diag(jnp.cos(X)))
    np.testing.assert_allclose(jax.grad(lambda dy: jnp.sum(back(dy)[0]))(v), jnp.cos(X))


def _check_pullback_linear(shape, seed, a, b):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, tuple(shape))
    f = lambda v: (jnp.tanh(v) * 2.0, jnp.sum(v**2))
    _, back = tg.pullback(f, x)
    _, rback = jax.vjp(f, x)
    d1 = (jax.random.normal(k2, x.shape), jnp.array(a, jnp.float32))
    d2 = (jax.random.normal(k3, x.shape), jnp.array(b, jnp.float32))
    mix = jax.tree_util.tree_map(lambda u, v: a * u + b * v, d1, d2)
    (g1,), (g2,), (gm,) = back(d1), back(d2), back(mix)
    np.testing.assert_allclose(g1, rback(d1)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gm, a * g1 + b * g2, rtol=1e-4, atol=1e-4)


def test_pullback_is_linear_in_dy_and_equals_jax_vjp():
    _check_pullback_linear((2, 3), 0, 1.5, -0.5)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=2),
    st.integers(0, 2**16),
    st.floats(-3, 3),
    st.floats(-3, 3),
)
def test_pullback_is_linear_in_dy_and_equals_jax_vjp_random(shape, seed, a, b):
    _check_pullback_linear(shape, seed, a, b)


# ================================================================ jacobian, hessian


def test_jacobian_of_a_module_and_an_array_against_jacrev():
    d = dense()
    f = lambda m, x: jnp.tanh(m(x))
    jm, jx = tg.jacobian(f, d, X)
    rm, rx = jax.jacrev(f, argnums=(0, 1))(d, X)
    assert type(jm) is nn.Dense and jm.in_features == 3 and jm.activation is None
    assert jm.weight.shape == (2, 2, 3) and jm.bias.shape == (2, 2)
    assert_trees_close(jm, rm, rtol=1e-6)
    np.testing.assert_allclose(jx, rx, rtol=1e-6)


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_hessian_of_a_module_and_an_array_against_jax_hessian():
    d = dense()
    loss = lambda m, x: jnp.sum(jnp.tanh(m(x)) ** 2)
    hm, hx = tg.hessian(loss, d, X)
    rm = jax.hessian(loss, 0)(d, X)
    assert type(hm) is nn.Dense and type(hm.weight) is nn.Dense
    assert_trees_close(hm, rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hx, jax.hessian(loss, 1)(d, X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "f, x",
    [
        pytest.param(lambda a: a * 2.0, jnp.array(1.5), marks=pytest.mark.slow),
        (lambda a: jnp.stack([a, a**2, jnp.sin(a)]), jnp.array(0.4)),
        pytest.param(lambda a: jnp.sum(a**2), X, marks=pytest.mark.slow),
        (lambda a: a * 2.0, jnp.zeros((0,))),
        (lambda a: a[:0] * 2.0, X),
        pytest.param(lambda a: jnp.outer(a, a), X, marks=pytest.mark.slow),
        pytest.param(lambda a: a.T @ a, jnp.arange(6.0).reshape(3, 2), marks=pytest.mark.slow),
        pytest.param(lambda a: a * 2.0, jnp.zeros((0, 2)), marks=pytest.mark.slow),
    ],
    ids=["0d-0d", "0d-1d", "1d-0d", "empty-in", "empty-out", "outer", "2d-2d", "empty-2d"],
)
def test_jacobian_edge_shapes_against_jacrev(f, x):
    (J,) = tg.jacobian(f, x)
    ref = jax.jacrev(f)(x)
    assert J.shape == ref.shape
    np.testing.assert_allclose(J, ref, rtol=1e-6)


def test_jacobian_integer_arguments_get_none_and_pytree_outputs_are_clear_errors():
    ja, jn, jp = tg.jacobian(lambda a, n, p: a * n * p, X, jnp.array([1, 2, 3]), 2)
    np.testing.assert_allclose(ja, np.diag([2.0, 4.0, 6.0]))
    assert jn is None and jp is None
    assert tg.jacobian(lambda n: n * 2.0, jnp.arange(3)) == (None,)
    for out, name in [
        (lambda a: (a, a), "tuple"),
        (lambda a: {"u": a}, "dict"),
        (lambda a: [a], "list"),
        (lambda a: 1.0, "float"),
    ]:
        with pytest.raises(TypeError, match=rf"tg\.jacobian: .*one array, got {name}.*jnp\.stack"):
            tg.jacobian(out, X)


@pytest.mark.parametrize(
    "f",
    [lambda a: (a > 0).astype(jnp.int32), lambda a: a > 0],
    ids=["int-output", "bool-output"],
)
def test_jacobian_of_integer_output_error_names_jacobian(f):
    with pytest.raises(TypeError, match=r"tg\.jacobian.*(int32|bool)"):
        tg.jacobian(f, X)


def test_jacobian_of_complex_output_as_advised_by_gradient():
    f = lambda a: a * (1.0 + 2.0j)
    with pytest.raises(TypeError, match=r"tg\.jacobian for a complex output"):
        tg.gradient(lambda a: jnp.sum(f(a)), X)
    (J,) = tg.jacobian(f, X)  # dy/dx of a complex function of a real x: well defined
    np.testing.assert_allclose(J, jax.jacfwd(f)(X), rtol=1e-6)


def test_hessian_of_complex_parameter_error_names_hessian():
    with pytest.raises(TypeError, match=r"tg\.hessian.*complex"):
        tg.hessian(lambda z: jnp.sum(jnp.abs(z) ** 2), Z)


def test_hessian_mixed_leaves_int_and_python_args_against_closed_form():
    t = {"a": X, "b": jnp.array(2.0), "n": jnp.arange(3), "s": "x", "p": 2}
    f = lambda t, k: jnp.sum(t["a"] ** 2 * t["b"] * t["n"]) * t["p"] * k + jnp.sum(t["b"] ** 3)
    ht, hk = tg.hessian(f, t, 3)
    assert hk is None and ht["s"] is None and ht["p"] is None
    # f = 6 b sum(n a^2) + b^3: H_aa = diag(12 b n), H_ab = H_ba = 12 n a, H_bb = 6 b
    a, n = np.asarray(X), np.arange(3.0)
    ref = [[np.diag(24.0 * n), 12 * n * a], [12 * n * a, np.array(12.0)]]
    for i, ki in enumerate("ab"):
        assert ht[ki]["n"] is None and ht[ki]["s"] is None and ht[ki]["p"] is None
        for j, kj in enumerate("ab"):
            np.testing.assert_allclose(ht[ki][kj], ref[i][j], rtol=1e-5, err_msg=ki + kj)


def test_hessian_of_a_tied_weight_is_one_block():
    t = {"a": X, "u": X}
    f = lambda t: jnp.sum(t["a"] ** 3) + jnp.sum(t["u"] ** 2)
    (g,) = tg.gradient(f, t)
    assert g["u"] is None
    np.testing.assert_allclose(g["a"], jax.grad(lambda x: jnp.sum(x**3) + jnp.sum(x**2))(X))
    (H,) = tg.hessian(f, t)
    np.testing.assert_allclose(H["a"]["a"], jax.hessian(lambda x: jnp.sum(x**3 + x**2))(X))
    assert H["a"]["u"] is None and H["u"] is None  # the later place: a row of None, as its gradient


def test_hessian_row_of_an_integer_leaf_is_none():
    t = {"a": X, "n": jnp.arange(3), "p": 2}
    (H,) = tg.hessian(lambda t: jnp.sum(t["a"] ** 3 * t["n"]) * t["p"], t)
    assert H["p"] is None
    assert H["n"] is None, H["n"]


def _check_jacobian_and_hessian_of_a_tree(sa, sb, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    t = {"a": jax.random.normal(k1, tuple(sa)), "b": [jax.random.normal(k2, tuple(sb))]}
    f = lambda t: jnp.sin(t["a"])[..., None] * jnp.sum(t["b"][0] ** 2) + jnp.sum(t["a"])
    (J,) = tg.jacobian(f, t)
    # The references compiled: run eagerly, each new shape compiled ~125 small programs.
    assert_trees_close(J, jax.jit(jax.jacrev(f))(t), rtol=1e-5, atol=1e-6)
    loss = lambda t: jnp.sum(f(t) ** 2)
    (H,) = tg.hessian(loss, t)
    assert_trees_close(H, jax.jit(jax.hessian(loss))(t), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=0, max_size=2),
    st.lists(st.integers(1, 3), min_size=0, max_size=2),
    st.integers(0, 2**16),
)
def test_jacobian_and_hessian_of_trees_match_jax_for_random_shapes(sa, sb, seed):
    _check_jacobian_and_hessian_of_a_tree(sa, sb, seed)


# ================================================================ withgradient aux


class Out(NamedTuple):
    loss: jax.Array
    pred: jax.Array
    n: int
    best: jax.Array


def test_withgradient_namedtuple_aux_keeps_its_type_and_values():
    f = lambda a: Out(jnp.sum(a**2), jnp.tanh(a), 3, jnp.argmax(a))
    value, (g,) = tg.withgradient(f, X)
    assert type(value) is Out and value.n == 3 and int(value.best) == 2
    rv, rg = jax.value_and_grad(lambda a: (f(a)[0], f(a)[1:]), has_aux=True)(X)
    np.testing.assert_allclose(value.loss, rv[0], rtol=1e-6)
    np.testing.assert_allclose(value.pred, rv[1][0], rtol=1e-6)
    np.testing.assert_allclose(g, rg, rtol=1e-6)
    # aux holding None, a Module and the input array itself
    d = dense()
    value, (g,) = tg.withgradient(lambda a: (jnp.sum(a**3), None, {"m": d}, a), X)
    assert value[1] is None and type(value[2]["m"]) is nn.Dense
    np.testing.assert_allclose(value[2]["m"].weight, d.weight)
    np.testing.assert_allclose(value[3], X)
    np.testing.assert_allclose(g, 3 * np.asarray(X) ** 2, rtol=1e-6)


@pytest.mark.parametrize(
    "f, kind",
    [
        (lambda a: {"loss": jnp.sum(a)}, "dict"),
        (lambda a: [jnp.sum(a), a], "list"),
        (lambda a: ((jnp.sum(a), a), 1), "tuple"),
    ],
    ids=["dict", "list", "nested-tuple"],
)
def test_withgradient_non_scalar_first_output_is_a_clear_error(f, kind):
    with pytest.raises(TypeError, match=rf"tg\.withgradient: .*real scalar.*returned a {kind}"):
        tg.withgradient(f, X)


def test_withgradient_with_aux_per_example_under_vmap_and_jit():
    d = dense()
    xs, ys = BX[:, :3], BY

    def one(x, y):
        return tg.withgradient(lambda m: (jnp.sum((m(x) - y) ** 2), m(x)), d)

    def one_ref(x, y):
        return jax.value_and_grad(lambda m: (jnp.sum((m(x) - y) ** 2), m(x)), has_aux=True)(d)

    (loss, pred), (g,) = jax.jit(jax.vmap(one))(xs, ys)
    (rl, rp), rg = jax.vmap(one_ref)(xs, ys)
    np.testing.assert_allclose(loss, rl, rtol=1e-5)
    np.testing.assert_allclose(pred, rp, rtol=1e-5)
    assert type(g) is nn.Dense and g.in_features == 3
    assert_trees_close(g, rg, rtol=1e-5, atol=1e-6)


# ================================================================ composition


def test_every_transform_inside_jax_jit_equals_jax_and_traces_once():
    traced = []

    def f(a):
        traced.append(1)
        return jnp.sum(jnp.sin(a) * a**2)

    @jax.jit
    def everything(a, dy):
        v, (g,) = tg.withgradient(f, a)
        _, back = tg.pullback(jnp.sin, a)
        return v, g, back(dy)[0], tg.jacobian(jnp.sin, a)[0], tg.hessian(f, a)[0]

    for k in range(3):
        a, dy = X + k, jnp.array([1.0, -2.0, 0.5]) * k
        v, g, pb, J, H = everything(a, dy)
        np.testing.assert_allclose(v, f(a), rtol=1e-6)
        np.testing.assert_allclose(g, jax.grad(f)(a), rtol=1e-6)
        np.testing.assert_allclose(pb, jax.vjp(jnp.sin, a)[1](dy)[0], rtol=1e-6)
        np.testing.assert_allclose(J, jax.jacrev(jnp.sin)(a), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(H, jax.hessian(f)(a), rtol=1e-5, atol=1e-6)
    n = len(traced)
    everything(X * 3, X)
    assert len(traced) == n, "a second call of the jitted function traced f again"


def test_new_lambdas_of_the_same_code_do_not_retrace_pullback_jacobian_hessian():
    traced = []

    def body(a):
        traced.append(1)
        return jnp.sin(a) * a

    for k in range(4):
        a = X + k
        _, back = tg.pullback(lambda v: body(v), a)
        np.testing.assert_allclose(back(X)[0], jax.vjp(body, a)[1](X)[0], rtol=1e-6)
        (J,) = tg.jacobian(lambda v: body(v), a)
        np.testing.assert_allclose(J, jax.jacrev(body)(a), rtol=1e-6, atol=1e-7)
        (H,) = tg.hessian(lambda v: jnp.sum(body(v)), a)
        np.testing.assert_allclose(H, jax.hessian(lambda v: jnp.sum(body(v)))(a), rtol=1e-5)
        if k == 0:
            first = len(traced) - 3  # the three references above traced it too
    assert len(traced) - 3 * 4 == first, "tg traced the function again for a new lambda"


def test_per_example_gradients_of_a_module_vmap_equals_vmap_of_jax_grad():
    d = dense()
    loss = lambda m, x, y: jnp.sum((m(x) - y) ** 2)
    xs, ys = BX[:, :3], jnp.concatenate([BY, -BY], axis=1)
    per = jax.jit(jax.vmap(lambda x, y: tg.gradient(loss, d, x, y)))
    ref = jax.vmap(lambda x, y: jax.grad(loss, argnums=(0, 1, 2))(d, x, y))
    (gm, gx, gy), (rm, rx, ry) = per(xs, ys), ref(xs, ys)
    assert type(gm) is nn.Dense and gm.weight.shape == (5, 2, 3)
    assert_trees_close(gm, rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gy, ry, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ensemble_vmapped_over_the_model_explicit_and_implicit():
    d = dense()
    ms = jax.tree_util.tree_map(lambda p: jnp.stack([p, -2.0 * p]), d)
    loss = lambda m, x: jnp.sum(jnp.tanh(m(x)) ** 2)
    ref = jax.vmap(lambda m: jax.grad(loss)(m, X))(ms)
    explicit = jax.vmap(lambda m: tg.gradient(loss, m, X)[0])(ms)
    implicit = jax.vmap(lambda m: tg.gradient(lambda: loss(m, X), tg.params(m)).to_tree(m))(ms)
    assert type(explicit) is nn.Dense and type(implicit) is nn.Dense
    assert_trees_close(explicit, ref, rtol=1e-5, atol=1e-6)
    assert_trees_close(implicit, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_implicit_mode_inside_jax_jit_with_a_traced_model_and_global_params():
    model = nn.Dense(4, 1, key=jax.random.key(0))

    @jax.jit
    def step(m, x, y):
        return tg.gradient(lambda: mse(m, x, y), tg.params(m)).to_tree(m)

    ref = jax.grad(mse)(model, BX, BY)
    assert_trees_close(step(model, BX, BY), ref, rtol=1e-5, atol=1e-6)
    ps = tg.Params([W])
    got = jax.jit(lambda x: tg.gradient(lambda: jnp.sum(W * x) ** 2, ps)[W])(X)
    np.testing.assert_allclose(got, 2 * jnp.sum(W * X) * X, rtol=1e-6)


def test_higher_order_jax_over_tg_and_tg_over_tg_equal_jax():
    ref_h = jax.hessian(wavy)(X)
    np.testing.assert_allclose(jax.jacfwd(lambda a: tg.gradient(wavy, a)[0])(X), ref_h, rtol=1e-5)
    np.testing.assert_allclose(jax.jacrev(lambda a: tg.gradient(wavy, a)[0])(X), ref_h, rtol=1e-5)
    np.testing.assert_allclose(
        tg.jacobian(lambda a: tg.gradient(wavy, a)[0], X)[0], ref_h, rtol=1e-5
    )
    np.testing.assert_allclose(
        jax.grad(lambda a: tg.withgradient(wavy, a)[0])(X), jax.grad(wavy)(X), rtol=1e-6
    )


@pytest.mark.slow
def test_third_order_and_jvp_over_tg_equal_jax():
    tangent = jnp.array([1.0, 0.5, -1.0])
    _, jt = jax.jvp(lambda a: tg.gradient(wavy, a)[0], (X,), (tangent,))
    np.testing.assert_allclose(jt, jax.hessian(wavy)(X) @ tangent, rtol=1e-5)
    third = jax.grad(lambda a: jnp.sum(jax.hessian(wavy)(a)))(X)
    np.testing.assert_allclose(
        tg.gradient(lambda a: jnp.sum(tg.hessian(wavy, a)[0]), X)[0], third, rtol=1e-4
    )
    np.testing.assert_allclose(
        jax.grad(lambda a: jnp.sum(tg.hessian(wavy, a)[0]))(X), third, rtol=1e-4
    )


def _small_loss(m, x):
    return jnp.sum(jnp.tanh(m["w"] * x + m["b"]) ** 2)


def _sq_norm(tree):
    return sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(tree))


def test_gradient_of_a_gradient_norm_explicit_implicit_and_mixed():
    model = {"w": W, "b": jnp.array(0.3)}
    ref = jax.grad(lambda m: _sq_norm(jax.grad(_small_loss)(m, X)))(model)
    (explicit,) = tg.gradient(lambda m: _sq_norm(tg.gradient(_small_loss, m, X)[0]), model)
    assert_trees_close(explicit, ref, rtol=1e-5, atol=1e-6)
    ps = tg.params(model)
    gnorm = lambda: _sq_norm(list(tg.gradient(lambda: _small_loss(model, X), ps).values()))
    assert_trees_close(tg.gradient(gnorm, ps).to_tree(model), ref, rtol=1e-5, atol=1e-6)
    # outer explicit, inner implicit on the argument's own Params
    inner = lambda m: tg.gradient(lambda: _small_loss(m, X), tg.params(m)).values()
    (mixed,) = tg.gradient(lambda m: _sq_norm(list(inner(m))), model)
    assert_trees_close(mixed, ref, rtol=1e-5, atol=1e-6)


def test_closure_over_an_outer_tracer_gets_its_derivative():
    f = lambda w, s: jnp.sum(jnp.sin(w * s)) ** 2
    inner = lambda s: tg.gradient(lambda w: f(w, s), W)[0]
    inner_ref = lambda s: jax.grad(lambda w: f(w, s))(W)
    np.testing.assert_allclose(
        jax.grad(lambda s: jnp.sum(inner(s)))(S),
        jax.grad(lambda s: jnp.sum(inner_ref(s)))(S),
        rtol=1e-5,
    )
    ss = jnp.array([0.7, 1.3, -0.2])
    np.testing.assert_allclose(jax.vmap(inner)(ss), jax.vmap(inner_ref)(ss), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_closure_over_an_outer_tracer_implicit_and_pullback():
    f = lambda w, s: jnp.sum(jnp.sin(w * s)) ** 2
    inner_ref = lambda s: jax.grad(lambda w: f(w, s))(W)
    ss = jnp.array([0.7, 1.3, -0.2])
    ps = tg.Params([W])
    implicit = lambda s: jnp.sum(tg.gradient(lambda: f(W, s), ps)[W])
    np.testing.assert_allclose(
        jax.grad(implicit)(S), jax.grad(lambda s: jnp.sum(inner_ref(s)))(S), rtol=1e-5
    )

    def pb(s):
        _, back = tg.pullback(lambda w: jnp.sin(w * s), W)
        return jnp.sum(back(jnp.ones(3) * s)[0])

    def pb_ref(s):
        _, back = jax.vjp(lambda w: jnp.sin(w * s), W)
        return jnp.sum(back(jnp.ones(3) * s)[0])

    np.testing.assert_allclose(jax.grad(pb)(S), jax.grad(pb_ref)(S), rtol=1e-5)
    np.testing.assert_allclose(jax.vmap(pb)(ss), jax.vmap(pb_ref)(ss), rtol=1e-5)


@pytest.mark.slow
def test_scan_cond_and_checkpoint_around_and_inside_tg():
    f = lambda w, s: jnp.sum(jnp.sin(w * s)) ** 2

    def body(c, x, grad):
        g = grad(lambda w: f(w, c))(W)
        return c + 0.01 * jnp.sum(g) * x, jnp.sum(g)

    tg_grad = lambda fn: lambda w: tg.gradient(fn, w)[0]
    xs = jnp.arange(4.0)
    got = jax.lax.scan(lambda c, x: body(c, x, tg_grad), S, xs)
    ref = jax.lax.scan(lambda c, x: body(c, x, jax.grad), S, xs)
    assert_trees_close(got, ref, rtol=1e-5)
    d_got = jax.grad(lambda s: jax.lax.scan(lambda c, x: body(c, x, tg_grad), s, xs)[0])(S)
    d_ref = jax.grad(lambda s: jax.lax.scan(lambda c, x: body(c, x, jax.grad), s, xs)[0])(S)
    np.testing.assert_allclose(d_got, d_ref, rtol=1e-5)

    def branchy(p, s, grad):
        return jax.lax.cond(
            p, lambda s: grad(lambda w: f(w, s))(W), lambda s: -grad(lambda w: f(w, s))(W), s
        )

    for p in (True, False):
        np.testing.assert_allclose(
            jax.jit(lambda p, s: branchy(p, s, tg_grad))(p, S), branchy(p, S, jax.grad), rtol=1e-5
        )
    ck = lambda s: jnp.sum(jax.checkpoint(lambda s: tg.gradient(lambda w: f(w, s), W)[0])(s))
    np.testing.assert_allclose(
        jax.grad(ck)(S), jax.grad(lambda s: jnp.sum(jax.grad(lambda w: f(w, s))(W)))(S), rtol=1e-5
    )
    inside = lambda a: (
        jnp.sum(jax.checkpoint(lambda v: jnp.sin(v) ** 2)(a))
        + jax.lax.cond(jnp.sum(a) > 0, lambda v: jnp.sum(v**2), lambda v: jnp.sum(v**3), a)
    )
    for a in (X, -X):
        np.testing.assert_allclose(tg.gradient(inside, a)[0], jax.grad(inside)(a), rtol=1e-6)


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


@jax.custom_jvp
def _fake_sin(x):
    return jnp.sin(x)


_fake_sin.defjvps(lambda t, ans, x: 3.0 * t)


def test_custom_rules_and_stop_gradient_inside_f():
    f = lambda a: jnp.sum(_clip_grad(a) ** 2)
    np.testing.assert_allclose(tg.gradient(f, X)[0], jax.grad(f)(X))
    np.testing.assert_allclose(tg.gradient(f, X)[0], [0.1, -0.1, 0.1])
    np.testing.assert_allclose(tg.gradient(lambda a: jnp.sum(_fake_sin(a)), X)[0], [3.0] * 3)
    (H,) = tg.hessian(lambda a: jnp.sum(_fake_sin(a) * a), X)
    np.testing.assert_allclose(H, jax.hessian(lambda a: jnp.sum(_fake_sin(a) * a))(X), rtol=1e-6)
    ga, gb = tg.gradient(lambda a, b: jnp.sum(jax.lax.stop_gradient(a) * b), X, W)
    assert ga is None  # a structural zero where jax.grad gives zeros
    np.testing.assert_allclose(gb, X)
    g = lambda a: jnp.sum(jax.lax.stop_gradient(a**2) * a)
    np.testing.assert_allclose(tg.gradient(g, X)[0], jax.grad(g)(X))


def _host_double(x):
    return np.asarray(x) * 2


def test_pure_callback_forward_only_and_its_gradient_error():
    cb = lambda a: jax.pure_callback(_host_double, jax.ShapeDtypeStruct(a.shape, a.dtype), a)
    f = lambda a: jnp.sum(cb(jax.lax.stop_gradient(a)) * a)
    v, (g,) = tg.withgradient(f, X)
    rv, rg = jax.value_and_grad(f)(X)
    np.testing.assert_allclose(v, rv, rtol=1e-6)
    np.testing.assert_allclose(g, rg, rtol=1e-6)
    with pytest.raises(ValueError, match=r"[Pp]ure callbacks do not support JVP.*custom_jvp"):
        tg.gradient(lambda a: jnp.sum(cb(a) * a), X)


def test_where_nan_trap_is_jax_s_and_the_double_where_fix_works():
    a = jnp.array([4.0, -1.0, 0.0])
    trap = lambda a: jnp.sum(jnp.where(a > 0, jnp.sqrt(a), 0.0))
    got, ref = tg.gradient(trap, a)[0], jax.grad(trap)(a)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    safe = lambda a: jnp.sum(jnp.where(a > 0, jnp.sqrt(jnp.where(a > 0, a, 1.0)), 0.0))
    np.testing.assert_allclose(tg.gradient(safe, a)[0], [0.25, 0.0, 0.0])
    ps = tg.Params([a])
    np.testing.assert_allclose(tg.gradient(lambda: safe(a), ps)[a], [0.25, 0.0, 0.0])


def test_complex_parameters_under_jit_vmap_and_second_order_closed_forms():
    f = lambda z: jnp.sum(jnp.abs(z) ** 2)
    np.testing.assert_allclose(jax.jit(lambda z: tg.gradient(f, z)[0])(Z), 2 * Z, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(lambda z: tg.gradient(f, z)[0])(Z), 2 * Z, rtol=1e-6)
    # steepest ascent of |z|^4 is 4|z|^2 z; of |4|z|^2 z|^2 = 16|z|^6 it is 96|z|^4 z
    inner = lambda z: tg.gradient(lambda z: jnp.sum(jnp.abs(z) ** 4), z)[0]
    np.testing.assert_allclose(inner(Z), 4 * jnp.abs(Z) ** 2 * Z, rtol=1e-5)
    (g2,) = tg.gradient(lambda z: jnp.sum(jnp.abs(inner(z)) ** 2), Z)
    np.testing.assert_allclose(g2, 96 * jnp.abs(Z) ** 4 * Z, rtol=1e-5)


# ================================================================ destructure


class Frozen(tg.Module):
    __trainable__ = ("w",)

    def __init__(self):
        self.w = jnp.array([1.0, -2.0])
        self.c = jnp.array([5.0])
        self.n = jnp.array([1, 2])


def test_destructure_gradient_through_rebuild_equals_the_tree_gradient():
    fz = Frozen()
    model = {
        "f": fz,
        "g": fz,  # a shared sub-model
        "t": [X, X],  # a tied array
        "h": jnp.array([0.5, 1.5], jnp.bfloat16),
        "s": 2.0,
    }
    flat, rebuild = tg.destructure(model)
    assert flat.dtype == jnp.float32 and flat.shape == (2 + 3 + 2,)
    new = rebuild(flat)
    assert new["f"] is new["g"] and new["t"][0] is new["t"][1]
    assert new["h"].dtype == jnp.bfloat16 and new["s"] == 2.0 and new["f"].c is fz.c

    def loss(m):
        h = m["h"].astype(jnp.float32)
        return (
            jnp.sum(m["f"].w * m["f"].c * m["f"].n)
            + jnp.sum(m["g"].w ** 2)
            + jnp.sum(m["t"][0] * m["t"][1] ** 2)
            + jnp.sum(h**3) * m["s"]
        )

    (gv,) = tg.gradient(lambda v: loss(rebuild(v)), flat)
    np.testing.assert_allclose(gv, jax.grad(lambda v: loss(rebuild(v)))(flat), rtol=1e-6)
    # flat is [f.w, h, t[0]] (dict keys in sorted order, a tie and a shared sub-model once)
    w, x, h = np.asarray(fz.w), np.asarray(X), np.asarray([0.5, 1.5])
    closed = np.concatenate([np.array([5.0, 10.0]) + 2 * w, 6 * h**2, 3 * x**2])
    np.testing.assert_allclose(gv, closed, rtol=1e-6)
    # the same numbers as the tree gradient, flattened (the tie summed at its first place)
    (gt,) = tg.gradient(loss, model)
    np.testing.assert_allclose(gv[:2], gt["f"].w)
    np.testing.assert_allclose(gv[2:4], np.asarray(gt["h"], np.float32))
    np.testing.assert_allclose(gv[4:], gt["t"][0])
    assert gt["g"].w is None and gt["t"][1] is None


def test_destructure_rebuild_under_jit_vmap_and_its_shape_error():
    flat, rebuild = tg.destructure({"w": X, "b": jnp.array(1.0)})
    both = jnp.stack([flat, 2 * flat])
    np.testing.assert_allclose(jax.jit(lambda v: rebuild(v)["w"])(flat), X)
    np.testing.assert_allclose(jax.vmap(lambda v: rebuild(v)["w"])(both), [X, 2 * X])
    with pytest.raises(ValueError, match=r"rebuild expects a vector of shape \(4,\), got \(4, 1\)"):
        rebuild(flat[:, None])


@pytest.mark.parametrize(
    "model, vec",
    [
        ({"w": X}, jnp.arange(3)),
        ({"w": X}, jnp.arange(3.0).astype(jnp.bfloat16)),
        ({"w": X, "h": jnp.ones(2, jnp.bfloat16)}, jnp.arange(5)),
    ],
    ids=["int-into-f32", "bf16-into-f32", "int-into-mixed"],
)
def test_destructure_rebuild_keeps_each_leaf_dtype(model, vec):
    flat, rebuild = tg.destructure(model)
    new = rebuild(vec)
    for k, leaf in model.items():
        assert new[k].dtype == leaf.dtype, (k, new[k].dtype, leaf.dtype)
    # the values are the vector's, cast; and the gradient flows back to it
    at = sum(model[k].size for k in sorted(model) if k < "w")  # dict leaves: sorted keys
    w = np.asarray(vec[at : at + 3], np.float32)
    np.testing.assert_allclose(new["w"], w)
    g = jax.grad(lambda v: jnp.sum(rebuild(v)["w"] ** 2))(vec.astype(flat.dtype))
    np.testing.assert_allclose(np.asarray(g[at : at + 3], np.float32), 2 * w)


def test_destructure_rebuild_refuses_a_complex_vector_for_a_real_model():
    _, rebuild = tg.destructure({"w": X})
    with pytest.raises(TypeError, match=r"rebuild got a complex vector \(complex64\) for a real"):
        rebuild(jnp.ones(3, jnp.complex64))


# ================================================================ losses


L = tg.losses


def _check_losses(n, c, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    yhat, y = jax.random.normal(k[0], (n, c)), jax.random.normal(k[1], (n, c))
    labels = jax.random.randint(k[2], (n,), 0, c)
    t = (y > 0) * 1.0
    got = jax.jit(
        lambda yhat, y, labels, t: {
            "mse": L.mse(yhat, y),
            "mae": L.mae(yhat, y),
            "huber": L.huber(yhat, y, delta=0.7),
            "lce": L.logitcrossentropy(yhat, labels),
            "lce-onehot": L.logitcrossentropy(yhat, jax.nn.one_hot(labels, c)),
            "ce": L.crossentropy(jax.nn.softmax(yhat), labels),
            "lbce": L.logitbinarycrossentropy(yhat, t),
            "dmse": jax.grad(L.mse)(yhat, y),
        }
    )(yhat, y, labels, t)
    if n == 0:  # an empty batch: the mean of nothing, as jnp.mean and optax
        for name in ("mse", "mae", "huber", "lce", "lbce"):
            assert np.isnan(got[name]), name
        return
    a, b = np.asarray(yhat, np.float64), np.asarray(y, np.float64)
    lce = np.mean(optax.losses.softmax_cross_entropy_with_integer_labels(yhat, labels))
    want = {
        "mse": np.mean((a - b) ** 2),
        "mae": np.mean(np.abs(a - b)),
        "huber": np.mean(optax.losses.huber_loss(yhat, y, delta=0.7)),
        "lce": lce,
        "lce-onehot": lce,
        "ce": lce,
        "lbce": np.mean(optax.losses.sigmoid_binary_cross_entropy(yhat, t)),
        "dmse": 2 * (a - b) / a.size,
    }
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("n", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_losses_against_optax_and_closed_forms(n):
    _check_losses(n, 4, n)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(st.integers(0, 5), st.integers(1, 4), st.integers(0, 2**16))
def test_losses_against_optax_and_closed_forms_random_shapes(n, c, seed):
    _check_losses(n, c, seed)


@pytest.mark.slow
def test_loss_integer_and_boolean_targets_equal_their_float_forms():
    logits = jnp.array([[1.0, 2.0, 0.5], [0.1, -1.0, 3.0]])
    lab = jnp.array([1, 2])
    ref = np.mean(optax.losses.softmax_cross_entropy_with_integer_labels(logits, lab))
    for y in (lab, lab.astype(jnp.uint8), np.asarray(lab), jax.nn.one_hot(lab, 3) > 0):
        np.testing.assert_allclose(L.logitcrossentropy(logits, y), ref, rtol=1e-6)
    p = jnp.array([0.9, 0.2])
    for y in (jnp.array([True, False]), jnp.array([1, 0])):
        np.testing.assert_allclose(
            L.binarycrossentropy(p, y), -(np.log(0.9) + np.log(0.8)) / 2, rtol=1e-5
        )
        np.testing.assert_allclose(
            L.logitbinarycrossentropy(p, y),
            np.mean(optax.losses.sigmoid_binary_cross_entropy(p, jnp.array([1.0, 0.0]))),
            rtol=1e-6,
        )


@pytest.mark.parametrize(
    "call, err, words",
    [
        (
            lambda: L.mse(jnp.zeros((3, 1)), jnp.zeros(3)),
            ValueError,
            r"mse: y of shape \(3,\).*\(3, 3\)",
        ),
        (lambda: L.mae(jnp.zeros(3), jnp.zeros((3, 1))), ValueError, r"mae: y of shape \(3, 1\)"),
        (
            lambda: L.logitbinarycrossentropy(jnp.zeros((4, 1)), jnp.zeros(4)),
            ValueError,
            r"logitbinarycrossentropy: y of shape \(4,\).*reshape",
        ),
        (
            lambda: L.logitcrossentropy(jnp.zeros((2, 3)), jnp.array([[0], [1]])),
            ValueError,
            r"integer labels y of shape \(2, 1\).*shape \(2,\)",
        ),
        (
            lambda: L.crossentropy(jnp.full((2, 3), 1 / 3), jnp.array([0.0, 1.0])),
            ValueError,
            r"targets y of shape \(2,\) do not match probs of shape \(2, 3\)",
        ),
        (lambda: L.mse([1.0, 2.0], jnp.zeros(2)), TypeError, r"mse: yhat must be an array.*list"),
        (lambda: L.mse(jnp.array([1, 2]), jnp.zeros(2)), TypeError, r"mse: yhat has dtype int32"),
        (
            lambda: L.huber(jnp.ones(3), jnp.zeros(3), delta=0.0),
            ValueError,
            r"delta must be positive",
        ),
    ],
    ids=["mse-n1-n", "mae-n-n1", "lbce", "int-labels", "soft-shape", "list", "int-yhat", "delta"],
)
def test_loss_shape_and_type_mistakes_are_clear_errors(call, err, words):
    with pytest.raises(err, match=words):
        call()


@pytest.mark.parametrize(
    "y", [0.5, jnp.array(0.5), jnp.array([0.5, -1.0])], ids=["py-float", "0d", "row"]
)
def test_mse_target_broadcastable_to_yhat(y):
    yhat = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.0, 0.5]])
    assert L.mae(yhat, y).shape == ()  # mae and huber take it
    want = np.mean((np.asarray(yhat) - np.asarray(y)) ** 2)
    np.testing.assert_allclose(L.mse(yhat, y), want, rtol=1e-6)


def test_crossentropy_gradient_at_probability_one():
    # Probabilities from normalising x: p = x / sum(x) = [1, 0] at x = [2, 0].
    # d/dx of -log(x0 / (x0 + x1)) = [-1/x0 + 1/s, 1/s] = [0, 0.5].
    x = jnp.array([2.0, 0.0])
    loss = lambda x: L.crossentropy((x / jnp.sum(x))[None], jnp.array([0]))
    np.testing.assert_allclose(loss(x), 0.0, atol=1e-6)
    np.testing.assert_allclose(tg.gradient(loss, x)[0], [0.0, 0.5], atol=1e-6)
    # and directly: d/dp of -log p at p = 1 is -1 (one-hot target, batch of one)
    g = jax.grad(L.crossentropy)(jnp.array([[1.0, 0.0]]), jnp.array([[1.0, 0.0]]))
    np.testing.assert_allclose(g, [[-1.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize(
    "delta", [np.float32(0.0), np.float32(-1.0), jnp.array(0.0)], ids=["np0", "np-1", "jnp0"]
)
def test_huber_nonpositive_array_delta_is_rejected(delta):
    with pytest.raises(ValueError, match=r"delta must be positive"):
        L.huber(jnp.ones(3), jnp.zeros(3), delta=delta)


def test_mse_of_complex_predictions_is_fluxs_mean_abs2():
    # Flux's mse: mean(abs2(yhat - y)), real; its gradient (steepest ascent) 2(yhat - y)/n
    yhat, y = jnp.array([1.0 + 1.0j, 2.0 - 1.0j]), jnp.array([0.0j, 1.0 + 0j])
    np.testing.assert_allclose(L.mse(yhat, y), (2.0 + 2.0) / 2, rtol=1e-6)
    (g,) = tg.gradient(lambda z: L.mse(z, y), yhat)
    np.testing.assert_allclose(g, np.asarray(yhat - y), rtol=1e-6)
