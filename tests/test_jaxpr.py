"""Pins the JAX internals treegrad relies on; a failure here means a JAX upgrade changed them."""

import jax
import jax.numpy as jnp
import numpy as np

from treegrad import _jaxpr


def test_captured_arrays_are_constants_by_identity():
    W = jnp.ones((3, 5))
    s = jnp.asarray(2.0)  # 0-d arrays stay constants too
    closed, shape = _jaxpr.stage(lambda: jnp.sum(W) * s, [])
    consts = _jaxpr.constants(closed)
    assert any(c is W for c in consts) and any(c is s for c in consts)
    assert shape.shape == ()


def test_constants_inside_inner_jit_are_found():
    W = jnp.ones(4)
    inner = jax.jit(lambda: jnp.sum(W))
    closed, _ = _jaxpr.stage(lambda: inner() + 1.0, [])
    assert any(c is W for c in _jaxpr.constants(closed))


def test_dependencies_follow_inner_jit():
    inner = jax.jit(lambda a, b: a * 2.0)
    closed, _ = _jaxpr.stage(
        lambda a, b, c: inner(a, b) + jnp.sum(c), [jnp.ones(()), jnp.ones(()), jnp.ones(2)]
    )
    assert _jaxpr.dependencies(closed, [0]) == {0, 2}


def test_as_function_evaluates_staged_jaxpr():
    closed, _ = _jaxpr.stage(lambda a, b: (a * b, a + b), [jnp.ones(2), jnp.full(2, 3.0)])
    out = _jaxpr.as_function(closed)(jnp.full(2, 2.0), jnp.ones(2))
    np.testing.assert_array_equal(out[0], [2.0, 2.0])
    np.testing.assert_array_equal(out[1], [3.0, 3.0])
