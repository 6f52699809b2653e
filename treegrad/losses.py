"""Loss functions, named as in Flux, delegating to `optax.losses`.

Every loss reduces to a scalar mean over the batch.

Examples:
    >>> import jax.numpy as jnp, treegrad as tg
    >>> tg.losses.mse(jnp.array([1.0, 2.0]), jnp.array([1.0, 4.0]))
    Array(2., dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

__all__ = [
    "binarycrossentropy",
    "crossentropy",
    "huber",
    "logitbinarycrossentropy",
    "logitcrossentropy",
    "mae",
    "mse",
]


def mse(yhat: Any, y: Any) -> Any:
    """Mean squared error: `mean((yhat - y) ** 2)`."""
    return jnp.mean(optax.losses.squared_error(yhat, y))


def mae(yhat: Any, y: Any) -> Any:
    """Mean absolute error: `mean(abs(yhat - y))`."""
    return jnp.mean(jnp.abs(yhat - y))


def huber(yhat: Any, y: Any, delta: float = 1.0) -> Any:
    """Mean Huber loss (quadratic within `delta`, linear outside)."""
    return jnp.mean(optax.losses.huber_loss(yhat, y, delta=delta))


def logitcrossentropy(logits: Any, y: Any) -> Any:
    """Softmax cross-entropy from logits; `y` is integer labels or one-hot/probabilities.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> logits = jnp.array([[2.0, 0.0], [0.0, 2.0]])
        >>> a = tg.losses.logitcrossentropy(logits, jnp.array([0, 1]))
        >>> b = tg.losses.logitcrossentropy(logits, jnp.eye(2))
        >>> bool(jnp.allclose(a, b))
        True
    """
    if jnp.issubdtype(jnp.asarray(y).dtype, jnp.integer):
        return jnp.mean(optax.losses.softmax_cross_entropy_with_integer_labels(logits, y))
    return jnp.mean(optax.losses.softmax_cross_entropy(logits, y))


def crossentropy(probs: Any, y: Any, eps: float = 1e-7) -> Any:
    """Cross-entropy from probabilities (use `logitcrossentropy` on logits: it is stabler)."""
    return logitcrossentropy(jnp.log(jnp.clip(probs, eps, 1.0)), y)


def logitbinarycrossentropy(logits: Any, y: Any) -> Any:
    """Binary cross-entropy from logits, labels in [0, 1]."""
    return jnp.mean(optax.losses.sigmoid_binary_cross_entropy(logits, y))


def binarycrossentropy(p: Any, y: Any, eps: float = 1e-7) -> Any:
    """Binary cross-entropy from probabilities."""
    p = jnp.clip(p, eps, 1.0 - eps)
    return logitbinarycrossentropy(jnp.log(p) - jnp.log1p(-p), y)
