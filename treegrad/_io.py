"""`tg.save` / `tg.load`: checkpoints of models and optimiser states.

The format is a plain `.npz` (numpy's zip of `.npy` arrays, read with
`allow_pickle=False`, so loading never runs code) with one entry per array
leaf, named by its dotted path, plus a JSON manifest of paths, shapes and
dtypes. Writes go to a temporary file in the same folder that is renamed over
the target only once complete (`os.replace` is atomic), so a crash mid-save
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._tree import path_str

_MANIFEST = "__treegrad_manifest__"


def _array_leaves(tree: Any) -> list[tuple[str, Any]]:
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, (jax.Array, np.ndarray)):
            out.append((path_str(path) or "<root>", leaf))
    return out


def save(path: str | os.PathLike[str], tree: Any) -> None:
    """Write the arrays of a model, optimiser state, or any pytree to `path`.

    Arguments:
        path: the file to write (`.npz` is conventional); replaced atomically.
        tree: a model, a state from `tg.setup`, or a tuple of them.

    Returns:
        None. On any failure the previous file at `path` is left intact.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg, tempfile, os
        >>> model = {"w": jnp.ones(2)}
        >>> f = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
        >>> tg.save(f, model)
        >>> tg.load(f, model)["w"]
        Array([1., 1.], dtype=float32)
    """
    leaves = _array_leaves(tree)
    arrays: dict[str, np.ndarray] = {}
    manifest = []
    for i, (name, leaf) in enumerate(leaves):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"tg.save: '{name}' is a PRNG key array; save jax.random.key_data(key) instead."
            )
        arrays[f"a{i}"] = np.asarray(leaf)
        manifest.append({"path": name, "shape": list(leaf.shape), "dtype": str(leaf.dtype)})
    arrays[_MANIFEST] = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load(path: str | os.PathLike[str], like: Any) -> Any:
    """Read a checkpoint into a tree with the structure of `like`.

    Arguments:
        path: a file written by `tg.save`.
        like: a model or state of the expected structure (e.g. freshly built);
            its arrays are not modified.

    Returns:
        A new tree like `like` holding the saved arrays.

    Raises:
        ValueError: the checkpoint does not match `like`; the message names the
            first mismatching path, with the expected and saved shape and dtype.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg, tempfile, os
        >>> f = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
        >>> tg.save(f, {"w": jnp.arange(3.0)})
        >>> tg.load(f, {"w": jnp.zeros(3)})["w"]
        Array([0., 1., 2.], dtype=float32)
    """
    with np.load(os.fspath(path), allow_pickle=False) as data:
        if _MANIFEST not in data:
            raise ValueError(f"tg.load: {path} is not a treegrad checkpoint (no manifest).")
        manifest = json.loads(bytes(data[_MANIFEST]).decode())
        arrays = [data[f"a{i}"] for i in range(len(manifest))]
    expected = _array_leaves(like)
    saved = {m["path"]: (m, a) for m, a in zip(manifest, arrays, strict=True)}
    for name, leaf in expected:
        if name not in saved:
            raise ValueError(
                f"tg.load: the model has '{name}' ({leaf.dtype}{list(leaf.shape)}) but the "
                f"checkpoint {path} does not."
            )
        m = saved[name][0]
        if tuple(m["shape"]) != tuple(leaf.shape) or m["dtype"] != str(leaf.dtype):
            raise ValueError(
                f"tg.load: '{name}' is {leaf.dtype}{list(leaf.shape)} in the model but "
                f"{m['dtype']}{m['shape']} in the checkpoint {path}."
            )
    extra = set(saved) - {n for n, _ in expected}
    if extra:
        raise ValueError(
            f"tg.load: the checkpoint {path} has '{sorted(extra)[0]}', which the model lacks."
        )
    new = iter(jnp.asarray(saved[name][1]) for name, _ in expected)
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out = [next(new) if isinstance(leaf, (jax.Array, np.ndarray)) else leaf for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)
