"""A manifest's text form: `dump` writes it, `parse` reads back only exactly that.

`dump(manifest)` writes the records (`_manifest.py`) as JSON with a sha256 of
its own canonical form, one record a line; `parse(text)` rejects anything that
is not exactly what `dump` writes (`ManifestError`, saying what is wrong), and
checks every field's type, so every later step works on known types. Apart
from the records because it is only about the file's format and its damage,
not about any tree.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

import jax.numpy as jnp

from ._manifest import _VALUE_TYPES, ArrayRecord, LeafRecord, Manifest, _is_key

FORMAT = "treegrad-checkpoint"
VERSION = 1


class ManifestError(ValueError):
    """The manifest text is not one that `dump` writes; the message says what is wrong."""


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
