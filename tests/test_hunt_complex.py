"""Hunt: complex parameters through the whole API (API.md section 1's convention).

For a real loss, the gradient of a complex leaf is `df/dx + i df/dy`, the conjugate of
`jax.grad`'s. References: `jnp.conj(jax.grad(...))`, central finite differences in the
real and imaginary directions, and plain optax applied to the conjugated gradients.
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import _optstep, nn

Z = jnp.array([1 + 2j, 3 - 1j, -0.5 + 0.25j], dtype=jnp.complex64)
W = jnp.array([0.5, -1.0, 2.0])
T = jnp.array([0.3 - 1j, 1 + 1j, 2j], dtype=jnp.complex64)

# ~20 s in all: the slow run (CI), so the default run stays under 3 minutes.
pytestmark = pytest.mark.slow


def conj_grad(f, *args, argnums=0):
    return jax.tree.map(jnp.conj, jax.grad(f, argnums=argnums)(*args))


def close(a, b, **kw):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert jnp.shape(x) == jnp.shape(y)
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), **{"rtol": 1e-5, "atol": 1e-5, **kw}
        )


def mixed_loss(m):
    z, w = m["z"], m["w"]
    return (
        jnp.sum(jnp.abs(z * w - T) ** 2)
        + jnp.sum(jnp.real(z) ** 3)
        + jnp.sum(jnp.imag(z) * w)
        + 0.1 * jnp.sum(w**2)
    )


# ---------------------------------------------------------------- explicit gradients


def test_explicit_mixed_dict_is_steepest_ascent_against_jax_and_finite_differences():
    m = {"z": Z, "w": W}
    (g,) = tg.gradient(mixed_loss, m)
    assert g["z"].dtype == jnp.complex64 and g["w"].dtype == jnp.float32
    close(g, conj_grad(mixed_loss, m))
    # finite differences in the real and imaginary directions (float64 on the host)
    zn, wn = np.asarray(Z, np.complex128), np.asarray(W, np.float64)
    tn = np.asarray(T, np.complex128)

    def f(z):
        return (
            np.sum(np.abs(z * wn - tn) ** 2)
            + np.sum(z.real**3)
            + np.sum(z.imag * wn)
            + 0.1 * np.sum(wn**2)
        )

    eps = 1e-6
    for k in range(3):
        e = np.zeros(3)
        e[k] = eps
        dx = (f(zn + e) - f(zn - e)) / (2 * eps)
        dy = (f(zn + 1j * e) - f(zn - 1j * e)) / (2 * eps)
        np.testing.assert_allclose(complex(g["z"][k]), dx + 1j * dy, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "fn",
    [
        lambda z: jnp.sum(jnp.abs(z)),
        lambda z: jnp.sum(jnp.angle(z)),
        lambda z: jnp.sum(jnp.real(z)),
        lambda z: jnp.sum(jnp.imag(z)),
        lambda z: jnp.sum(jnp.real(jnp.conj(z) * 1j)),
        lambda z: jnp.sum(jnp.real(jnp.exp(z))),
        lambda z: jnp.real(jnp.vdot(z, 2j * z + 1)),
        lambda z: jnp.sum(jnp.real(z**3)),  # holomorphic inside: conj(3 z^2)
    ],
    ids=["abs", "angle", "real", "imag", "conj", "exp", "vdot", "holomorphic"],
)
def test_elementwise_complex_functions(fn):
    (g,) = tg.gradient(fn, Z)
    close(g, conj_grad(fn, Z))


def test_holomorphic_real_part_is_conj_of_derivative():
    (g,) = tg.gradient(lambda z: jnp.sum(jnp.real(z**3)), Z)
    close(g, jnp.conj(3 * Z**2))


def test_inside_jax_jit_tg_jit_vmap_and_scan():
    m = {"z": Z, "w": W}
    ref = conj_grad(mixed_loss, m)
    close(jax.jit(lambda m: tg.gradient(mixed_loss, m)[0])(m), ref)
    close(tg.jit(lambda m: tg.gradient(mixed_loss, m)[0])(m), ref)
    batch = jnp.stack([Z, 2 * Z, Z * 1j])
    got = jax.vmap(lambda z: tg.gradient(mixed_loss, {"z": z, "w": W})[0])(batch)
    want = jax.vmap(lambda z: conj_grad(mixed_loss, {"z": z, "w": W}))(batch)
    close(got, want)

    def body(c, x, grad):
        g = grad(lambda z: jnp.sum(jnp.abs(z * x - 1) ** 2), c)
        return c - 0.1 * g, jnp.sum(jnp.abs(c * x - 1) ** 2)

    xs = jnp.array([[1j, 2.0, 1], [0.5, -1j, 1], [1 + 1j, 0, 2]], dtype=jnp.complex64)
    a = jax.lax.scan(lambda c, x: body(c, x, lambda f, c: tg.gradient(f, c)[0]), Z, xs)
    b = jax.lax.scan(lambda c, x: body(c, x, conj_grad), Z, xs)
    close(a, b)
    assert float(a[1][-1]) < float(a[1][0])


def test_second_order_through_tg_gradient_of_complex_argument():
    f = lambda w, z: jnp.sum(jnp.abs(z * w - 1j) ** 2 * w)
    outer = lambda w: jnp.sum(
        jnp.abs(tg.gradient(f, w, Z)[1]) ** 2 + jnp.real(tg.gradient(f, w, Z)[1])
    )
    ref = lambda w: jnp.sum(
        jnp.abs(conj_grad(f, w, Z, argnums=1)) ** 2 + jnp.real(conj_grad(f, w, Z, argnums=1))
    )
    close(jax.grad(outer)(W), jax.grad(ref)(W))
    inner = lambda z: jnp.sum(jnp.imag(tg.gradient(f, W, z)[1]))
    inner_ref = lambda z: jnp.sum(jnp.imag(conj_grad(f, W, z, argnums=1)))
    close(tg.gradient(inner, Z)[0], conj_grad(inner_ref, Z))


def test_custom_vjp_and_custom_jvp_on_complex_inputs():
    @jax.custom_vjp
    def cf(z):
        return z * 2

    cf.defvjp(lambda z: (z * 2, z), lambda r, ct: (ct * (2 + 1j),))
    loss = lambda z: jnp.sum(jnp.abs(cf(z) - 1j) ** 2)
    close(tg.gradient(loss, Z)[0], conj_grad(loss, Z))

    @jax.custom_vjp
    def ste(z):
        return jnp.round(jnp.real(z)) + 0j

    ste.defvjp(lambda z: (ste(z), None), lambda r, ct: (ct * 1j,))
    loss2 = lambda z: jnp.sum(jnp.real(ste(z)))
    (g,) = tg.gradient(loss2, Z)
    assert g is not None
    close(g, conj_grad(loss2, Z))

    @jax.custom_jvp
    def cj(z):
        return jnp.sin(z)

    cj.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0] * 3))
    loss3 = lambda z: jnp.sum(jnp.abs(cj(z)) ** 2)
    close(tg.gradient(loss3, Z)[0], conj_grad(loss3, Z))


def test_withgradient_with_aux_and_complex_parameter():
    v, (g,) = tg.withgradient(lambda z: (jnp.sum(jnp.abs(z) ** 2), z * 2), Z)
    close(v[0], jnp.sum(jnp.abs(Z) ** 2))
    close(v[1], Z * 2)
    close(g, 2 * Z)  # d|z|^2/dx + i d|z|^2/dy = 2x + 2iy


# ------------------------------------------------------ Modules, implicit mode, Grads


class Cplx(tg.Module):
    def __init__(self, key):
        self.l1 = nn.Dense(3, 4, key=key)
        self.c = jnp.array([1 + 1j, 0.5 - 2j, 0.1j, 2.0], dtype=jnp.complex64)
        self.c2 = self.c  # tied

    def __call__(self, x):
        return jnp.abs(self.l1(x) * self.c + self.c2 * 0.5j)


X = jax.random.normal(jax.random.key(1), (5, 3))
Y = jax.random.normal(jax.random.key(2), (5, 4))


def cplx_loss(m):
    return jnp.mean((m(X) - Y) ** 2)


def untied(w, b, c):
    return jnp.mean((jnp.abs((X @ w.T + b) * c + c * 0.5j) - Y) ** 2)


def test_module_with_dense_and_tied_complex_leaf_explicit_and_implicit():
    model = Cplx(jax.random.key(0))
    ref = conj_grad(untied, model.l1.weight, model.l1.bias, model.c, argnums=(0, 1, 2))
    (g,) = tg.gradient(cplx_loss, model)
    close((g.l1.weight, g.l1.bias, g.c), ref)
    assert g.c2 is None
    ps = tg.params(model)
    assert list(ps.named()) == ["l1.weight", "l1.bias", "c"]
    grads = tg.gradient(lambda: cplx_loss(model), ps)
    close(grads[model.c], ref[2])
    tree = grads.to_tree(model)
    close(tree.c, ref[2])
    assert tree.c2 is None


def test_grads_arithmetic_with_complex_gradients():
    d = {"z": Z, "w": W}
    ps = tg.Params(d)
    g = tg.gradient(lambda: mixed_loss(d), ps)
    ref = conj_grad(mixed_loss, d)
    close((g + g)[d["z"]], 2 * ref["z"])
    close((g - g * 0.5)[d["z"]], 0.5 * ref["z"])
    close((-g)[d["z"]], -ref["z"])
    close((g * 1j)[d["z"]], 1j * ref["z"])
    close((1j * g)[d["z"]], 1j * ref["z"])
    close((g / 2j)[d["z"]], ref["z"] / 2j)
    close((g * jnp.asarray(2 + 0j))[d["z"]], 2 * ref["z"])
    close(g.map(jnp.conj)[d["z"]], jnp.conj(ref["z"]))
    # None acts as zero
    g2 = tg.gradient(lambda: jnp.sum(jnp.abs(d["z"]) ** 2), ps)
    assert g2[d["w"]] is None
    close((g + g2)[d["w"]], ref["w"])
    close((g + g2)[d["z"]], ref["z"] + 2 * Z)


def test_weight_decay_idiom_over_captured_params_with_complex_leaf():
    z, w = Z, W
    ps = tg.Params([z, w])
    g = tg.gradient(
        lambda: jnp.sum(jnp.abs(z * w) ** 2) + sum(jnp.sum(jnp.abs(p) ** 2) for p in ps), ps
    )
    f = lambda z, w: jnp.sum(jnp.abs(z * w) ** 2) + jnp.sum(jnp.abs(z) ** 2) + jnp.sum(w**2)
    rz, rw = conj_grad(f, z, w, argnums=(0, 1))
    close(g[z], rz)
    close(g[w], rw)


# -------------------------------------------------------- pullback, jacobian, hessian


def test_pullback_complex_output_with_complex_dy_and_chain_rule():
    f = lambda z, w: jnp.sin(z) * w + jnp.conj(z) * 2
    y, back = tg.pullback(f, Z, W)
    dy = jnp.array([0.3 + 1j, -2 + 0.5j, 1j], dtype=jnp.complex64)
    _, vjp = jax.vjp(f, Z, W)
    rz, rw = vjp(jnp.conj(dy))
    gz, gw = back(dy)
    close(gz, jnp.conj(rz))
    close(gw, rw)
    loss = lambda y: jnp.sum(jnp.abs(y - T) ** 2)
    (dl,) = tg.gradient(loss, y)
    close(back(dl), tg.gradient(lambda z, w: loss(f(z, w)), Z, W))
    close(back(dl), conj_grad(lambda z, w: loss(f(z, w)), Z, W, argnums=(0, 1)))
    # through jax.jit and vmap
    _, backj = jax.jit(lambda z, w: tg.pullback(f, z, w))(Z, W)
    close(backj(dy), (gz, gw))
    dys = jnp.stack([dy, 1j * dy])
    got = jax.vmap(lambda d: tg.pullback(f, Z, W)[1](d))(dys)
    want = jax.vmap(lambda d: (jnp.conj(vjp(jnp.conj(d))[0]), vjp(jnp.conj(d))[1]))(dys)
    close(got, want)


def test_pullback_real_output_of_complex_input():
    g = lambda z: jnp.abs(z) ** 2 * jnp.array([1.0, 2.0, 3.0])
    _, back = tg.pullback(g, Z)
    dy = jnp.array([1.0, -2.0, 0.5])
    close(back(dy)[0], jnp.conj(jax.vjp(g, Z)[1](dy)[0]))
    with pytest.raises(ValueError, match="cotangent dy has dtype complex64 where the output"):
        back(dy.astype(jnp.complex64))
    _, back = tg.pullback(lambda z: jnp.sum(jnp.abs(z) ** 2), Z)
    close(back(1.0)[0], tg.gradient(lambda z: jnp.sum(jnp.abs(z) ** 2), Z)[0])
    with pytest.raises(ValueError, match="is a complex where the output has dtype float32"):
        back(1j)


def test_implicit_pullback_and_jacobian_with_complex_parameter():
    d = {"z": Z, "w": W}
    ps = tg.Params(d)
    _, back = tg.pullback(lambda: jnp.sin(d["z"]) * d["w"], ps)
    dy = jnp.array([0.3 + 1j, -2 + 0.5j, 1j], dtype=jnp.complex64)
    rz, rw = jax.vjp(lambda z, w: jnp.sin(z) * w, Z, W)[1](jnp.conj(dy))
    g = back(dy)
    close(g[d["z"]], jnp.conj(rz))
    close(g[d["w"]], rw)
    J = tg.jacobian(lambda: jnp.abs(d["z"]) ** 2 * d["w"], ps)
    close(J[d["z"]], jnp.conj(jax.jacrev(lambda z: jnp.abs(z) ** 2 * W)(Z)))
    close(J[d["w"]], jax.jacrev(lambda w: jnp.abs(Z) ** 2 * w)(W))


def test_jacobian_conventions_and_documented_refusals():
    h = lambda z: jnp.abs(z) ** 2 + jnp.real(z)
    close(tg.jacobian(h, Z)[0], jnp.conj(jax.jacrev(h)(Z)))
    k = lambda w: jnp.exp(1j * w) * w
    close(tg.jacobian(k, W)[0], jax.jacfwd(k)(W))
    close(jax.vmap(lambda z: tg.jacobian(h, z)[0])(jnp.stack([Z, 2 * Z])),
          jax.vmap(lambda z: jnp.conj(jax.jacrev(h)(z)))(jnp.stack([Z, 2 * Z])))  # fmt: skip
    with pytest.raises(TypeError, match="returns a complex array and takes a complex input"):
        tg.jacobian(lambda z, w: jnp.sin(z) * w, Z, W)
    with pytest.raises(TypeError, match=r"tg\.hessian: an argument holds a complex array"):
        tg.hessian(lambda z: jnp.sum(jnp.abs(z) ** 2), Z)
    with pytest.raises(TypeError, match=r"tg\.hessian: an argument holds a complex array"):
        tg.hessian(lambda m: jnp.sum(jnp.abs(m["z"]) ** 2 * m["w"]), {"z": Z, "w": W})
    # a real argument with a complex array captured is fine
    f = lambda w: jnp.sum(jnp.abs(Z * w) ** 2)
    close(tg.hessian(f, W)[0], jax.hessian(f)(W))
    with pytest.raises(TypeError, match="must return a real floating-point scalar"):
        tg.gradient(lambda z: jnp.sum(z), Z)


def test_destructure_of_mixed_model_gradient():
    m = {"z": Z, "w": W}
    flat, rebuild = tg.destructure(m)
    assert flat.dtype == jnp.complex64
    (gf,) = tg.gradient(lambda v: mixed_loss(rebuild(v)), flat)
    ref = conj_grad(mixed_loss, m)
    close(gf, jnp.concatenate([ref["w"].astype(jnp.complex64), ref["z"]]))
    back = rebuild(flat - 0.01 * gf)
    assert back["w"].dtype == jnp.float32
    assert float(mixed_loss(back)) < float(mixed_loss(m))


def test_numpy_complex_leaves_follow_one_rule():
    zn = np.asarray(Z)
    assert tg.is_differentiable(zn)
    m = {"z": zn, "w": W}
    (g,) = tg.gradient(mixed_loss, m)
    close(g["z"], conj_grad(mixed_loss, {"z": Z, "w": W})["z"])
    s = tg.setup(optax.sgd(0.1), m)
    s, new = tg.update(s, m, g)
    close(new["z"], Z - 0.1 * g["z"])
    held = {"z": zn.copy(), "w": W}
    ps = tg.params(held)
    assert len(ps) == 2 and isinstance(held["z"], jax.Array)
    grads = tg.gradient(lambda: mixed_loss(held), ps)
    close(grads[held["z"]], g["z"])
    st = tg.setup(optax.sgd(0.1), ps)
    tg.update_(st, ps, grads)
    close(held["z"], Z - 0.1 * g["z"])


def test_complex_dense_layer_gradient():
    d = nn.Dense(2, 3, key=jax.random.key(0), dtype=jnp.complex64)
    x = jnp.array([[1.0, 2.0], [0.5j, -1]], dtype=jnp.complex64)
    (g,) = tg.gradient(lambda d: jnp.sum(jnp.abs(d(x) - 1) ** 2), d)
    rw, rb = conj_grad(
        lambda w, b: jnp.sum(jnp.abs(x @ w.T + b - 1) ** 2), d.weight, d.bias, argnums=(0, 1)
    )
    close(g.weight, rw)
    close(g.bias, rb)


# ----------------------------------------------------------------------- optimiser

RULES = {
    "sgd": lambda: optax.sgd(0.05),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(0.05),
    "rmsprop": lambda: optax.rmsprop(0.05),
    "adagrad": lambda: optax.adagrad(0.1),
    "lion": lambda: optax.lion(0.01),
    "inject_adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.05),
    "clip_inject": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.inject_hyperparams(optax.adam)(learning_rate=0.05)
    ),
}


@pytest.mark.parametrize("name", list(RULES))
def test_optax_rules_descend_and_equal_plain_optax(name):
    rule = RULES[name]()
    m = {"z": Z, "w": W}
    s = tg.setup(rule, m)
    p, os_ = dict(m), rule.init(dict(m))

    def ref_step(p, os_):
        u, os_ = rule.update(conj_grad(mixed_loss, p), os_, p)
        return optax.apply_updates(p, u), os_

    losses = [float(mixed_loss(m))]
    for _ in range(3):
        (g,) = tg.gradient(mixed_loss, m)
        s, m = tg.update(s, m, g)
        p, os_ = ref_step(p, os_)
        losses.append(float(mixed_loss(m)))
    assert m["z"].dtype == jnp.complex64 and m["w"].dtype == jnp.float32
    close(m, p, rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0]


def test_none_gradient_keeps_complex_parameter_and_its_moments():
    rule = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05))
    m = {"z": Z, "w": W}
    s = tg.setup(rule, m)
    s, m = tg.update(s, m, tg.gradient(mixed_loss, m)[0])
    p = dict(m)
    os_ = rule.update(conj_grad(mixed_loss, {"z": Z, "w": W}), rule.init({"z": Z, "w": W}),
                      {"z": Z, "w": W})[1]  # fmt: skip
    (g,) = tg.gradient(mixed_loss, m)
    g = {"z": None, "w": g["w"]}
    s2, m2 = tg.update(s, m, g)
    assert bool(jnp.all(m2["z"] == m["z"]))
    ref_g = conj_grad(mixed_loss, p)
    ref_g["z"] = jnp.zeros_like(ref_g["z"])
    u, _ = rule.update(ref_g, os_, p)
    close(m2["w"], optax.apply_updates(p, u)["w"])
    before = s["z"].state[1][0]
    after = s2["z"].state[1][0]
    close(after.mu, before.mu)
    close(after.nu, before.nu)
    assert int(after.count) == int(before.count) + 1
    # frozen complex leaf
    st = tg.setup(optax.adam(0.1), {"z": Z, "w": W})
    tg.freeze_(st["z"])
    _, m3 = tg.update(st, {"z": Z, "w": W}, tg.gradient(mixed_loss, {"z": Z, "w": W})[0])
    assert bool(jnp.all(m3["z"] == Z)) and not bool(jnp.all(m3["w"] == W))


def test_tied_complex_weight_sums_gradients_over_places():
    tied = {"enc": Z, "dec": Z, "w": W}
    s = tg.setup(optax.adam(0.1), tied)
    g1 = jnp.array([1 + 1j, -2j, 0.5], dtype=jnp.complex64)
    g2 = jnp.array([0.5 - 1j, 1 + 0j, 1j], dtype=jnp.complex64)
    s, new = tg.update(s, tied, {"enc": g1, "dec": g2, "w": jnp.ones(3)})
    rule = optax.adam(0.1)
    p = {"z": Z, "w": W}
    u, _ = rule.update({"z": g1 + g2, "w": jnp.ones(3)}, rule.init(p), p)
    assert new["enc"] is new["dec"]
    close(new["enc"], optax.apply_updates(p, u)["z"])


def test_implicit_tg_jit_step_on_module_matches_explicit_and_optax():
    rule = optax.adam(0.05)
    model = Cplx(jax.random.key(0))
    ps = tg.params(model)
    s = tg.setup(rule, ps)

    @tg.jit
    def step():
        tg.update_(s, ps, tg.gradient(lambda: cplx_loss(model), ps))

    l0 = float(cplx_loss(model))
    for _ in range(5):
        step()
    assert model.c is model.c2
    assert float(cplx_loss(model)) < l0
    ref = Cplx(jax.random.key(0))
    p = {"w": ref.l1.weight, "b": ref.l1.bias, "c": ref.c}
    os_ = rule.init(p)
    for _ in range(5):
        g = conj_grad(lambda p: untied(p["w"], p["b"], p["c"]), p)
        u, os_ = rule.update(g, os_, p)
        p = optax.apply_updates(p, u)
    close((model.l1.weight, model.l1.bias, model.c), (p["w"], p["b"], p["c"]))


def test_explicit_step_in_user_jax_jit_and_tg_jit():
    rule = optax.adam(0.1)
    m = {"z": Z, "w": W}

    def step(s, m):
        (g,) = tg.gradient(mixed_loss, m)
        return tg.update(s, m, g)

    _, m1 = jax.jit(step)(tg.setup(rule, m), m)
    _, m2 = tg.jit(step)(tg.setup(rule, m), m)
    u, _ = rule.update(conj_grad(mixed_loss, m), rule.init(m), m)
    ref = optax.apply_updates(m, u)
    close(m1, ref)
    close(m2, ref)


def test_complex_gradient_for_real_parameter_is_refused_and_nothing_changes():
    m = {"z": Z, "w": W}
    s = tg.setup(optax.adam(0.1), m)
    bad = {"z": Z, "w": jnp.array([1 + 1j, 0j, 1], dtype=jnp.complex64)}
    with pytest.raises(
        ValueError, match="the gradient at 'w' is complex but its parameter is real"
    ):
        tg.update(s, m, bad)
    ps = tg.params(m)
    st = tg.setup(optax.sgd(0.1), ps)
    grads = tg.gradient(lambda: mixed_loss(m), ps) * 1j
    with pytest.raises(ValueError, match="is complex but its parameter is real"):
        tg.update_(st, ps, grads)
    assert m["z"] is Z and m["w"] is W


def test_real_gradient_for_complex_parameter_is_a_gradient_with_zero_imaginary_part():
    # Undocumented: it is accepted, as a complex gradient with zero imaginary part.
    m = {"z": Z, "w": W}
    g = {"z": jnp.array([1.0, -2.0, 0.5]), "w": jnp.ones(3)}
    _, new = tg.update(tg.setup(optax.sgd(0.1), m), m, g)
    assert new["z"].dtype == jnp.complex64
    close(new["z"], Z - 0.1 * g["z"])


def test_train_complex_model_equals_plain_optax_explicit_and_implicit():
    rule = optax.adam(0.1)
    loss = lambda m, t: jnp.sum(jnp.abs(m["z"] * m["w"] - t) ** 2)
    data = [(T,), (T * 1j,), (T,)] * 2
    m = {"z": Z, "w": W}
    _, m2, losses = tg.train(loss, m, data, tg.setup(rule, m))
    p, os_, ref = dict(m), rule.init(m), []
    for (t,) in data:
        ref.append(float(loss(p, t)))
        u, os_ = rule.update(conj_grad(loss, p, t), os_, p)
        p = optax.apply_updates(p, u)
    close(losses, ref)
    close(m2, p)
    held = {"z": Z, "w": W}
    ps = tg.params(held)
    _, _, losses2 = tg.train(lambda t: loss(held, t), ps, data, tg.setup(rule, ps))
    close(losses2, ref)
    close(held, p)


def _steps(rule, n):
    m = {"z": Z, "w": W}
    s = tg.setup(rule, m)
    for _ in range(n):
        s, m = tg.update(s, m, tg.gradient(mixed_loss, m)[0])
    return s, m


@pytest.mark.parametrize(
    "make",
    [lambda: optax.adam(0.1), lambda: optax.sgd(0.1, momentum=0.9)],
    ids=["adam", "momentum"],
)
def test_save_load_complex_model_and_state(make):
    s, m = _steps(make(), 2)
    folder = os.path.join(tempfile.mkdtemp(), "ckpt")
    tg.save(folder, (m, s))
    m2, s2 = tg.load(folder, ({"z": Z, "w": W}, tg.setup(make(), {"z": Z, "w": W})))
    for a, b in zip(jax.tree.leaves((m, s)), jax.tree.leaves((m2, s2)), strict=True):
        assert a.dtype == b.dtype and bool(jnp.all(a == b))


def test_inject_hyperparams_state_of_mixed_model_reloads_after_a_step():
    # optax.inject_hyperparams keeps its hyperparameters in the parameters' common dtype
    # (complex here), and the real leaf's moments turn complex at the first step; the
    # state is set up in those dtypes, so it keeps one layout (was: a load failure).
    make = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    s, m = _steps(make(), 1)
    folder = os.path.join(tempfile.mkdtemp(), "ckpt")
    tg.save(folder, (m, s))
    m2, s2 = tg.load(folder, ({"z": Z, "w": W}, tg.setup(make(), {"z": Z, "w": W})))
    for a, b in zip(jax.tree.leaves((m, s)), jax.tree.leaves((m2, s2)), strict=True):
        assert bool(jnp.all(a == b))
    # Three more steps: the values plain optax gives (its gradient: jax's conjugate),
    # and the compiled step traced once for all of them.
    rule, ref = make(), {"z": Z, "w": W}
    ost = rule.init(ref)
    for _ in range(4):
        g = jax.tree.map(jnp.conj, jax.grad(mixed_loss)(ref))
        u, ost = rule.update(g, ost, ref)
        ref = optax.apply_updates(ref, u)
    before = _optstep.step._cache_size()
    for _ in range(3):
        s2, m2 = tg.update(s2, m2, tg.gradient(mixed_loss, m2)[0])
    assert _optstep.step._cache_size() - before <= 1
    for k in ("z", "w"):
        np.testing.assert_allclose(m2[k], ref[k], rtol=1e-5, atol=1e-6)


def test_complex128_under_enable_x64():
    with jax.enable_x64(True):
        z = jnp.array([1 + 2j, 3 - 1j], dtype=jnp.complex128)
        w = jnp.array([0.5, -1.0], dtype=jnp.float64)
        loss = lambda m: jnp.sum(jnp.abs(m["z"] * m["w"] - 1j) ** 2) + jnp.sum(jnp.angle(m["z"]))
        m = {"z": z, "w": w}
        (g,) = tg.gradient(loss, m)
        assert g["z"].dtype == jnp.complex128
        eps = 1e-6
        for k in range(2):
            e = jnp.zeros(2).at[k].set(eps)
            dx = (loss({"z": z + e, "w": w}) - loss({"z": z - e, "w": w})) / (2 * eps)
            dy = (loss({"z": z + 1j * e, "w": w}) - loss({"z": z - 1j * e, "w": w})) / (2 * eps)
            np.testing.assert_allclose(complex(g["z"][k]), complex(dx + 1j * dy), rtol=1e-7)
        rule = optax.adam(0.1)
        s, p, os_ = tg.setup(rule, m), m, rule.init(m)
        for _ in range(3):
            s, m = tg.update(s, m, tg.gradient(loss, m)[0])
            u, os_ = rule.update(conj_grad(loss, p), os_, p)
            p = optax.apply_updates(p, u)
        assert m["z"].dtype == jnp.complex128
        close(m, p, rtol=1e-12, atol=1e-12)
