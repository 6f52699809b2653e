"""One script for one process or several: training on a mesh of 8 CPU devices.

Run by `tests/test_scaling.py` as `python tests/scaling_procs.py N_PROC PID PORT OUT`
in N_PROC processes (8 / N_PROC CPU devices each, `jax.distributed` on
127.0.0.1 with CPU collectives). Each process loads only its rows of every
batch. Two runs of 20 steps each:

- data parallel: `tg.train(..., mesh=mesh)`, the model replicated;
- model parallel and fully sharded at once (2x4 mesh): 10 steps of a
  `tg.jit` step, a sharded save (each process writes its own shards), a load
  onto another mesh (4x2, other specs) from an abstract model, then 10
  implicit-style steps there.

Process 0 writes the gathered parameters and the losses to OUT/result.npz.
"""

import os
import sys


def main(n_proc: int, pid: int, port: str, out: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // n_proc}"
    import jax

    if n_proc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n_proc, process_id=pid)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import treegrad as tg

    sys.path.insert(0, os.path.dirname(__file__))
    from scaling_mesh import MLP, RULE, host_batches, layout, loss_fn

    steps = 20
    assert jax.device_count() == 8 and jax.process_count() == n_proc
    rows = slice(pid * 32 // n_proc, (pid + 1) * 32 // n_proc)
    local = [(x[rows], y[rows]) for x, y in host_batches(steps)]

    def gathered(model):
        return {
            k: multihost_utils.process_allgather(v, tiled=True)
            for k, v in tg.params(model).named().items()
        }

    # Data parallel, through tg.train: each process gives its rows of each batch.
    mesh, rules = layout("data")
    model = tg.shard(MLP(jax.random.key(0)), rules, mesh=mesh)
    _, model, dp_losses = tg.train(loss_fn, model, local, tg.setup(RULE, model), mesh=mesh)
    dp = gathered(model)

    # Model parallel + fully sharded, compiled, on a 2x4 mesh.
    mesh, rules = layout("model+fsdp")
    model = tg.shard(MLP(jax.random.key(0)), rules, mesh=mesh)
    state = tg.setup(RULE, model)

    @tg.jit
    def step(state, model, x, y):
        loss, (g,) = tg.withgradient(lambda m: loss_fn(m, x, y), model)
        state, model = tg.update(state, model, g)
        return state, model, loss

    losses = []
    for batch in local[:10]:
        x, y = tg.shard_batch(batch, mesh)
        state, model, loss = step(state, model, x, y)
        losses.append(float(loss))
    path = os.path.join(out, "ck")
    tg.save(path, (model, state))

    # Restore onto another mesh from an abstract model and state, and go on implicitly.
    mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rules2 = {"layers.*.weight": P("data", "model"), "layers.*.bias": P("data")}
    abstract = jax.eval_shape(
        lambda: (MLP(jax.random.key(0)), tg.setup(RULE, MLP(jax.random.key(0))))
    )
    like = (tg.shard(abstract[0], rules2, mesh=mesh2), tg.shard(abstract[1], rules2, mesh=mesh2))
    model, state = tg.load(path, like)
    ps = tg.params(model)

    def implicit_step(x, y):
        loss, grads = tg.withgradient(lambda: loss_fn(model, x, y), ps)
        tg.update_(state, ps, grads)
        return loss

    for batch in local[10:]:
        losses.append(float(implicit_step(*tg.shard_batch(batch, mesh2))))
    for name, p in tg.params(model).named().items():
        spec = P("data", "model") if name.endswith("weight") else P("data")
        assert p.sharding.is_equivalent_to(NamedSharding(mesh2, spec), p.ndim), (name, p.sharding)
        adam = state.layers[int(name.split(".")[1])].weight.state[0]
        assert adam.count.sharding.is_equivalent_to(NamedSharding(mesh2, P()), 0)
    mp = gathered(model)

    if pid == 0:
        (data,) = [e for e in os.listdir(path) if e.startswith("data-")]
        written = sorted(e for e in os.listdir(os.path.join(path, data)) if "process_" in e)
        assert written == [f"ocdbt.process_{i}" for i in range(n_proc)], written
        np.savez(
            os.path.join(out, "result.npz"),
            dp_losses=np.array(dp_losses),
            mp_losses=np.array(losses),
            **{f"dp/{k}": v for k, v in dp.items()},
            **{f"mp/{k}": v for k, v in mp.items()},
        )
    print("ok", pid, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
