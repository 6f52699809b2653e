"""Hostile-user hunt: tg.save / tg.load.

New angles beside tests/test_io.py and tests/test_io_damage.py: a Module holding
every dtype at once loaded through jax.eval_shape, optimiser states of several
optax rules (training continues bit for bit), odd `like`s, odd paths, and saves
that fail part-way. Rows marked xfail(strict=True) are bugs found by this hunt.
"""

import logging
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

from .test_io import INVALID, assert_same, bits


class A2(tg.Module):
    def __init__(self):
        self.f32 = jnp.ones(2)
        self.u32 = jnp.arange(3, dtype=jnp.uint32)


class Everything(tg.Module):
    def __init__(self, seed):
        k = jax.random.split(jax.random.key(seed), 4)
        x = jax.random.normal(k[0], (3, 2))
        self.f32 = x
        self.bf16 = x.astype(jnp.bfloat16)
        self.f16 = (x * 100).astype(jnp.float16)
        self.c64 = (x + 1j * jax.random.normal(k[1], (3, 2))).astype(jnp.complex64)
        self.i8 = jnp.round(x * 50).astype(jnp.int8)
        self.u32 = jax.random.bits(k[2], (3,), jnp.uint32)
        self.b = x > 0
        self.key = jax.random.split(k[3], 2)
        self.scalar = jnp.array(seed, jnp.float32)
        self.empty = jnp.zeros((0, 3), jnp.bfloat16)
        self.tied = self.f32
        self.layers = [{"w": x[0]}, (x[1], None)]
        self.act = jax.nn.relu
        self.step = seed


def _leaves(t):
    return jax.tree_util.tree_leaves(t)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_module_of_every_dtype_round_trips_through_eval_shape_like(tmp_path):
    m = Everything(3)
    tg.save(tmp_path / "ck", m)
    like = jax.eval_shape(lambda: Everything(0))
    out = tg.load(tmp_path / "ck", like)
    # static attributes (act, step) are not stored: they come from `like`
    assert type(out) is Everything and out.act is jax.nn.relu and out.step == 0
    assert out.tied is out.f32
    for a, b in zip(_leaves(out), _leaves(m), strict=True):
        assert isinstance(a, jax.Array)
        assert bits(a) == bits(b)
    # and loaded into a concrete model of other values
    out2 = tg.load(tmp_path / "ck", Everything(11))
    assert_same(out2, m)
    assert out2.tied is out2.f32


def test_tied_weights_across_model_and_second_tree_come_back_tied(tmp_path):
    m = Everything(1)
    extra = {"again": m.f32, "other": m.bf16}
    tg.save(tmp_path / "ck", (m, extra))
    out_m, out_extra = tg.load(tmp_path / "ck", jax.eval_shape(lambda: (Everything(0), extra)))
    assert out_extra["again"] is out_m.f32 and out_m.tied is out_m.f32
    assert out_extra["other"] is out_m.bf16


def _model(seed, bias=jnp.bfloat16):
    k = jax.random.split(jax.random.key(seed), 2)
    return {
        "enc": {"w": jax.random.normal(k[0], (3, 2)), "b": jnp.zeros(2, bias)},
        "dec": [jax.random.normal(k[1], (2,))],
        "step": jnp.array(0),
    }


def _loss(m, x):
    h = x @ m["enc"]["w"] + m["enc"]["b"].astype(jnp.float32)
    return jnp.sum(h**2) + jnp.sum((m["dec"][0] - 1) ** 2)


RULES = {
    "adamw": lambda: optax.adamw(1e-2),
    "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "clip_chain": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.scale_by_adam(), optax.scale(-1e-2)
    ),
    "multisteps": lambda: optax.MultiSteps(optax.sgd(1e-2, momentum=0.9), every_k_schedule=2),
    "ema": lambda: optax.chain(optax.ema(0.9), optax.scale(-1e-2)),
    "masked": lambda: optax.masked(
        optax.adam(1e-2), {"enc": {"w": True, "b": False}, "dec": [True], "step": False}
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RULES))
def test_optimiser_states_round_trip_and_training_continues_identically(tmp_path, name):
    rule = RULES[name]()
    # optax's inject_hyperparams promotes a bfloat16 moment to float32 on the first
    # step (plain optax does it too), so a fresh state no longer fits: float32 there.
    bias = jnp.float32 if name == "inject" else jnp.bfloat16
    m = _model(0, bias)
    s = tg.setup(rule, m)
    for i in range(3):
        g, _ = tg.gradient(_loss, m, jnp.ones((4, 3)) * i)
        s, m = tg.update(s, m, g)
    tg.save(tmp_path / "ck", (m, s))
    fresh = _model(5, bias)
    m2, s2 = tg.load(tmp_path / "ck", jax.eval_shape(lambda: (fresh, tg.setup(rule, fresh))))
    outs = []
    for mm, ss in ((m, s), (m2, s2)):
        for i in range(2):
            g, _ = tg.gradient(_loss, mm, jnp.ones((4, 3)) * (i + 7))
            ss, mm = tg.update(ss, mm, g)
        outs.append(_leaves((mm, ss)))
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs, strict=True):
        assert bits(a) == bits(b)


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_complex_model_and_adam_state_round_trip(tmp_path):
    p = {"z": jnp.array([1 + 2j, -3j], jnp.complex64), "r": jnp.ones(2)}
    s = tg.setup(optax.adam(0.1), p)
    loss = lambda p: jnp.sum(jnp.abs(p["z"]) ** 2) + jnp.sum(p["r"] ** 2)
    (g,) = tg.gradient(loss, p)
    s, p = tg.update(s, p, g)
    tg.save(tmp_path / "ck", (p, s))
    p2, s2 = tg.load(tmp_path / "ck", (p, tg.setup(optax.adam(0.1), p)))
    assert_same((p2, s2), (p, s))


# ---------------------------------------------------------------- `like` mismatches


def test_shape_dtype_struct_like_mismatches_name_the_path(tmp_path):
    tg.save(tmp_path / "ck", Everything(0))
    like = jax.eval_shape(lambda: Everything(0))
    like.layers[0]["w"] = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(
        ValueError, match=r"'layers\.0\.w' is float32\[3\] in the model but float32\[2\]"
    ):
        tg.load(tmp_path / "ck", like)
    other = Everything(0)
    other.u32 = other.u32.astype(jnp.int32)
    like = jax.eval_shape(lambda: other)
    with pytest.raises(ValueError, match=r"'u32' is int32\[3\] in the model but uint32\[3\]"):
        tg.load(tmp_path / "ck", like)


def test_editing_an_eval_shape_like_module_keeps_its_leaves(tmp_path):
    tg.save(tmp_path / "ck", A2())
    like = jax.eval_shape(A2)
    like.u32 = jax.ShapeDtypeStruct((3,), jnp.uint32)  # e.g. to give it another sharding
    assert len(jax.tree_util.tree_leaves(like)) == 2
    assert_same(tg.load(tmp_path / "ck", like), A2())


_SDS = jax.ShapeDtypeStruct
_ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])

# Edits one makes to an eval_shape'd `like` before tg.load; none changes its structure.
LIKE_EDITS = {
    "same static value": lambda like: setattr(like, "step", 0),
    "same function": lambda like: setattr(like, "act", jax.nn.relu),
    "ShapeDtypeStruct": lambda like: setattr(like, "u32", _SDS((3,), jnp.uint32)),
    "with a sharding": lambda like: setattr(
        like, "bf16", _SDS((3, 2), jnp.bfloat16, sharding=_ONE_DEVICE)
    ),
    "container of them": lambda like: setattr(
        like, "layers", [{"w": _SDS((2,), jnp.float32)}, (_SDS((2,), jnp.float32), None)]
    ),
    "array": lambda like: setattr(like, "f16", jnp.zeros((3, 2), jnp.float16)),
    "several": lambda like: [
        setattr(like, "step", 0),
        setattr(like, "key", _SDS((2,), jax.random.key(0).dtype)),
        setattr(like, "empty", _SDS((0, 3), jnp.bfloat16)),
    ],
}


@pytest.mark.parametrize("edit", LIKE_EDITS.values(), ids=LIKE_EDITS.keys())
def test_edited_eval_shape_like_keeps_its_structure_and_loads(tmp_path, edit):
    m = Everything(3)
    tg.save(tmp_path / "ck", m)
    like = jax.eval_shape(lambda: Everything(0))
    before = jax.tree_util.tree_structure(like)
    jax.tree_util.tree_leaves(like)  # flattened once: its split is cached, then edited
    edit(like)
    assert jax.tree_util.tree_structure(like) == before
    out = tg.load(tmp_path / "ck", like)
    assert_same(out, m)
    assert out.tied is out.f32


def test_eval_shape_like_of_tree_holding_a_python_number(tmp_path):
    tree = {"w": jnp.ones(2), "epoch": 3, "lr": 0.5, "z": 1j, "flag": True}
    tg.save(tmp_path / "ck", tree)
    out = tg.load(tmp_path / "ck", jax.eval_shape(lambda: tree))
    # the Python values come back as the Python values that were saved
    assert {k: out[k] for k in ("epoch", "lr", "z", "flag")} == {
        "epoch": 3, "lr": 0.5, "z": 1j, "flag": True
    }  # fmt: skip
    assert type(out["epoch"]) is int
    np.testing.assert_array_equal(out["w"], np.ones(2))
    # a strongly typed scalar in `like` asks for an array: still an error
    like = {**jax.eval_shape(lambda: tree), "epoch": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(
        ValueError, match=r"'epoch' is an array \(int32\[\]\) in the model but a int"
    ):
        tg.load(tmp_path / "ck", like)


def test_python_value_versus_array_mismatches(tmp_path):
    tg.save(tmp_path / "a", {"a": jnp.ones(3)})
    with pytest.raises(
        ValueError, match=r"'a' is a float in the model but an array \(float32\[3\]"
    ):
        tg.load(tmp_path / "a", {"a": 0.0})
    tg.save(tmp_path / "p", {"a": 1.5})
    with pytest.raises(
        ValueError, match=r"'a' is an array \(float32\[\]\) in the model but a float"
    ):
        tg.load(tmp_path / "p", {"a": jnp.zeros(())})


class A(tg.Module):
    def __init__(self):
        self.w = jnp.zeros(3)


def test_module_checkpoint_into_dict_like_says_the_containers_differ(tmp_path):
    tg.save(tmp_path / "ck", A())
    with pytest.raises(
        ValueError, match=r"containers differ: the root is of type dict in the model but of type A"
    ):
        tg.load(tmp_path / "ck", {"w": jnp.zeros(3)})
    tg.save(tmp_path / "nested", {"m": [A()]})
    with pytest.raises(
        ValueError,
        match=r"the container at \['m'\]\[0\] is of type dict in the model but of type A",
    ):
        tg.load(tmp_path / "nested", {"m": [{"w": jnp.zeros(3)}]})


@pytest.mark.parametrize("saved", [b"vocab\x00\xff", b""], ids=["bytes", "empty"])
def test_bytes_leaves_round_trip(tmp_path, saved):
    tg.save(tmp_path / "ck", {"v": saved, "w": jnp.ones(2)})
    out = tg.load(tmp_path / "ck", {"v": b"other", "w": jnp.zeros(2)})
    assert out["v"] == saved and type(out["v"]) is bytes


@pytest.mark.parametrize(
    "saved, instead",
    [
        ({1, 2}, "a sorted tuple or list instead"),
        (frozenset({1}), "a sorted tuple or list instead"),
        (bytearray(b"x"), "bytes instead"),
    ],
    ids=["set", "frozenset", "bytearray"],
)
def test_data_leaves_without_a_stored_form_are_refused(tmp_path, saved, instead):
    tg.save(tmp_path / "ck", {"w": jnp.arange(2.0)})
    listing = sorted(os.listdir(tmp_path / "ck"))
    kind = type(saved).__name__
    with pytest.raises(TypeError, match=rf"tg\.save: 'v' is a {kind}, .*Save it as {instead}"):
        tg.save(tmp_path / "ck", {"v": saved, "w": jnp.ones(2)})
    assert sorted(os.listdir(tmp_path / "ck")) == listing


# ---------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "ck" / "treegrad.json", "it is a file"),
        (lambda d: d / "ck" / "data-0", "has no treegrad.json"),
        (lambda d: d, "has no treegrad.json"),
    ],
    ids=["manifest-itself", "data-folder", "parent-folder"],
)
def test_paths_inside_and_around_a_checkpoint(tmp_path, make, words):
    tg.save(tmp_path / "ck", {"w": jnp.ones(2)})
    target = make(tmp_path)
    with pytest.raises(tg.CheckpointError, match=f"{target} is {INVALID}: .*{words}"):
        tg.load(target, {"w": jnp.zeros(2)})


def test_manifest_that_is_a_folder_or_foreign_json(tmp_path):
    (tmp_path / "jd" / "treegrad.json").mkdir(parents=True)
    with pytest.raises(tg.CheckpointError, match=rf"{tmp_path / 'jd'} is {INVALID}"):
        tg.load(tmp_path / "jd", {"w": jnp.zeros(2)})
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "treegrad.json").write_text('{"a": 1}')
    with pytest.raises(tg.CheckpointError, match=rf"{tmp_path / 'j'} is {INVALID}"):
        tg.load(tmp_path / "j", {"w": jnp.zeros(2)})


def test_removed_data_folder(tmp_path):
    import shutil

    tg.save(tmp_path / "ck", {"w": jnp.ones(2)})
    shutil.rmtree(tmp_path / "ck" / "data-0")
    with pytest.raises(tg.CheckpointError, match=f"{INVALID}: its data folder data-0 is missing"):
        tg.load(tmp_path / "ck", {"w": jnp.zeros(2)})


def test_symlinked_checkpoint_and_trailing_slash(tmp_path):
    tree = {"w": jnp.arange(3.0)}
    tg.save(tmp_path / "real", tree)
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert_same(tg.load(str(tmp_path / "link") + "/", {"w": jnp.zeros(3)}), tree)
    tg.save(tmp_path / "link", {"w": tree["w"] + 1})
    assert os.path.islink(tmp_path / "link")
    assert_same(tg.load(tmp_path / "real", {"w": jnp.zeros(3)}), {"w": tree["w"] + 1})


def test_save_to_dangling_symlink_names_tg_save(tmp_path):
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(
        FileExistsError,
        match=r"tg\.save: .*dangling is a symbolic link to .*nowhere, which does not",
    ):
        tg.save(tmp_path / "dangling", {"w": jnp.ones(2)})
    assert not os.path.exists(tmp_path / "nowhere")


def test_load_of_a_fifo_does_not_block(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = {}

    def run():
        try:
            tg.load(fifo, {"w": jnp.zeros(2)})
        except Exception as e:
            result["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(3)
    blocked = t.is_alive()
    if blocked:  # unblock the reader: open for writing, then close (EOF)
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
    assert not blocked, "tg.load blocked on a FIFO"
    assert isinstance(result.get("e"), tg.CheckpointError)
    assert re.search(f"{fifo} is {INVALID}: it is a FIFO", str(result["e"]))


# ---------------------------------------------------------------- failed saves


@pytest.fixture
def quiet_absl():
    logging.disable(logging.CRITICAL)  # orbax logs the failure's traceback from its threads
    yield
    logging.disable(logging.NOTSET)


UNSUPPORTED = {
    "str": np.array(["a", "b"]),
    "object": np.array([object()], dtype=object),
    "datetime64": np.array(["2020-01-01"], dtype="datetime64[D]"),
    "numpy-str-scalar": np.str_("a"),
}
if np.dtype(np.longdouble).itemsize > 8:  # float128 here; plain float64 on some platforms
    UNSUPPORTED["longdouble"] = np.array([1.0], dtype=np.longdouble)


@pytest.mark.parametrize("bad", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_failed_save_of_unsupported_array_keeps_previous(tmp_path, bad, quiet_absl):
    good = {"w": jnp.arange(3.0), "k": 3}
    tg.save(tmp_path / "ck", good)
    with pytest.raises((TypeError, ValueError), match=r"dtype|data type"):
        tg.save(tmp_path / "ck", {"w": jnp.ones(3), "k": 9, "bad": bad})
    assert_same(tg.load(tmp_path / "ck", {"w": jnp.zeros(3), "k": 0}), good)
    tg.save(tmp_path / "ck", {"w": jnp.ones(3), "k": 4})  # and the next save works
    assert tg.load(tmp_path / "ck", {"w": jnp.zeros(3), "k": 0})["k"] == 4


@pytest.mark.parametrize("bad", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_failed_save_of_unsupported_array_is_clear_and_clean(tmp_path, bad, caplog):
    tg.save(tmp_path / "ck", {"w": jnp.arange(3.0)})
    listing = sorted(os.listdir(tmp_path / "ck"))
    dtype = re.escape(str(bad.dtype))
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(TypeError, match=rf"tg\.save: 'bad' is an array of dtype {dtype}, "),
    ):
        tg.save(tmp_path / "ck", {"w": jnp.ones(3), "bad": bad})
    assert sorted(os.listdir(tmp_path / "ck")) == listing
    assert not caplog.records  # refused before orbax ran: no tracebacks logged from its threads


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_save_into_read_only_folder_keeps_previous(tmp_path):
    good = {"w": jnp.arange(3.0)}
    tg.save(tmp_path / "ck", good)
    os.chmod(tmp_path / "ck", 0o555)
    try:
        with pytest.raises(PermissionError, match="ck"):
            tg.save(tmp_path / "ck", {"w": jnp.ones(3)})
    finally:
        os.chmod(tmp_path / "ck", 0o755)
    assert_same(tg.load(tmp_path / "ck", {"w": jnp.zeros(3)}), good)
