"""Scale-out: `tg.shard`, `tg.shard_batch`, `tg.train(mesh=)`, on a mesh and in two processes.

The placement rules and their errors run here on a one-device mesh. Training
on 8 devices runs `tests/scaling_mesh.py` in a subprocess (jax fixes the
device count when it starts), and the multi-process runs start
`tests/scaling_procs.py` in one and in two processes.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treegrad as tg

from .helpers import MLP, mse
from .scaling_mesh import reference

HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": str(HERE.parent)}
pytestmark = pytest.mark.devices  # (`.ci/run` runs the slow ones on every jax)


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def specs(tree):
    return {k: v.sharding.spec for k, v in tg.params(tree).named().items()}


# --------------------------------------------------------------------- tg.shard


def test_rules_place_matched_arrays_and_leave_the_rest(mesh):
    model = MLP(jax.random.key(0), sizes=(4, 8, 8, 1))
    rules = {"layers.0": P("data"), "layers.*.weight": P(None, "data"), "layers.2.bias": P()}
    placed = tg.shard(model, rules, mesh=mesh)
    expected = {
        "layers.0.weight": P("data"),  # "layers.0" covers all under it, and comes first
        "layers.0.bias": P("data"),
        "layers.1.weight": P(None, "data"),  # `*` is one path component
        "layers.2.weight": P(None, "data"),
        "layers.2.bias": P(),
    }
    for name, a in tg.params(placed).named().items():
        if name in expected:
            assert a.sharding == NamedSharding(mesh, expected[name]), name
        else:  # no rule: left where it was
            assert name == "layers.1.bias" and a is model.layers[1].bias
    assert (
        placed.act is model.act
        and model.layers[0].weight.sharding != placed.layers[0].weight.sharding
    )
    for a, b in zip(
        jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(placed), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_star_is_one_component(mesh):
    model = {"enc": {"w": jnp.ones(2)}, "w": jnp.ones(2)}
    placed = tg.shard(model, {"*.w": P("data")}, mesh=mesh)
    assert placed["enc"]["w"].sharding == NamedSharding(mesh, P("data"))
    assert placed["w"] is model["w"]


def test_one_spec_a_sharding_and_a_prefix(mesh):
    tree = {"a": jnp.ones((2, 2)), "b": [jnp.ones(2), 3.0, "name", None, jnp.tanh]}
    out = tg.shard(tree, P(), mesh=mesh)
    assert out["a"].sharding == NamedSharding(mesh, P()) == out["b"][0].sharding
    assert out["b"][1:] == [3.0, "name", None, jnp.tanh]  # non-arrays left alone
    s = NamedSharding(mesh, P("data"))
    out = tg.shard(tree, {"a": s, "b": None})  # a Sharding needs no mesh; None: left as is
    assert out["a"].sharding == s and out["b"][0] is tree["b"][0]
    out = tg.shard((jnp.ones((4, 2)), jnp.ones(4)), (P("data", None), P()), mesh=mesh)
    assert [x.sharding.spec for x in out] == [P("data", None), P()]
    # numpy leaves become placed jax arrays
    (x,) = tg.shard([np.ones(3, np.float32)], P("data"), mesh=mesh)
    assert isinstance(x, jax.Array) and x.sharding.spec == P("data")


def test_mesh_from_set_mesh(mesh):
    with jax.set_mesh(mesh):
        x = tg.shard(jnp.ones(4), P("data"))
    assert x.sharding == NamedSharding(mesh, P("data"))


def test_abstract_leaves_and_inside_a_trace(mesh):
    abstract = tg.shard(jax.eval_shape(lambda: MLP(jax.random.key(0))), P(), mesh=mesh)
    leaf = abstract.layers[0].weight
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding == NamedSharding(mesh, P())
    # In a trace it is a sharding constraint: a model built inside tg.jit comes out placed.
    make = tg.jit(lambda key: tg.shard(MLP(key), {"layers.*.weight": P("data")}, mesh=mesh))
    model = make(jax.random.key(0))
    assert model.layers[0].weight.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    np.testing.assert_array_equal(model.layers[0].weight, MLP(jax.random.key(0)).layers[0].weight)


def test_optimiser_state_by_its_parameters_paths(mesh):
    model = MLP(jax.random.key(0))
    state = tg.setup(optax.adam(1e-3), model)
    placed = tg.shard(state, {"layers.0.weight": P("data"), "layers.1": P()}, mesh=mesh)
    adam = placed.layers[0].weight.state[0]
    assert adam.mu.sharding.spec == P("data") == adam.nu.sharding.spec
    assert placed.layers[1].bias.state[0].mu.sharding.spec == P()
    assert placed.layers[0].bias.state[0].mu is state.layers[0].bias.state[0].mu  # no rule
    assert adam.count.sharding == NamedSharding(mesh, P())  # shared: replicated on the mesh
    with pytest.raises(TypeError, match="optimiser state with one Sharding or PartitionSpec"):
        tg.shard(state, [P()], mesh=mesh)


def test_shard_errors_name_what_is_wrong(mesh):
    model = MLP(jax.random.key(0))
    with pytest.raises(ValueError, match=r"rule 'layers\.\*\.wieght' matches no array.*"
                       r"layers\.0\.weight, layers\.0\.bias"):  # fmt: skip
        tg.shard(model, {"layers.*.weight": P(), "layers.*.wieght": P()}, mesh=mesh)
    with pytest.raises(ValueError, match=r"P\('data',\) is a PartitionSpec, which needs a mesh"):
        tg.shard(model, P("data"))
    with pytest.raises(ValueError, match=r"names the axis 'model', which the mesh lacks.*'data'"):
        tg.shard(model, {"layers.0.weight": P("model")}, mesh=mesh)
    with pytest.raises(ValueError, match=r"cannot place 'layers\.0\.bias' \(float32\[8\]\).*"
                       r"2 entries but the array has 1 dimension"):  # fmt: skip
        tg.shard(model, P(None, "data"), mesh=mesh)
    with pytest.raises(TypeError, match="spec holds a str"):
        tg.shard(model, "data", mesh=mesh)
    with pytest.raises(ValueError, match="not a pytree prefix of the tree"):
        tg.shard({"a": jnp.ones(2)}, {"b": {"c": P()}}, mesh=mesh)
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh, got \(8,\)"):
        tg.shard(model, P(), mesh=(8,))


# --------------------------------------------------------------- tg.shard_batch


def test_shard_batch_places_each_leaf(mesh):
    x, y = np.arange(12.0, dtype=np.float32).reshape(4, 3), np.arange(4, dtype=np.int32)
    gx, gy = tg.shard_batch((x, y), mesh)
    assert gx.sharding == NamedSharding(mesh, P("data")) == gy.sharding
    np.testing.assert_array_equal(gx, x)
    out = tg.shard_batch(
        {"x": x, "t": 0.5, "m": jnp.ones(())}, mesh, {"x": P("data"), "t": None, "m": P()}
    )
    assert out["t"] == 0.5 and out["m"].sharding.spec == P()
    with pytest.raises(
        ValueError, match=r"'1' \(int32\[4\]\) has 1 dimension\(s\), fewer than the 2"
    ):
        tg.shard_batch((x, y), mesh, P("data", None))
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh, got P\('data',\)"):
        tg.shard_batch((x, y), P("data"))


# -------------------------------------------------------------- tg.train(mesh=)


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_train_with_a_mesh_equals_plain_optax(mesh):
    rng = np.random.default_rng(0)
    data = [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))
        for _ in range(3)
    ]
    model = tg.shard(MLP(jax.random.key(0)), P(), mesh=mesh)
    state, trained, losses = tg.train(mse, model, data, tg.setup(optax.sgd(0.1), model), mesh=mesh)
    ref, opt = MLP(jax.random.key(0)), optax.sgd(0.1)
    o = opt.init(ref)
    for x, y in data:
        loss, g = jax.value_and_grad(mse)(ref, x, y)
        u, o = opt.update(g, o, ref)
        ref = optax.apply_updates(ref, u)
        assert np.isclose(losses.pop(0), float(loss), rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(ref), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        assert a.sharding == NamedSharding(mesh, P())
    with pytest.raises(
        TypeError, match=r"tg\.train: mesh must be a jax\.sharding\.Mesh, got 'data'"
    ):
        tg.train(mse, model, data, state, mesh="data")


# ------------------------------------------------------ 8 devices, 2 processes


# 65 s alone on a 2-core machine (8 devices in a subprocess): in CI's slow run, in two
# parts that two workers can run at once. One process each (`-n 0`): pytest-xdist there
# would add workers to a run already using every core (119 s of CPU against 89 s).
@pytest.mark.slow
@pytest.mark.parametrize("case", ["tests/scaling_mesh.py", "docs/scaling.md"])
def test_on_eight_devices(case):
    """Data, 2x4 model and fully sharded training in every style (tests/scaling_mesh.py),
    and the examples of docs/scaling.md, on 8 devices."""
    env = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
    cmd.append(str(HERE.parent / case))
    run = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-6000:] + run.stderr[-3000:]
    assert "skipped" not in run.stdout, run.stdout[-2000:]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One process: the same script, 8 s on a 2-core machine; two processes 11 s. Both
# slow: CI's slow run has them.
@pytest.mark.slow
@pytest.mark.parametrize("n_proc", [1, 2])
def test_processes_equal_one_device(tmp_path, n_proc):
    """20 data-parallel and 20 model+FSDP steps (save, load onto another mesh midway)."""
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "scaling_procs.py"),
                str(n_proc),
                str(i),
                port,
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
        )
        for i in range(n_proc)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"ok {i}" in out, out[-4000:]
    result = np.load(tmp_path / "result.npz")
    model, losses = reference(20)
    np.testing.assert_allclose(result["dp_losses"], losses, rtol=1e-6)
    np.testing.assert_allclose(result["mp_losses"], losses, rtol=1e-6)
    for name, p in tg.params(model).named().items():
        for run in ("dp", "mp"):
            np.testing.assert_allclose(
                result[f"{run}/{name}"], p, rtol=1e-6, atol=1e-6, err_msg=run
            )
