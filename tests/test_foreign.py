"""Other libraries' pytree models (equinox) work everywhere a model is accepted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

eqx = pytest.importorskip("equinox")


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_equinox_model_both_styles_and_optimiser():
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    x, y = jnp.ones((5, 3)), jnp.zeros((5, 2))

    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    ref = eqx.filter_grad(loss)(model)
    (g,) = tg.gradient(loss, model)
    assert type(g) is type(model)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    ps = tg.params(model)
    assert list(ps.named())[:2] == ["layers.0.weight", "layers.0.bias"]
    grads = tg.gradient(lambda: loss(model), ps)
    for p, r in zip(ps, jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(grads[p], r, rtol=1e-5, atol=1e-7)

    state = tg.setup(optax.adam(1e-2), model)
    _, new = tg.update(state, model, g)
    assert float(loss(new)) < float(loss(model))
    before = float(loss(model))
    istate = tg.setup(optax.adam(1e-2), ps)
    tg.update_(istate, ps, grads)  # rebinds inside the frozen equinox module
    assert float(loss(model)) < before
