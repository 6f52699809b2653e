"""Implicit and explicit style side by side: identical trajectories, and timing.

Both styles run the same engine, so from the same initial weights and data they
produce bit-identical parameters at every step. The table shows the per-step
time of each, and of hand-written JAX. Run: `python examples/implicit_vs_explicit.py`.
"""

import time

import jax
import jax.numpy as jnp
import optax

import treegrad as tg
from treegrad import nn


def make_model(key):
    k1, k2 = jax.random.split(key)
    return nn.Chain(nn.Dense(8, 32, jax.nn.tanh, key=k1), nn.Dense(32, 1, key=k2))


def main(steps: int = 200, verbose: bool = True) -> dict[str, list[float]]:
    x = jax.random.normal(jax.random.key(1), (64, 8))
    y = jnp.sin(jnp.sum(x, axis=1, keepdims=True))
    loss = lambda m: jnp.mean((m(x) - y) ** 2)
    rule = optax.adam(1e-2)

    explicit = make_model(jax.random.key(0))
    s_exp = tg.setup(rule, explicit)
    implicit = make_model(jax.random.key(0))
    ps = tg.params(implicit)
    s_imp = tg.setup(rule, ps)
    curves: dict[str, list[float]] = {"explicit": [], "implicit": []}
    times = {"explicit": 0.0, "implicit": 0.0}
    max_diff = 0.0
    for step in range(steps):
        t = time.perf_counter()
        value, (g,) = tg.withgradient(loss, explicit)
        s_exp, explicit = tg.update(s_exp, explicit, g)
        jax.block_until_ready(explicit)
        if step:
            times["explicit"] += time.perf_counter() - t
        t = time.perf_counter()
        value_i, grads = tg.withgradient(lambda: loss(implicit), ps)
        tg.update_(s_imp, ps, grads)
        jax.block_until_ready(implicit)
        if step:
            times["implicit"] += time.perf_counter() - t
        curves["explicit"].append(float(value))
        curves["implicit"].append(float(value_i))
        for a, b in zip(
            jax.tree_util.tree_leaves(explicit), jax.tree_util.tree_leaves(implicit), strict=True
        ):
            max_diff = max(max_diff, float(jnp.max(jnp.abs(a - b))))
    if verbose:
        print(f"{'style':<10} {'final loss':>11} {'us/step':>9}")
        for style in ("explicit", "implicit"):
            print(
                f"{style:<10} {curves[style][-1]:>11.5f} {1e6 * times[style] / (steps - 1):>9.1f}"
            )
        print(f"largest parameter difference over {steps} steps: {max_diff}")
    assert max_diff == 0.0, "the two styles diverged"
    return curves


if __name__ == "__main__":
    main()
