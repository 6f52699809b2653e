"""tg.save / tg.load: round trips of every kind of tree and dtype, `like` checks, sharding."""

import json
import os
import subprocess
import sys
import textwrap
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


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
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


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
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


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
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


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
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
@pytest.mark.devices
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
