"""Hunt: equinox users. (a) equinox's own tests (test_ad, test_module, test_shared,
tree_at) ported to tg.Module; (b) equinox models used as treegrad models, each result
compared with eqx.filter_grad / jax.grad / plain optax on the same leaves."""

import dataclasses
import functools
import warnings

import jax
import jax.flatten_util
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

eqx = pytest.importorskip("equinox")

X3 = jnp.array([1.0, -2.0, 0.5])


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def arrays(tree):
    return jtu.tree_leaves(eqx.filter(tree, eqx.is_array))


def trees_close(a, b, tol=1e-5):
    la, lb = arrays(a), arrays(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        close(x, y, tol)


def optax_steps(model, loss, opt, n, *batch):
    """The reference: eqx.filter_grad + plain optax on the inexact arrays."""
    st = opt.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(n):
        value, g = eqx.filter_value_and_grad(loss)(model, *batch)
        u, st = opt.update(g, st, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, u)
        losses.append(float(value))
    return model, losses


# --- (a) equinox's own tests, on tg.Module ------------------------------------------------


def _sum_arrays(tree):
    s = jnp.array(0.0)
    for leaf in jtu.tree_leaves(tree):
        if eqx.is_array_like(leaf):
            s = s + jnp.sum(leaf).astype(s.dtype)
    return s


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_filter_grad_leaf_kinds_as_equinox():
    # equinox tests/test_ad.py::test_filter_grad, with int, bool and bfloat16 leaves added
    a = jax.random.normal(jax.random.key(1), (2, 3))
    (g,) = tg.gradient(_sum_arrays, [True, "hi", object(), a])
    assert g[:3] == [None, None, None]
    close(g[3], jnp.ones((2, 3)))
    lin = eqx.nn.Linear(1, 1, key=jax.random.key(2))
    tree = [
        True,
        {"hi": lin},
        (5, 1.0),
        np.array([2.0, 3.0]),
        jnp.arange(3),
        jnp.array([True, False]),
        jnp.array([1.0], jnp.bfloat16),
    ]
    (g,) = tg.gradient(_sum_arrays, tree)
    ref = eqx.filter_grad(_sum_arrays)(tree)
    assert g[0] is None and g[2] == (None, None) and g[4] is None and g[5] is None
    assert type(g[1]["hi"]) is eqx.nn.Linear and g[1]["hi"].in_features == 1
    close(g[1]["hi"].weight, ref[1]["hi"].weight)
    close(g[3], ref[3])  # a float numpy array is differentiated, as in equinox
    assert g[6].dtype == jnp.bfloat16
    close(g[6].astype(jnp.float32), [1.0])


class _Holder(tg.Module):
    def __init__(self):
        self.w = jnp.array([0.5, -1.0])
        self.steps = jnp.arange(2)
        self.mask = jnp.array([True, False])
        self.key = jax.random.key(0)
        self.scale = 3.0
        self.name = "holder"

    def __call__(self, x):
        return jnp.sum(jnp.where(self.mask, self.w, 2 * self.w) * x) * self.scale + jnp.sum(
            self.steps
        )


def test_module_leaf_kinds_int_bool_key_get_none_and_static_kept():
    m = _Holder()
    x = jnp.array([2.0, 3.0])
    (g,) = tg.gradient(lambda mm: mm(x), m)
    close(g.w, [6.0, 18.0])  # scale * where(mask, 1, 2) * x
    assert g.steps is None and g.mask is None and g.key is None
    assert g.scale == 3.0 and g.name == "holder"  # static data is kept
    assert list(tg.params(m).named()) == ["w"]
    _, new = tg.update(tg.setup(optax.sgd(0.1), m), m, g)
    close(new.w, m.w - 0.1 * g.w)
    assert new.steps is m.steps and new.mask is m.mask and new.key is m.key


class _Scaled(tg.Module):
    scale = 2.0  # a class attribute

    def __init__(self, w):
        self.w = w

    @property
    def w2(self):
        return self.w * self.scale

    def method(self, y):
        return jnp.sum(jnp.sin(self.w2 * y))

    def __call__(self, y):
        return self.method(y)


def _ref_dy(w, s, y):
    return jax.grad(lambda y: jnp.sum(jnp.sin(w * s * y)))(y)


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_bound_method_property_and_class_attribute_never_stale():
    # equinox test_ad.py::test_methods: a bound method differentiated as a function
    m = _Scaled(jnp.array([0.1, 0.2, 0.3]))
    try:
        close(tg.gradient(m.method, X3)[0], _ref_dy(m.w, 2.0, X3))
        m.w = jnp.array([1.0, 1.0, 1.0])  # the instance's array replaced
        close(tg.gradient(m.method, X3)[0], _ref_dy(m.w, 2.0, X3))
        _Scaled.scale = 3.0  # the class attribute the property reads
        close(tg.gradient(m.method, X3)[0], _ref_dy(m.w, 3.0, X3))
        m2 = _Scaled(jnp.array([0.5, 0.5, 0.5]))  # another instance, same code
        close(tg.gradient(m2.method, X3)[0], _ref_dy(m2.w, 3.0, X3))
        m2.scale = 4.0  # an instance attribute shadowing the class's
        close(tg.gradient(m2, X3)[0], _ref_dy(m2.w, 4.0, X3))
        (gm,) = tg.gradient(lambda mm: mm(X3), m2)  # through the property, w.r.t. the model
        close(gm.w, jax.grad(lambda w: jnp.sum(jnp.sin(w * 4.0 * X3)))(m2.w))
        assert gm.scale == 4.0
        jm = tg.jit(m2.method)
        close(jm(X3), m2.method(X3))
        m2.w = m2.w * 0 + 2.0
        close(jm(X3), jnp.sum(jnp.sin(2.0 * 4.0 * X3)))
        del m2.scale  # back to the class's 3.0
        close(jm(X3), jnp.sum(jnp.sin(2.0 * 3.0 * X3)))
    finally:
        _Scaled.scale = 2.0


def test_implicit_gradient_through_a_captured_bound_method_follows_replacement():
    m = _Scaled(jnp.array([0.1, 0.2, 0.3]))
    f = m.method  # captured once, as equinox users hold `model.__call__`
    ps = tg.params(m)
    g = tg.gradient(lambda: f(X3), ps)
    close(g[m.w], jax.grad(lambda w: jnp.sum(jnp.sin(w * 2.0 * X3)))(m.w))
    tg.update_(tg.setup(optax.sgd(0.5), ps), ps, g)
    g = tg.gradient(lambda: f(X3), ps)  # the bound method's self holds the new array
    close(g[m.w], jax.grad(lambda w: jnp.sum(jnp.sin(w * 2.0 * X3)))(m.w))


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
@pytest.mark.parametrize("frozen", [False, True])
def test_dataclass_style_modules(frozen):
    @dataclasses.dataclass(frozen=frozen)
    class Lin(tg.Module):
        w: jax.Array
        b: jax.Array
        act: object = jnp.tanh

        def __call__(self, x):
            return self.act(self.w @ x + self.b)

    @dataclasses.dataclass(frozen=frozen)
    class Net(tg.Module):
        l1: Lin
        l2: Lin
        n: int = 3

        def __call__(self, x):
            return jnp.sum(self.l2(self.l1(x))) * self.n

    k = jax.random.split(jax.random.key(0))
    net = Net(
        Lin(jax.random.normal(k[0], (4, 3)), jnp.zeros(4)),
        Lin(jax.random.normal(k[1], (2, 4)), jnp.ones(2)),
    )
    leaves = [net.l1.w, net.l1.b, net.l2.w, net.l2.b]

    def ref_loss(p):
        h = jnp.tanh(p[0] @ X3 + p[1])
        return jnp.sum(jnp.tanh(p[2] @ h + p[3])) * 3

    ref = jax.grad(ref_loss)(leaves)
    (g,) = tg.gradient(lambda m: m(X3), net)
    assert type(g) is Net and g.n == 3 and g.l1.act is jnp.tanh
    for a, b in zip([g.l1.w, g.l1.b, g.l2.w, g.l2.b], ref, strict=True):
        close(a, b)
    ps = tg.params(net)
    assert list(ps.named()) == ["l1.w", "l1.b", "l2.w", "l2.b"]
    st = tg.setup(optax.sgd(0.1), ps)
    tg.update_(st, ps, tg.gradient(lambda: net(X3), ps))  # a frozen dataclass too
    close(net.l1.w, leaves[0] - 0.1 * ref[0])

    @tg.jit
    def step():
        tg.update_(st, ps, tg.gradient(lambda: net(X3), ps))

    step()
    p1 = [a - 0.1 * b for a, b in zip(leaves, ref, strict=True)]
    p2 = [a - 0.1 * b for a, b in zip(p1, jax.grad(ref_loss)(p1), strict=True)]
    close(net.l2.w, p2[2])
    flat, rebuild = tg.destructure(net)
    back = rebuild(flat)
    assert type(back) is Net and back.n == 3
    close(back.l2.b, net.l2.b)


def test_module_holding_functions_that_capture_arrays():
    c = {"v": jnp.array([2.0, 3.0, 4.0])}

    class M(tg.Module):
        def __init__(self):
            self.w = jnp.array([0.1, 0.2, 0.3])
            self.scale = lambda v: v * c["v"]  # a function: static, reads c fresh
            self.fp = functools.partial(jnp.multiply, jnp.array([3.0, 3.0, 3.0]))  # static

        def __call__(self, v):
            return jnp.sum(jnp.sin(self.fp(self.scale(self.w * v))))

    m = M()
    assert list(tg.params(m).named()) == ["w"]

    def ref(cv, f):
        return jax.grad(lambda w: jnp.sum(jnp.sin(f * cv * w * X3)))(m.w)

    (g,) = tg.gradient(lambda mm: mm(X3), m)
    close(g.w, ref(c["v"], 3.0))
    assert g.scale is m.scale and g.fp is m.fp
    c["v"] = jnp.array([1.0, -1.0, 1.0])
    close(tg.gradient(lambda mm: mm(X3), m)[0].w, ref(c["v"], 3.0))
    m.fp = functools.partial(jnp.multiply, jnp.array([0.5, 0.5, 0.5]))
    close(tg.gradient(lambda mm: mm(X3), m)[0].w, ref(c["v"], 0.5))
    f = tg.jit(lambda v: m(v))
    close(f(X3), m(X3))
    c["v"] = jnp.array([5.0, 1.0, 1.0])
    close(f(X3), m(X3))


class _WithPartial(tg.Module):
    def __init__(self):
        self.w = jnp.array([1.0, 2.0, 3.0])
        # a jax.tree_util.Partial is a pytree: its array is a child, a parameter
        self.p = jtu.Partial(jnp.multiply, jnp.array([1.0, 0.5, 2.0]))

    def __call__(self, x):
        return jnp.sum(self.p(self.w * x) ** 2)


def _partial_ref(m):
    return jax.grad(lambda w, a: jnp.sum((a * w * X3) ** 2), argnums=(0, 1))(m.w, m.p.args[0])


@pytest.mark.parametrize("style", ["update_", "implicit", "implicit-jit"])
def test_a_partial_held_by_a_module_trains_in_place(style):
    # Was silent: tg.update_ rebound w but left the Partial's array as it was (the
    # rebind of a functools.partial found no attribute to take: _paths._become), and
    # implicit mode refused the Partial's array as held by an object it cannot see into.
    m = _WithPartial()
    gw, ga = _partial_ref(m)
    w0, a0 = m.w, m.p.args[0]
    p_obj = m.p
    if style == "update_":
        (g,) = tg.gradient(lambda mm: mm(X3), m)
        close(g.p.args[0], ga)
        tg.update_(tg.setup(optax.sgd(0.1), m), m, g)
    else:
        ps = tg.params(m)
        assert list(ps.named()) == ["w", "p.0.0"]
        st = tg.setup(optax.sgd(0.1), ps)
        if style == "implicit":
            tg.update_(st, ps, tg.gradient(lambda: m(X3), ps))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", tg.RetraceWarning)  # compiled once
                step = tg.jit(lambda: tg.update_(st, ps, tg.gradient(lambda: m(X3), ps)))
                step()
    close(m.w, w0 - 0.1 * gw)
    close(m.p.args[0], a0 - 0.1 * ga)
    assert m.p is p_obj and m.p.func is jnp.multiply  # the same Partial, updated in place


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_pure_update_of_a_partial_matches_plain_optax():
    m = _WithPartial()
    (g,) = tg.gradient(lambda mm: mm(X3), m)
    opt = optax.adam(0.1)
    _, new = tg.update(tg.setup(opt, m), m, g)
    tree = {"w": m.w, "a": m.p.args[0]}
    u, _ = opt.update({"w": g.w, "a": g.p.args[0]}, opt.init(tree), tree)
    close(new.w, m.w + u["w"])
    close(new.p.args[0], m.p.args[0] + u["a"])


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_nested_module_key_paths_named_and_repr():
    class Block(tg.Module):
        def __init__(self, k):
            self.dense = nn.Dense(3, 3, key=k)
            self.gain = jnp.ones(3)

    class Net(tg.Module):
        def __init__(self):
            ks = jax.random.split(jax.random.key(0), 2)
            self.blocks = [Block(ks[0]), Block(ks[1])]
            self.head = {"out": nn.Dense(3, 1, key=ks[0])}
            self.act = jax.nn.relu

    net = Net()
    paths = [jtu.keystr(p, simple=True, separator=".") for p, _ in jtu.tree_leaves_with_path(net)]
    assert paths == list(tg.params(net).named())
    assert paths[:3] == ["blocks.0.dense.weight", "blocks.0.dense.bias", "blocks.0.gain"]
    first = jtu.tree_leaves_with_path(net)[0][0]
    assert isinstance(first[0], jtu.GetAttrKey) and isinstance(first[1], jtu.SequenceKey)
    text = repr(net)
    assert text.splitlines()[0] == "Net  # 34 parameters"  # 2*(9+3+3) + 3 + 1
    assert "weight: float32[3×3]" in text and "act = <function relu>" in text


def test_lazy_init_outside_then_gradient():
    class Lazy(tg.Module):
        def __init__(self, out):
            self.out = out
            self.w = None

        def __call__(self, x):
            if self.w is None:
                self.w = jnp.ones((self.out, x.shape[-1])) * 0.1
            return jnp.tanh(self.w @ x)

    m = Lazy(2)
    with pytest.raises(ValueError, match="found no floating-point arrays in the Lazy"):
        tg.params(m)
    m(X3)  # initialised by a first call outside
    assert list(tg.params(m).named()) == ["w"]
    (g,) = tg.gradient(lambda mm: jnp.sum(mm(X3)), m)
    close(g.w, jax.grad(lambda w: jnp.sum(jnp.tanh(w @ X3)))(m.w))


class _Lazy(tg.Module):
    def __init__(self):
        self.w = None


@pytest.mark.parametrize("dep", [False, True])
def test_captured_lazy_module_filled_while_traced_leaks_no_tracer(dep):
    # Was: the captured Module (no arrays in it yet) kept the tracer the function stored
    # in it, and the next call raised jax's UnexpectedTracerError (_swap.Swap._tree).
    lz = _Lazy()

    def f(v):
        if lz.w is None:
            lz.w = v * 0.1 if dep else jnp.ones(3) * 0.1
        return jnp.sum(lz.w * v)

    expected = 0.2 * X3 if dep else jnp.full(3, 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            (g,) = tg.gradient(f, X3)
            close(g, expected)
            assert lz.w is None  # taken out again, as documented for a traced value
    assert any("stores values computed from its traced arrays" in str(w.message) for w in caught)


# --- (b) equinox models as treegrad models ------------------------------------------------


def _mlp(key=0):
    return eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(key))


XB = jax.random.normal(jax.random.key(1), (6, 3))
YB = jnp.ones((6, 2))


def _mse(m, x, y):
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_eqx_mlp_jit_explicit_and_implicit_steps_and_train_match_optax():
    opt = optax.adam(1e-2)
    ref, ref_losses = optax_steps(_mlp(), _mse, opt, 3, XB, YB)
    m = _mlp()
    (g,) = tg.gradient(lambda mm: _mse(mm, XB, YB), m)
    trees_close(g, eqx.filter_grad(_mse)(m, XB, YB))
    assert type(g) is eqx.nn.MLP and g.activation is None  # a non-array leaf: None

    @tg.jit
    def step(st, m, x, y):
        loss, (g,) = tg.withgradient(lambda mm: _mse(mm, x, y), m)
        st, m = tg.update(st, m, g)
        return st, m, loss

    st = tg.setup(opt, m)
    losses = []
    for _ in range(3):
        st, m, loss = step(st, m, XB, YB)
        losses.append(float(loss))
    trees_close(m, ref)
    close(losses, ref_losses)
    assert m.activation is ref.activation

    m2 = _mlp()
    ps = tg.params(m2)
    ist = tg.setup(opt, ps)

    @tg.jit
    def istep():
        tg.update_(ist, ps, tg.gradient(lambda: _mse(m2, XB, YB), ps))

    for _ in range(3):
        istep()
    trees_close(m2, ref)  # rebound inside the frozen equinox modules

    m3 = _mlp()
    _, m3, tlosses = tg.train(_mse, m3, [(XB, YB)] * 3, tg.setup(opt, m3))
    trees_close(m3, ref)
    close(tlosses, ref_losses)


def test_eqx_grads_and_tg_grads_interchange():
    m = _mlp()
    opt = optax.sgd(0.1)
    ge = eqx.filter_grad(_mse)(m, XB, YB)
    (gt,) = tg.gradient(lambda mm: _mse(mm, XB, YB), m)
    _, a = tg.update(tg.setup(opt, m), m, ge)  # equinox's gradient tree into tg.update
    b = eqx.apply_updates(m, jtu.tree_map(lambda v: -0.1 * v, gt))  # ours into equinox's
    trees_close(a, b)
    st = tg.setup(opt, m)
    tg.update_(st, m, gt)  # in place on an equinox model (not a Params)
    trees_close(m, a)


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_eqx_shared_tie_trains_as_equinox():
    # equinox tests/test_shared.py: an embedding tied to a head through eqx.nn.Shared
    k1, k2 = jax.random.split(jax.random.key(0))

    class M(eqx.Module):
        shared: eqx.nn.Shared

        def __init__(self):
            emb = eqx.nn.Embedding(3, 4, key=k1)
            head = eqx.nn.Linear(4, 3, key=k2)
            self.shared = eqx.nn.Shared((emb, head), lambda p: p[1].weight, lambda p: p[0].weight)

        def __call__(self, t):
            e, h = self.shared()
            return h(e(t))

    toks = jnp.array([0, 2, 1])

    def loss(m):
        return jnp.sum(jax.vmap(m)(toks) ** 2)

    m = M()
    assert list(tg.params(m).named()) == ["shared.pytree.0.weight", "shared.pytree.1.bias"]
    opt = optax.adam(1e-2)
    ref, _ = optax_steps(m, loss, opt, 3)
    st, mm = tg.setup(opt, m), m
    for _ in range(3):
        (g,) = tg.gradient(loss, mm)
        st, mm = tg.update(st, mm, g)
    trees_close(mm, ref)
    e, h = mm.shared()
    assert e.weight is h.weight


class _Tied(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __init__(self):
        self.a = eqx.nn.Linear(3, 3, key=jax.random.key(0))
        b = eqx.nn.Linear(3, 3, key=jax.random.key(9))
        self.b = eqx.tree_at(lambda layer: layer.weight, b, self.a.weight)  # one array

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _tied_reference(opt, n):
    m = _Tied()

    def loss(p, x, y):
        w, ba, bb = p
        return jnp.mean((jnp.tanh(x @ w.T + ba) @ w.T + bb - y) ** 2)

    p = (m.a.weight, m.a.bias, m.b.bias)
    st = opt.init(p)
    for _ in range(n):
        u, st = opt.update(jax.grad(loss)(p, XB[:, :3], YB[:, :1] * jnp.ones(3)), st, p)
        p = optax.apply_updates(p, u)
    return p


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_same_object_tie_in_eqx_model_stays_tied_and_matches_one_shared_array():
    opt = optax.adam(1e-2)
    y = YB[:, :1] * jnp.ones(3)
    w, ba, bb = _tied_reference(opt, 3)
    m = _Tied()
    assert m.a.weight is m.b.weight
    (g,) = tg.gradient(lambda mm: _mse(mm, XB, y), m)
    assert g.b.weight is None  # the total at the first place (docs/gradients.md)

    @tg.jit
    def step(st, m):
        _, (g,) = tg.withgradient(lambda mm: _mse(mm, XB, y), m)
        return tg.update(st, m, g)

    st, mj = tg.setup(opt, m), m
    for _ in range(3):
        st, mj = step(st, mj)
    assert mj.a.weight is mj.b.weight
    close(mj.a.weight, w)
    close(mj.b.bias, bb)
    m3 = _Tied()
    ps = tg.params(m3)
    assert len(ps) == 3
    tg.train(lambda x, yy: _mse(m3, x, yy), ps, [(XB, y)] * 3, tg.setup(opt, ps))
    assert m3.a.weight is m3.b.weight
    close(m3.a.weight, w)
    close(m3.a.bias, ba)


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_eqx_static_field_float_leaf_and_int_leaf():
    class M(eqx.Module):
        w: jax.Array
        s: float
        n: jax.Array
        act: object = eqx.field(static=True)

        def __call__(self, x):
            return self.act(self.w * x) * self.s + jnp.sum(self.n)

    m = M(jnp.array([0.5, -1.0]), 2.0, jnp.arange(2), jnp.tanh)
    x = jnp.array([1.0, 3.0])
    (g,) = tg.gradient(lambda mm: jnp.sum(mm(x)), m)
    ref = eqx.filter_grad(lambda mm: jnp.sum(mm(x)))(m)
    close(g.w, ref.w)
    assert g.s is None and g.n is None and ref.s is None and ref.n is None
    _, new = tg.update(tg.setup(optax.sgd(0.1), m), m, g)
    assert new.s == 2.0 and new.n is m.n and new.act is jnp.tanh
    f = tg.jit(lambda mm, v: jnp.sum(mm(v)))
    for mm in [
        m,
        eqx.tree_at(lambda t: t.s, m, 3.0),  # a Python float leaf changed
        M(m.w, 2.0, m.n, jnp.sin),  # the static field changed
        eqx.tree_at(lambda t: t.n, m, jnp.arange(2) + 5),
    ]:
        close(f(mm, x), jnp.sum(mm(x)))


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_captured_eqx_model_replaced_between_compiled_calls():
    k1, k2 = jax.random.split(jax.random.key(0))
    holder = {"m": eqx.nn.Linear(3, 2, key=k1)}
    f = tg.jit(lambda v: holder["m"](v))

    def loss(v):
        return jnp.sum(holder["m"](v) ** 2)

    for new in [eqx.nn.Linear(3, 2, key=k2), eqx.nn.Linear(3, 2, use_bias=False, key=k1)]:
        close(f(X3), holder["m"](X3))
        close(tg.gradient(loss, X3)[0], jax.grad(loss)(X3))
        holder["m"] = new
    close(f(X3), holder["m"](X3))
    close(tg.gradient(loss, X3)[0], jax.grad(loss)(X3))


@pytest.mark.slow
def test_compiled_step_rebinding_a_captured_eqx_model_matches_optax():
    opt = optax.adam(1e-2)
    ref, ref_losses = optax_steps(_mlp(), _mse, opt, 3, XB, YB)
    box = {"model": _mlp()}
    box["state"] = tg.setup(opt, box["model"])

    @tg.jit
    def step(x, y):
        loss, (g,) = tg.withgradient(lambda m: _mse(m, x, y), box["model"])
        box["state"], box["model"] = tg.update(box["state"], box["model"], g)
        return loss

    losses = [float(step(XB, YB)) for _ in range(3)]
    close(losses, ref_losses)
    trees_close(box["model"], ref)
    assert not any(isinstance(a, jax.core.Tracer) for a in arrays(box["model"]))


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_eqx_batchnorm_state_as_aux_output():
    class Net(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __init__(self, key):
            self.lin = eqx.nn.Linear(3, 4, key=key)
            self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

        def __call__(self, x, state):
            return self.bn(self.lin(x), state)

    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    assert list(tg.params(model).named()) == ["lin.weight", "lin.bias", "bn.weight", "bn.bias"]
    x = jax.random.normal(jax.random.key(1), (8, 3))

    def loss(m, s):
        out, s2 = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, s)
        return jnp.sum(out[:, 0] * jnp.arange(8.0)), s2

    (rl, rs), rg = eqx.filter_value_and_grad(loss, has_aux=True)(model, state)
    (value, s2), (g,) = tg.withgradient(lambda m: loss(m, state), model)
    close(value, rl)
    trees_close(g, rg, 1e-4)
    trees_close(s2, rs)
    opt = optax.sgd(0.1)

    @tg.jit
    def step(st, m, s):
        (_, s2), (g,) = tg.withgradient(lambda mm: loss(mm, s), m)
        st, m = tg.update(st, m, g)
        return st, m, s2

    _, m1, s1 = step(tg.setup(opt, model), model, state)
    trees_close(m1, eqx.apply_updates(model, jtu.tree_map(lambda v: -0.1 * v, rg)), 1e-4)
    trees_close(s1, rs)


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_eqx_save_load_and_destructure(tmp_path):
    m = _mlp()
    path = tmp_path / "m.tg"
    tg.save(path, m)
    back = tg.load(path, _mlp(5))
    trees_close(back, m, 0)
    back = tg.load(path, eqx.filter_eval_shape(_mlp))
    trees_close(back, m, 0)
    wrong = eqx.nn.MLP(3, 2, 5, 1, key=jax.random.key(0))
    before = arrays(wrong)
    with pytest.raises(ValueError, match=r"'layers.0.weight' is float32\[5, 3\] in the model"):
        tg.load(path, wrong)
    assert all(a is b for a, b in zip(arrays(wrong), before, strict=True))
    st = tg.setup(optax.adam(1e-2), m)
    tg.save(tmp_path / "s.tg", (m, st))
    tg.load(tmp_path / "s.tg", (m, tg.setup(optax.adam(1e-2), m)))
    flat, rebuild = tg.destructure(m)
    ref_flat, unravel = jax.flatten_util.ravel_pytree(eqx.filter(m, eqx.is_inexact_array))
    close(flat, ref_flat, 0)
    r = rebuild(flat * 0)
    assert type(r) is eqx.nn.MLP and r.activation is m.activation
    x = jnp.ones(3)
    (gf,) = tg.gradient(lambda v: jnp.sum(rebuild(v)(x)), flat)
    close(gf, jax.grad(lambda v: jnp.sum(eqx.combine(unravel(v), m)(x)))(ref_flat))


@pytest.mark.slow  # over ~1 s on a loaded 2-core host
def test_update_with_gradient_of_another_eqx_model_changes_nothing():
    m = _mlp()
    other = eqx.nn.MLP(3, 2, 5, 1, key=jax.random.key(0))
    (g,) = tg.gradient(lambda mm: jnp.sum(mm(X3)), other)
    st = tg.setup(optax.adam(0.1), m)
    before = arrays(m)
    for fn in (tg.update, tg.update_):
        with pytest.raises(ValueError, match=r"'layers.0.weight' has shape \(5, 3\) but its"):
            fn(st, m, g)
        assert all(a is b for a, b in zip(arrays(m), before, strict=True))
    _, new = tg.update(st, m, tg.gradient(lambda mm: jnp.sum(mm(X3)), m)[0])
    # the failed calls did not advance the state: one step equals optax's first step
    ref, _ = optax_steps(m, lambda mm: jnp.sum(mm(X3)), optax.adam(0.1), 1)
    trees_close(new, ref)


def test_params_of_a_replaced_eqx_model_warn_that_it_was_replaced():
    model = _mlp()
    ps = tg.params(model)
    model = eqx.apply_updates(
        model, jtu.tree_map(lambda a: a * 0.1, eqx.filter(model, eqx.is_inexact_array))
    )
    with pytest.warns(tg.NoGradientWarning, match="the model was probably replaced"):
        g = tg.gradient(lambda: _mse(model, XB, YB), ps)
    assert all(v is None for v in g.values())
    # a loss computed outside keeps the usual message
    q = _mse(model, XB, YB)
    with pytest.warns(tg.NoGradientWarning, match="probably done outside the function") as rec:
        tg.gradient(lambda: q, tg.params(model))
    assert not any("replaced" in str(w.message) for w in rec)
