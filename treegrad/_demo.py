"""`treegrad demo`: train a digits classifier in explicit and in implicit style.

Both runs start from the same weights and see the same batches; the demo
prints a table per style and the largest difference between their final
parameters, writes a loss-curve PNG, and fails (exit 1) if they disagree.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from . import datasets, losses, nn
from ._gradient import withgradient
from ._optim import setup, update, update_
from ._params import params

TOLERANCE = 1e-5


def _model(seed: int) -> nn.Chain:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return nn.Chain(nn.Dense(64, 64, jax.nn.relu, key=k1), nn.Dense(64, 10, key=k2))


def _loss(model: Any, x: Any, y: Any) -> Any:
    return losses.logitcrossentropy(model(x), y)


def _accuracy(model: Any, x: Any, y: Any) -> float:
    return float(jnp.mean(jnp.argmax(model(x), axis=-1) == y))


def _train(
    style: str, model: Any, data: list[Any], epochs: int, rule: Any, bar: Any
) -> tuple[Any, list[float], float]:
    """Train in one style; return the model, the loss per step and the steady-state time."""
    if style == "explicit":
        state = setup(rule, model)

        def step(x: Any, y: Any) -> Any:
            nonlocal state, model
            loss, (g,) = withgradient(lambda m: _loss(m, x, y), model)
            state, model = update(state, model, g)
            return loss

    else:
        ps = params(model)
        state = setup(rule, ps)

        def step(x: Any, y: Any) -> Any:
            loss, grads = withgradient(lambda: _loss(model, x, y), ps)
            update_(state, ps, grads)
            return loss

    curve: list[Any] = []
    start = 0.0
    for _ in range(epochs):
        for x, y in data:
            if len(curve) == 1:  # time the steady state, not the first compile
                jax.block_until_ready(model)
                start = time.perf_counter()
            curve.append(step(x, y))
            bar.update(1)
    jax.block_until_ready(model)
    return model, [float(v) for v in curve], time.perf_counter() - start


def run(
    epochs: int = 20, batch_size: int = 64, plot: str | None = "treegrad-demo.png", seed: int = 0
) -> int:
    """Run the demo; return the process exit code (0: the two styles agree)."""
    x, y = datasets.digits()
    (xtr, ytr), (xte, yte) = datasets.split(x, y, seed=seed)
    data = [
        (jnp.asarray(a), jnp.asarray(b))
        for a, b in datasets.batches(xtr, ytr, batch_size, seed=seed)
    ]
    xte_j, yte_j = jnp.asarray(xte), jnp.asarray(yte)
    rule = optax.adam(3e-3)
    steps = epochs * len(data)
    print(
        f"treegrad demo: digits ({len(xtr)} train / {len(xte)} test, 8x8 pixels), "
        f"MLP 64-64-10, adam, {epochs} epochs x {len(data)} batches of {batch_size}"
    )
    results = {}
    with tqdm(total=2 * steps, unit="step", desc="training", disable=None) as bar:
        for style in ("explicit", "implicit"):
            results[style] = _train(style, _model(seed), data, epochs, rule, bar)

    print()
    print(f"{'style':<10} {'final loss':>11} {'test accuracy':>14} {'ms/step':>9}")
    for style, (model, curve, elapsed) in results.items():
        final = float(np.mean(curve[-len(data) :]))
        acc = _accuracy(model, xte_j, yte_j)
        print(f"{style:<10} {final:>11.4f} {acc:>14.3f} {1e3 * elapsed / (steps - 1):>9.3f}")
    a = jax.tree_util.tree_leaves(results["explicit"][0])
    b = jax.tree_util.tree_leaves(results["implicit"][0])
    diff = max(float(jnp.max(jnp.abs(p - q))) for p, q in zip(a, b, strict=True))
    print(f"\nlargest difference between the two styles' final parameters: {diff:.3g}")
    if plot:
        _plot(results, plot)
    if diff > TOLERANCE:
        print(f"FAIL: the styles disagree by more than {TOLERANCE}")
        return 1
    print("OK: explicit and implicit training agree")
    return 0


def _plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        print("(matplotlib not installed: no plot written)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (style, (_, curve, _)), ls in zip(results.items(), ("-", "--"), strict=True):
        ax.plot(curve, ls, label=style, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    ax.set_title("treegrad demo: digits, explicit vs implicit")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curves written to {Path(path).resolve()}")
