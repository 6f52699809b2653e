"""Recurrent cells and a sequence runner on `lax.scan`, with the hidden state explicit.

A cell maps `(state, x) -> (new_state, y)`; `nn.Recurrence(cell)` runs it over
the leading (time) axis of a sequence with `jax.lax.scan` and returns the final
state with the stacked outputs. There is no hidden global state to reset: the
initial state is an argument (`cell.initial_state()` gives zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._module import Module
from ._basic import check_features, check_key, check_size


def _glorot(key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    return jax.nn.initializers.glorot_uniform()(key, shape, dtype)


def _sizes(layer: str, in_features: Any, hidden: Any, key: Any) -> tuple[int, int]:
    check_key(layer, key)
    return check_size(layer, "in_features", in_features), check_size(layer, "hidden", hidden)


class RNNCell(Module):
    """Elman cell: `h' = activation(Wi @ x + Wh @ h + b)`; output `h'`.

    Arguments:
        in_features: size of each input.
        hidden: size of the hidden state.
        activation: applied to the new state (default tanh).
        key: PRNG key (Glorot-uniform input weights, orthogonal recurrent weights).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> cell = nn.RNNCell(2, 3, key=jax.random.key(0))
        >>> h, y = cell(cell.initial_state(), jnp.ones(2))
        >>> h.shape, bool(jnp.all(h == y))
        ((3,), True)
    """

    __trainable__ = ("Wi", "Wh", "b")

    def __init__(
        self,
        in_features: int,
        hidden: int,
        activation: Callable[[Any], Any] = jnp.tanh,
        *,
        key: Any,
        dtype: Any = jnp.float32,
    ):
        in_features, hidden = _sizes("RNNCell", in_features, hidden, key)
        k1, k2 = jax.random.split(key)
        self.Wi = _glorot(k1, (hidden, in_features), dtype)
        self.Wh = jax.nn.initializers.orthogonal()(k2, (hidden, hidden), dtype)
        self.b = jnp.zeros((hidden,), dtype)
        self.activation = activation
        self.in_features = in_features
        self.hidden = hidden

    def initial_state(self, batch_shape: tuple[int, ...] = ()) -> Any:
        return jnp.zeros((*batch_shape, self.hidden), self.b.dtype)

    def __call__(self, h: Any, x: Any) -> tuple[Any, Any]:
        check_features(self, x, self.in_features)
        check_features(self, h, self.hidden, what="a state")
        h = self.activation(x @ self.Wi.T + h @ self.Wh.T + self.b)
        return h, h

    def __str__(self) -> str:
        return f"RNNCell({self.in_features} => {self.hidden})"


class LSTMCell(Module):
    """LSTM cell; the state is `(h, c)`, the output `h`. Gate order: input, forget, cell, output.

    Arguments:
        in_features: size of each input.
        hidden: size of `h` and `c`.
        key: PRNG key for the Glorot-uniform weights.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> cell = nn.LSTMCell(2, 3, key=jax.random.key(0))
        >>> (h, c), y = cell(cell.initial_state((5,)), jnp.ones((5, 2)))
        >>> h.shape, c.shape
        ((5, 3), (5, 3))
    """

    __trainable__ = ("Wi", "Wh", "b")

    def __init__(self, in_features: int, hidden: int, *, key: Any, dtype: Any = jnp.float32):
        in_features, hidden = _sizes("LSTMCell", in_features, hidden, key)
        k1, k2 = jax.random.split(key)
        self.Wi = _glorot(k1, (4 * hidden, in_features), dtype)
        self.Wh = _glorot(k2, (4 * hidden, hidden), dtype)
        # Forget-gate bias of 1, as is standard, so early gradients flow.
        self.b = jnp.zeros((4 * hidden,), dtype).at[hidden : 2 * hidden].set(1.0)
        self.in_features = in_features
        self.hidden = hidden

    def initial_state(self, batch_shape: tuple[int, ...] = ()) -> tuple[Any, Any]:
        z = jnp.zeros((*batch_shape, self.hidden), self.b.dtype)
        return z, z

    def __call__(self, state: tuple[Any, Any], x: Any) -> tuple[tuple[Any, Any], Any]:
        check_features(self, x, self.in_features)
        if not (isinstance(state, (tuple, list)) and len(state) == 2):
            raise TypeError(
                f"{self}: the state is a pair (h, c), got a {type(state).__name__}; start from "
                "cell.initial_state(batch_shape)."
            )
        h, c = state
        check_features(self, h, self.hidden, what="a state")
        check_features(self, c, self.hidden, what="a state")
        gates = x @ self.Wi.T + h @ self.Wh.T + self.b
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    def __str__(self) -> str:
        return f"LSTMCell({self.in_features} => {self.hidden})"


class GRUCell(Module):
    """GRU cell (gate order: reset, update, candidate); the state and output are `h`.

    Arguments:
        in_features: size of each input.
        hidden: size of `h`.
        key: PRNG key for the Glorot-uniform weights.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> cell = nn.GRUCell(2, 3, key=jax.random.key(0))
        >>> h, y = cell(cell.initial_state(), jnp.ones(2))
        >>> h.shape
        (3,)
    """

    __trainable__ = ("Wi", "Wh", "bi", "bh")

    def __init__(self, in_features: int, hidden: int, *, key: Any, dtype: Any = jnp.float32):
        in_features, hidden = _sizes("GRUCell", in_features, hidden, key)
        k1, k2 = jax.random.split(key)
        self.Wi = _glorot(k1, (3 * hidden, in_features), dtype)
        self.Wh = _glorot(k2, (3 * hidden, hidden), dtype)
        self.bi = jnp.zeros((3 * hidden,), dtype)
        self.bh = jnp.zeros((3 * hidden,), dtype)
        self.in_features = in_features
        self.hidden = hidden

    def initial_state(self, batch_shape: tuple[int, ...] = ()) -> Any:
        return jnp.zeros((*batch_shape, self.hidden), self.bi.dtype)

    def __call__(self, h: Any, x: Any) -> tuple[Any, Any]:
        check_features(self, x, self.in_features)
        check_features(self, h, self.hidden, what="a state")
        xr, xz, xn = jnp.split(x @ self.Wi.T + self.bi, 3, axis=-1)
        hr, hz, hn = jnp.split(h @ self.Wh.T + self.bh, 3, axis=-1)
        r = jax.nn.sigmoid(xr + hr)
        z = jax.nn.sigmoid(xz + hz)
        n = jnp.tanh(xn + r * hn)
        h = (1 - z) * n + z * h
        return h, h

    def __str__(self) -> str:
        return f"GRUCell({self.in_features} => {self.hidden})"


class Recurrence(Module):
    """Run a cell over the leading (time) axis of a sequence with `lax.scan`.

    `Recurrence(cell)(state, xs)` returns `(final_state, ys)` with `ys` stacked
    along time. The state is explicit: pass `cell.initial_state(batch_shape)`.

    Arguments:
        cell: a Module mapping `(state, x)` to `(new_state, y)`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from treegrad import nn
        >>> rnn = nn.Recurrence(nn.GRUCell(2, 4, key=jax.random.key(0)))
        >>> xs = jnp.ones((7, 2))   # 7 time steps
        >>> h, ys = rnn(rnn.cell.initial_state(), xs)
        >>> h.shape, ys.shape
        ((4,), (7, 4))
    """

    def __init__(self, cell: Any):
        if not callable(cell):
            raise TypeError(
                "Recurrence: cell must be a Module mapping (state, x) to (new_state, y), e.g. "
                f"nn.GRUCell(2, 4, key=key), got a {type(cell).__name__}."
            )
        self.cell = cell

    def __call__(self, state: Any, xs: Any) -> tuple[Any, Any]:
        return jax.lax.scan(lambda s, x: self.cell(s, x), state, xs)

    def __str__(self) -> str:
        return f"Recurrence({self.cell})"
