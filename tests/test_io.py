"""tg.save / tg.load: round trips, damaged and foreign checkpoints, crashes mid-save."""

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
import ml_dtypes
import numpy as np
import optax
import pytest

import treegrad as tg

from .helpers import MLP, mse

INVALID = "not a valid or complete treegrad checkpoint"


def bits(x):
    """The exact contents of an array, for bit-exact comparison (NaN payloads included)."""
    a = np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    if a.dtype.itemsize == 0 or a.dtype.name in ("int2", "uint2", "int4", "uint4", "float4_e2m1fn"):
        a = a.astype(np.float64 if "float" in a.dtype.name else np.int64)
    return a.dtype.name, a.shape, a.tobytes()


def assert_same(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (_, x), (_, y) in zip(la, lb, strict=True):
        assert type(x) is type(y), (type(x), type(y))
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            assert bits(x) == bits(y)
        else:
            assert x == y


def trained(steps=2, seed=0):
    model = MLP(jax.random.key(seed))
    state = tg.setup(optax.adam(1e-2), model)
    for i in range(steps):
        x = jax.random.normal(jax.random.key(100 + i), (4, 4))
        (g,) = tg.gradient(lambda m: mse(m, x, jnp.zeros((4, 1))), model)  # noqa: B023
        state, model = tg.update(state, model, g)
    return model, state


def fresh(seed=9):
    model = MLP(jax.random.key(seed))
    return model, tg.setup(optax.adam(1e-2), model)


# ---------------------------------------------------------------- round trips


def test_model_and_state_round_trip_and_training_continues_identically(tmp_path):
    model, state = trained()
    tg.save(tmp_path / "ck", (model, state))
    m2, s2 = tg.load(tmp_path / "ck", fresh())
    for a, b in zip(
        jax.tree_util.tree_leaves((m2, s2)), jax.tree_util.tree_leaves((model, state)), strict=True
    ):
        assert bits(a) == bits(b)
    # The restored state is a working state: one more step from each agrees bit for bit.
    x = jnp.ones((3, 4))
    (g,) = tg.gradient(lambda m: mse(m, x, jnp.zeros((3, 1))), model)
    _, ref = tg.update(state, model, g)
    (g2,) = tg.gradient(lambda m: mse(m, x, jnp.zeros((3, 1))), m2)
    _, out = tg.update(s2, m2, g2)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref), strict=True):
        assert bits(a) == bits(b)


def test_state_of_params_round_trip(tmp_path):
    model, _ = trained()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    grads = tg.gradient(lambda: mse(model, jnp.ones((2, 4)), jnp.zeros((2, 1))), ps)
    tg.update_(state, ps, grads)
    tg.save(tmp_path / "ck", state)
    like = tg.setup(optax.adam(1e-2), tg.params(fresh()[0]))
    out = tg.load(tmp_path / "ck", like)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(state), strict=True):
        assert bits(a) == bits(b)


def _dtype_names():
    names = [
        "bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32",
        "bfloat16", "complex64", "int2", "uint2", "int4", "uint4", "float4_e2m1fn",
        "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
        "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    ]  # fmt: skip
    return [n for n in names if hasattr(jnp, n)]


def random_array(name, shape, rng):
    """Random contents covering every bit pattern of the dtype (NaNs, infinities, -0)."""
    dt = np.dtype(getattr(ml_dtypes, name, None) or name)
    if name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.itemsize == 1 and name[-1] in "24" and ("int" in name or name == "float4_e2m1fn"):
        nbits = int(name[-1]) if "int" in name else 4
        raw = rng.integers(0, 2**nbits, shape).astype(np.uint8)
        if name.startswith("int"):
            return (raw.astype(np.int8) - 2 ** (nbits - 1)).astype(dt)
        if name.startswith("uint"):
            return raw.astype(dt)
        return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(raw).astype(jnp.uint4), dt))
    u = np.dtype(f"uint{dt.itemsize * 8}") if dt.itemsize <= 8 else np.dtype(np.uint64)
    n = int(np.prod(shape)) * max(1, dt.itemsize // 8 if dt.itemsize > 8 else 1)
    raw = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
    return raw.view(dt).reshape(shape)


@pytest.mark.parametrize("name", _dtype_names())
def test_every_dtype_round_trips_bit_exact(tmp_path, name):
    rng = np.random.default_rng(0)
    host = random_array(name, (5, 3), rng)
    tree = {
        "jax": jnp.asarray(host),
        "numpy": host,
        "scalar": jnp.asarray(host[0, 0]),
        "empty": jnp.zeros((0, 2), host.dtype),
    }
    tg.save(tmp_path / "ck", tree)
    like = {k: (np.zeros_like if k == "numpy" else jnp.zeros_like)(v) for k, v in tree.items()}
    out = tg.load(tmp_path / "ck", like)
    assert_same(out, tree)
    assert out["jax"].dtype == jnp.dtype(name)


def test_64_bit_dtypes_round_trip_as_numpy(tmp_path):
    # jax holds 64-bit arrays only with x64 on; numpy leaves hold them always.
    rng = np.random.default_rng(1)
    tree = {n: random_array(n, (4,), rng) for n in ("float64", "int64", "uint64", "complex128")}
    tree["longdouble_free_scalar"] = np.float64(np.pi)
    tg.save(tmp_path / "ck", tree)
    like = {k: np.zeros_like(v) for k, v in tree.items()}
    like["longdouble_free_scalar"] = np.float64(0)
    out = tg.load(tmp_path / "ck", like)
    assert_same(out, tree)


def test_prng_keys_round_trip(tmp_path):
    tree = {
        "new": jax.random.split(jax.random.key(3), 4),
        "rbg": jax.random.key(5, impl="rbg"),
        "old": jax.random.PRNGKey(7),
    }
    tg.save(tmp_path / "ck", tree)
    like = {
        "new": jax.random.split(jax.random.key(0), 4),
        "rbg": jax.random.key(0, impl="rbg"),
        "old": jax.random.PRNGKey(0),
    }
    out = tg.load(tmp_path / "ck", like)
    assert_same(out, tree)
    assert jax.random.key_impl(out["rbg"]) == jax.random.key_impl(tree["rbg"])
    with pytest.raises(ValueError, match=r"'rbg' is key<fry>\[\] in the model but key<rbg>\[\]"):
        tg.load(tmp_path / "ck", {**like, "rbg": jax.random.key(0)})


class Tied(tg.Module):
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (5, 3))
        self.head = self.embed
        self.other = jax.random.normal(k2, (3,))


def test_tied_weights_come_back_tied(tmp_path):
    model = Tied(jax.random.key(0))
    tg.save(tmp_path / "ck", model)
    out = tg.load(tmp_path / "ck", Tied(jax.random.key(1)))
    assert out.head is out.embed
    assert bits(out.embed) == bits(model.embed)
    # The manifest stores the tied array once.
    manifest = json.loads((tmp_path / "ck" / "treegrad.json").read_text())
    assert len(manifest["arrays"]) == 2
    # A checkpoint with two arrays cannot be loaded into a model that ties them.
    untied = {"embed": model.embed, "head": model.embed + 1, "other": model.other}
    tg.save(tmp_path / "untied", untied)
    with pytest.raises(ValueError, match=r"'head' and 'embed' are one \(tied\) array"):
        like = Tied(jax.random.key(1))
        tg.load(tmp_path / "untied", {"embed": like.embed, "head": like.head, "other": like.other})


def test_paths_that_read_alike_never_collide(tmp_path):
    tree = {
        "a.b": jnp.ones(2),
        "a": {"b": jnp.zeros(2)},
        "c": [jnp.full(2, 3.0)],
        "c.0": jnp.full(2, 4.0),
    }
    tg.save(tmp_path / "ck", tree)
    out = tg.load(tmp_path / "ck", jax.tree_util.tree_map(jnp.zeros_like, tree))
    assert_same(out, tree)


def test_python_values_and_other_leaves(tmp_path):
    tree = {
        "step": 7,
        "lr": 0.5,
        "name": "run-1",
        "z": 1 + 2j,
        "flag": True,
        "act": jax.nn.relu,
        "w": jnp.ones(2),
    }
    tg.save(tmp_path / "ck", tree)
    like = {
        "step": 0,
        "lr": 0.0,
        "name": "",
        "z": 0j,
        "flag": False,
        "act": jnp.tanh,
        "w": jnp.zeros(2),
    }
    out = tg.load(tmp_path / "ck", like)
    assert {k: out[k] for k in ("step", "lr", "name", "z", "flag")} == {
        "step": 7, "lr": 0.5, "name": "run-1", "z": 1 + 2j, "flag": True
    }  # fmt: skip
    assert out["act"] is jnp.tanh  # not stored: taken from `like`
    with pytest.raises(ValueError, match="'step' is a float in the model but a int"):
        tg.load(tmp_path / "ck", {**like, "step": 0.0})


def test_like_of_shape_dtype_structs_numpy_and_sharding(tmp_path):
    model, state = trained()
    tg.save(tmp_path / "ck", (model, state))
    like = jax.eval_shape(lambda: fresh())
    out = tg.load(tmp_path / "ck", like)
    for a, b in zip(
        jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves((model, state)), strict=True
    ):
        assert isinstance(a, jax.Array) and bits(a) == bits(b)
    # Each loaded array lands on the sharding of `like`'s leaf.
    dev = jax.devices()[-1]
    placed = jax.device_put(fresh(), jax.sharding.SingleDeviceSharding(dev))
    out = tg.load(tmp_path / "ck", placed)
    assert all(
        a.sharding == jax.sharding.SingleDeviceSharding(dev) for a in jax.tree_util.tree_leaves(out)
    )
    # numpy leaves in `like` come back as numpy.
    as_numpy = jax.tree_util.tree_map(np.asarray, fresh())
    out = tg.load(tmp_path / "ck", as_numpy)
    assert all(isinstance(a, np.ndarray) for a in jax.tree_util.tree_leaves(out))


def test_like_is_not_modified_and_resave_same_path(tmp_path):
    model, state = trained()
    like = fresh()
    before = [bits(a) for a in jax.tree_util.tree_leaves(like)]
    tg.save(tmp_path / "ck", (model, state))
    tg.load(tmp_path / "ck", like)
    assert [bits(a) for a in jax.tree_util.tree_leaves(like)] == before
    model2, state2 = trained(steps=3)
    tg.save(tmp_path / "ck", (model2, state2))
    assert_same(tg.load(tmp_path / "ck", like)[0].layers[0].weight, model2.layers[0].weight)
    assert sorted(os.listdir(tmp_path / "ck")) == ["data-1", "treegrad.json"]


def test_tree_without_arrays(tmp_path):
    tg.save(tmp_path / "ck", {"epoch": 3})
    assert tg.load(tmp_path / "ck", {"epoch": 0}) == {"epoch": 3}
    assert os.listdir(tmp_path / "ck") == ["treegrad.json"]


# ---------------------------------------------------------------- mismatch with `like`


def test_mismatch_names_path_shape_dtype(tmp_path):
    f = tmp_path / "ck"
    tg.save(f, MLP(jax.random.key(0)))
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.weight' is float32\[8, 3\] in the model but float32\[8, 4\] in the "
        r"checkpoint .*ck",
    ):
        tg.load(f, MLP(jax.random.key(0), sizes=(3, 8, 1)))
    bf = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), MLP(jax.random.key(0)))
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.weight' is bfloat16\[8, 4\] in the model but float32\[8, 4\]",
    ):
        tg.load(f, bf)
    with pytest.raises(
        ValueError,
        match=r"the model has 'layers\.2\.weight' \(float32\[1, 1\]\) but the checkpoint",
    ):
        tg.load(f, MLP(jax.random.key(0), sizes=(4, 8, 1, 1)))
    with pytest.raises(
        ValueError, match=r"the checkpoint .*ck has 'layers\.1\.weight', which the model lacks"
    ):
        tg.load(f, MLP(jax.random.key(0), sizes=(4, 8)))
    assert not issubclass(ValueError, tg.CheckpointError)


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


_SHARDED = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + sys.argv[1]
    import jax
    n_proc, pid, port, path = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    if n_proc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n_proc, process_id=pid)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import treegrad as tg

    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(2, -1), ("data", "model"))
    full = {
        "w": np.arange(64.0, dtype=np.float32).reshape(8, 8),
        "b": np.arange(8, dtype=np.int32),
        "h": np.linspace(0, 1, 8).astype(jnp.bfloat16),
    }
    specs = {"w": P("data", "model"), "b": P("model"), "h": P("data")}
    tree = {
        k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
        for k, v in full.items()
    }
    tree["step"] = 7
    for _ in range(2):  # the second save replaces the first
        tg.save(path, tree)
    # Load onto another layout: a 1-D mesh, specs that differ from the saved ones.
    mesh2 = Mesh(devices, ("x",))
    new_specs = {"w": P(None, "x"), "b": P(), "h": P("x")}
    like = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh2, new_specs[k]))
        for k, v in full.items()
    }
    like["step"] = 0
    out = tg.load(path, like)
    assert out["step"] == 7
    for k, v in full.items():
        assert out[k].sharding == like[k].sharding, (k, out[k].sharding)
        for shard in out[k].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), v[shard.index]), k
    if pid == 0:
        assert sorted(os.listdir(path)) == ["data-1", "treegrad.json"], os.listdir(path)
        # orbax: each process wrote its own shards, into its own ocdbt.process_<i>.
        written = sorted(e for e in os.listdir(os.path.join(path, "data-1")) if "process_" in e)
        assert written == [f"ocdbt.process_{i}" for i in range(n_proc)], written
    print("ok", pid, flush=True)
    """
)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("n_proc", [1, 2])
def test_sharded_save_and_load_onto_another_mesh(tmp_path, n_proc):
    """Each process writes its own shards; load reshards onto `like`'s shardings."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    port, path = str(_free_port()), str(tmp_path / "ck")
    per_process = str(4 // n_proc)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARDED, per_process, str(n_proc), str(i), port, path],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(n_proc)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"ok {i}" in out, out[-3000:]
