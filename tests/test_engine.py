"""The engine's outputs and costs: complex parameters, numpy leaves, empty models,
memory held by the cache, first-call and trace counts."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

from .helpers import finite_difference


def test_complex_gradient_is_the_direction_of_steepest_ascent():
    z = jnp.array([1.0 + 2.0j, -0.5 + 1.0j])
    f = lambda z: jnp.sum(jnp.abs(z) ** 2 + jnp.real(z) * 3.0)
    (g,) = tg.gradient(f, z)
    # df/dx + i df/dy by finite differences of the real function of (x, y).
    x, y = np.real(np.asarray(z)), np.imag(np.asarray(z))
    dfdx = finite_difference(lambda a: float(np.sum(a**2 + y**2 + 3 * a)), x)
    dfdy = finite_difference(lambda b: float(np.sum(x**2 + b**2 + 3 * x)), y)
    np.testing.assert_allclose(g, dfdx + 1j * dfdy, rtol=1e-3)
    np.testing.assert_allclose(g, jnp.conj(jax.grad(f)(z)), rtol=1e-6)  # jax's conjugate


@pytest.mark.parametrize("rule", [optax.adam(0.05), optax.sgd(0.05)], ids=["adam", "sgd"])
def test_training_a_complex_model_lowers_its_loss(rule):
    # Fit complex weights w so that w * x matches a complex target, in both styles.
    x = jnp.array([1.0 + 1.0j, 2.0 - 0.5j, -1.0 + 0.3j])
    target = jnp.array([0.5 - 2.0j, 1.0 + 1.0j, -0.3j])
    loss = lambda m: jnp.sum(jnp.abs(m["w"] * x - target) ** 2)
    model = {"w": jnp.zeros(3, jnp.complex64)}
    state = tg.setup(rule, model)
    first = float(loss(model))
    for _ in range(60):
        (g,) = tg.gradient(loss, model)
        state, model = tg.update(state, model, g)
    assert float(loss(model)) < 0.05 * first
    implicit = {"w": jnp.zeros(3, jnp.complex64)}
    ps = tg.params(implicit)
    st = tg.setup(rule, ps)
    for _ in range(60):
        tg.update_(st, ps, tg.gradient(lambda: loss(implicit), ps))
    np.testing.assert_allclose(implicit["w"], model["w"], rtol=1e-5, atol=1e-6)


def test_numpy_float_leaves_follow_one_rule_everywhere():
    model = {"w": np.ones(3, np.float32), "b": jnp.zeros(3)}
    loss = lambda m: jnp.sum(m["w"] * 2.0 + m["b"])
    assert tg.is_differentiable(model["w"])
    (g,) = tg.gradient(loss, model)
    np.testing.assert_allclose(g["w"], jax.grad(loss)(model)["w"])
    state = tg.setup(optax.sgd(0.1), model)
    assert state["w"] is not None  # trained by the optimiser too
    _, new = tg.update(state, model, g)
    np.testing.assert_allclose(new["w"], [0.8, 0.8, 0.8])
    tg.update_(state, model, g)
    np.testing.assert_allclose(model["w"], [0.8, 0.8, 0.8])
    ints = {"n": np.arange(3)}
    assert not tg.is_differentiable(ints["n"])
    assert tg.gradient(lambda m: jnp.sum(m["n"]).astype(float), ints)[0]["n"] is None


class _Empty(tg.Module):
    def __init__(self):
        self.name = "empty"


@pytest.mark.parametrize(
    "model",
    [{}, [], (), _Empty(), {"a": {}, "b": []}],
    ids=["dict", "list", "tuple", "module", "nested"],
)
def test_empty_models_give_gradients_of_the_same_structure(model):
    (g,) = tg.gradient(lambda m: jnp.asarray(1.0), model)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(model)
    assert type(g) is type(model)


def _differentiate_and_forget():
    big = jnp.ones((1000, 1000))
    batch = jnp.ones((10, 1000))
    model = {"w": big}
    tg.gradient(lambda m: jnp.sum(m["w"] @ batch.T), model)
    tg.withgradient(lambda: jnp.sum(model["w"]), tg.params(model))
    return [weakref.ref(big), weakref.ref(batch)]


def test_the_cache_frees_the_users_arrays():
    refs = _differentiate_and_forget()
    gc.collect()
    assert [r() for r in refs] == [None, None]  # as jax.jit(jax.grad(...)) would
    assert tg._cache.cache_size() == 2


def test_the_cache_is_bounded_by_entries(monkeypatch):
    monkeypatch.setattr(tg._cache, "MAX_ENTRIES", 5)
    w = jnp.ones(2)
    for k in range(12):
        ns = {"jnp": jnp}
        exec(f"def f(v):\n    return jnp.sum(v) * {k}\n", ns)  # a new code object each time
        assert float(tg.gradient(ns["f"], w)[0][0]) == k
    assert tg._cache.cache_size() == 5


def test_a_new_lambda_each_step_traces_once():
    traces = []

    def loss(w, xb):
        traces.append(1)
        return jnp.sum((xb @ w) ** 2)

    w = jnp.array([1.0, -2.0])
    for i in range(20):
        xb = jnp.full((4, 2), float(i))
        (g,) = tg.gradient(lambda w: loss(w, xb), w)  # noqa: B023 -- the point of the test
        np.testing.assert_allclose(g, jax.grad(loss)(w, xb) if i % 7 == 0 else g)
    assert len(traces) == 1 + 3  # ours once; jax.grad's three reference calls


def test_unused_inputs_are_none_and_the_program_is_pruned():
    traces = []

    def f(a, b):
        traces.append(1)
        return jnp.sum(a**2)

    for _ in range(3):
        ga, gb = tg.gradient(f, jnp.ones(2), jnp.ones(3))
        assert gb is None
        np.testing.assert_allclose(ga, [2.0, 2.0])
    # Traced once to find the unused input, once without differentiating it; then cached.
    assert len(traces) == 2


def _grad_of_closure(a, b, v):
    # One code object for every call below: each goes through the cache's usual-call path
    # (`_cache._lookup`), which must hand every unusual call to the general one.
    return tg.gradient(lambda v: jnp.sum(v * a) + jnp.sum(jnp.sin(v) * b), v)[0]


def test_the_usual_call_path_hands_ties_and_new_dtypes_to_the_general_one():
    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
    v = jnp.array([0.5, 0.25])
    calls = [
        (a, b, v),  # distinct captured arrays: the path the next calls are checked on
        (a, a, v),  # the same array captured twice
        (a, b, v.astype(jnp.bfloat16)),  # a new float dtype at the argument
        (a, b, v),
        (b, b, v),
        (a, b, v.astype(jnp.float16)),
        (a, b, np.asarray(v)),  # a numpy argument (its dtype is read another way)
        (a, b, np.asarray(v)),
    ]
    for x, y, w in calls:
        got = _grad_of_closure(x, y, w)
        want = jax.grad(lambda v, x=x, y=y: jnp.sum(v * x) + jnp.sum(jnp.sin(v) * y))(w)
        assert got.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # An integer argument where a float one was: not differentiated (None), not an error.
    assert _grad_of_closure(a, b, jnp.array([1, 2])) is None
    np.testing.assert_allclose(_grad_of_closure(a, b, v), a + jnp.cos(v) * b)


def test_the_usual_update_path_hands_other_gradient_trees_to_the_general_one():
    # tg.update's inline path takes a gradient tree of the model's own structure with an
    # array at every leaf; a None, a 1-tuple around it or another structure go the long way.
    model = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}
    rule = optax.sgd(0.1)
    state = tg.setup(rule, model)
    g = {"w": jnp.array([1.0, -1.0]), "b": jnp.array([2.0])}
    state, m1 = tg.update(state, model, g)  # builds the model's generated flatten
    state, m2 = tg.update(state, m1, g)  # the inline path
    np.testing.assert_allclose(m2["w"], model["w"] - 0.2 * g["w"], rtol=1e-6)
    state, m3 = tg.update(state, m2, {"w": None, "b": g["b"]})
    assert m3["w"] is m2["w"]  # no gradient: the same array object, not only its value
    np.testing.assert_allclose(m3["b"], m2["b"] - 0.1 * g["b"])
    with pytest.raises(TypeError, match=r"got a 1-tuple of gradients.*\(g,\) = tg.gradient"):
        tg.update(state, m3, (g,))
    with pytest.raises(
        ValueError, match=r"gradient tree does not match the model \(first difference at 'b'\)"
    ):
        tg.update(state, m3, {"w": g["w"]})
    # Tied since setup: named, on the inline path too.
    with pytest.raises(ValueError, match="'b' and 'w' are now one array"):
        tg.update(state, {"w": m3["w"], "b": m3["w"]}, {"w": g["w"], "b": g["w"]})


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_the_usual_step_takes_neither_general_path_and_matches_plain_optax(monkeypatch):
    # The naive loop's usual call (`Entry.run_plain`) and step (`_optim._update_plain`)
    # skip the general paths; what they give must be what those (and jax, optax) give.
    x = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)

    def loss(m, x):
        return jnp.sum(jnp.tanh(x @ m["w"] + m["b"]) ** 2)

    def value_and_grad(model):  # a new lambda each call, of one code object
        return tg.withgradient(lambda m: loss(m, x), model)

    model = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.array([0.1, -0.2])}
    rule = optax.adam(0.1)
    ref_m, opt_state = model, rule.init(model)
    state = tg.setup(rule, model)
    _, (g,) = value_and_grad(model)
    state, model = tg.update(state, model, g)  # both paths learn the structures here
    u, opt_state = rule.update(g, opt_state, ref_m)
    ref_m = optax.apply_updates(ref_m, u)

    def general(*args, **kwargs):
        raise AssertionError("the usual call took the general path")

    monkeypatch.setattr(tg._engine.Entry, "run", general)
    monkeypatch.setattr(tg._optim, "_run", general)
    for _ in range(3):
        value, (g,) = value_and_grad(model)
        want_v, want_g = jax.value_and_grad(loss)(ref_m, x)
        np.testing.assert_allclose(value, want_v, rtol=1e-6)
        for k in model:
            np.testing.assert_allclose(g[k], want_g[k], rtol=1e-6)
        state, model = tg.update(state, model, g)
        u, opt_state = rule.update(want_g, opt_state, ref_m)
        ref_m = optax.apply_updates(ref_m, u)
        for k in model:
            np.testing.assert_allclose(model[k], ref_m[k], rtol=1e-6)


def test_an_integer_argument_where_a_float_one_was_is_refused_while_tracing():
    # Which inputs are differentiated was read from the first call's dtypes; jax traces
    # each new dtype, and that trace refuses it (before the user's function runs).
    traces = []
    c = jnp.array([2.0, 3.0])

    def f(v):
        traces.append(v.dtype)
        return jnp.sum(v * c)

    v, n = jnp.array([1.0, 1.0]), jnp.array([1, 2])
    for _ in range(2):
        np.testing.assert_allclose(tg.gradient(lambda v: f(v), v)[0], c)
        assert tg.gradient(lambda v: f(v), n)[0] is None
    assert traces == [jnp.float32, jnp.int32]  # each kind once: no trace on the way back
