"""Dense layers and the Chain container."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._jaxpr import is_tracer
from .._module import Module


def check_features(
    layer: Module, x: Any, expected: int, axis: int = -1, what: str = "input"
) -> None:
    """Raise a clear error when `x` does not have `expected` features on `axis`."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) == 0 or shape[axis] != expected:
        fix = "; start from cell.initial_state(batch_shape)" if what == "a state" else ""
        # A Python number or list has no shape: "got shape None" would not say what it was.
        got = f"shape {shape}" if shape is not None else f"a {type(x).__name__}, not an array"
        raise ValueError(
            f"{layer!s}: expected {what} with {expected} features on axis {axis}, got {got}{fix}."
        )


def as_int(value: Any) -> int | None:
    """`value` as an int when it is an integer (numpy ints too, not bools or floats), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_size(layer: str, name: str, value: Any) -> int:
    """A layer size argument: a positive int (numpy ints too, not bools or floats)."""
    n = as_int(value)
    if n is None:
        raise TypeError(f"{layer}: {name} must be a positive int, got {value!r}.")
    if n <= 0:
        raise ValueError(f"{layer}: {name} must be a positive int, got {n}.")
    return n


def check_key(layer: str, key: Any) -> None:
    """A PRNG key: a new-style key array, or a legacy uint32 key (`jax.random.PRNGKey`)."""
    ok = isinstance(key, (jax.Array, np.ndarray)) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or key.dtype == np.uint32
    )
    if not ok:
        raise TypeError(
            f"{layer}: key must be a jax.random key, e.g. key=jax.random.key(0), got "
            f"{type(key).__name__}{' ' + str(key.dtype) if hasattr(key, 'dtype') else ''}."
        )


def check_activation(layer: str, activation: Any, *, optional: bool = True) -> None:
    """An activation: a function (or None for the identity, where `optional`)."""
    if activation is None and optional:
        return
    if not callable(activation):
        none = " or None" if optional else ""
        raise TypeError(
            f"{layer}: activation must be a function{none}, e.g. jax.nn.relu, got {activation!r}."
        )


def check_float_dtype(layer: str, dtype: Any, *, complex_ok: bool = False) -> None:
    """A parameter dtype: floating point (or complex), since parameters are trained by their
    gradients; an integer one would never be differentiated."""
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.inexact if complex_ok else jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        kind = "floating-point or complex" if complex_ok else "floating-point"
        raise TypeError(
            f"{layer}: dtype must be a {kind} dtype (parameters are trained by their "
            f"gradients), e.g. jnp.float32 or jnp.bfloat16, got {dtype!r}."
        )


def check_rate(layer: str, name: str, value: Any, closed: bool) -> None:
    interval = "[0, 1]" if closed else "[0, 1)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{layer} {name} must be a number in {interval}, got {value!r}")
    v = float(value)
    if not (0.0 <= v <= 1.0 if closed else 0.0 <= v < 1.0):
        raise ValueError(f"{layer} {name} must be in {interval}, got {value}")


class Dense(Module):
    """A fully connected layer: `activation(x @ weight.T + bias)`.

    Arguments:
        in_features: size of the last axis of the input.
        out_features: size of the last axis of the output.
        activation: a function applied to the output, e.g. `jax.nn.relu`
            (default: identity); anything else is refused here.
        key: a `jax.random` key for the Glorot-uniform initialisation of `weight`.
        use_bias: whether to add `bias` (zeros at initialisation).
        dtype: a floating-point (or complex) dtype for the parameters.

    `weight` has shape `(out_features, in_features)`, `bias` `(out_features,)`,
    and `(..., in_features)` maps to `(..., out_features)`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> layer = nn.Dense(4, 8, jax.nn.relu, key=jax.random.key(0))
        >>> layer.weight.shape, layer(jnp.ones((2, 4))).shape
        ((8, 4), (2, 8))
    """

    __trainable__ = ("weight", "bias")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        activation: Callable[[Any], Any] | None = None,
        *,
        key: Any,
        use_bias: bool = True,
        dtype: Any = jnp.float32,
    ):
        in_features = check_size("Dense", "in_features", in_features)
        out_features = check_size("Dense", "out_features", out_features)
        check_activation("Dense", activation)
        check_float_dtype("Dense", dtype, complex_ok=True)
        check_key("Dense", key)
        init = jax.nn.initializers.glorot_uniform()
        self.weight = init(key, (out_features, in_features), dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.activation = activation
        self.in_features = in_features
        self.out_features = out_features

    def __call__(self, x: Any) -> Any:
        check_features(self, x, self.in_features)
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return y if self.activation is None else self.activation(y)

    def __str__(self) -> str:
        act = getattr(self.activation, "__name__", None)
        return f"Dense({self.in_features} => {self.out_features}{', ' + act if act else ''})"


class _Function(Module):
    """A function layer of a Chain (`jax.nn.relu`), held as static data.

    In a list a function is a pytree leaf, and `jax.eval_shape` or `jax.jit`
    cannot return a model with one; as an attribute of a Module it is static
    data, carried in the treedef.
    """

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn

    def __call__(self, x: Any) -> Any:
        return self.fn(x)

    def __str__(self) -> str:
        return getattr(self.fn, "__name__", None) or repr(self.fn)


def _unwrap(layer: Any) -> Any:
    return layer.fn if type(layer) is _Function else layer


class Chain(Module):
    """Layers applied in order; indexable (`chain[0]`) and sliceable (`chain[1:]`).

    Arguments:
        *layers: callables (usually Modules) applied in order; a `key` passed
            to the chain is split among the layers that take one. A plain
            function (`jax.nn.relu`) is static data, so `jax.eval_shape` and
            `jax.jit` can return a chain that holds one.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> model = nn.Chain(nn.Dense(2, 4, key=k1), jax.nn.relu, nn.Dense(4, 1, key=k2))
        >>> model(jnp.ones((3, 2))).shape, len(model), type(model[1:]).__name__
        ((3, 1), 3, 'Chain')
        >>> model[1] is jax.nn.relu
        True
    """

    takes_key: ClassVar[bool] = True

    def __init__(self, *layers: Any):
        for i, layer in enumerate(layers):
            if not callable(layer):
                raise TypeError(
                    f"Chain: layer {i} is a {type(layer).__name__}, not callable; pass layers "
                    "or functions, e.g. nn.Chain(nn.Dense(2, 4, key=k), jax.nn.relu)."
                )
        self.layers: list[Any] = [
            _Function(layer)
            if not isinstance(layer, Module) and jax.tree_util.all_leaves([layer])
            else layer
            for layer in layers
        ]

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        """Apply the layers; `key` is split among layers that take one (Dropout)."""
        for layer in self.layers:
            if key is not None and getattr(type(layer), "takes_key", False):
                key, sub = jax.random.split(key)
                x = layer(x, key=sub)
            else:
                x = layer(x)
        return x

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return Chain(*self.layers[i])
        return _unwrap(self.layers[i])

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Any]:
        return map(_unwrap, self.layers)

    def __str__(self) -> str:
        return "Chain(" + ", ".join(str(layer) for layer in self.layers) + ")"


class Embedding(Module):
    """A lookup table: integer indices to rows of `weight` (shape `(vocab, features)`).

    Arguments:
        vocab_size: number of rows.
        features: size of each embedding vector.
        key: PRNG key for the standard-normal initialisation.

    An index out of range (negative ones included) is an `IndexError` when the
    indices are concrete, and gives a row of NaN when they are traced (under
    `jax.jit` or `jax.vmap`), where they cannot be checked.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> emb = nn.Embedding(10, 4, key=jax.random.key(0))
        >>> emb(jnp.array([1, 2, 3])).shape
        (3, 4)
    """

    __trainable__ = ("weight",)

    def __init__(self, vocab_size: int, features: int, *, key: Any, dtype: Any = jnp.float32):
        vocab_size = check_size("Embedding", "vocab_size", vocab_size)
        features = check_size("Embedding", "features", features)
        check_float_dtype("Embedding", dtype, complex_ok=True)
        check_key("Embedding", key)
        self.weight = jax.random.normal(key, (vocab_size, features), dtype)
        self.vocab_size = vocab_size
        self.features = features

    def __call__(self, idx: Any) -> Any:
        idx = jnp.asarray(idx)
        if not jnp.issubdtype(idx.dtype, jnp.integer):
            raise TypeError(f"{self}: expected integer indices, got dtype {idx.dtype}")
        n = self.weight.shape[0]
        if not is_tracer(idx) and idx.size:
            values = np.asarray(idx)  # concrete: checked in numpy, nothing traced
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= n:
                bad = high if high >= n else low
                raise IndexError(
                    f"{self}: index {bad} is out of range; indices go from 0 to {n - 1}."
                )
        # Traced, the indices cannot be checked here: an index out of range gives a row
        # of NaN (JAX would clamp it to the last row, a wrong value without a word).
        rows = jnp.take(self.weight, idx, axis=0, mode="fill", fill_value=jnp.nan)
        if jnp.issubdtype(idx.dtype, jnp.signedinteger):
            # mode="fill" counts -n..-1 from the end, as NumPy does: -1 would be the last row.
            rows = jnp.where((idx < 0)[..., None], jnp.nan, rows)
        return rows

    def __str__(self) -> str:
        return f"Embedding({self.vocab_size} => {self.features})"


class Dropout(Module):
    """Zero each element with probability `rate` and scale the rest by `1/(1-rate)`.

    Active only in training mode (the default) and given a PRNG key; in test
    mode (`nn.testmode(model)`) it is the identity.

    Arguments:
        rate: the probability of dropping an element, in [0, 1).
        training: start in training mode.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> d = nn.Dropout(0.5)
        >>> y = d(jnp.ones(1000), key=jax.random.key(0))
        >>> 0.4 < float(jnp.mean(y == 0)) < 0.6, float(jnp.max(y))
        (True, 2.0)
        >>> nn.testmode(d)(jnp.ones(3))
        Array([1., 1., 1.], dtype=float32)
    """

    takes_key: ClassVar[bool] = True

    def __init__(self, rate: float, *, training: bool = True):
        check_rate("Dropout", "rate", rate, closed=False)
        self.rate = rate
        self.training = training

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        if not self.training or self.rate == 0.0:
            return x
        if key is None:
            raise ValueError(
                f"{self} is in training mode and needs a PRNG key: call it as layer(x, key=key), "
                "or switch to test mode with nn.testmode(model)."
            )
        keep = jax.random.bernoulli(key, 1.0 - self.rate, jnp.shape(x))
        return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros((), jnp.result_type(x)))

    def __str__(self) -> str:
        return f"Dropout({self.rate})"


def _set_mode(node: Any, training: bool, memo: dict[int, Any] | None = None) -> Any:
    memo = {} if memo is None else memo
    if isinstance(node, Module):
        done = memo.get(id(node))
        if done is not None:  # a layer held at two places stays one object
            return done
        new = memo[id(node)] = object.__new__(type(node))
        for k, v in node.__dict__.items():
            setattr(new, k, training if k == "training" else _set_mode(v, training, memo))
        return new
    if jax.tree_util.all_leaves([node]):
        return node
    # Any container JAX sees into (NamedTuples and OrderedDicts too), with the
    # layers in it switched.
    return jax.tree_util.tree_map(
        lambda v: _set_mode(v, training, memo),
        node,
        is_leaf=lambda x: x is not node and isinstance(x, Module),
    )


def testmode(model: Any) -> Any:
    """A copy of `model` with every layer in test mode (Dropout off, BatchNorm running stats).

    Arguments:
        model: any model; layers with a `training` flag are switched.

    Returns:
        A new model; `model` is unchanged.

    Examples:
        >>> from treegrad import nn
        >>> nn.testmode(nn.Chain(nn.Dropout(0.5)))[0].training
        False
    """
    return _set_mode(model, False)


def trainmode(model: Any) -> Any:
    """A copy of `model` with every layer in training mode.

    Arguments:
        model: any model; layers with a `training` flag are switched.

    Returns:
        A new model; `model` is unchanged.

    Examples:
        >>> from treegrad import nn
        >>> nn.trainmode(nn.Dropout(0.5, training=False)).training
        True
    """
    return _set_mode(model, True)
