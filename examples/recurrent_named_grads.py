"""Which weight does each gradient belong to? A small RNN in implicit style.

Zygote's raw gradient dictionary mixed weights with internal objects; treegrad's
`Grads` holds exactly the registered parameters, and `grads.named()` gives each
its path in the model. Run: `python examples/recurrent_named_grads.py`.
"""

import jax
import jax.numpy as jnp
import optax

import treegrad as tg
from treegrad import nn


class SequenceModel(tg.Module):
    """An RNN over a sequence, then a linear read-out of the last hidden state."""

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.rnn = nn.Recurrence(nn.RNNCell(2, 3, key=k1))
        self.head = nn.Dense(3, 1, key=k2)

    def __call__(self, xs):
        h0 = self.rnn.cell.initial_state(xs.shape[1:-1])
        h, _ = self.rnn(h0, xs)
        return self.head(h)


def make_data(key, n=32, steps=3):
    xs = jax.random.normal(key, (steps, n, 2))  # time, batch, features
    ys = jnp.sum(xs[..., 0], axis=0, keepdims=True).T * 0.5  # a running sum to learn
    return xs, ys


def main(steps: int = 300, verbose: bool = True) -> list[float]:
    model = SequenceModel(jax.random.key(0))
    xs, ys = make_data(jax.random.key(1))
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    losses = []
    for step in range(steps):
        loss, grads = tg.withgradient(lambda: jnp.mean((model(xs) - ys) ** 2), ps)
        if verbose and step == 0:
            print("gradients by parameter (exactly the registered ones, no internal keys):")
            for name, g in grads.named().items():
                print(
                    f"  {name:<14} shape {tuple(g.shape)}  |grad| {float(jnp.linalg.norm(g)):.4f}"
                )
        tg.update_(state, ps, grads)
        losses.append(float(loss))
    if verbose:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
