"""Hunt: the usual call's one-step paths give exactly what the checked paths give.

`tg.withgradient` of a function seen before runs `Entry.run_plain`, and `tg.update`
of the usual step runs `_optim._update_plain`; each hands anything unusual to the
checked path. Here a table of models (containers, Modules, numpy and bfloat16
leaves, scalars) and optax rules is trained three steps twice, once on the one-step
paths and once with them turned off, and every gradient, model and state leaf must
be bitwise equal, and the gradients equal to `jax.grad`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

# The default run stays under 3 minutes; CI runs this file in the slow run.
pytestmark = pytest.mark.slow

X = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)


def _dict():
    return {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.array([0.1, -0.2])}


def _nested():
    return {"layers": [_dict(), {"w": jnp.eye(2), "b": jnp.zeros(2)}], "scale": jnp.array(1.5)}


def _chain():
    return nn.Chain(
        nn.Dense(2, 3, jnp.tanh, key=jax.random.key(0)), nn.Dense(3, 2, key=jax.random.key(1))
    )


def _numpy_leaf():
    m = _dict()
    m["w"] = np.asarray(m["w"])
    return m


def _bf16():
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), _dict())


def _apply(m, x):
    if isinstance(m, nn.Chain):
        return m(x)
    if "layers" in m:
        for layer in m["layers"]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return x * m["scale"]
    return jnp.tanh(x @ m["w"] + m["b"])


def _loss(m, x):
    return jnp.sum(_apply(m, x).astype(jnp.float32) ** 2)


MODELS = {"dict": _dict, "nested": _nested, "chain": _chain, "numpy": _numpy_leaf, "bf16": _bf16}
RULES = {
    "adam": lambda: optax.adam(0.1),
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1)),
    "injected": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
}


def _train(make_model, make_rule):
    model = make_model()
    state = tg.setup(make_rule(), model)
    record = []
    for _ in range(4):
        value, (g,) = tg.withgradient(lambda m: _loss(m, X), model)
        record.append((value, g))
        state, model = tg.update(state, model, g)
        record.append((model, state._leaves))
    return record


class _Counted:
    def __init__(self, fn):
        self.fn, self.hits = fn, 0

    def __call__(self, *args):
        out = self.fn(*args)
        self.hits += out is not None
        return out


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("model", MODELS)
def test_one_step_paths_equal_the_checked_paths_bitwise(model, rule, monkeypatch):
    run_plain = _Counted(tg._engine.Entry.run_plain)
    update_plain = _Counted(tg._optim._update_plain)
    monkeypatch.setattr(tg._engine.Entry, "run_plain", lambda self, *a: run_plain(self, *a))
    monkeypatch.setattr(tg._optim, "_update_plain", update_plain)
    fast = _train(MODELS[model], RULES[rule])
    # The first call of each traces; every later one took the one-step path.
    assert (run_plain.hits, update_plain.hits) == (3, 3)
    monkeypatch.setattr(tg._engine.Entry, "run_plain", lambda self, *a: None)
    monkeypatch.setattr(tg._optim, "_update_plain", lambda *a: None)
    checked = _train(MODELS[model], RULES[rule])
    got = jax.tree_util.tree_leaves(fast)
    want = jax.tree_util.tree_leaves(checked)
    assert jax.tree_util.tree_structure(fast) == jax.tree_util.tree_structure(checked)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # And the gradients are jax.grad's, at each step's model.
    models = [m for m, _ in fast[1::2]]
    for m, (_, g) in zip([MODELS[model](), *models[:-1]], fast[0::2], strict=True):
        want_g = jax.grad(_loss)(m, X)
        for a, b in zip(
            jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want_g), strict=True
        ):
            np.testing.assert_allclose(
                np.asarray(a, np.float32),
                np.asarray(b, np.float32),
                rtol=2e-2 if a.dtype == jnp.bfloat16 else 1e-5,
                atol=1e-6,
            )
