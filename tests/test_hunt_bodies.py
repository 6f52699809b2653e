"""A function whose control flow (a `lax.cond` or `switch` branch, a `scan` or
`fori_loop` body, a `jax.checkpoint`-ed helper) is a long-lived function reading
the model from a global: jax keeps each traced body by the function's identity,
with the arrays it read as constants. The engine traces the user's function with
its own tracers in the user's places, so neither may leak into the other: the
user's plain calls after a gradient work (no leaked tracer), and a gradient after
a plain call reads the arrays of this call (no stale constant, no hidden
parameter). Each checked against `jax.grad` of the explicit equivalent."""

import jax
import jax.numpy as jnp
import pytest

import treegrad as tg

MODEL = {"w": jnp.full(3, 2.0)}
XS = jnp.array([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]])


# Each loss twice: reading the model from the global through a long-lived body, and
# (the reference) with the model an argument, its bodies new closures on each call.
def _cond_w(w, x):
    out = jax.lax.cond(jnp.sum(x) > 0, lambda v: v * w, lambda v: -v, x)
    return jnp.sum(out**2)


def _switch_w(w, x):
    return jnp.sum(jax.lax.switch(1, [lambda v: -v, lambda v: v * w], x) ** 2)


def _scan_w(w, x):
    return jax.lax.scan(lambda c, r: (c + jnp.sum(r * w**2), None), 0.0, XS * x)[0]


def _fori_w(w, x):
    return jax.lax.fori_loop(0, 2, lambda i, acc: acc + jnp.sum(XS[i] * w**2), jnp.sum(x))


def _checkpoint_w(w, x):
    return jnp.sum(jax.checkpoint(lambda v: jnp.sin(v * w))(x))


def _cond_branch(v):
    return v * MODEL["w"]


def _scan_body(c, r):
    return c + jnp.sum(r * MODEL["w"] ** 2), None


def _fori_body(i, acc):
    return acc + jnp.sum(XS[i] * MODEL["w"] ** 2)


@jax.checkpoint
def _remat(v):
    return jnp.sin(v * MODEL["w"])


def _cond(x):
    out = jax.lax.cond(jnp.sum(x) > 0, _cond_branch, lambda v: -v, x)
    return jnp.sum(out**2)


def _switch(x):
    return jnp.sum(jax.lax.switch(1, [lambda v: -v, _cond_branch], x) ** 2)


def _scan(x):
    return jax.lax.scan(_scan_body, 0.0, XS * x)[0]


def _fori(x):
    return jax.lax.fori_loop(0, 2, _fori_body, jnp.sum(x))


def _checkpoint(x):
    return jnp.sum(_remat(x))


# The scan in the default run; the others over ~1 s each, in the slow one.
_SLOW = pytest.mark.slow
LOSSES = [pytest.param(f, marks=_SLOW) for f in (_cond, _switch, _fori, _checkpoint)] + [_scan]
EXPLICIT = {_cond: _cond_w, _switch: _switch_w, _scan: _scan_w, _fori: _fori_w}
EXPLICIT[_checkpoint] = _checkpoint_w


def _name(loss):
    return loss.__name__.strip("_")


def _reference(loss, x):
    """jax.grad of the loss with the model an argument: (d/dw, d/dx)."""
    return jax.grad(EXPLICIT[loss], argnums=(0, 1))(MODEL["w"], x)


@pytest.fixture(autouse=True)
def _model():
    MODEL["w"] = jnp.full(3, 2.0)
    yield
    MODEL["w"] = jnp.full(3, 2.0)


@pytest.mark.parametrize("loss", LOSSES, ids=_name)
def test_plain_calls_after_a_gradient_leak_no_tracer(loss):
    x = jnp.array([1.0, 0.5, 2.0])
    gw, gx = _reference(loss, x)
    ps = tg.params(MODEL)
    assert jnp.allclose(tg.gradient(lambda: loss(x), ps)[MODEL["w"]], gw)
    assert jnp.allclose(tg.gradient(loss, x)[0], gx)
    # The user's own calls, plain and transformed, after treegrad traced the body.
    expected = EXPLICIT[loss](MODEL["w"], x)
    assert jnp.allclose(loss(x), expected)
    assert jnp.allclose(jax.grad(loss)(x), gx)
    assert jnp.allclose(jax.jit(loss)(x), expected)


@pytest.mark.parametrize("loss", LOSSES, ids=_name)
def test_a_gradient_after_a_plain_call_reads_this_calls_model(loss):
    x = jnp.array([1.0, 0.5, 2.0])
    loss(x)  # the body traced by jax, holding the model's array as a constant
    # Implicit: the parameter is found (not "hidden"), with its gradient.
    ps = tg.params(MODEL)
    assert jnp.allclose(tg.gradient(lambda: loss(x), ps)[MODEL["w"]], _reference(loss, x)[0])
    # Explicit, after the model changed: this call's model, as uncompiled.
    MODEL["w"] = jnp.array([3.0, -1.0, 0.5])
    loss(x)
    MODEL["w"] = jnp.array([1.5, 2.0, -0.5])
    assert jnp.allclose(tg.gradient(loss, x)[0], _reference(loss, x)[1])
    assert jnp.allclose(tg.jit(loss)(x), EXPLICIT[loss](MODEL["w"], x))


def test_two_functions_sharing_a_body():
    x = jnp.array([1.0, 0.5, 2.0])
    other = lambda x: 2.0 * _scan(x)
    assert jnp.allclose(tg.gradient(_scan, x)[0], _reference(_scan, x)[1])
    assert jnp.allclose(tg.gradient(other, x)[0], 2.0 * _reference(_scan, x)[1])
    assert jnp.allclose(tg.jit(_scan)(x), _scan_w(MODEL["w"], x))
