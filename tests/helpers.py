"""Shared test models and numerical references."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import treegrad as tg
from treegrad import nn


class MLP(tg.Module):
    def __init__(self, key, sizes=(4, 8, 1)):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [
            nn.Dense(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=True)
        ]
        self.act = jax.nn.tanh

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def assert_trees_close(a, b, rtol=1e-6, atol=1e-6):
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda v: v is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda v: v is None)
    assert ta == tb, f"structures differ:\n{ta}\n{tb}"
    for x, y in zip(la, lb, strict=True):
        if x is None or y is None:
            assert x is None and y is None, (x, y)
        else:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def finite_difference(f, x, eps=1e-3):
    """Central differences of scalar f at float64 copy of array x."""
    x = np.asarray(x, dtype=np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


def _masked(x):
    return isinstance(x, optax.MaskedNode)


def restore_own_entries(rule, old, new, skip):
    """Plain optax state `new`, with the per-parameter entries of skipped parameters
    taken from `old` (shared entries, e.g. `count`, stay new)."""
    marks = optax.tree_map_params(
        rule,
        lambda x, s: x if _masked(x) else s,
        new,
        skip,
        transform_non_params=lambda v: jax.tree_util.tree_map(lambda _: False, v),
        is_leaf=_masked,
    )
    marks = jax.tree_util.tree_leaves(marks)
    new_leaves, treedef = jax.tree_util.tree_flatten(new)
    old_leaves = jax.tree_util.tree_leaves(old)
    assert len(marks) == len(new_leaves)
    merged = [o if m else n for m, n, o in zip(marks, new_leaves, old_leaves, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, merged)


def assert_leaves_equal(a, b):
    """The same number of leaves, each bit-identical."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def run_on_cpu_devices(script, devices, timeout=300):
    """Run `script` (dedented) in a fresh Python with `devices` host CPU devices (jax reads
    XLA_FLAGS once, at import, so a test process cannot change its own device count)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent.parent),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
