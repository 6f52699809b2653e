"""`tg.save` / `tg.load`: checkpoints of models and optimiser states, stored with orbax.

A checkpoint is a folder::

    ckpt/
      treegrad.json      the manifest, written last: the commit point
      data-7/            an orbax-checkpoint (OCDBT + zarr, written by tensorstore)

The arrays are written by orbax-checkpoint, the JAX ecosystem's checkpoint
library, so sharded arrays are written shard by shard and restored onto the
shardings of `like` (see API.md §6). treegrad adds what orbax does not do:

- **The manifest** (`treegrad.json`, JSON): one record per leaf of the saved
  tree, keyed by its key path (one `jax.tree_util.keystr` per key entry, so
  `{"a.b": x}` and `{"a": {"b": y}}` never collide), pointing to a stored
  array (tied weights, one object at several paths, point to the same one),
  or holding a Python bool/int/float/complex/str/bytes, or marking another leaf
  (a function, an object) that `load` takes from `like`; and, for messages,
  the type of each container on the leaf's path. Per stored array: the
  leaf's shape and dtype and its storage form (PRNG keys as their key data;
  the dtypes tensorstore refuses, uint2/uint4/float8_e4m3, widened or bitcast
  bit-exact). The sha256 and size of every file orbax wrote, and a sha256 of
  the manifest itself.
- **Integrity**: tensorstore does not detect flipped bits in array data (a
  flipped bit loads as a wrong number; measured), so `load` checks every
  file's size and sha256 before reading it, and the stored shapes and dtypes
  against the manifest. Anything wrong raises `tg.CheckpointError` naming the
  folder; no file is ever unpickled or executed.
- **Atomic replacement**: `save` writes the arrays to a new `data-N` folder,
  then the manifest to a temporary file renamed over `treegrad.json`
  (`os.replace` is atomic). A crash at any point leaves the previous manifest
  pointing to the previous, complete data; the next `save` removes the
  leftovers (unreferenced `data-*` folders, orbax's `*.orbax-checkpoint-tmp`,
  temporary manifests). Files and folders get the usual mode (the umask).

With several processes (`jax.distributed`), every process calls `save` and
`load`: orbax writes and reads each process's own shards (`ocdbt.process_<i>`),
process 0 alone prepares the folder, hashes the files and commits the
manifest, and no process returns from `save` before the commit. The folder
must be on a file system that every process sees. In one program, saves and
loads of one path wait for each other (threads); two programs saving to one
path at the same time, or loading while another saves there, are not
supported (the save removes the data the load may be reading).

Why a folder and not one file: orbax writes a folder (each process its own
shards), and a multi-process save cannot be funnelled into one file without
gathering every array on one host.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import threading
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import _manifest, _manifestmatch, _manifesttext
from ._cache import TURN
from ._manifest import Manifest, display
from ._manifestmatch import Target
from ._manifesttext import ManifestError
from ._optview import OptState
from ._tree import refuse_unsortable
from ._typing import PyTree

_MANIFEST = "treegrad.json"
_TMP_MANIFEST = ".treegrad.json.tmp-"
_DATA = re.compile(r"data-(\d+)(\.orbax-checkpoint-tmp.*)?")
_CHUNK = 1 << 22  # hashing reads 4 MiB at a time: sha256 runs at ~2 GB/s here, I/O-bound above
# One lock per checkpoint folder (by its real path), held by `save` and `load`: two
# threads saving to one folder would each remove the other's unfinished data (and
# fail with orbax's errors), and a load would read a data folder a save removes.
_LOCKS: weakref.WeakValueDictionary[str, threading.Lock] = weakref.WeakValueDictionary()
_LOCKS_GUARD = threading.Lock()


def _folder_lock(folder: Path) -> threading.Lock:
    key = os.path.realpath(folder)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.Lock()
        return lock


class CheckpointError(ValueError):
    """`tg.load` was given something that is not a valid, complete treegrad checkpoint.

    Raised for a damaged, truncated, edited or foreign file or folder, and for
    a save that did not finish; the message names the path and what is wrong.
    A checkpoint that is valid but does not fit `like` raises `ValueError`
    naming the path, shape and dtype instead.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg, tempfile, os
        >>> f = os.path.join(tempfile.mkdtemp(), "notes.txt")
        >>> with open(f, "w") as fh:
        ...     _ = fh.write("hello")
        >>> try:
        ...     tg.load(f, {"w": jnp.zeros(2)})
        ... except tg.CheckpointError as e:
        ...     print("not a valid or complete treegrad checkpoint" in str(e))
        True
    """


def _invalid(where: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"tg.load: {where} is not a valid or complete treegrad checkpoint: {why}."
    )


# ---------------------------------------------------------------- save


def save(path: str | os.PathLike[str], tree: PyTree) -> None:
    """Write a model, an optimiser state, or any pytree (e.g. a tuple of them) to `path`.

    Arguments:
        path: the checkpoint folder (created if missing, with its parents). An
            existing checkpoint there is replaced atomically: until the new one
            is complete, `path` holds the previous one.
        tree: a model, a state from `tg.setup`, or any pytree of them. Arrays
            of every numeric dtype (bfloat16, float8, int4, complex, bool, PRNG
            keys, sharded arrays) and Python numbers, strings and bytes are
            stored (a weakly typed array stays weakly typed); other leaves
            (functions, objects) and a Module's static data are taken from
            `like` by `tg.load`.

    Returns:
        None.

    Raises:
        FileExistsError: `path` is a file, a dangling symbolic link, or a
            folder holding files that `tg.save` did not write (it never
            deletes those).
        TypeError: `tree` holds traced arrays (`save` runs outside `jit`),
            arrays of a dtype a checkpoint cannot store (strings, objects,
            datetime64, float128), a set, frozenset, bytearray or numpy
            masked array (whose value or mask would be lost), or a
            `tg.Params`, `tg.Grads` or sub-state view (`state.l1`, a `tg.Leaf`), which hold
            references rather than arrays; nothing is written then.

    Examples:
        >>> import jax.numpy as jnp, treegrad as tg, tempfile, os
        >>> model = {"w": jnp.ones(2)}
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> tg.save(path, model)
        >>> tg.load(path, model)["w"]
        Array([1., 1.], dtype=float32)
    """
    # Read the tree in one turn with treegrad's calls (`_cache.TURN`): a `tg.update_` or
    # compiled step in another thread rebinds the model's arrays one place at a time,
    # and a save reading between two rebinds would store half of one step and half of
    # the next. The arrays themselves are immutable: once read, the file is consistent.
    with TURN:
        try:
            arrays, leaves, data = _manifest.describe(tree)
        except ValueError as e:  # a dict whose keys jax cannot sort: named
            refuse_unsortable("tg.save", [("the tree", tree)], e)
            raise
    folder = Path(os.fspath(path))
    with _folder_lock(folder):
        _save(folder, tree, arrays, leaves, data)


def _save(
    folder: Path,
    tree: PyTree,
    arrays: list[_manifest.ArrayRecord],
    leaves: list[_manifest.LeafRecord],
    data: list[Any],
) -> None:
    # With several processes (jax.distributed), every process calls save and
    # orbax writes each one's shards; the folder, the manifest and the commit
    # are process 0's alone, and no process returns before the commit.
    primary = jax.process_index() == 0
    previous, generation = _prepare_on_primary(folder)
    name = f"data-{generation}"
    stored = {f"a{i}": x for i, (a, x) in enumerate(zip(arrays, data, strict=True)) if a.stored}
    tmp = folder / f"{_TMP_MANIFEST}{generation}"
    written = False
    try:
        files: list[tuple[str, int, str]] = []
        if stored:
            _orbax_save(folder / name, stored)
        if primary:
            files = _hash_files(folder, name, sync=True) if stored else []
            manifest = Manifest(
                generation,
                name if stored else None,
                tuple(arrays),
                tuple(leaves),
                tuple(files),
                _frozen_of(tree),
            )
            with open(tmp, "xb") as f:
                f.write(_manifesttext.dump(manifest))
                f.flush()
                os.fsync(f.fileno())
            written = True
            os.replace(tmp, folder / _MANIFEST)  # the commit
    except BaseException:
        # An interrupt can land just after the rename: then the new manifest names
        # this save's data, which must stay (the next save removes the previous).
        committed = written and not os.path.lexists(tmp)
        if primary and not committed:
            # Not committed: the previous checkpoint is untouched; drop what this save wrote.
            _remove_unfinished(folder, name)
            _remove(tmp)
        raise
    if primary:
        _fsync_dir(folder)
        if previous is not None and previous != name:
            _remove(folder / previous)
    _sync("tg.save committed")


def _prepare_on_primary(folder: Path) -> tuple[str | None, int]:
    if jax.process_count() == 1:
        return _prepare(folder)
    from jax.experimental import multihost_utils

    previous, generation, error = None, -1, None
    if jax.process_index() == 0:
        try:
            previous, generation = _prepare(folder)
        except (OSError, ValueError) as e:
            error = e
    generation = int(multihost_utils.broadcast_one_to_all(np.int64(generation)))
    if error is not None:
        raise error
    if generation < 0:
        raise RuntimeError(f"tg.save: process 0 could not prepare {folder}; see its error.")
    return previous, generation


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _prepare(folder: Path) -> tuple[str | None, int]:
    """Create or check the folder, clean leftovers; return (current data folder, new generation)."""
    if folder.is_symlink() and not folder.exists():
        raise FileExistsError(
            f"tg.save: {folder} is a symbolic link to {os.readlink(folder)}, which does not "
            "exist. Create the folder it points to, remove the link, or save to another path."
        )
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(
            f"tg.save: {folder} is a file, and a treegrad checkpoint is a folder. Remove the "
            "file or save to another path."
        )
    folder.mkdir(parents=True, exist_ok=True)
    entries = sorted(os.listdir(folder))
    current: str | None = None
    if _MANIFEST in entries:
        try:
            current = _read_manifest(folder).data
        except CheckpointError:
            current = None  # damaged: nothing in it can be loaded, so it is replaced whole
    foreign = [e for e in entries if not _ours(e)]
    if foreign and _MANIFEST not in entries:
        raise FileExistsError(
            f"tg.save: {folder} is a folder holding files that tg.save did not write "
            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); it will not write "
            "into it. Save to a new path or an empty folder."
        )
    numbers = [int(m.group(1)) for e in entries if (m := _DATA.fullmatch(e))]
    for e in entries:
        if e != current and e != _MANIFEST and _ours(e):
            _remove(folder / e)
    return current, max(numbers, default=-1) + 1


def _ours(entry: str) -> bool:
    return entry == _MANIFEST or entry.startswith(_TMP_MANIFEST) or bool(_DATA.fullmatch(entry))


def _remove(p: Path) -> None:
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    except OSError:
        # A leftover that cannot be removed now is unreferenced and is retried
        # at the next save; failing the save over it would lose nothing but time.
        pass


def _remove_unfinished(folder: Path, name: str) -> None:
    """Remove data folder `name` and orbax's temporary one, which orbax leaves when it fails."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return  # the next save's cleanup retries; the save's own error is the one to raise
    for e in entries:
        if e == name or e.startswith(f"{name}.orbax-checkpoint-tmp"):
            _remove(folder / e)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _orbax_save(where: Path, arrays: dict[str, Any]) -> None:
    # Imported here: orbax and tensorstore add ~0.8 s to `import treegrad` (measured).
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
        ck.save(where, args=ocp.args.StandardSave(arrays))


def _hash_files(folder: Path, data: str, sync: bool) -> list[tuple[str, int, str]]:
    out = []
    for root, dirs, names in os.walk(folder / data):
        dirs.sort()
        for n in sorted(names):
            p = Path(root) / n
            digest = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                if sync:
                    os.fsync(f.fileno())
            out.append((p.relative_to(folder).as_posix(), p.stat().st_size, digest.hexdigest()))
        if sync:
            _fsync_dir(Path(root))
    return out


# ---------------------------------------------------------------- load


def load(path: str | os.PathLike[str], like: PyTree) -> PyTree:
    """Read a checkpoint into a new tree with the structure of `like`.

    Arguments:
        path: a checkpoint folder written by `tg.save`.
        like: a model or state of the expected structure (e.g. freshly built),
            or one of `jax.ShapeDtypeStruct`s (`jax.eval_shape(make_model)`).
            Its arrays are not modified; each loaded array takes the type
            (jax or numpy) and sharding of `like`'s leaf.

    Returns:
        A new tree like `like` holding the saved arrays and Python values;
        leaves that were arrays of one object at several paths (tied weights)
        are again one object.

    Raises:
        CheckpointError: `path` is not a valid, complete treegrad checkpoint
            (damaged, truncated, edited, foreign, or an unfinished save).
        ValueError: the checkpoint does not fit `like`; the message names the
            first differing path, with its shape and dtype in each. Also when
            `like` gives the paths of a tied array (one stored array)
            different shardings, naming both.
        FileNotFoundError: nothing is at `path`.

    Examples:
        >>> import jax, jax.numpy as jnp, treegrad as tg, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> tg.save(path, {"w": jnp.arange(3.0)})
        >>> tg.load(path, {"w": jnp.zeros(3)})["w"]
        Array([0., 1., 2.], dtype=float32)
        >>> like = jax.eval_shape(lambda: {"w": jnp.zeros(3)})
        >>> tg.load(path, like)["w"]
        Array([0., 1., 2.], dtype=float32)
    """
    folder = Path(os.fspath(path))
    with _folder_lock(folder):
        return _load(folder, like)


def _load(folder: Path, like: PyTree) -> PyTree:
    if not folder.exists():
        raise FileNotFoundError(f"tg.load: no checkpoint at {folder} (nothing is there).")
    if not folder.is_dir():
        raise _invalid(folder, f"it is {_sniff(folder)}, and tg.save writes a folder")
    m = _read_manifest(folder)
    targets, rebuild = _manifestmatch.match(m, like, str(folder))
    _one_placement(targets, like)
    _verify_files(folder, m)
    restored = _restore(folder, m, targets)
    new: list[Any] = []
    for t, leaf in zip(targets, jax.tree_util.tree_leaves(like), strict=True):
        if isinstance(t, Target):
            new.append(restored[(t.array, _is_numpy(t.leaf))])
            if isinstance(t.leaf, np.generic):
                new[-1] = new[-1][()]
        elif t is None:
            new.append(leaf)
        else:
            new.append(t.value)
    out = rebuild(new)
    _refreeze(out, m, str(folder))
    return out


def _states(tree: Any) -> list[tuple[tuple[str, ...], OptState]]:
    """The optimiser states in `tree`, each with its key path (one `keystr` per key)."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, OptState))
    return [
        (tuple(jax.tree_util.keystr((k,)) for k in path), x)
        for path, x in found[0]
        if isinstance(x, OptState)
    ]


def _frozen_of(tree: Any) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """Per optimiser state in `tree`: the model paths of its frozen parameters.

    `tg.freeze_` is static data of the state, not an array: without this record a
    state would load frozen as `like` is, and a resumed run would train what the
    saved one did not."""
    out = []
    for keys, state in _states(tree):
        config = state._config
        out.append((keys, tuple(sorted(config.paths[config.first[i]] for i in config.frozen))))
    return tuple(out)


def _refreeze(tree: Any, m: Manifest, where: str) -> None:
    """Give each loaded optimiser state the frozen parameters its saved one had."""
    if not m.states:
        return  # written before treegrad recorded them: `like`'s stand
    saved = dict(m.states)
    for keys, state in _states(tree):
        frozen = saved.get(keys)
        if frozen is None:
            continue
        config = state._config
        by_path = {config.paths[config.first[i]]: i for i in range(config.n)}
        missing = [p for p in frozen if p not in by_path]
        if missing:
            raise ValueError(
                f"tg.load: the optimiser state in the checkpoint {where} has '{missing[0]}' "
                "frozen, a parameter the state in `like` lacks. Load into a state set up for "
                "the model that was saved."
            )
        chosen = frozenset(by_path[p] for p in frozen)
        if chosen != config.frozen:
            state._install(config.replaced(frozen=chosen), state._leaves)


def _sniff(p: Path) -> str:
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        # Opening a FIFO (or a device) to read it would block or read forever.
        return "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
    with open(p, "rb") as f:
        head = f.read(8)
    if not head:
        return "an empty file"
    if head.startswith(b"\x93NUMPY"):
        return "a numpy .npy file"
    if head.startswith(b"PK"):
        return "a zip file (.npz? treegrad 0.1 checkpoints were .npz files, no longer read)"
    return "a file"


def _read_manifest(folder: Path) -> Manifest:
    p = folder / _MANIFEST
    if not p.is_file():
        names = sorted(os.listdir(folder))
        why = (
            "it is an empty folder"
            if not names
            else f"it has no {_MANIFEST} (a save that did not finish, or a folder that tg.save "
            "did not write)"
        )
        raise _invalid(folder, why)
    try:
        return _manifesttext.parse(p.read_bytes())
    except ManifestError as e:
        raise _invalid(folder, f"its manifest {_MANIFEST} is damaged: {e}") from None


def _verify_files(folder: Path, m: Manifest) -> None:
    if m.data is None:
        return
    if not (folder / m.data).is_dir():
        raise _invalid(folder, f"its data folder {m.data} is missing")
    listed = {name for name, _, _ in m.files}
    for root, _, names in os.walk(folder / m.data):
        for n in names:
            name = (Path(root) / n).relative_to(folder).as_posix()
            if name not in listed:
                # Every file orbax may read must be checked, or a damaged one could slip through.
                raise _invalid(folder, f"its file {name} is not listed in its manifest")
    for name, size, digest in m.files:
        p = folder / name
        if not p.is_file():
            raise _invalid(folder, f"its file {name} is missing")
        if p.stat().st_size != size:
            raise _invalid(
                folder,
                f"its file {name} has {p.stat().st_size} bytes instead of {size} (truncated?)",
            )
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != digest:
            raise _invalid(folder, f"its file {name} is damaged (sha256 differs from the manifest)")


def _is_numpy(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic))


def _sharding(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return leaf.sharding
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
        return leaf.sharding
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _one_placement(targets: list[Any], like: Any) -> None:
    """A stored tied array is restored as one array: its `like` places must agree on
    its sharding (else the first would silently win)."""
    first: dict[int, tuple[int, Any]] = {}
    for k, t in enumerate(targets):
        if not isinstance(t, Target) or _is_numpy(t.leaf):
            continue
        s = _sharding(t.leaf)
        j, s0 = first.setdefault(t.array, (k, s))
        if s is s0 or s == s0 or s0.is_equivalent_to(s, len(t.leaf.shape)):
            continue
        names = [display(path) for _, path, _ in _manifest.leaves_with_keys(like)]
        raise ValueError(
            f"tg.load: '{names[j]}' and '{names[k]}' are one (tied) array in the checkpoint, "
            f"but `like` places them differently ({s0} and {s}); it is restored as one array "
            "with one placement. Give both paths the same sharding in `like`."
        )


def _restore(folder: Path, m: Manifest, targets: list[Any]) -> dict[tuple[int, bool], Any]:
    """The stored arrays, by (array index, wanted as numpy), each restored once."""
    wanted: dict[int, list[Any]] = {}
    for t in targets:
        if isinstance(t, Target):
            wanted.setdefault(t.array, []).append(t.leaf)
    # A numpy leaf in `like` is restored by orbax as numpy (exact even for float64
    # with jax's x64 off); anything else on the sharding of its first jax leaf.
    request: dict[str, Any] = {}
    for i, leaves in wanted.items():
        a = m.arrays[i]
        jax_leaves = [x for x in leaves if not _is_numpy(x)]
        if not a.stored:
            continue
        if jax_leaves:
            request[f"a{i}"] = jax.ShapeDtypeStruct(
                a.stored_shape, np.dtype(a.storage), sharding=_sharding(jax_leaves[0])
            )
        else:
            request[f"a{i}"] = np.empty(0, np.dtype(a.storage))
    raw = _orbax_restore(folder, m, request) if request else {}
    out: dict[tuple[int, bool], Any] = {}
    for i, leaves in wanted.items():
        a = m.arrays[i]
        jax_leaves = [x for x in leaves if not _is_numpy(x)]
        if a.stored:
            data = raw[f"a{i}"]
        else:
            data = _manifest.empty(
                a, not jax_leaves, _sharding(jax_leaves[0]) if jax_leaves else None
            )
        value = _manifest.from_storage(a, data)
        if jax_leaves:
            out[(i, False)] = value
        if len(jax_leaves) < len(leaves):
            out[(i, True)] = np.asarray(value)
    return out


def _orbax_restore(folder: Path, m: Manifest, request: dict[str, Any]) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    assert m.data is not None  # parse: stored arrays imply a data folder
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
        item = ck.metadata(folder / m.data).item_metadata
        if item is None:
            # orbax found no metadata: the folder changed after its files were checked
            # (another program saving to the same path removed it).
            raise _invalid(folder, f"orbax cannot read its data folder {m.data}")
        meta = item.tree
        # orbax would cast to the requested dtype and reject only some shape
        # differences: check the stored arrays against the manifest first.
        if not isinstance(meta, dict) or set(meta) != set(request):
            raise _invalid(folder, "its stored arrays are not the ones its manifest lists")
        for key, info in meta.items():
            a = m.arrays[int(key[1:])]
            got = (tuple(info.shape), np.dtype(info.dtype))
            if got != (a.stored_shape, np.dtype(a.storage)):
                raise _invalid(
                    folder,
                    f"the stored array {key} is {got[1]}{list(got[0])} but its manifest says "
                    f"{a.storage}{list(a.stored_shape)}",
                )
        restored: dict[str, Any] = ck.restore(
            folder / m.data, args=ocp.args.StandardRestore(request)
        )
    return restored
