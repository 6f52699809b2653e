"""Property: explicit == implicit == jax.grad on random models and inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treegrad as tg
from treegrad import nn


class Net(tg.Module):
    def __init__(self, sizes, act, key):
        keys = jax.random.split(key, len(sizes))
        self.layers = [
            nn.Dense(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=False)
        ]
        self.scale = jax.random.normal(keys[-1], ())  # a 0-d parameter
        self.act = act

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x) * self.scale


@pytest.mark.slow  # 6.6 s on a quiet 2-core machine: a compile per random model shape
@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    batch=st.integers(1, 4),
    act=st.sampled_from([jnp.tanh, jax.nn.sigmoid, jnp.sin]),
    seed=st.integers(0, 2**16),
)
def test_explicit_implicit_and_jax_grad_agree(sizes, batch, act, seed):
    key = jax.random.key(seed)
    model = Net(sizes, act, key)
    x = jax.random.normal(jax.random.fold_in(key, 1), (batch, sizes[0]))
    y = jax.random.normal(jax.random.fold_in(key, 2), (batch, sizes[-1]))

    def loss(m):
        return jnp.mean((m(x) - y) ** 2)

    (explicit,) = tg.gradient(loss, model)
    implicit = tg.gradient(lambda: loss(model), tg.params(model)).to_tree(model)
    reference = jax.jit(jax.grad(loss))(model)
    for e, i, r in zip(
        jax.tree_util.tree_leaves(explicit),
        jax.tree_util.tree_leaves(implicit),
        jax.tree_util.tree_leaves(reference),
        strict=True,
    ):
        np.testing.assert_array_equal(e, i)
        np.testing.assert_allclose(e, r, rtol=1e-6, atol=1e-6)
