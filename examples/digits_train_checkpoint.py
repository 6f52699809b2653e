"""Train a digits classifier with `tg.train`, save a checkpoint, reload it.

The data ships inside treegrad (`treegrad.datasets.digits`), so this runs
offline. Run: `python examples/digits_train_checkpoint.py`.
"""

import os
import tempfile

import jax
import jax.numpy as jnp
import optax

import treegrad as tg
from treegrad import datasets, nn


def make_model(key):
    k1, k2 = jax.random.split(key)
    return nn.Chain(nn.Dense(64, 64, jax.nn.relu, key=k1), nn.Dense(64, 10, key=k2))


def loss(model, x, y):
    return tg.losses.logitcrossentropy(model(x), y)


def accuracy(model, x, y):
    return float(jnp.mean(jnp.argmax(model(x), axis=-1) == y))


def main(epochs: int = 10, verbose: bool = True, folder: str | None = None) -> list[float]:
    x, y = datasets.digits()
    (xtr, ytr), (xte, yte) = datasets.split(x, y)
    data = [(jnp.asarray(a), jnp.asarray(b)) for a, b in datasets.batches(xtr, ytr, 64)]
    model = make_model(jax.random.key(0))
    state = tg.setup(optax.adam(3e-3), model)
    state, model, losses = tg.train(loss, model, data, state, epochs=epochs)
    acc = accuracy(model, jnp.asarray(xte), jnp.asarray(yte))

    path = os.path.join(folder or tempfile.mkdtemp(), "digits.npz")
    tg.save(path, (model, state))
    fresh = make_model(jax.random.key(1))
    restored, _ = tg.load(path, (fresh, tg.setup(optax.adam(3e-3), fresh)))
    assert accuracy(restored, jnp.asarray(xte), jnp.asarray(yte)) == acc
    if verbose:
        print(f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        print(f"test accuracy {acc:.3f}")
        print(f"checkpoint {path} reloaded: same accuracy")
    return losses


if __name__ == "__main__":
    main()
