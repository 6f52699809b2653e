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
    """Mean squared error: `mean((yhat - y) ** 2)`.

    Arguments:
        yhat: predictions.
        y: targets, broadcastable to `yhat`.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> tg.losses.mse(jnp.array([1.0, 2.0]), jnp.array([1.0, 4.0]))
        Array(2., dtype=float32)
    """
    return jnp.mean(optax.losses.squared_error(yhat, y))


def mae(yhat: Any, y: Any) -> Any:
    """Mean absolute error: `mean(abs(yhat - y))`.

    Arguments:
        yhat: predictions.
        y: targets, broadcastable to `yhat`.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> tg.losses.mae(jnp.array([1.0, 2.0]), jnp.array([1.0, 4.0]))
        Array(1., dtype=float32)
    """
    return jnp.mean(jnp.abs(yhat - y))


def huber(yhat: Any, y: Any, delta: float = 1.0) -> Any:
    """Mean Huber loss: quadratic within `delta` of the target, linear outside.

    Arguments:
        yhat: predictions.
        y: targets.
        delta: where the loss turns from quadratic to linear.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> tg.losses.huber(jnp.array([3.0, 0.5]), jnp.array([0.0, 0.0]))
        Array(1.3125, dtype=float32)
    """
    return jnp.mean(optax.losses.huber_loss(yhat, y, delta=delta))


def logitcrossentropy(logits: Any, y: Any) -> Any:
    """Softmax cross-entropy from logits, averaged over the batch.

    Arguments:
        logits: unnormalised scores, classes on the last axis.
        y: integer labels, or one-hot / probability targets shaped like `logits`.

    Returns:
        A scalar.

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
    """Cross-entropy from probabilities (on logits, `logitcrossentropy` is stabler).

    Arguments:
        probs: class probabilities, classes on the last axis.
        y: integer labels, or one-hot targets.
        eps: probabilities are clipped to `[eps, 1]` before the log.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> round(float(tg.losses.crossentropy(jnp.array([[0.5, 0.5]]), jnp.array([0]))), 4)
        0.6931
    """
    return logitcrossentropy(jnp.log(jnp.clip(probs, eps, 1.0)), y)


def logitbinarycrossentropy(logits: Any, y: Any) -> Any:
    """Binary cross-entropy from logits.

    Arguments:
        logits: unnormalised scores.
        y: labels in [0, 1], shaped like `logits`.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> round(float(tg.losses.logitbinarycrossentropy(jnp.array([0.0]), jnp.array([1.0]))), 4)
        0.6931
    """
    return jnp.mean(optax.losses.sigmoid_binary_cross_entropy(logits, y))


def binarycrossentropy(p: Any, y: Any, eps: float = 1e-7) -> Any:
    """Binary cross-entropy from probabilities.

    Arguments:
        p: probabilities of the positive class.
        y: labels in [0, 1], shaped like `p`.
        eps: probabilities are clipped to `[eps, 1 - eps]`.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> round(float(tg.losses.binarycrossentropy(jnp.array([0.5]), jnp.array([1.0]))), 4)
        0.6931
    """
    p = jnp.clip(p, eps, 1.0 - eps)
    return logitbinarycrossentropy(jnp.log(p) - jnp.log1p(-p), y)
