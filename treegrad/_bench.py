"""`treegrad bench`: one Adam step of an MLP, side by side with hand-written JAX.

Every system trains the same MLP on the same batch in one process. Repetitions
are interleaved (every system once, in a new random order, then again), each
timing `steps` steps to completion; the table reports the median per-step time,
its spread (min-max over repetitions), the ratio of medians to the hand-written
fused and two-call steps, and the process's CPU time per step (all threads) over
the two-call's. A second copy of the hand-written two-call runs as a control:
its ratio to the first shows how far two identical loops measure apart.
Anchor libraries (equinox, flax, torch) run when installed, else are skipped
with a note.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._benchanchors import LR, Runner, add_anchors
from ._benchengine import first_calls, format_breakdown, format_first_calls, overhead_breakdown

SIZES: dict[str, tuple[list[int], int]] = {
    "tiny": ([16, 32, 32, 4], 32),
    "deep": ([32] * 18, 32),
    "wide": ([256, 1024, 1024, 10], 512),
}
TWO = "jax two-call (hand-written)"
# The same loop as TWO with its own model and state: the table's control.
CONTROL = "jax two-call, again (control)"


def _init(sizes: list[int], key: Any) -> list[dict[str, Any]]:
    out = []
    for a, b in itertools.pairwise(sizes):
        key, k = jax.random.split(key)
        out.append({"w": jax.random.normal(k, (b, a)) / jnp.sqrt(a), "b": jnp.zeros(b)})
    return out


def _forward(ps: list[dict[str, Any]], x: Any) -> Any:
    for layer in ps[:-1]:
        x = jax.nn.relu(x @ layer["w"].T + layer["b"])
    return x @ ps[-1]["w"].T + ps[-1]["b"]


def _loss(ps: Any, x: Any, y: Any) -> Any:
    return jnp.mean((_forward(ps, x) - y) ** 2)


def _tg_model(sizes: list[int], key: Any) -> Any:
    from . import nn

    keys = jax.random.split(key, len(sizes) - 1)
    layers = [
        nn.Dense(a, b, jax.nn.relu if i < len(sizes) - 2 else None, key=k)
        for i, (a, b, k) in enumerate(zip(sizes[:-1], sizes[1:], keys, strict=True))
    ]
    return nn.Chain(*layers)


def _tg_loss(m: Any, x: Any, y: Any) -> Any:
    return jnp.mean((m(x) - y) ** 2)


def _systems(
    sizes: list[int], batch: int, anchors: bool = True
) -> tuple[dict[str, Runner], list[str], dict[str, list[int]]]:
    import treegrad as tg

    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (batch, sizes[0]))
    y = jax.random.normal(jax.random.key(2), (batch, sizes[-1]))
    opt = optax.adam(LR)
    systems: dict[str, Runner] = {}
    notes: list[str] = []

    ps0 = _init(sizes, key)

    @jax.jit
    def fused(ps: Any, st: Any, x: Any, y: Any) -> Any:
        loss, g = jax.value_and_grad(_loss)(ps, x, y)
        u, st = opt.update(g, st, ps)
        return optax.apply_updates(ps, u), st, loss

    vg = jax.jit(jax.value_and_grad(_loss))

    @jax.jit
    def apply(ps: Any, st: Any, g: Any) -> Any:
        u, st = opt.update(g, st, ps)
        return optax.apply_updates(ps, u), st

    # Each runner keeps its own model and state between repetitions in `s`.
    def hand_fused(n: int, s: list[Any] = [ps0, opt.init(ps0)]) -> None:  # noqa: B006, B008
        ps, st = s
        for _ in range(n):
            ps, st, _loss_v = fused(ps, st, x, y)
        jax.block_until_ready(ps)
        s[:] = [ps, st]

    def hand_two(n: int, s: list[Any] = [ps0, opt.init(ps0)]) -> None:  # noqa: B006, B008
        ps, st = s
        for _ in range(n):
            _l, g = vg(ps, x, y)
            ps, st = apply(ps, st, g)
        jax.block_until_ready(ps)
        s[:] = [ps, st]

    def hand_two_again(n: int, s: list[Any] = [ps0, opt.init(ps0)]) -> None:  # noqa: B006, B008
        hand_two(n, s)

    systems["jax.jit fused (hand-written)"] = hand_fused
    systems[TWO] = hand_two
    systems[CONTROL] = hand_two_again

    m0 = _tg_model(sizes, key)

    # The same fused step written by hand with jax.jit, on treegrad's Module model:
    # what JAX's pytree handling of Python classes costs before any treegrad code runs.
    @jax.jit
    def fused_modules(m: Any, st: Any, x: Any, y: Any) -> Any:
        loss, g = jax.value_and_grad(_tg_loss)(m, x, y)
        u, st = opt.update(g, st, m)
        return optax.apply_updates(m, u), st, loss

    def hand_modules(n: int, s: list[Any] = [m0, opt.init(m0)]) -> None:  # noqa: B006, B008
        m, st = s
        for _ in range(n):
            m, st, _loss_v = fused_modules(m, st, x, y)
        jax.block_until_ready(m)
        s[:] = [m, st]

    @tg.jit
    def tg_step(state: Any, m: Any, x: Any, y: Any) -> Any:
        loss, (g,) = tg.withgradient(lambda m: _tg_loss(m, x, y), m)
        state, m = tg.update(state, m, g)
        return state, m, loss

    def tg_jit(n: int, s: list[Any] = [tg.setup(opt, m0), m0]) -> None:  # noqa: B006, B008
        st, m = s
        for _ in range(n):
            st, m, _l = tg_step(st, m, x, y)
        jax.block_until_ready(m)
        s[:] = [st, m]

    # One log per loss, appended to when traced: a list a function only appends to is
    # its output (a number it advances would be read fresh, tracing every call).
    naive_traces: list[int] = []
    implicit_traces: list[int] = []
    traces = {"naive": naive_traces, "implicit": implicit_traces}

    def counted(m: Any, x: Any, y: Any) -> Any:
        naive_traces.append(1)
        return _tg_loss(m, x, y)

    def tg_naive(n: int, s: list[Any] = [tg.setup(opt, m0), m0]) -> None:  # noqa: B006, B008
        st, m = s
        for _ in range(n):
            _l, (g,) = tg.withgradient(lambda m: counted(m, x, y), m)
            st, m = tg.update(st, m, g)
        jax.block_until_ready(m)
        s[:] = [st, m]

    m_imp = jax.tree_util.tree_map(lambda a: a, m0)
    ps = tg.params(m_imp)
    st_imp = tg.setup(opt, ps)

    def counted_implicit() -> Any:
        implicit_traces.append(1)
        return _tg_loss(m_imp, x, y)

    def tg_implicit(n: int) -> None:
        for _ in range(n):
            grads = tg.gradient(lambda: counted_implicit(), ps)
            tg.update_(st_imp, ps, grads)
        jax.block_until_ready(m_imp)

    m_jit = jax.tree_util.tree_map(lambda a: a, m0)
    ps_jit = tg.params(m_jit)
    st_jit = tg.setup(opt, ps_jit)

    @tg.jit
    def tg_implicit_step(x: Any, y: Any) -> Any:
        grads = tg.gradient(lambda: _tg_loss(m_jit, x, y), ps_jit)
        tg.update_(st_jit, ps_jit, grads)

    def tg_implicit_jit(n: int) -> None:
        for _ in range(n):
            tg_implicit_step(x, y)
        jax.block_until_ready(m_jit)

    systems["jax.jit fused, tg Modules (hand)"] = hand_modules
    systems["tg.jit step"] = tg_jit
    systems["tg.jit implicit step"] = tg_implicit_jit
    systems["tg naive loop (new lambda/step)"] = tg_naive
    systems["tg implicit loop"] = tg_implicit
    if anchors:
        add_anchors(systems, notes, sizes, x, y, opt)
    return systems, notes, traces


class Measured(NamedTuple):
    """Per system, seconds per step of each repetition: wall clock, and the
    process's CPU time (all threads: Python's and JAX's workers)."""

    times: dict[str, list[float]]
    cpu: dict[str, list[float]]
    notes: list[str]
    traces: dict[str, list[int]]


def measure(
    sizes: list[int], batch: int, steps: int, repeats: int, anchors: bool = True, seed: int = 0
) -> Measured:
    systems, notes, traces = _systems(sizes, batch, anchors)
    for run in systems.values():
        run(3)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    order = list(systems)
    rng = random.Random(seed)
    for _ in range(repeats):
        # A new order each repetition. In a fixed one each system always follows
        # the same other, and what ran just before changes how the kernel places
        # JAX's worker threads next to the Python thread on a machine of few
        # cores: two copies of the same hand-written loop measured 1.17x apart
        # in a fixed rotation with equinox, 0.88x in another (docs/benchmarks.md).
        rng.shuffle(order)
        for name in order:
            t, c = time.perf_counter(), time.process_time()
            systems[name](steps)
            times[name].append((time.perf_counter() - t) / steps)
            cpu[name].append((time.process_time() - c) / steps)
    return Measured(times, cpu, notes, traces)


def first_call(sizes: list[int], batch: int) -> dict[str, float]:
    """Seconds from a cold cache to the first result: trace + compile + run."""
    import treegrad as tg

    tg.clear_cache()
    # Batch sizes used nowhere else, so neither system reuses a compiled program.
    x = jax.random.normal(jax.random.key(1), (batch + 1, sizes[0]))
    y = jax.random.normal(jax.random.key(2), (batch + 1, sizes[-1]))
    x2 = jax.random.normal(jax.random.key(1), (batch + 2, sizes[0]))
    y2 = jax.random.normal(jax.random.key(2), (batch + 2, sizes[-1]))
    opt = optax.adam(LR)
    ps = _init(sizes, jax.random.key(0))
    st = opt.init(ps)

    def fused(ps: Any, st: Any, x: Any, y: Any) -> Any:
        loss, g = jax.value_and_grad(_loss)(ps, x, y)
        u, st = opt.update(g, st, ps)
        return optax.apply_updates(ps, u), st, loss

    t = time.perf_counter()
    jax.block_until_ready(jax.jit(fused)(ps, st, x, y))
    plain = time.perf_counter() - t
    m = _tg_model(sizes, jax.random.key(0))
    tst = tg.setup(opt, m)

    def step(state: Any, m: Any, x: Any, y: Any) -> Any:
        loss, (g,) = tg.withgradient(lambda m: _tg_loss(m, x, y), m)
        state, m = tg.update(state, m, g)
        return state, m, loss

    t = time.perf_counter()
    jax.block_until_ready(tg.jit(step)(tst, m, x2, y2))
    ours = time.perf_counter() - t
    return {"jax.jit": plain, "tg.jit": ours}


def format_table(
    title: str,
    times: dict[str, list[float]],
    cpu: dict[str, list[float]] | None = None,
    paired: bool = False,
) -> str:
    """The table: per system, the median time per step, its spread (min-max) and ratios.

    `paired`: entry i of every list comes from the same process (`measure_processes`),
    and each ratio is the median over processes of that process's ratio, so what is
    fixed for a process's life (its memory layout) cancels. Otherwise the ratios
    are of medians over one process's repetitions.
    """

    def ratio(over: dict[str, list[float]], name: str, base: str) -> float:
        if paired:
            return statistics.median(a / b for a, b in zip(over[name], over[base], strict=True))
        return statistics.median(over[name]) / statistics.median(over[base])

    fused = "jax.jit fused (hand-written)"
    header = f"{'system':<34} {'median us/step':>15} {'spread':>17} {'vs fused':>9}"
    header += f" {'vs two-call':>12}" + (f" {'cpu vs two-call':>16}" if cpu else "")
    lines = [title, header]
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = f"{1e6 * min(ts):.1f}-{1e6 * max(ts):.1f}"
        line = (
            f"{name:<34} {1e6 * med:>15.1f} {spread:>17} {ratio(times, name, fused):>9.2f} "
            f"{ratio(times, name, TWO):>12.2f}"
        )
        if cpu:
            line += f" {ratio(cpu, name, TWO):>16.2f}"
        lines.append(line)
    return "\n".join(lines)


def measure_processes(
    size: str, steps: int, repeats: int, processes: int, progress: bool = False
) -> Measured:
    """`measure` in `processes` fresh Python processes, one after another (seeds 0, 1,
    ...); per system, each process's median (wall and CPU) per step, in process order.

    One process's medians carry that process's memory layout, fixed for its life:
    the same tiny loop measured 0.99-1.21x the hand-written one in five fresh
    processes. The median over several processes does not depend on one layout.
    """
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    notes: list[str] = []
    traces: dict[str, list[int]] = {}
    for seed in range(processes):
        if progress:
            print(f"{size}: process {seed + 1}/{processes}", flush=True)
        args = [size, str(steps), str(repeats), str(seed)]
        done = subprocess.run(
            [sys.executable, "-m", "treegrad._bench", *args],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"benchmark process {seed + 1} of {processes} failed "
                f"(exit {done.returncode}):\n{done.stderr[-2000:]}"
            )
        one = json.loads(done.stdout.strip().splitlines()[-1])
        for name, value in one["times"].items():
            times.setdefault(name, []).append(value)
            cpu.setdefault(name, []).append(one["cpu"][name])
        notes = one["notes"]
        traces = one["traces"]
    return Measured(times, cpu, notes, traces)


def _worker(size: str, steps: int, repeats: int, seed: int) -> None:
    """One process of `measure_processes`: print its medians as one JSON line."""
    layer_sizes, batch = SIZES[size]
    m = measure(layer_sizes, batch, steps, repeats, seed=seed)
    out = {
        "times": {k: statistics.median(v) for k, v in m.times.items()},
        "cpu": {k: statistics.median(v) for k, v in m.cpu.items()},
        "notes": m.notes,
        "traces": m.traces,
    }
    print(json.dumps(out))


# Each treegrad loop against the hand-written JAX step it replaces.
BASELINES = {
    "tg.jit step": "jax.jit fused (hand-written)",
    "tg.jit implicit step": "jax.jit fused (hand-written)",
    "tg naive loop (new lambda/step)": TWO,
    "tg implicit loop": TWO,
}
SWEEP_DEPTHS = [5, 25, 100, 500]


class SweepPoint(NamedTuple):
    """One system at one model size: its time per step over its hand-written baseline."""

    leaves: int
    median: float
    low: float
    high: float


def leaf_sweep(
    depths: list[int], steps: int, repeats: int, progress: bool = False
) -> dict[str, list[SweepPoint]]:
    """Each treegrad loop's time per step over its `BASELINES` entry, by number of leaves.

    Repetitions are interleaved, so each repetition gives one ratio per system; a point
    holds their median and range (min-max).
    """
    out: dict[str, list[SweepPoint]] = {}
    start = time.perf_counter()
    for i, depth in enumerate(depths):
        if progress:
            print(
                f"sweep {i + 1}/{len(depths)}: MLP of {depth} layers ({2 * depth} leaves), "
                f"{time.perf_counter() - start:.0f} s so far",
                flush=True,
            )
        times = measure([8] * (depth + 1), 8, steps, repeats, anchors=False).times
        for name, base in BASELINES.items():
            ratios = [t / b for t, b in zip(times[name], times[base], strict=True)]
            out.setdefault(name, []).append(
                SweepPoint(2 * depth, statistics.median(ratios), min(ratios), max(ratios))
            )
    if progress:
        print(f"sweep done in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def main(
    steps: int = 200,
    repeats: int = 5,
    sizes: list[str] | None = None,
    plot: str | None = None,
    first_call_leaves: tuple[int, ...] = (),
    processes: int = 1,
) -> int:
    """Print the comparison tables (and write the leaf-count plot to `plot`); return 0.

    `processes` > 1 runs each size's table in that many fresh processes
    (`measure_processes`) and reports medians and ratios across them.
    """
    sizes = sizes or ["tiny", "deep"]
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        raise ValueError(f"unknown benchmark size {unknown[0]!r}: choose from {', '.join(SIZES)}")
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
        f"devices {jax.devices()}"
    )
    for size in sizes:
        layer_sizes, batch = SIZES[size]
        title = f"{size}: MLP {'-'.join(map(str, layer_sizes))}, batch {batch}, Adam"
        if processes > 1:
            times, cpu, notes, traces = measure_processes(
                size, steps, repeats, processes, progress=True
            )
            title += (
                f"; {processes} processes of {repeats} repetitions: medians across processes, "
                "spread = min-max of the processes' medians"
            )
        else:
            times, cpu, notes, traces = measure(layer_sizes, batch, steps, repeats)
        print()
        print(format_table(title, times, cpu, paired=processes > 1))
        print(
            f"traces of the loss: naive loop {len(traces['naive'])}, "
            f"implicit loop {len(traces['implicit'])}"
        )
        fc = first_call(layer_sizes, batch)
        print(
            f"first call (trace+compile+run): jax.jit {fc['jax.jit']:.3f}s, "
            f"tg.jit {fc['tg.jit']:.3f}s (ratio {fc['tg.jit'] / fc['jax.jit']:.2f})"
        )
        print(format_breakdown(overhead_breakdown(layer_sizes, batch)))
        for note in notes:
            print("note:", note)
    if first_call_leaves:
        print()
        print(format_first_calls(first_calls(first_call_leaves)))
    if plot:
        print(f"\nleaf-count sweep for {plot} (several minutes):", flush=True)
        sweep = leaf_sweep(SWEEP_DEPTHS, max(10, steps // 10), 3, progress=True)
        plot_sweep(sweep, plot)
    return 0


def plot_sweep(sweep: dict[str, list[SweepPoint]], path: str) -> None:
    """Write the sweep as a PNG: ratio to hand-written JAX per leaf count, min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.axhline(1.0, color="0.4", linewidth=1, linestyle="--", label="hand-written JAX (1.0)")
    for name, pts in sweep.items():
        med = [p.median for p in pts]
        ax.errorbar(
            [p.leaves for p in pts],
            med,
            yerr=[
                [m - p.low for m, p in zip(med, pts, strict=True)],
                [p.high - m for m, p in zip(med, pts, strict=True)],
            ],
            fmt="o-",
            capsize=3,
            label=f"{name} / {BASELINES[name].removesuffix(' (hand-written)')}",
        )
    ax.set_xscale("log")
    leaves = sorted({p.leaves for pts in sweep.values() for p in pts})
    ax.set_xticks(leaves, [str(n) for n in leaves])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("number of parameter arrays (leaves)")
    ax.set_ylabel("time per step / hand-written JAX")
    ax.set_title("treegrad's overhead against hand-written JAX, by number of leaves", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"overhead plot written to {path}")


if __name__ == "__main__":  # one process of `measure_processes`
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
