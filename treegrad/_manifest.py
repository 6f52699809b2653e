"""What a checkpoint says about its tree: leaf records, stored arrays, and the checks on load.

`describe(tree)` turns a tree into leaf records (one per leaf, keyed by its
unambiguous key path) and the distinct arrays to store; `parse(text)` reads a
manifest back and rejects anything that is not exactly what `dump` writes;
`match(manifest, like)` pairs the records with the leaves of `like`, naming
the first path whose structure, shape, dtype or tying differs. The bytes on
disk (folders, orbax, checksums, atomic commit) are `_io.py`'s business.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._grads import Grads
from ._jaxpr import is_tracer, weakly_typed
from ._optview import SubState
from ._params import Params
from ._tree import path_str

FORMAT = "treegrad-checkpoint"
VERSION = 1

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
# What jax.eval_shape makes of a Python number: a scalar ShapeDtypeStruct of
# this kind of dtype (weakly typed, but for bool).
_SCALAR_KINDS: dict[str, type] = {
    "bool": np.bool_,
    "int": np.signedinteger,
    "float": np.floating,
    "complex": np.complexfloating,
}


class ManifestError(ValueError):
    """The manifest text is not one that `dump` writes; the message says what is wrong."""


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


# ---------------------------------------------------------------- text form


def _body(m: Manifest) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "generation": m.generation,
        "data": m.data,
        "arrays": [
            {
                "shape": list(a.shape),
                "dtype": a.dtype,
                "stored_shape": list(a.stored_shape),
                "storage": a.storage,
                "key_impl": a.key_impl,
                # Only when set: a manifest without weak arrays reads as before.
                **({"weak": True} if a.weak else {}),
            }
            for a in m.arrays
        ],
        "leaves": [_leaf_json(r) for r in m.leaves],
        "files": [{"name": n, "size": s, "sha256": h} for n, s, h in m.files],
        **(
            {"states": [{"keys": list(k), "frozen": list(f)} for k, f in m.states]}
            if m.states
            else {}
        ),
    }


def _leaf_json(r: LeafRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"keys": list(r.keys), "path": r.path, "kind": r.kind}
    if r.containers is not None:
        out["containers"] = list(r.containers)
    if r.kind == "array":
        out["array"] = r.array
    elif r.kind == "value":
        out["type"] = r.type
        out["value"] = _value_json(r)
    else:
        out["type"] = r.type
    return out


def _value_json(r: LeafRecord) -> Any:
    if r.type == "complex":
        return [r.value.real, r.value.imag]
    if r.type == "bytes":
        return base64.b64encode(r.value).decode("ascii")
    return r.value


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def dump(m: Manifest) -> bytes:
    """The manifest as JSON with a sha256 of its own canonical form, so any edit is seen."""
    body = _body(m)
    full = {**body, "checksum": hashlib.sha256(_canonical(body)).hexdigest()}
    # One line per record, so a person can read and diff it.
    parts = []
    for k, v in full.items():
        if isinstance(v, list) and v:
            items = ",\n  ".join(json.dumps(x) for x in v)
            parts.append(f"{json.dumps(k)}: [\n  {items}\n ]")
        else:
            parts.append(f"{json.dumps(k)}: {json.dumps(v)}")
    # No trailing newline: cut anywhere, the text is no longer valid JSON.
    return ("{\n " + ",\n ".join(parts) + "\n}").encode()


def parse(text: bytes) -> Manifest:
    """Read what `dump` wrote; raise `ManifestError` saying what is wrong otherwise."""
    try:
        obj = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"it is not valid JSON ({e})") from None
    _need(isinstance(obj, dict), "it is not a JSON object")
    _need(obj.get("format") == FORMAT, f"its 'format' is not {FORMAT!r}")
    version = obj.get("version")
    _need(
        type(version) is int and version <= VERSION,
        f"its version {version!r} is not one this treegrad reads (<= {VERSION}); upgrade treegrad",
    )
    digest = obj.pop("checksum", None)
    _need(
        isinstance(digest, str) and hashlib.sha256(_canonical(obj)).hexdigest() == digest,
        "its checksum does not match its contents (edited or damaged)",
    )
    # The checksum proves these are the bytes `dump` wrote; the checks below
    # guard against a writer bug, and keep every later step on known types.
    _need(type(obj.get("generation")) is int, "'generation' is not an integer")
    data = obj.get("data")
    _need(data is None or _is_name(data), "'data' is not a folder name")
    arrays = tuple(_array(a) for a in _list(obj, "arrays"))
    leaves = tuple(_leaf(r, len(arrays)) for r in _list(obj, "leaves"))
    _need(len({r.keys for r in leaves}) == len(leaves), "two leaves have the same keys")
    used = {r.array for r in leaves if r.kind == "array"}
    _need(used == set(range(len(arrays))), "an array is stored that no leaf uses")
    files = tuple(_file(f) for f in _list(obj, "files"))
    _need(all(f[0].startswith(f"{data}/") for f in files), "a file lies outside 'data'")
    _need(data is not None or not any(a.stored for a in arrays), "arrays are stored but no 'data'")
    states = tuple(_state(r) for r in obj["states"]) if "states" in obj else ()
    return Manifest(obj["generation"], data, arrays, leaves, files, states)


def _state(r: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    _need(isinstance(r, dict), "a 'states' entry is not an object")
    keys, frozen = r.get("keys"), r.get("frozen")
    for v in (keys, frozen):
        _need(isinstance(v, list) and all(isinstance(k, str) for k in v), "bad 'states' entry")
    return tuple(keys), tuple(frozen)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ManifestError(what)


def _list(obj: dict[str, Any], name: str) -> list[Any]:
    v = obj.get(name)
    if not isinstance(v, list):
        raise ManifestError(f"'{name}' is not a list")
    return v


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v


def _shape(v: Any) -> tuple[int, ...]:
    _need(isinstance(v, list) and all(type(d) is int and d >= 0 for d in v), f"bad shape {v!r}")
    return tuple(v)


def _array(a: Any) -> ArrayRecord:
    _need(isinstance(a, dict), "an 'arrays' entry is not an object")
    for field in ("dtype", "storage"):
        _need(isinstance(a.get(field), str), f"an array's '{field}' is not a string")
    impl = a.get("key_impl")
    _need(impl is None or isinstance(impl, str), "an array's 'key_impl' is not a string")
    weak = a.get("weak", False)
    _need(type(weak) is bool, "an array's 'weak' is not a boolean")
    record = ArrayRecord(
        _shape(a.get("shape")),
        a["dtype"],
        _shape(a.get("stored_shape")),
        a["storage"],
        impl,
        weak,
    )
    try:
        storage = jnp.dtype(record.storage)
        if impl is None:
            _need(jnp.dtype(record.dtype).name == record.dtype, f"bad dtype {record.dtype!r}")
    except TypeError:
        raise ManifestError(f"unknown dtype {record.dtype!r} / {record.storage!r}") from None
    _need(not _is_key(storage), "a storage dtype is a key type")
    return record


def _leaf(r: Any, n_arrays: int) -> LeafRecord:
    _need(isinstance(r, dict), "a 'leaves' entry is not an object")
    keys, path, kind = r.get("keys"), r.get("path"), r.get("kind")
    _need(isinstance(keys, list) and all(isinstance(k, str) for k in keys), "bad leaf 'keys'")
    _need(isinstance(path, str), "a leaf's 'path' is not a string")
    inside = r.get("containers")
    _need(
        inside is None
        or (
            isinstance(inside, list)
            and len(inside) == len(keys)
            and all(isinstance(c, str) for c in inside)
        ),
        f"leaf '{path}' has bad 'containers'",
    )
    containers = None if inside is None else tuple(inside)
    if kind == "array":
        i = r.get("array")
        _need(type(i) is int and 0 <= i < n_arrays, f"leaf '{path}' names no stored array")
        return LeafRecord(tuple(keys), path, kind, array=i, containers=containers)
    t = r.get("type")
    _need(isinstance(t, str), f"leaf '{path}' has no type")
    if kind == "value":
        _need(t in _VALUE_TYPES, f"leaf '{path}' has an unknown value type {t!r}")
        v = _parse_value(t, r.get("value"), path)
        _need(type(v) is _VALUE_TYPES[t], f"leaf '{path}': value is not a {t}")
        return LeafRecord(tuple(keys), path, kind, type=t, value=v, containers=containers)
    _need(kind == "other", f"leaf '{path}' has an unknown kind {kind!r}")
    return LeafRecord(tuple(keys), path, kind, type=t, containers=containers)


def _parse_value(t: str, v: Any, path: str) -> Any:
    if t == "complex":
        _need(isinstance(v, list) and len(v) == 2, f"leaf '{path}': bad complex value")
        return complex(float(v[0]), float(v[1]))
    if t == "float" and type(v) is int:
        return float(v)
    if t == "bytes":
        _need(isinstance(v, str), f"leaf '{path}': bad bytes value")
        try:
            return base64.b64decode(v, validate=True)
        except binascii.Error:
            raise ManifestError(f"leaf '{path}': bad bytes value") from None
    return v


def _file(f: Any) -> tuple[str, int, str]:
    _need(isinstance(f, dict), "a 'files' entry is not an object")
    name, size, digest = f.get("name"), f.get("size"), f.get("sha256")
    _need(
        isinstance(name, str)
        and name != ""
        and not name.startswith("/")
        and ".." not in name.split("/"),
        f"bad file name {name!r}",
    )
    _need(type(size) is int and size >= 0, f"bad size for {name}")
    _need(isinstance(digest, str) and len(digest) == 64, f"bad sha256 for {name}")
    return name, size, digest


# ---------------------------------------------------------------- matching `like`


@dataclass(frozen=True)
class Target:
    """Where stored array `array` goes: the `like` leaf that decides its type and sharding."""

    array: int
    leaf: Any


def match(
    m: Manifest, like: Any, where: str, api: str = "tg.load"
) -> tuple[list[Target | LeafRecord | None], Callable[[list[Any]], Any]]:
    """Pair each leaf of `like` with the manifest; raise ValueError at the first difference.

    Returns one entry per leaf of `like` (a `Target` for an array, the record
    for a saved Python value, None to keep `like`'s leaf) and a function that
    rebuilds `like`'s structure from new leaves.
    """
    saved = {r.keys: r for r in m.leaves}
    out: list[Target | LeafRecord | None] = []
    owner: dict[int, tuple[str, int]] = {}  # id of a like array -> (first path, its array)
    used: set[tuple[str, ...]] = set()
    containers = container_names(like)
    for (keys, path, leaf), inside in zip(leaves_with_keys(like), containers, strict=True):
        check_not_params(leaf, path, api)
        r = saved.get(keys)
        name = display(path)
        if r is None:
            raise _missing(m, keys, inside, leaf, name, where, api)
        used.add(keys)
        if _is_saved_python_scalar(leaf, r):
            out.append(r)  # the saved Python number, as the tree that was saved held it
        elif is_array(leaf):
            check_concrete(leaf, path, api)
            if r.kind != "array":
                raise ValueError(
                    f"{api}: '{name}' is an array ({describe_array(leaf)}) in the model but a "
                    f"{r.type} in the checkpoint {where}."
                )
            assert r.array is not None  # parse guarantees it for kind "array"
            a = m.arrays[r.array]
            if tuple(leaf.shape) != a.shape or str(leaf.dtype) != a.dtype:
                raise ValueError(
                    f"{api}: '{name}' is {describe_array(leaf)} in the model but "
                    f"{a.dtype}{list(a.shape)} in the checkpoint {where}."
                )
            if isinstance(leaf, (jax.Array, np.ndarray)):
                first, array = owner.setdefault(id(leaf), (name, r.array))
                if array != r.array:
                    raise ValueError(
                        f"{api}: '{name}' and '{first}' are one (tied) array in the model but "
                        f"two different arrays in the checkpoint {where}; load into a model "
                        "built without that tie."
                    )
            out.append(Target(r.array, leaf))
        elif r.kind == "array":
            raise ValueError(
                f"{api}: '{name}' is a {type(leaf).__name__} in the model but an array "
                f"({m.arrays[r.array or 0].dtype}{list(m.arrays[r.array or 0].shape)}) in the "
                f"checkpoint {where}."
            )
        elif r.kind == "value":
            if _value_type(leaf) != r.type:
                raise ValueError(
                    f"{api}: '{name}' is a {type(leaf).__name__} in the model but a {r.type} "
                    f"({r.value!r}) in the checkpoint {where}."
                )
            out.append(r)
        else:
            out.append(None)
    extra = [r for r in m.leaves if r.keys not in used]
    if extra:
        path = display(extra[0].path)
        hint = "Load into a model built like the one that was saved."
        if _STATE in (extra[0].containers or ()) and ":" not in path:
            hint = (
                "It is an entry of a saved optimiser state: the optimiser rule in `like` "
                "differs from the one the state was saved with. Load into "
                "tg.setup(rule, model) with the rule that was saved."
            )
        elif ":" in path:
            # Named `sub.model:...`: a sub-state that had a rule or hyperparameters of
            # its own when saved; a fresh tg.setup has not (yet).
            hint = (
                f"It is an entry of the sub-state '{path.split(':')[0]}', which had a rule or "
                "hyperparameters of its own when saved (state[...] = rule, or tg.adjust_ of a "
                "sub-state): set the fresh state up the same way before loading into it."
            )
        raise ValueError(
            f"{api}: the checkpoint {where} has '{path}', which the model lacks. {hint}"
        )
    treedef = jax.tree_util.tree_structure(like)
    return out, lambda new: jax.tree_util.tree_unflatten(treedef, new)


def _is_saved_python_scalar(leaf: Any, r: LeafRecord) -> bool:
    """`leaf` is what `jax.eval_shape` makes of the Python number `r` saved."""
    kind = _SCALAR_KINDS.get(r.type or "") if r.kind == "value" else None
    return (
        kind is not None
        and isinstance(leaf, jax.ShapeDtypeStruct)
        and leaf.shape == ()
        and not _is_key(leaf.dtype)
        and bool(jnp.issubdtype(leaf.dtype, kind))
        # eval_shape marks Python numbers weakly typed (bools excepted): a
        # strongly typed scalar in `like` asks for an array, and gets an error.
        and (leaf.weak_type or kind is np.bool_)
    )


def _missing(
    m: Manifest,
    keys: tuple[str, ...],
    inside: tuple[str, ...],
    leaf: Any,
    name: str,
    where: str,
    api: str,
) -> ValueError:
    """The error for a leaf of `like` the checkpoint lacks, naming the containers if they differ."""
    differ = _container_difference(m, keys, inside)
    if differ is not None:
        at, ours, theirs = differ
        return ValueError(
            f"{api}: the containers differ: {at} is of type {ours} in the model but of type "
            f"{theirs} in the checkpoint {where} (so the model's '{name}' is not in it). Load "
            "into a model built like the one that was saved."
        )
    what = describe_array(leaf) if is_array(leaf) else type(leaf).__name__
    alike = next((r for r in m.leaves if r.path == name), None)
    if alike is not None:
        # Two keys that print alike in a dotted path ({1: x} and {"1": x}): show both.
        return ValueError(
            f"{api}: the model has {''.join(keys)} ({what}) but the checkpoint {where} has "
            f"{''.join(alike.keys)} there instead (the keys differ in type; both read "
            f"'{name}'). Load into a model built like the one that was saved."
        )
    if _STATE in inside:
        depth = inside.index(_STATE)
        saved = [r for r in m.leaves if r.keys[:depth] == keys[:depth]]
        if saved and all(_STATE in (r.containers or ()) for r in saved):
            held = ", ".join(f"'{_inner(r.path, depth)}'" for r in saved[:3])
            inner = _inner(name, depth)
            at = f" at '{name[: len(name) - len(inner) - 1]}'" if depth else ""
            return ValueError(
                f"{api}: the optimiser state{at} in `like` has '{inner}' "
                f"({what}) but the state in the checkpoint {where} does not (it has {held}"
                f"{', ...' if len(saved) > 3 else ''}): the optimiser rule differs from the "
                "one the state was saved with. Load into tg.setup(rule, model) with the rule "
                "that was saved (and the same sub-state rules and adjusts)."
            )
    return ValueError(
        f"{api}: the model has '{name}' ({what}) but the checkpoint {where} does not. "
        "Load into a model built like the one that was saved."
    )


_STATE = "OptState"  # the type name a state's leaves have above them in `containers`


def _inner(path: str, depth: int) -> str:
    """A state leaf's name: its dotted path without the `depth` keys above the state."""
    return path.split(".", depth)[-1] if depth else path


def _container_difference(
    m: Manifest, keys: tuple[str, ...], inside: tuple[str, ...]
) -> tuple[str, str, str] | None:
    """(where, model's type, checkpoint's type) of the first container on `keys`'s path
    whose type differs from the saved leaf sharing the longest key prefix, if any."""
    best: LeafRecord | None = None
    depth = -1
    for r in m.leaves:
        n = _common_prefix(r.keys, keys)
        if r.containers is not None and n > depth:
            best, depth = r, n
    if best is None or best.containers is None or depth >= min(len(keys), len(best.keys)):
        return None
    ours, theirs = inside[depth], best.containers[depth]
    if ours == theirs:
        return None
    at = f"the container at {''.join(keys[:depth])}" if depth else "the root"
    return at, ours, theirs


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
