"""Loss functions, named as in Flux, delegating to `optax.losses`.

Every loss reduces to a scalar mean over the batch.

Examples:
    >>> import jax.numpy as jnp, treegrad as tg
    >>> tg.losses.mse(jnp.array([1.0, 2.0]), jnp.array([1.0, 4.0]))
    Array(2., dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._jaxpr import is_tracer as _is_tracer

__all__ = [
    "binarycrossentropy",
    "crossentropy",
    "huber",
    "logitbinarycrossentropy",
    "logitcrossentropy",
    "mae",
    "mse",
]


def _array(api: str, name: str, x: Any) -> Any:
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        raise TypeError(f"{api}: {name} must be an array (or a number), got a {type(x).__name__}.")
    return x


def _pair(api: str, yhat: Any, y: Any, names: tuple[str, str] = ("yhat", "y")) -> None:
    """`y` must broadcast to `yhat`'s shape without changing it.

    A `(n,)` target against `(n, 1)` predictions would broadcast to `(n, n)`
    and compare every prediction with every target: a silent wrong loss.
    """
    _array(api, names[0], yhat)
    _array(api, names[1], y)
    a, b = np.shape(yhat), np.shape(y)
    try:
        out = np.broadcast_shapes(a, b)
    except ValueError:
        raise ValueError(
            f"{api}: {names[1]} of shape {b} does not broadcast to {names[0]} of shape {a}; "
            f"give both the same shape."
        ) from None
    if out != a:
        raise ValueError(
            f"{api}: {names[1]} of shape {b} broadcasts against {names[0]} of shape {a} to "
            f"{out}, which would compare every prediction with every target; reshape one to "
            f"the other's shape (e.g. {names[1]}.reshape({names[0]}.shape))."
        )


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
    _pair("tg.losses.mse", yhat, y)
    if not jnp.issubdtype(jnp.result_type(yhat), jnp.inexact):
        # optax's own error would name neither this function nor the argument.
        raise TypeError(
            f"tg.losses.mse: yhat has dtype {jnp.result_type(yhat)}; predictions must be "
            "floating point (a loss is differentiated): pass yhat.astype(jnp.float32)."
        )
    if jnp.iscomplexobj(yhat) or jnp.iscomplexobj(y):
        # Flux's mse, mean(abs2(yhat - y)): optax's squared_error takes real arrays only.
        return jnp.mean(jnp.square(jnp.abs(jnp.asarray(yhat) - y)))
    # `_pair` made sure y broadcasts to yhat's shape; optax wants the shapes equal.
    return jnp.mean(optax.losses.squared_error(yhat, jnp.broadcast_to(y, jnp.shape(yhat))))


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
    _pair("tg.losses.mae", yhat, y)
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
    _pair("tg.losses.huber", yhat, y)
    try:
        d = np.asarray(delta, dtype=float)
    except jax.errors.TracerArrayConversionError:  # traced (a schedule): unchecked
        d = None
    if d is not None and (d.ndim != 0 or not d > 0):
        raise ValueError(f"tg.losses.huber: delta must be positive (a scalar), got {delta}.")
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
    return _logitcrossentropy("tg.losses.logitcrossentropy", "logits", logits, y)


def _integer_labels(api: str, what: str, x: Any, y: Any) -> bool:
    """Check `y` against `x` (classes on the last axis): integer labels, or targets."""
    _array(api, what, x)
    _array(api, "y", y)
    shape, ys = np.shape(x), np.shape(y)
    if jnp.issubdtype(jnp.asarray(y).dtype, jnp.integer):
        if ys != shape[:-1]:
            raise ValueError(
                f"{api}: integer labels y of shape {ys} do not fit {what} of shape {shape}: "
                f"give one class index per row, shape {shape[:-1]} "
                f"(e.g. y.reshape({shape[:-1]}))."
            )
        if not _is_tracer(y) and np.size(y):
            # A label out of range would pick another class (-1: the last) or give NaN.
            # Traced, it cannot be checked here: `_out_of_range` makes its loss NaN.
            values = np.asarray(y)
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= shape[-1]:
                raise ValueError(
                    f"{api}: label {high if high >= shape[-1] else low} is out of range: "
                    f"{what} has {shape[-1]} classes, labels go from 0 to {shape[-1] - 1}."
                )
        return True
    if ys != shape:
        raise ValueError(
            f"{api}: targets y of shape {ys} do not match {what} of shape {shape}; give "
            f"one-hot or probability targets of shape {shape}, or integer labels of shape "
            f"{shape[:-1]}."
        )
    return False


_EPS = 1e-7


def _eps(x: Any, eps: float | None) -> Any:
    """The `eps` of a probability loss: as given, or by default 1e-7 where `x`'s dtype
    resolves it, else that dtype's machine epsilon (Flux's `epseltype`).

    In bfloat16 and float16, `1 - 1e-7` rounds to 1 (the clip then keeps p = 1 and
    the loss is infinite) and 1e-7 is below the smallest normal float16 (a subnormal,
    flushed to 0 where the hardware flushes them); float32 and float64 keep 1e-7.
    """
    if eps is not None:
        return eps
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        return _EPS
    info = jnp.finfo(dtype)
    if float(info.tiny) > _EPS or float(np.asarray(1 - _EPS, dtype)) == 1.0:
        return float(info.eps)
    return _EPS


def _logitcrossentropy(api: str, what: str, logits: Any, y: Any) -> Any:
    if _integer_labels(api, what, logits, y):
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.mean(_out_of_range(losses, y, np.shape(logits)[-1]))
    return jnp.mean(optax.losses.softmax_cross_entropy(logits, y))


def _out_of_range(values: Any, y: Any, n: int) -> Any:
    """NaN where a traced label is out of range (negative ones would count from the end)."""
    y = jnp.asarray(y)
    return jnp.where((y < 0) | (y >= n), jnp.nan, values)


def crossentropy(probs: Any, y: Any, eps: float | None = None) -> Any:
    """Cross-entropy from probabilities (on logits, `logitcrossentropy` is stabler).

    Arguments:
        probs: class probabilities, classes on the last axis.
        y: integer labels, or one-hot targets.
        eps: probabilities below `eps` are raised to it before the log. Default:
            1e-7, or the machine epsilon of `probs`'s dtype where that dtype cannot
            resolve 1e-7 (bfloat16: 2**-7, float16: 2**-10), as Flux's `epseltype`.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> round(float(tg.losses.crossentropy(jnp.array([[0.5, 0.5]]), jnp.array([0]))), 4)
        0.6931
    """
    api = "tg.losses.crossentropy"
    integer = _integer_labels(api, "probs", probs, y)
    # The probabilities as given (Flux's crossentropy): a softmax of their log would
    # renormalise them, and the loss of [0.2, 0.2, 0.2] would be log 3, not -log 0.2.
    # Raised to eps with `where`, not clipped to [eps, 1]: at a probability of exactly
    # 1 (or eps), a clip's tie would halve the gradient of the log.
    probs = jnp.asarray(probs)
    eps = _eps(probs, eps)
    logp = jnp.log(jnp.where(probs < eps, eps, probs))
    if integer:
        picked = jnp.take_along_axis(logp, jnp.asarray(y)[..., None], axis=-1)[..., 0]
        return -jnp.mean(_out_of_range(picked, y, probs.shape[-1]))
    return -jnp.mean(jnp.sum(y * logp, axis=-1))


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
    _pair("tg.losses.logitbinarycrossentropy", logits, y, ("logits", "y"))
    return jnp.mean(optax.losses.sigmoid_binary_cross_entropy(logits, y))


def binarycrossentropy(p: Any, y: Any, eps: float | None = None) -> Any:
    """Binary cross-entropy from probabilities.

    Arguments:
        p: probabilities of the positive class.
        y: labels in [0, 1], shaped like `p`.
        eps: probabilities are clipped to `[eps, 1 - eps]`. Default: 1e-7, or the
            machine epsilon of `p`'s dtype where that dtype cannot resolve 1e-7
            (bfloat16: 2**-7, float16: 2**-10; there `1 - 1e-7` rounds to 1 and a
            saturated probability would give an infinite loss), as Flux's `epseltype`.

    Returns:
        A scalar.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg
        >>> round(float(tg.losses.binarycrossentropy(jnp.array([0.5]), jnp.array([1.0]))), 4)
        0.6931
    """
    _pair("tg.losses.binarycrossentropy", p, y, ("p", "y"))
    eps = _eps(p, eps)
    p = jnp.clip(p, eps, 1.0 - eps)
    return jnp.mean(optax.losses.sigmoid_binary_cross_entropy(jnp.log(p) - jnp.log1p(-p), y))
