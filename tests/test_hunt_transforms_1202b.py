"""Hostile-user hunt (2 Dec): higher-order and composed differentiation, and the
implicit-mode containers.

Each test here failed before its fix, but for one guard that what a new error
advises still works. Numbers are compared with closed forms (the explicit
equivalent worked by hand: jax run eagerly costs seconds of compiles); errors
assert their message.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg

X = jnp.array([0.5, -1.0])


def _model():
    return {"W": jnp.array([[1.0, 2.0], [0.5, -1.0]]), "b": jnp.array([0.1, 0.2])}


def _out(m, x):
    return jnp.sin(m["W"] @ x + m["b"])


def _vjp(m, dy):
    """The pullback of `_out(m, X)` at `dy`, in closed form (numpy: no op-by-op compiles)."""
    d = np.cos(np.asarray(m["W"]) @ np.asarray(X) + np.asarray(m["b"])) * np.asarray(dy)
    return {"W": np.outer(d, X), "b": d}


@pytest.mark.parametrize(
    "make",
    [
        lambda m, ps: tg.jit(lambda x: tg.pullback(lambda: _out(m, x), ps))(X),
        lambda m, ps: tg.withgradient(
            lambda: (jnp.sum(_out(m, X)), tg.pullback(lambda: _out(m, X), ps)[1]), ps
        )[0][1],
        lambda m, ps: tg.pullback(lambda x: (x, tg.pullback(lambda: _out(m, x), ps)[1]), X)[0][1],
    ],
    ids=["tg.jit", "withgradient-aux", "pullback-output"],
)
def test_implicit_back_cannot_leave_the_trace_it_was_made_in(make):
    """Its Grads were keyed by the trace's parameter tracers: every lookup with the
    user's arrays missed, and `named()` gave values keyed by dead tracers."""
    m = _model()
    W = m["W"]
    ps = tg.params(m)
    with pytest.raises(TypeError, match=r"returns the backward function of an implicit-mode "):
        make(m, ps)
    assert m["W"] is W  # the model untouched


def test_implicit_back_called_inside_or_made_outside_a_trace_works():
    """What the message above advises, and a back whose keys are the user's arrays:
    neither is refused."""
    m = _model()
    ps = tg.params(m)
    dy = jnp.array([1.0, 3.0])
    ref = _vjp(m, dy)
    g = tg.jit(lambda x: tg.pullback(lambda: _out(m, x), ps)[1](dy).named())(X)
    np.testing.assert_allclose(g["W"], ref["W"], rtol=1e-6)
    _, back = tg.jit(lambda x: tg.pullback(lambda m: _out(m, x), m))(X)
    np.testing.assert_allclose(back(dy)[0]["b"], ref["b"], rtol=1e-6)
    _, back = tg.pullback(lambda: _out(m, X), ps)
    (out,) = tg.jit(lambda b: (b,))(back)  # made outside: its keys are the user's arrays
    np.testing.assert_allclose(out(dy)[m["W"]], ref["W"], rtol=1e-6)


@pytest.mark.parametrize(
    "call, api, what",
    [
        (lambda g, ps: tg.withgradient(lambda x: (jnp.sum(x), g(x)), X), "withgradient", "Grads"),
        (lambda g, ps: tg.withgradient(lambda x: (jnp.sum(x), ps), X), "withgradient", "Params"),
        (lambda g, ps: tg.pullback(lambda x: g(x), X), "pullback", "Grads"),
        (lambda g, ps: tg.pullback(lambda x: (x, [g(x)]), X), "pullback", "Grads"),
    ],
    ids=["withgradient-grads", "withgradient-params", "pullback-grads", "pullback-nested"],
)
def test_grads_or_params_in_an_output_names_the_function_called(call, api, what):
    """The message said `tg.jit: the compiled function returns ...` whatever was called."""
    m = _model()
    ps = tg.params(m)

    def g(x):
        return tg.gradient(lambda: jnp.sum(_out(m, x)), ps)

    with pytest.raises(TypeError, match=rf"^tg\.{api}: the function's output holds a tg\.{what}"):
        call(g, ps)


class _Scaled(tg.Module):
    __trainable__ = ("w", "scale")  # `scale` is a Python number: static, not a leaf

    def __init__(self):
        self.w = jnp.array([1.0, -2.0])
        self.scale = 3.0
        self.frozen = jnp.array([0.5, 0.5])

    def __call__(self, x):
        return self.w * x * self.scale + self.frozen


@pytest.mark.parametrize(
    "holder", [lambda m: m, lambda m: {"t": m}, lambda m: [m]], ids=["module", "dict", "list"]
)
def test_trainable_naming_a_static_attribute_is_not_a_leaf(holder):
    """Reading the Params crashed with an internal KeyError (the static 3.0 was
    taken for a trainable leaf of the tree)."""
    m = _Scaled()
    ps = tg.params(holder(m))
    assert list(ps) == [m.w] and len(ps.named()) == 1
    g = tg.gradient(lambda: jnp.sum(m(X) ** 2), ps)
    ref = 2 * (m.w * X * 3.0 + m.frozen) * X * 3.0
    np.testing.assert_allclose(g[m.w], ref, rtol=1e-6)
    assert next(iter(g.named().values())) is g[m.w]
    assert g.to_tree(m).frozen is None and g.to_tree(m).scale == 3.0


def test_params_passed_with_other_arguments_is_an_error_not_a_silent_none():
    """Weight decay over a Params passed as a second argument: the Params was an
    explicit argument (its gradient None) and the decay term read the model's
    arrays as constants, so the model's gradient silently lacked it."""
    m = _model()
    ps = tg.params(m)
    W = m["W"]

    def loss(m, ps):
        return jnp.sum(_out(m, X)) + sum(jnp.sum(p**2) for p in ps)

    for api in (tg.gradient, tg.withgradient, tg.pullback, tg.jacobian):
        with pytest.raises(TypeError, match=r"a tg\.Params is passed among 2 argument\(s\).*only"):
            api(loss, m, ps)
    with pytest.raises(TypeError, match=r"a tg\.Params is passed inside argument 0 \(list\)"):
        tg.gradient(lambda t: jnp.sum(_out(m, X)), [ps])
    assert m["W"] is W and list(ps) == [W, m["b"]]
    # The idiom that works, checked against its closed form.
    got = tg.gradient(lambda: loss(m, ps), ps)
    ref = _vjp(m, np.ones(2))["W"] + 2 * np.asarray(W)
    np.testing.assert_allclose(got[W], ref, rtol=1e-6)
    with pytest.raises(TypeError, match=r"a tg\.Grads is passed as \(part of\) argument 0.*named"):
        tg.gradient(lambda g: jnp.sum(g[W]), got)


def test_hessian_without_arguments_does_not_advise_its_missing_implicit_style():
    with pytest.raises(TypeError, match=r"no argument to differentiate.*model\)\.$") as e:
        tg.hessian(lambda: jnp.sum(X**2))
    assert "params" not in str(e.value)
    with pytest.raises(TypeError, match=r"implicit style: tg\.jacobian\(lambda: loss"):
        tg.jacobian(lambda: X**2)


def test_hessian_of_a_function_rebinding_what_it_captures_counts_the_rebinding_once():
    """The Hessian's trace runs the function once for the value and once per argument
    for the second derivatives; each later run started from what the one before had
    rebound (`c["s"] = c["s"] + 1` counted twice), so H was 3x where uncompiled is 2x."""
    c = {"s": jnp.array(1.0)}
    y = jnp.array([2.0])

    def f(x, y):
        c["s"] = c["s"] + 1.0
        return jnp.sum(jnp.sin(x) * c["s"]) + jnp.sum(y**3 * c["s"])

    for s in (1.0, 2.0):  # compiled, then the cached program
        hx, hy = tg.hessian(f, X, y)
        # Closed forms (jax.hessian run eagerly costs seconds of op-by-op compiles).
        np.testing.assert_allclose(hx, np.diag(-np.sin(X) * (s + 1)), rtol=1e-6)
        np.testing.assert_allclose(hy, np.diag(6 * y * (s + 1)), rtol=1e-6)
        assert float(c["s"]) == s + 1.0  # rebound once, as uncompiled


@pytest.mark.parametrize("api", ["gradient", "hessian"])
def test_rebinding_an_array_while_growing_a_captured_module_is_a_clear_error(api):
    """tg.hessian: jax's UnexpectedTracerError (a tracer leaked by the second run);
    tg.gradient: `log.s = log.s * 2` was lost silently, a tracer left in `log.xs`."""

    class Log(tg.Module):
        def __init__(self):
            self.s = jnp.array(1.0)
            self.xs = [jnp.array(0.0)]

    log = Log()

    def f(x):
        log.s = log.s * 2.0
        log.xs = [*log.xs, jnp.sum(x)]
        return jnp.sum(jnp.sin(x) * log.s)

    # The call's own run raises, before any Hessian's.
    with pytest.raises(
        TypeError,
        match=rf"tg\.{api}: the function rebinds arrays it captures, .*\(the structure of a "
        r"Log it captures changed\)",
    ):
        getattr(tg, api)(f, X)
    assert float(log.s) == 1.0 and len(log.xs) == 1  # as before the call
    assert not isinstance(log.xs[0], jax.core.Tracer)


def test_rebinding_and_replacing_a_container_error_says_what_was_replaced():
    """The message read "changed where its arrays live ( was replaced by ...)"."""
    c = {"s": jnp.array(1.0), "xs": [jnp.array(0.0)]}
    s = c["s"]

    def f(x):
        c["s"] = c["s"] + 1.0
        c["xs"] = 3
        return jnp.sum(jnp.sin(x) * c["s"])

    with pytest.raises(TypeError, match=r"arrays live \(a container was replaced by another kind"):
        tg.gradient(f, X)
    assert c["s"] is s
