"""Data-parallel training of a digits classifier, on one machine's CPU split into devices.

    python examples/data_parallel.py                  # one process, 8 CPU devices
    python examples/data_parallel.py --processes 2    # two processes, 4 devices each

XLA is told to present the CPU as 8 devices (`XLA_FLAGS`, set before jax
starts). The model is replicated on a mesh of all of them and each batch of
128 digits is split over the `"data"` axis, 16 rows per device; XLA sums the
gradients across devices. With `--processes N` the script starts itself N
times on 127.0.0.1: each process joins through `jax.distributed`, loads only
its own rows of every batch, and `tg.shard_batch` (inside `tg.train`) makes
the global batch from them. On a real cluster the same code runs with
`jax.distributed.initialize()` finding the other hosts by itself, and a GPU
or TPU per device instead of a slice of the CPU.
"""

import argparse
import os
import socket
import subprocess
import sys

DEVICES = 8
BATCH = 128


def make_model(key):
    import jax

    from treegrad import nn

    k1, k2 = jax.random.split(key)
    return nn.Chain(nn.Dense(64, 64, jax.nn.relu, key=k1), nn.Dense(64, 10, key=k2))


def loss(model, x, y):
    import treegrad as tg

    return tg.losses.logitcrossentropy(model(x), y)


def local_batches(steps, process=0, processes=1):
    """This process's rows of each of the first `steps` batches (the epoch repeated)."""
    from treegrad import datasets

    x, y = datasets.digits()
    batches = datasets.batches(x, y, BATCH)
    rows = slice(process * BATCH // processes, (process + 1) * BATCH // processes)
    return [(bx[rows], by[rows]) for bx, by in (batches[i % len(batches)] for i in range(steps))]


def train(steps, process=0, processes=1):
    """Train on a mesh of every device of every process; returns the model and the losses."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import treegrad as tg

    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = tg.shard(make_model(jax.random.key(0)), P(), mesh=mesh)  # replicated
    state = tg.setup(optax.adam(3e-3), model)
    data = local_batches(steps, process, processes)
    _, model, losses = tg.train(loss, model, data, state, mesh=mesh, batch_spec=P("data"))
    return model, losses


def worker(steps, process, processes, port):
    """One process of the run: join the others, train, report."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES // processes}"
    import jax

    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, process)
    _, losses = train(steps, process, processes)
    if process == 0:
        print(
            f"{jax.process_count()} process(es), {jax.device_count()} devices: "
            f"{steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )
        print("losses", " ".join(f"{v:.6f}" for v in losses), flush=True)


def main(steps=50, processes=1):
    """Run `processes` copies of this script and wait for them.

    Returns process 0's report and its losses, one per step.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), "--processes", str(processes),
             "--steps", str(steps), "--port", port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"a process failed:\n{out[-3000:]}")
    lines = outs[0].splitlines()
    report = next(line for line in lines if "process(es)" in line)
    losses = next(line for line in lines if line.startswith("losses "))
    return report, [float(v) for v in losses.split()[1:]]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is None:
        print(main(args.steps, args.processes)[0])
    else:
        worker(args.steps, args.worker, args.processes, args.port)
