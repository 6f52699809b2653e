"""What a checkpoint says about its tree: the leaf and array records, made from a tree.

`describe(tree)` turns a tree into leaf records (one per leaf, keyed by its
unambiguous key path) and the distinct arrays to store, refusing, before
anything is written, a leaf a checkpoint cannot hold faithfully; an array's
storage form (`_storage_form`, `from_storage`) keeps every dtype bit-exact.
These records are what the other two halves of a manifest work on:
`_manifesttext.py` writes them as text and reads them back (`dump`, `parse`),
and `_manifestmatch.py` pairs them with the leaves of `like` on load (`match`).
The bytes on disk (folders, orbax, checksums, atomic commit) are `_io.py`'s
business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._grads import Grads
from ._jaxpr import is_tracer, weakly_typed
from ._optview import Leaf, SubState
from ._params import Params
from ._tree import path_str

# Dtypes tensorstore 0.1.86 refuses ("Unsupported data type"), stored bit-exact
# in a type it accepts: the same-width float by bitcast, the sub-byte unsigned
# ints widened to uint8. Every other dtype jax has is stored as itself (tested
# over all of them in tests/test_io.py).
_BITCAST = {"float8_e4m3": "uint8"}
_WIDEN = {"uint2": "uint8", "uint4": "uint8"}
_VALUE_TYPES: dict[str, type] = {
    "bool": bool,
    "int": int,
    "float": float,
    "complex": complex,
    "str": str,
    "bytes": bytes,
}
# Leaves that hold data but have no faithful form in a checkpoint: `save`
# refuses them (naming the path) rather than silently restoring `like`'s value.
_REFUSED = {
    set: "a sorted tuple or list instead (tg.save stores their elements)",
    frozenset: "a sorted tuple or list instead (tg.save stores their elements)",
    bytearray: "bytes instead",
}


@dataclass(frozen=True)
class ArrayRecord:
    """One stored array: the leaf's shape and dtype, and how it is stored."""

    shape: tuple[int, ...]
    dtype: str
    stored_shape: tuple[int, ...]
    storage: str
    key_impl: str | None
    # A weakly typed jax array (`jnp.asarray(2.0)`, `jnp.full(n, 0.5)`) promotes
    # differently (bfloat16 * weak float32 is bfloat16, * float32 is float32): lose
    # it and a loaded model computes in another dtype than the one that was saved.
    weak: bool = False

    @property
    def stored(self) -> bool:
        # orbax refuses zero-size arrays; they carry no data, so the manifest alone rebuilds them.
        return math.prod(self.stored_shape) > 0


@dataclass(frozen=True)
class LeafRecord:
    """One leaf: its key path, and either an array index, a Python value, or neither."""

    keys: tuple[str, ...]
    path: str
    kind: str  # "array", "value" (a Python bool/int/float/complex/str/bytes) or "other"
    array: int | None = None
    type: str | None = None
    value: Any = None
    # The type name of each container on the path, root first (one per key), for
    # messages; None in checkpoints written before treegrad recorded it.
    containers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Manifest:
    generation: int
    data: str | None
    arrays: tuple[ArrayRecord, ...]
    leaves: tuple[LeafRecord, ...]
    files: tuple[tuple[str, int, str], ...]  # (name relative to the checkpoint, size, sha256)
    # Per optimiser state in the tree: its key path (one `keystr` per key, as a leaf's
    # `keys`) and the model paths of its frozen parameters (`tg.freeze_`), which are
    # static data of the state, not arrays. Empty in checkpoints written before.
    states: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()


def display(path: str) -> str:
    return path or "<root>"


def describe_array(x: Any) -> str:
    return f"{x.dtype}{list(x.shape)}"


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _is_key(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))


def _value_type(x: Any) -> str | None:
    for name, t in _VALUE_TYPES.items():
        if type(x) is t:
            return name
    return None


def leaves_with_keys(tree: Any) -> list[tuple[tuple[str, ...], str, Any]]:
    """`(keys, dotted path, leaf)` per leaf; `keys` holds one `keystr` per key entry.

    The dotted path is for messages only: `{"a.b": x}` and `{"a": {"b": y}}`
    both read `a.b`, while their keys, `("['a.b']",)` and `("['a']", "['b']")`,
    differ, so two leaves can never be confused.
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = tuple(jax.tree_util.keystr((entry,)) for entry in path)
        out.append((keys, path_str(path), leaf))
    return out


def container_names(tree: Any) -> list[tuple[str, ...]]:
    """Per leaf, the type name of each container on its path, root first (one per key)."""
    out: list[tuple[str, ...]] = []

    def walk(node: Any, above: tuple[str, ...]) -> None:
        data = node.node_data()
        if data is None:
            out.append(above)
            return
        for child in node.children():
            walk(child, (*above, data[0].__name__))

    walk(jax.tree_util.tree_structure(tree), ())
    return out


def check_concrete(leaf: Any, path: str, api: str) -> None:
    if is_tracer(leaf):
        raise TypeError(
            f"{api}: '{display(path)}' is a traced array: {api} cannot run inside jax.jit, "
            "tg.jit, grad or vmap. Call it outside the compiled function, on its results."
        )
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ValueError(
            f"{api}: the array at '{display(path)}' has been deleted (donated to a compiled "
            "call?). Pass the arrays that call returned instead."
        )


def describe(
    tree: Any, api: str = "tg.save"
) -> tuple[list[ArrayRecord], list[LeafRecord], list[Any]]:
    """Records for the leaves of `tree` and the distinct arrays to store (in storage form)."""
    arrays: list[ArrayRecord] = []
    stored: list[Any] = []
    leaves: list[LeafRecord] = []
    index: dict[int, int] = {}
    seen: dict[tuple[str, ...], str] = {}
    check_no_leaf_view(tree, api)
    containers = container_names(tree)
    for (keys, path, leaf), inside in zip(leaves_with_keys(tree), containers, strict=True):
        if keys in seen:
            raise ValueError(
                f"{api}: two leaves have the same key path {''.join(keys)} ('{display(path)}'); "
                "give the containers keys whose repr differs."
            )
        seen[keys] = path
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"{api}: '{display(path)}' is a jax.ShapeDtypeStruct, which holds no data; "
                "save real arrays (ShapeDtypeStructs belong in the `like` of tg.load)."
            )
        if is_array(leaf):
            check_concrete(leaf, path, api)
            check_storable(leaf, path, api)
            if isinstance(leaf, np.ma.MaskedArray):
                # An ndarray whose mask orbax would drop: the masked entries would load
                # as plain values, and nothing would say the mask was lost.
                raise TypeError(
                    f"{api}: '{display(path)}' is a numpy masked array, whose mask a "
                    "checkpoint does not store. Save its .data and np.ma.getmaskarray(x) as "
                    "two arrays, or x.filled(value)."
                )
            # Tied weights: one array object at several paths is stored once and
            # restored as one object. Scalars (np.generic) have no identity to keep.
            shared = index.get(id(leaf)) if isinstance(leaf, (jax.Array, np.ndarray)) else None
            if shared is None:
                record, data = _storage_form(
                    np.asarray(leaf) if isinstance(leaf, np.generic) else leaf
                )
                shared = len(arrays)
                arrays.append(record)
                stored.append(data)
                if isinstance(leaf, (jax.Array, np.ndarray)):
                    index[id(leaf)] = shared
            leaves.append(LeafRecord(keys, path, "array", array=shared, containers=inside))
        elif (vt := _value_type(leaf)) is not None:
            leaves.append(LeafRecord(keys, path, "value", type=vt, value=leaf, containers=inside))
        else:
            check_not_data(leaf, path, api)
            leaves.append(
                LeafRecord(keys, path, "other", type=type(leaf).__name__, containers=inside)
            )
    return arrays, leaves, stored


def _storable(dtype: Any) -> bool:
    # tensorstore stores bool and the numeric dtypes of jax and numpy, except
    # numpy's long double (float128/complex256 here, "Unsupported data type").
    if _is_key(dtype) or jnp.issubdtype(dtype, np.bool_):
        return True
    if not jnp.issubdtype(dtype, np.number):
        return False
    return np.dtype(dtype).itemsize <= (16 if jnp.issubdtype(dtype, np.complexfloating) else 8)


def check_storable(leaf: Any, path: str, api: str) -> None:
    """Refuse an array dtype orbax cannot write before anything is written.

    orbax fails on them only mid-save, from its threads, with an error that
    does not name the leaf and a temporary folder left behind.
    """
    if not _storable(leaf.dtype):
        raise TypeError(
            f"{api}: '{display(path)}' is an array of dtype {leaf.dtype}, which a checkpoint "
            "cannot store (bool and numeric dtypes up to 64-bit floats only). Convert it "
            "(e.g. strings to a Python str or list of str, datetime64 to int64, float128 to "
            "float64) or leave it out of the saved tree."
        )


def check_not_data(leaf: Any, path: str, api: str) -> None:
    """Refuse a data leaf that would otherwise be silently replaced by `like`'s on load."""
    check_not_params(leaf, path, api)
    for t, instead in _REFUSED.items():
        if isinstance(leaf, t):
            raise TypeError(
                f"{api}: '{display(path)}' is a {t.__name__}, which a checkpoint does not "
                f"store (its value would be lost). Save it as {instead}."
            )


def check_no_leaf_view(tree: Any, api: str) -> None:
    """Refuse a `tg.Leaf` (`state.l1.weight`), in the tree saved or in `like`.

    A Leaf is a view of one parameter's part of the whole optax state, and a pytree
    node whose child is that view: saved, it would store a copy of the view, and a
    load would hand back a bare optax state tuple, not a Leaf, changing no state.
    """
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Leaf))
    for path, leaf in found[0]:
        if isinstance(leaf, Leaf):
            where = f" at '{display(path_str(path))}'" if path else ""
            raise TypeError(
                f"{api}: got the optimiser state of one parameter{where} (a tg.Leaf such as "
                "state.l1.weight, a view into the whole state), which a checkpoint does not "
                "store. Save the whole state, tg.save(path, state), and load it with "
                "tg.load(path, tg.setup(rule, model))."
            )


def check_not_params(leaf: Any, path: str, api: str) -> None:
    """Refuse a `tg.Params`, a `tg.Grads` or a sub-state view, in the tree saved or in `like`."""
    if isinstance(leaf, SubState):
        # A view (`state.l1`) is not a pytree of its arrays: it would store nothing,
        # and a load would hand `like`'s view, of `like`'s state, back.
        where = f" at '{display(path)}'" if path else ""
        raise TypeError(
            f"{api}: got a part of an optimiser state{where} (state.l1 or state[0], a view "
            "into the whole state), which a checkpoint does not store. Save the whole state, "
            "tg.save(path, state), and load it with tg.load(path, tg.setup(rule, model))."
        )
    if isinstance(leaf, Grads):
        # Keyed by array identity, not a pytree: it too would store nothing.
        where = f" at '{display(path)}'" if path else ""
        raise TypeError(
            f"{api}: got a tg.Grads{where}, a mapping keyed by the identity of a model's "
            "arrays, which a checkpoint does not store. Save grads.named() (a dict from "
            "path to gradient) or grads.to_tree(model) instead."
        )
    if isinstance(leaf, Params):
        # A Params is not a pytree of its arrays (it is a leaf): it would store nothing,
        # and a load would hand `like`'s arrays back.
        where = f" at '{display(path)}'" if path else ""
        raise TypeError(
            f"{api}: got a tg.Params{where}, a set of references to a model's arrays that a "
            "checkpoint does not store. Save the model it was built from, "
            "tg.save(path, model), and load it with tg.load(path, model_like); then "
            "tg.params(model) gives its Params."
        )


def _storage_form(x: Any) -> tuple[ArrayRecord, Any]:
    shape = tuple(int(d) for d in x.shape)
    weak = bool(isinstance(x, jax.Array) and getattr(x, "weak_type", False))  # keys: none
    data: Any
    if _is_key(x.dtype):
        data = jax.random.key_data(x)
        impl = str(jax.random.key_impl(x))
        return ArrayRecord(shape, str(x.dtype), tuple(data.shape), str(data.dtype), impl), data
    name = str(x.dtype)
    if name in _BITCAST:
        storage = _BITCAST[name]
        data = (
            x.view(storage)
            if isinstance(x, np.ndarray)
            else jax.lax.bitcast_convert_type(x, storage)
        )
    elif name in _WIDEN:
        storage = _WIDEN[name]
        data = x.astype(storage)
    else:
        storage, data = name, x
    return ArrayRecord(shape, name, shape, storage, None, weak), data


def from_storage(record: ArrayRecord, data: Any) -> Any:
    """The array a `_storage_form` stored, rebuilt bit-exact (numpy in, numpy out)."""
    if record.key_impl is not None:
        return jax.random.wrap_key_data(jnp.asarray(data), impl=record.key_impl)
    if record.dtype in _BITCAST:
        if isinstance(data, np.ndarray):
            return data.view(jnp.dtype(record.dtype))
        return jax.lax.bitcast_convert_type(data, jnp.dtype(record.dtype))
    if record.dtype in _WIDEN:
        data = data.astype(jnp.dtype(record.dtype))
    if record.weak and isinstance(data, jax.Array):
        data = weakly_typed(data)  # (a jax internal: `_jaxpr` keeps them all)
    return data


def empty(record: ArrayRecord, numpy: bool, sharding: Any) -> Any:
    """A zero-size array of the record's storage form (nothing of it was stored)."""
    if numpy:
        return np.zeros(record.stored_shape, jnp.dtype(record.storage))
    return jnp.zeros(record.stored_shape, jnp.dtype(record.storage), device=sharding)
