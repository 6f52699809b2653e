"""Explicit mode: gradient, withgradient, pullback, jacobian, hessian."""

import collections
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg

from .helpers import MLP, assert_trees_close, finite_difference, mse

W = jax.random.normal(jax.random.key(0), (3, 5))
b = jnp.zeros(3)
x = jnp.array([3.0, 1, 0, 1, 2])


def test_flux_seed_example():
    gW, gb = tg.gradient(lambda W, b: jnp.sum(W @ x + b), W, b)
    np.testing.assert_allclose(gW, np.outer(np.ones(3), x))
    np.testing.assert_allclose(gb, np.ones(3))


def test_model_gradient_matches_jax_grad():
    m = MLP(jax.random.key(1))
    xs = jax.random.normal(jax.random.key(2), (7, 4))
    ys = jax.random.normal(jax.random.key(3), (7, 1))
    (g,) = tg.gradient(lambda m: mse(m, xs, ys), m)
    assert type(g) is MLP and g.act is jax.nn.tanh
    assert_trees_close(g, jax.grad(mse)(m, xs, ys))


def test_against_finite_differences():
    f = lambda v: jnp.sum(jnp.sin(v) * v**2)
    v = jnp.array([0.3, -1.2, 2.0])
    (g,) = tg.gradient(f, v)
    fd = finite_difference(lambda a: float(np.sum(np.sin(a) * a**2)), v)
    np.testing.assert_allclose(g, fd, rtol=1e-3)


def test_structural_zero_is_none():
    assert tg.gradient(lambda a, c: jnp.sum(a), x, b)[1] is None
    g = tg.gradient(lambda d: jnp.sum(d["used"]), {"used": x, "unused": b})[0]
    assert g["unused"] is None
    np.testing.assert_array_equal(g["used"], np.ones(5))


def test_non_differentiable_leaves_are_none():
    tree = {
        "w": jnp.ones(2),
        "n": jnp.arange(3),
        "flag": jnp.array([True, False]),
        "key": jax.random.key(0),
        "name": "layer",
        "k": 3,
    }
    (g,) = tg.gradient(
        lambda t: jnp.sum(t["w"]) * t["k"] + jnp.sum(t["n"]).astype(jnp.float32), tree
    )
    assert g["n"] is None and g["flag"] is None and g["key"] is None
    assert g["name"] is None and g["k"] is None
    np.testing.assert_array_equal(g["w"], [3.0, 3.0])


def test_new_lambda_per_call_traces_once_and_sees_each_batch():
    traces = []

    def loss(w, xb):
        traces.append(1)
        return jnp.sum((xb @ w) ** 2)

    w = jnp.array([1.0, -2.0])
    for i in range(50):
        xb = jnp.full((4, 2), float(i))
        (g,) = tg.gradient(lambda w: loss(w, xb), w)  # noqa: B023 -- the point of the test
        ref = jax.grad(loss)(w, xb)
        np.testing.assert_allclose(g, ref)
    # jax.grad above traced loss 50 times itself; ours traced it once.
    assert len(traces) == 50 + 1


def test_changed_global_is_seen():
    global SCALE
    SCALE = jnp.array(2.0)
    f = lambda v: jnp.sum(v * SCALE)
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 2.0
    SCALE = jnp.array(5.0)
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 5.0


def test_changed_closure_cell_and_object_attribute():
    class Holder:  # not a pytree: treegrad walks its attributes
        def __init__(self):
            self.scale = jnp.array(2.0)

    h = Holder()
    c = jnp.array(3.0)
    f = lambda v: jnp.sum(v * c * h.scale)
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 6.0
    h.scale = jnp.array(10.0)
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 30.0
    c = jnp.array(1.0)
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 10.0


def test_captured_python_number_is_static_and_retraced():
    traces = []
    for k in (1.0, 2.0, 2.0):

        def f(v, k=k):
            traces.append(k)
            return jnp.sum(v) * k

        assert float(tg.gradient(f, jnp.ones(()))[0]) == k
    assert traces == [1.0, 2.0]


def test_hidden_capture_warns_and_stays_fresh():
    o = collections.deque([jnp.array(2.0)])  # a container treegrad does not see into
    f = lambda v: v * o[0]
    with pytest.warns(tg.RetraceWarning, match=r"cannot cache.*float32 scalar.*re-traced"):
        assert float(tg.gradient(f, jnp.ones(()))[0]) == 2.0
    o[0] = jnp.array(7.0)
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 7.0


def test_object_with_slots_is_seen_into():
    class Slotted:
        __slots__ = ("w",)

    o = Slotted()
    o.w = jnp.array(2.0)
    f = lambda v: v * o.w
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 2.0
    o.w = jnp.array(7.0)
    assert float(tg.gradient(f, jnp.ones(()))[0]) == 7.0
    assert tg._cache.cache_size() == 1


def test_withgradient_tuple_output_is_aux():
    class Out(NamedTuple):
        loss: jax.Array
        pred: jax.Array

    (value, (g,)) = tg.withgradient(lambda v: Out(jnp.sum(v**2), 2 * v), x)
    assert isinstance(value, Out)
    np.testing.assert_allclose(value.loss, np.sum(np.asarray(x) ** 2))
    np.testing.assert_allclose(value.pred, 2 * np.asarray(x))
    np.testing.assert_allclose(g, 2 * np.asarray(x))


def test_pullback():
    _, back = tg.pullback(lambda a, c: a * jnp.sin(c), x, b[0] + 1.0)
    ga, gc = back(jnp.ones(5))
    np.testing.assert_allclose(ga, np.full(5, np.sin(1.0)), rtol=1e-6)
    np.testing.assert_allclose(gc, np.sum(np.asarray(x)) * np.cos(1.0), rtol=1e-6)
    assert tg.pullback(lambda a, c: a * 2, x, b)[1](jnp.ones(5))[1] is None


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_jacobian_and_hessian_against_jax():
    f = lambda v: jnp.tanh(W @ v)
    (J,) = tg.jacobian(f, x)
    np.testing.assert_allclose(J, jax.jit(jax.jacrev(f))(x), rtol=1e-5, atol=1e-6)
    h = lambda v: jnp.sum(jnp.sin(v) ** 2)
    (H,) = tg.hessian(h, x)
    np.testing.assert_allclose(H, jax.hessian(h)(x), rtol=1e-5, atol=1e-6)


def test_nested_in_jit_vmap():
    def per_example(v):
        return tg.gradient(lambda w: jnp.sum(jnp.sin(w * v)), jnp.ones(5))[0]

    batch = jnp.stack([x, 2 * x])
    got = jax.jit(jax.vmap(per_example))(batch)
    ref = jax.vmap(lambda v: jax.grad(lambda w: jnp.sum(jnp.sin(w * v)))(jnp.ones(5)))(batch)
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_nested_in_grad_and_scan():
    def inner(v):
        return tg.gradient(lambda w: jnp.sum(w**3), v)[0]

    # d/dv sum(3 v^2) = 6 v
    np.testing.assert_allclose(
        jax.grad(lambda v: jnp.sum(inner(v)))(x), 6 * np.asarray(x), rtol=1e-6
    )

    def step(w, _):
        (g,) = tg.gradient(lambda w: jnp.sum(w**2), w)
        return w - 0.1 * g, None

    w, _ = jax.lax.scan(step, x, None, length=3)
    np.testing.assert_allclose(w, np.asarray(x) * 0.8**3, rtol=1e-6)


def test_non_scalar_loss_names_jacobian():
    with pytest.raises(TypeError, match=r"tg\.jacobian"):
        tg.gradient(lambda v: v * 2, x)


def test_integer_loss():
    with pytest.raises(TypeError, match="floating-point scalar"):
        tg.gradient(lambda v: jnp.sum(v).astype(jnp.int32), x)


def test_non_callable():
    with pytest.raises(TypeError, match="expects a function"):
        tg.gradient(3, x)


def test_loss_returning_python_object():
    with pytest.raises(TypeError, match=r"real scalar.*returned a str"):
        tg.gradient(lambda v: "loss", x)
    with pytest.raises(TypeError, match="returned a dict"):
        tg.gradient(lambda v: {"loss": jnp.sum(v)}, x)


def test_tied_leaves_stay_tied_and_get_the_total_at_the_first_place():
    w = jnp.array([1.0, 2.0])
    tree = {"a": w, "b": w}
    seen = []

    def loss(t):
        seen.append(t["a"] is t["b"])  # inside the trace too: one array at two places
        return jnp.sum(t["a"] * 3.0) + jnp.sum(t["b"] ** 2)

    (g,) = tg.gradient(loss, tree)
    assert seen == [True]
    ref = jax.grad(lambda v: loss({"a": v, "b": v}))(w)  # the total, by jax.grad
    np.testing.assert_allclose(g["a"], ref)
    np.testing.assert_allclose(ref, [5.0, 7.0])
    assert g["b"] is None


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_compile_reused_across_models_of_same_shape():
    m1, m2 = MLP(jax.random.key(1)), MLP(jax.random.key(2))
    xs, ys = jnp.ones((3, 4)), jnp.zeros((3, 1))
    grad = lambda model: tg.gradient(lambda m: mse(m, xs, ys), model)
    grad(m1)
    n = tg._cache.cache_size()
    (g2,) = grad(m2)
    assert tg._cache.cache_size() == n
    assert_trees_close(g2, jax.grad(mse)(m2, xs, ys))


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(tg._cache, "MAX_ENTRIES", 3)
    for k in range(6):
        assert float(tg.gradient(lambda v, k=k: jnp.sum(v) * k, jnp.ones(()))[0]) == k
    assert tg._cache.cache_size() == 3
