"""`tg.train`: the compiled training loop with a progress bar."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from tqdm.auto import tqdm

from ._gradient import withgradient
from ._jit import jit
from ._optim import update


class NonFiniteLossError(FloatingPointError):
    """Raised by `tg.train` when the loss becomes NaN or infinite.

    Attributes `.model` and `.state` are those of the last good step, and
    `.losses` the losses up to it.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.ones(())}
        >>> data = [(jnp.ones(2),), (jnp.array([jnp.nan, 1.0]),)]
        >>> loss = lambda m, x: jnp.sum(m["w"] * x)
        >>> try:
        ...     tg.train(loss, model, data, tg.setup(optax.sgd(0.1), model))
        ... except tg.NonFiniteLossError as e:
        ...     print(len(e.losses), round(float(e.model["w"]), 4))
        1 0.8
    """

    def __init__(self, message: str, state: Any, model: Any, losses: list[float]):
        super().__init__(message)
        self.state = state
        self.model = model
        self.losses = losses


class StepInfo(NamedTuple):
    """What a `tg.train` callback receives after each step.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.ones(())}
        >>> seen = []
        >>> loss = lambda m, x: jnp.sum(m["w"] * x)
        >>> state = tg.setup(optax.sgd(0.1), model)
        >>> _ = tg.train(loss, model, [(jnp.ones(2),)] * 3, state, callbacks=[seen.append])
        >>> [(s.epoch, s.step) for s in seen]
        [(0, 0), (0, 1), (0, 2)]
    """

    epoch: int
    step: int
    loss: float
    model: Any
    state: Any


@jit
def _step(loss: Callable[..., Any], state: Any, model: Any, batch: tuple[Any, ...]) -> Any:
    value, (g,) = withgradient(lambda m: loss(m, *batch), model)
    state, model = update(state, model, g)
    return state, model, value


def train(
    loss: Callable[..., Any],
    model: Any,
    data: Iterable[Any],
    state: Any,
    *,
    epochs: int = 1,
    callbacks: Iterable[Callable[[StepInfo], Any]] = (),
    progress: bool | None = None,
) -> tuple[Any, Any, list[float]]:
    """Train `model` on `data`: one compiled step (gradient + update) per batch.

    Arguments:
        loss: `loss(model, *batch)` returning a scalar.
        model: the model.
        data: an iterable of batches (tuples, or single arrays); re-iterated
            each epoch, so use a list or a re-iterable loader.
        state: from `tg.setup`.
        epochs: passes over `data`.
        callbacks: functions called with a `tg.StepInfo` after every step.
        progress: show a progress bar (default: only on a terminal).

    Returns:
        `(state, model, losses)` with one loss per step. The inputs are not
        modified.

    Raises:
        NonFiniteLossError: the loss became NaN or infinite; the error names the
            epoch and step and carries the last good `state` and `model`.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.zeros(())}
        >>> data = [(jnp.array([1.0, 2.0]), jnp.array([2.0, 4.0]))] * 20
        >>> loss = lambda m, x, y: tg.losses.mse(m["w"] * x, y)
        >>> state, model, losses = tg.train(loss, model, data, tg.setup(optax.adam(0.1), model))
        >>> losses[-1] < losses[0]
        True
    """
    callbacks = list(callbacks)
    losses: list[float] = []
    batches = data if isinstance(data, (list, tuple)) else None
    total = len(batches) * epochs if batches is not None else None
    bar = tqdm(
        total=total, disable=None if progress is None else not progress, unit="step", leave=False
    )
    try:
        for epoch in range(epochs):
            for step, batch in enumerate(data):
                args = batch if isinstance(batch, tuple) else (batch,)
                new_state, new_model, value = _step(loss, state, model, args)
                v = float(value)
                if not math.isfinite(v):
                    raise NonFiniteLossError(
                        f"tg.train: the loss is {v} at epoch {epoch}, step {step}; stopped. The "
                        "error's .model and .state are those of the last good step (lower the "
                        "learning rate, or check that batch for NaNs).",
                        state,
                        model,
                        losses,
                    )
                state, model = new_state, new_model
                losses.append(v)
                bar.update(1)
                if bar.n % 10 == 0:
                    bar.set_postfix(loss=f"{v:.4g}")
                for cb in callbacks:
                    cb(StepInfo(epoch, step, v, model, state))
    finally:
        bar.close()
    return state, model, losses
