"""Convolutions over one or two spatial axes, channels last (NWC / NHWC)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._module import Module
from ._basic import as_int, check_activation, check_float_dtype, check_key, check_size

_DIMS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}


def _entries(name: str, value: Any) -> tuple[Any, ...]:
    """An int (numpy ints too) or a sequence of them, as a tuple of its entries."""
    if as_int(value) is not None:
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"Conv: {name} must be an int or a tuple of ints, got {value!r}.") from None


def _per_axis(name: str, value: Any, n: int) -> tuple[int, ...]:
    values = (value,) * n if as_int(value) is not None else _entries(name, value)
    if len(values) != n:
        raise ValueError(
            f"Conv: {name} has {len(values)} entries but the kernel has {n} spatial axes; give "
            f"an int or {n} ints."
        )
    return tuple(check_size("Conv", name, v) for v in values)


def _pair(pair: Any) -> tuple[int, int] | None:
    try:
        lo, hi = (as_int(v) for v in pair)
    except (TypeError, ValueError):
        return None
    return None if lo is None or hi is None else (lo, hi)


def _padding(padding: Any, n: int) -> Any:
    if isinstance(padding, str) and padding in ("SAME", "VALID", "SAME_LOWER"):
        return padding
    p = as_int(padding)
    if p is not None and p >= 0:
        return ((p, p),) * n
    if p is None and not isinstance(padding, str):
        try:
            pairs = tuple(_pair(pair) for pair in padding)
        except TypeError:
            pairs = ()
        if len(pairs) == n and None not in pairs:
            return pairs
    raise ValueError(
        f'Conv: padding must be "SAME", "VALID", an int or a sequence of {n} (low, high) '
        f"pairs of ints, got {padding!r}."
    )


class Conv(Module):
    """A 1-D or 2-D convolution, channels last.

    Arguments:
        kernel_size: an int (1-D) or a tuple of one or two ints.
        in_channels: channels of the input (its last axis).
        out_channels: channels of the output.
        activation: applied to the output (default identity).
        key: PRNG key for the Glorot-uniform kernel.
        stride: per spatial axis (int or tuple).
        dilation: kernel dilation per spatial axis (int or tuple).
        padding: "SAME", "VALID", an int, or a sequence of (low, high) pairs.

    Input `(batch, *spatial, in_channels)` (the batch axis is optional);
    `weight` has shape `(*kernel_size, in_channels, out_channels)`. Sizes may be
    numpy integers. An input of lower precision or of integers is promoted
    with the weights (as `Dense` and `flax.linen.Conv` do); an input smaller
    than the (dilated) kernel plus its padding is an error, not an empty output.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> conv = nn.Conv((3, 3), 1, 8, jax.nn.relu, key=jax.random.key(0), padding="SAME")
        >>> conv(jnp.ones((2, 28, 28, 1))).shape
        (2, 28, 28, 8)
    """

    __trainable__ = ("weight", "bias")

    def __init__(
        self,
        kernel_size: int | Sequence[int],
        in_channels: int,
        out_channels: int,
        activation: Callable[[Any], Any] | None = None,
        *,
        key: Any,
        stride: int | Sequence[int] = 1,
        padding: str | int | Sequence[tuple[int, int]] = "VALID",
        dilation: int | Sequence[int] = 1,
        use_bias: bool = True,
        dtype: Any = jnp.float32,
    ):
        ks = _entries("kernel_size", kernel_size)
        if len(ks) not in _DIMS:
            raise ValueError(f"Conv supports 1-D and 2-D kernels, got kernel_size={kernel_size}")
        n = len(ks)
        self.kernel_size = tuple(check_size("Conv", "kernel_size", k) for k in ks)
        self.in_channels = in_channels = check_size("Conv", "in_channels", in_channels)
        self.out_channels = out_channels = check_size("Conv", "out_channels", out_channels)
        self.stride = _per_axis("stride", stride, n)
        self.dilation = _per_axis("dilation", dilation, n)
        self.padding = _padding(padding, n)
        check_activation("Conv", activation)
        check_float_dtype("Conv", dtype, complex_ok=True)
        check_key("Conv", key)
        init = jax.nn.initializers.glorot_uniform(in_axis=-2, out_axis=-1)
        self.weight = init(key, (*self.kernel_size, in_channels, out_channels), dtype)
        self.bias = jnp.zeros((out_channels,), dtype) if use_bias else None
        self.activation = activation

    def __call__(self, x: Any) -> Any:
        n = len(self.kernel_size)
        shape: tuple[int, ...] = tuple(getattr(x, "shape", ()))
        if len(shape) not in (n + 1, n + 2) or shape[-1] != self.in_channels:
            raise ValueError(
                f"{self}: expected input of shape (batch, {n} spatial axes, {self.in_channels}) "
                f"or without the batch axis, got shape {shape}."
            )
        self._check_fits(shape[-n - 1 : -1])
        unbatched = len(shape) == n + 1
        if unbatched:
            x = x[None]
        # Promoted as Dense's `x @ weight.T` and flax.linen.Conv do: lax wants equal dtypes.
        dtype = jnp.result_type(x, self.weight)
        w = self.weight if self.weight.dtype == dtype else self.weight.astype(dtype)
        y = jax.lax.conv_general_dilated(
            x if x.dtype == dtype else jnp.asarray(x, dtype),
            w,
            window_strides=self.stride,
            padding=self.padding,
            rhs_dilation=self.dilation,
            dimension_numbers=_DIMS[n],
        )
        if self.bias is not None:
            y = y + self.bias
        if self.activation is not None:
            y = self.activation(y)
        return y[0] if unbatched else y

    def _check_fits(self, spatial: tuple[int, ...]) -> None:
        """Refuse an input smaller than the dilated kernel: lax would return an empty output."""
        if isinstance(self.padding, str) and self.padding != "VALID":
            return  # "SAME": as many outputs as inputs over the stride, never fewer than one
        pads = ((0, 0),) * len(spatial) if self.padding == "VALID" else self.padding
        for axis, (size, k, d, (lo, hi)) in enumerate(
            zip(spatial, self.kernel_size, self.dilation, pads, strict=True)
        ):
            span = (k - 1) * d + 1
            if size + lo + hi < span:
                dilated = f" (dilated to {span})" if d > 1 else ""
                raise ValueError(
                    f"{self}: kernel size {k}{dilated} is larger than the input's spatial axis "
                    f"{axis} of size {size} with padding ({lo}, {hi}); give a larger input, a "
                    'smaller kernel, or padding="SAME".'
                )

    def __str__(self) -> str:
        return f"Conv({self.kernel_size}, {self.in_channels} => {self.out_channels})"
