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
from ._basic import check_activation, check_features, check_float_dtype, check_key, check_size


def _glorot(key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    return jax.nn.initializers.glorot_uniform()(key, shape, dtype)


def _sizes(layer: str, in_features: Any, hidden: Any, key: Any, dtype: Any) -> tuple[int, int]:
    sizes = check_size(layer, "in_features", in_features), check_size(layer, "hidden", hidden)
    check_float_dtype(layer, dtype, complex_ok=True)
    check_key(layer, key)
    return sizes


class RNNCell(Module):
    """Elman cell: `h' = activation(Wi @ x + Wh @ h + b)`; output `h'`.

    Arguments:
        in_features: size of each input.
        hidden: size of the hidden state.
        activation: a function applied to the new state (default tanh).
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
        in_features, hidden = _sizes("RNNCell", in_features, hidden, key, dtype)
        check_activation("RNNCell", activation, optional=False)
        k1, k2 = jax.random.split(key)
        self.Wi = _glorot(k1, (hidden, in_features), dtype)
        # The QR behind it has no bfloat16 or float16 kernel on CPU: built in float32.
        init = jax.nn.initializers.orthogonal()
        self.Wh = init(k2, (hidden, hidden), jnp.promote_types(dtype, jnp.float32)).astype(dtype)
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
        in_features, hidden = _sizes("LSTMCell", in_features, hidden, key, dtype)
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
        in_features, hidden = _sizes("GRUCell", in_features, hidden, key, dtype)
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
    A state given as a list where the cell returns a tuple (`[h, c]` for an
    LSTM) is taken as that tuple; a state whose shapes or dtypes the cell does
    not keep is an error that says which `initial_state` to start from.

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
        try:
            return jax.lax.scan(self._step, state, xs)
        except TypeError:
            # lax.scan's error names neither the layer nor the fix. Diagnosed only on
            # failure: it traces the cell once more.
            converted = self._state_as_the_cell_returns_it(state, xs)
            if converted is None:
                raise
        return jax.lax.scan(self._step, converted, xs)

    def _step(self, state: Any, x: Any) -> tuple[Any, Any]:
        out: tuple[Any, Any] = self.cell(state, x)
        return out

    def _state_as_the_cell_returns_it(self, state: Any, xs: Any) -> Any:
        """`state` in the structure of the cell's new state (a list as the cell's tuple),
        or None when lax.scan failed for another reason; a clear error when the cell
        changes the state's shapes or dtypes."""

        def spec(a: Any, drop: int = 0) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(jnp.shape(a)[drop:], jnp.result_type(a))

        step_x = jax.tree.map(lambda a: spec(a, 1), xs)
        try:
            new = jax.eval_shape(lambda s, x: self.cell(s, x)[0], state, step_x)
        except TypeError:
            return None  # the cell's own error, which lax.scan raised
        leaves, tree_ = jax.tree.flatten(state)
        new_leaves, new_tree_ = jax.tree.flatten(new)
        tree: Any = tree_  # mypy cannot resolve jax's PyTreeDef type (to compare it)
        new_tree: Any = new_tree_
        if tree != new_tree:
            if jax.tree.structure(_lists_as_tuples(state)) != new_tree:
                raise TypeError(
                    f"{self}: the state has structure {tree} but the cell returns a new state "
                    f"of structure {new_tree}; start from cell.initial_state(batch_shape)."
                )
            state = jax.tree.unflatten(new_tree, leaves)
        for old, out in zip(map(spec, leaves), new_leaves, strict=True):
            if (old.shape, old.dtype) != (out.shape, out.dtype):
                raise ValueError(
                    f"{self}: the state has a part of shape {old.shape} and dtype {old.dtype}, "
                    f"but the cell returns it with shape {out.shape} and dtype {out.dtype} for "
                    f"inputs {jax.tree.map(lambda a: a.shape, step_x)} per step; start from "
                    f"cell.initial_state(batch_shape){self._hint(step_x, new)}."
                )
        return None if tree == new_tree else state

    def _hint(self, step_x: Any, new: Any) -> str:
        """`, here cell.initial_state((5,))` when that state is the one the cell keeps."""
        if not (hasattr(self.cell, "initial_state") and hasattr(step_x, "shape")):
            return ""
        batch_shape = tuple(step_x.shape[:-1])
        try:
            want = jax.eval_shape(lambda: self.cell.initial_state(batch_shape))
        except (TypeError, ValueError):
            return ""
        if jax.tree.map(lambda a: (a.shape, a.dtype), want) != jax.tree.map(
            lambda a: (a.shape, a.dtype), new
        ):
            return ""
        return f", here cell.initial_state({batch_shape!r})"

    def __str__(self) -> str:
        return f"Recurrence({self.cell})"


def _lists_as_tuples(tree: Any) -> Any:
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return tuple(_lists_as_tuples(v) for v in tree)
    return tree
