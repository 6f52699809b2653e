"""tg.load of damaged, edited and foreign checkpoints; crashes and leftovers of tg.save."""

import hashlib
import json
import os
import pickle
import random
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg

from .test_io import INVALID, assert_same, bits, fresh, trained

# ---------------------------------------------------------------- damaged and foreign


def _files(folder):
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


def _model_ck(tmp_path, name="ck"):
    model, state = trained()
    tg.save(tmp_path / name, (model, state))
    return tmp_path / name, (model, state)


def test_truncated_files_are_invalid(tmp_path):
    path, _ = _model_ck(tmp_path)
    for f in _files(path):
        data = f.read_bytes()
        for cut in sorted({0, 1, len(data) // 2, len(data) - 1}):
            f.write_bytes(data[:cut])
            with pytest.raises(tg.CheckpointError, match=INVALID) as info:
                tg.load(path, fresh())
            assert str(path) in str(info.value)
        f.write_bytes(data)
    tg.load(path, fresh())  # intact again


def test_bit_flips_never_give_a_wrong_array(tmp_path):
    path, saved = _model_ck(tmp_path)
    rng = random.Random(0)
    raised = 0
    for f in _files(path):
        data = f.read_bytes()
        for _ in range(4):
            i, bit = rng.randrange(len(data)), rng.randrange(8)
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            f.write_bytes(bytes(flipped))
            try:
                out = tg.load(path, fresh())
            except tg.CheckpointError as e:
                assert INVALID in str(e) and str(path) in str(e)
                raised += 1
            else:  # only acceptable if nothing that matters changed
                assert_same(out, saved)
        f.write_bytes(data)
    # Every file is covered by a checksum: in practice every flip is caught.
    assert raised == 4 * len(_files(path))


def _rewrite_manifest(path, edit):
    """Edit the manifest and re-sign it, as a buggy writer would: only deeper checks catch it."""
    p = path / "treegrad.json"
    body = json.loads(p.read_text())
    body.pop("checksum")
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["checksum"] = hashlib.sha256(canonical).hexdigest()
    p.write_text(json.dumps(body))


def _set_first_array(key, value):
    def edit(body):
        body["arrays"][0][key] = value
        if key == "shape":
            body["arrays"][0]["stored_shape"] = value

    return edit


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
@pytest.mark.parametrize(
    "edit, loose, words",
    [
        (
            _set_first_array("shape", [4, 8]),
            True,
            "the stored array a0 is float32\\[8, 4\\] but its manifest says float32\\[4, 8\\]",
        ),
        (
            _set_first_array("storage", "int32"),
            True,
            "the stored array a0 is float32\\[8, 4\\] but its manifest says int32\\[8, 4\\]",
        ),
        (lambda b: b["files"].pop(), False, "its file data-0/.* is not listed in its manifest"),
        (lambda b: b.update(data="elsewhere"), False, "a file lies outside 'data'"),
        (lambda b: b["leaves"][0].update(array=99), False, "leaf .* names no stored array"),
        (lambda b: b["leaves"].append(dict(b["leaves"][0])), False, "two leaves have the same"),
        (lambda b: b["arrays"][0].update(dtype="float33"), False, "unknown dtype"),
        (lambda b: b["files"][0].update(name="../../etc/passwd"), False, "bad file name"),
        (lambda b: b.update(version=99), False, "version 99 is not one this treegrad reads"),
        (lambda b: b.update(format="npz"), False, "'format' is not"),
        (lambda b: b.pop("arrays"), False, "'arrays' is not a list"),
    ],
)
def test_manifest_that_differs_from_its_arrays(tmp_path, edit, loose, words):
    path, _ = _model_ck(tmp_path)
    _rewrite_manifest(path, edit)
    like = _loose_like(path) if loose else jax.eval_shape(fresh)
    with pytest.raises(tg.CheckpointError, match=f"{INVALID}: .*{words}"):
        tg.load(path, like)


def _loose_like(path):
    """A `like` that fits whatever the (edited) manifest claims, to reach the deeper checks."""
    body = json.loads((path / "treegrad.json").read_text())
    out = {}
    for r in body["leaves"]:
        a = body["arrays"][r["array"]]
        out[tuple(r["keys"])] = jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"]))
    return _fit(out)


def _fit(by_keys):
    model, state = fresh()
    flat, treedef = jax.tree_util.tree_flatten_with_path((model, state))
    leaves = [by_keys[tuple(jax.tree_util.keystr((e,)) for e in p)] for p, _ in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def test_broken_manifests(tmp_path):
    path, _ = _model_ck(tmp_path)
    p = path / "treegrad.json"
    good = p.read_bytes()
    cases = {
        b"": "not valid JSON",
        b"{not json": "not valid JSON",
        b"\xff\xfe\x00": "not valid JSON",
        b"[]": "not a JSON object",
        json.dumps({**json.loads(good), "generation": 5}).encode(): "checksum does not match",
        json.dumps(
            {k: v for k, v in json.loads(good).items() if k != "checksum"}
        ).encode(): "checksum",
    }
    for text, words in cases.items():
        p.write_bytes(text)
        with pytest.raises(
            tg.CheckpointError, match=f"{INVALID}: its manifest treegrad.json is damaged: .*{words}"
        ):
            tg.load(path, fresh())
    p.unlink()
    with pytest.raises(tg.CheckpointError, match=f"{INVALID}: it has no treegrad.json"):
        tg.load(path, fresh())


def test_foreign_files_and_folders(tmp_path):
    like = {"x": jnp.ones(2)}
    cases = {}
    (tmp_path / "empty.bin").write_bytes(b"")
    cases["empty.bin"] = "an empty file"
    (tmp_path / "notes.txt").write_text("hello\n")
    cases["notes.txt"] = "it is a file"
    np.save(tmp_path / "arr.npy", np.ones(2))
    cases["arr.npy"] = "a numpy .npy file"
    np.savez(tmp_path / "old.npz", x=np.ones(2))
    cases["old.npz"] = "a zip file"
    (tmp_path / "emptydir").mkdir()
    cases["emptydir"] = "an empty folder"
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "a.txt").write_text("x")
    cases["random"] = "has no treegrad.json"
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
        ck.save(tmp_path / "orbax", args=ocp.args.StandardSave({"x": jnp.ones(2)}))
    cases["orbax"] = "has no treegrad.json"
    for name, words in cases.items():
        with pytest.raises(tg.CheckpointError, match=f"{tmp_path / name} is {INVALID}: .*{words}"):
            tg.load(tmp_path / name, like)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*missing"):
        tg.load(tmp_path / "missing", like)


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/nonexistent"


def test_pickles_are_never_executed(tmp_path, monkeypatch):
    global MARKER
    marker = tmp_path / "executed"
    monkeypatch.setattr(sys.modules[__name__], "MARKER", str(marker))
    payload = pickle.dumps(_Boom())
    np.save(tmp_path / "obj.npy", np.array([_Boom()], dtype=object), allow_pickle=True)
    (tmp_path / "pickle.bin").write_bytes(payload)
    path, _ = _model_ck(tmp_path)
    for target in (tmp_path / "obj.npy", tmp_path / "pickle.bin"):
        with pytest.raises(tg.CheckpointError, match=INVALID):
            tg.load(target, fresh())
    (path / "treegrad.json").write_bytes(payload)
    with pytest.raises(tg.CheckpointError, match=INVALID):
        tg.load(path, fresh())
    for f in _files(path / "data-0")[:3]:
        f.write_bytes(payload)
    with pytest.raises(tg.CheckpointError, match=INVALID):
        tg.load(path, fresh())
    assert not marker.exists()


# ---------------------------------------------------------------- crashes and hygiene


def test_failed_save_keeps_previous_and_leaves_nothing(tmp_path, monkeypatch):
    from treegrad import _io

    path, saved = _model_ck(tmp_path)
    listing = sorted(os.listdir(path))

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(_io, "_hash_files", boom)
    with pytest.raises(OSError, match="disk full"):
        tg.save(path, trained(steps=4))
    monkeypatch.undo()
    assert_same(tg.load(path, fresh()), saved)
    assert sorted(os.listdir(path)) == listing


def test_next_save_cleans_leftovers_and_keeps_foreign_files(tmp_path):
    path, _ = _model_ck(tmp_path)
    (path / "data-7.orbax-checkpoint-tmp").mkdir()
    (path / "data-7.orbax-checkpoint-tmp" / "x").write_text("half")
    (path / "data-5").mkdir()
    (path / ".treegrad.json.tmp-3").write_text("{")
    (path / "README").write_text("mine")
    model, state = trained(steps=3)
    tg.save(path, (model, state))
    assert sorted(os.listdir(path)) == ["README", "data-8", "treegrad.json"]
    assert_same(tg.load(path, fresh()), (model, state))


def test_save_refuses_files_and_foreign_folders(tmp_path):
    (tmp_path / "f.npz").write_bytes(b"x")
    with pytest.raises(
        FileExistsError, match=r"f\.npz is a file, and a treegrad checkpoint is a folder"
    ):
        tg.save(tmp_path / "f.npz", {"x": jnp.ones(2)})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")
    with pytest.raises(
        FileExistsError, match=r"holding files that tg.save did not write \(thesis.tex\)"
    ):
        tg.save(tmp_path / "mine", {"x": jnp.ones(2)})
    assert os.listdir(tmp_path / "mine") == ["thesis.tex"]


def test_save_rejects_traced_and_deleted_arrays(tmp_path):
    with pytest.raises(TypeError, match=r"'w' is a traced array: tg.save cannot run inside"):
        jax.jit(lambda w: tg.save(tmp_path / "ck", {"w": w}))(jnp.ones(2))
    x = jnp.ones(3)
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    if x.is_deleted():  # donation is a no-op on some backends
        with pytest.raises(ValueError, match="'w' has been deleted"):
            tg.save(tmp_path / "ck", {"w": x})
    with pytest.raises(TypeError, match=r"'w' is a jax\.ShapeDtypeStruct, which holds no data"):
        tg.save(tmp_path / "ck", {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
    assert not (tmp_path / "ck").exists() or os.listdir(tmp_path / "ck") == []


def test_files_and_folders_respect_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        tg.save(tmp_path / "ck", trained())
    finally:
        os.umask(old)
    paths = [tmp_path / "ck", *(tmp_path / "ck").rglob("*")]
    for p in paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o750 if p.is_dir() else 0o640), (p, oct(mode))


@pytest.mark.slow  # over ~2 s: the default run stays under 3 minutes
def test_import_treegrad_does_not_import_orbax():
    code = "import sys, treegrad; print('orbax' in str(list(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert out.stdout.strip() == "False"


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import jax, jax.numpy as jnp
    import orbax.checkpoint  # imported before "ready", so the kills land in saves, not imports
    import treegrad as tg

    path, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # ~40 MB, so a save takes long enough to be killed in the middle of it.
    tree = {f"w{i}": jax.random.normal(jax.random.key(seed + i), (1024, 2560)) for i in range(4)}
    jax.block_until_ready(tree)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    replace = os.replace
    commit = lambda dst: str(dst).endswith("treegrad.json")
    if mode == "before-commit":
        os.replace = lambda src, dst: die() if commit(dst) else replace(src, dst)
    elif mode == "after-commit":
        os.replace = lambda src, dst: (replace(src, dst), commit(dst) and die())
    print("ready", flush=True)
    while True:
        tg.save(path, tree)
        if mode != "loop":
            break
        seed += 1000
        tree = {k: v + 1 for k, v in tree.items()}
    """
)


def _big(seed):
    return {f"w{i}": jax.random.normal(jax.random.key(seed + i), (1024, 2560)) for i in range(4)}


def _kill_child(path, mode, seed, delay):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [sys.executable, "-c", _CHILD, str(path), mode, str(seed)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as child:
        assert child.stdout.readline().strip() == "ready"
        if delay is not None:
            time.sleep(delay)
            child.kill()
        child.wait(timeout=120)
    return child.returncode


@pytest.mark.slow
def test_sigkill_mid_save_keeps_previous_bit_exact(tmp_path):
    path = tmp_path / "ck"
    previous = _big(0)
    tg.save(path, previous)
    like = jax.tree_util.tree_map(jnp.zeros_like, previous)
    # Killed just before the commit (the manifest rename): the previous checkpoint stays.
    assert _kill_child(path, "before-commit", 10, None) == -9
    leftovers = sorted(os.listdir(path))
    assert len(leftovers) > 2, leftovers  # the new data and temporary manifest are orphans
    assert_same(tg.load(path, like), previous)
    # Killed right after the commit, before the old data is removed: the new one loads.
    assert _kill_child(path, "after-commit", 20, None) == -9
    assert_same(tg.load(path, like), _big(20))
    previous = _big(20)
    # Killed at a random moment of repeated saves (the k-th adds 1 k times): one
    # complete checkpoint loads, bit-exact, the previous one or one of the loop's.
    orphans_seen = 0
    for attempt, delay in enumerate((0.3, 0.9, 0.5, 0.7)):
        if attempt >= 2 and orphans_seen:
            break
        _kill_child(path, "loop", 30, delay)
        orphans_seen += len(os.listdir(path)) > 2
        out = tg.load(path, like)
        candidates = [previous, _big(30)]
        while len(candidates) < 60 and bits(candidates[-1]["w0"]) != bits(out["w0"]):
            candidates.append({k: v + 1 for k, v in candidates[-1].items()})
        assert any(bits(out["w0"]) == bits(c["w0"]) for c in candidates)
        match = next(c for c in candidates if bits(out["w0"]) == bits(c["w0"]))
        assert_same(out, match)
        previous = match
    assert orphans_seen >= 1  # at least one kill landed inside a save
    # The next save removes every leftover.
    tg.save(path, previous)
    assert sorted(os.listdir(path)) == ["data-" + str(_generation(path)), "treegrad.json"]
    assert_same(tg.load(path, like), previous)


def _generation(path):
    return json.loads((path / "treegrad.json").read_text())["generation"]
