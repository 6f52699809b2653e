"""Pins the JAX internals treegrad relies on; a failure here means a JAX upgrade changed them."""

import jax
import jax.numpy as jnp
import numpy as np

from treegrad import _jaxpr


def _traced(fn, *args):
    return jax.jit(fn).trace(*args).jaxpr


def test_captured_arrays_are_constants_by_identity():
    W = jnp.ones((3, 5))
    s = jnp.asarray(2.0)  # 0-d arrays stay constants too
    consts = _jaxpr.constants(_traced(lambda: jnp.sum(W) * s))
    assert any(c is W for c in consts) and any(c is s for c in consts)


def test_constants_inside_inner_jit_are_found():
    W = jnp.ones(4)
    inner = jax.jit(lambda: jnp.sum(W))
    assert any(c is W for c in _jaxpr.constants(_traced(lambda: inner() + 1.0)))


def test_dependencies_follow_inner_jit():
    inner = jax.jit(lambda a, b: a * 2.0)
    closed = _traced(
        lambda a, b, c: inner(a, b) + jnp.sum(c), jnp.ones(()), jnp.ones(()), jnp.ones(2)
    )
    assert _jaxpr.dependencies(closed, [0]) == {0, 2}


def test_dependencies_of_a_forward_value_ignore_the_backward_pass():
    # The engine reads which inputs the loss depends on from the jaxpr of the
    # whole program (forward and backward): the loss is output 0.
    def program(a, b):
        loss, vjp = jax.vjp(lambda a, b: jnp.sum(a**2), a, b)
        return loss, vjp(jnp.ones(()))

    closed = _traced(program, jnp.ones(2), jnp.ones(2))
    assert _jaxpr.dependencies(closed, [0]) == {0}


def test_trace_then_call_traces_once():
    calls = []

    def f(x):
        calls.append(1)
        return x * 2

    j = jax.jit(f)
    j.trace(jnp.ones(2))
    j(jnp.ones(2))
    assert calls == [1]


def test_is_tracer():
    assert not _jaxpr.is_tracer(jnp.ones(2))
    seen = []
    jax.jit(lambda x: seen.append(_jaxpr.is_tracer(x)) or x)(jnp.ones(2))
    assert seen == [True]


def test_reached_finds_gradients_that_depend_on_the_cotangent():
    # A gradient that does not depend on the cotangent is a structural zero.
    inner = jax.jit(lambda a, b: jnp.sum(a) * 3.0)

    def program(a, b, c, ct):
        _, vjp = jax.vjp(lambda a, b, c: inner(a, b) + jnp.sum(c * 0.0), a, b, c)
        return vjp(ct)

    closed = _traced(program, jnp.ones(2), jnp.ones(2), jnp.ones(2), jnp.ones(()))
    assert _jaxpr.reached(closed, [3]) == {0, 2}  # b is unused; c is used (times zero)


def test_jax_reuses_a_traced_body_by_identity_until_forget_bodies():
    # What `forget_bodies` works around: a scan body (or cond branch) that reads a
    # global array is traced once and reused with that array as a constant, even
    # by plain, uncompiled calls.
    held = {"w": jnp.full(3, 2.0)}

    def body(c, x):
        return c + jnp.sum(x * held["w"]), None

    def run():
        return float(jax.lax.scan(body, 0.0, jnp.ones((2, 3)))[0])

    assert run() == 12.0
    held["w"] = jnp.full(3, 3.0)
    assert run() == 12.0  # jax's memo: the old array
    _jaxpr.forget_bodies()
    assert run() == 18.0


def test_weakly_typed_keeps_values_dtype_and_sharding():
    # `_manifest` restores a saved weak type with it (no public jax function does).
    x = jax.device_put(jnp.asarray([0.5, -1.0], jnp.bfloat16))
    y = _jaxpr.weakly_typed(x)
    assert y.weak_type and not x.weak_type
    assert y.dtype == x.dtype and y.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))
    # Weak, it takes the other operand's dtype, as `jnp.asarray(0.5)` does.
    assert (jnp.ones(2, jnp.float16) * y).dtype == jnp.float16
