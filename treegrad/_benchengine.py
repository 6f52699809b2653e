"""The engine's own costs, for `treegrad bench`: where a call's time goes, the
first call against plain `jax.jit` as models grow, and memory held by the cache.

Every figure is measured side by side with the hand-written JAX equivalent in
the same process; `docs/benchmarks.md` records them with machine and versions.
"""

from __future__ import annotations

import gc
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax


def _per_call(fn: Callable[[], Any], repeat: int = 7, budget: float = 0.1) -> float:
    """Microseconds per call: the fastest of `repeat` runs (the least disturbed by noise),
    each of as many calls as fit in about `budget` seconds (at least 5)."""
    t = time.perf_counter()
    fn()
    once = time.perf_counter() - t
    number = max(5, min(2000, int(budget / max(once, 1e-7))))
    return 1e6 * min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def overhead_breakdown(sizes: list[int], batch: int) -> dict[str, float]:
    """Microseconds per call of each part of a naive-loop step (`withgradient` + `update`).

    Each treegrad call is timed next to the hand-written jax.jit call that does
    the same work on the same Module model, and the engine's steps are timed
    alone, so the difference is the Python treegrad adds around XLA.
    """
    import treegrad as tg
    from treegrad import _cache as C
    from treegrad import _programs as P
    from treegrad._call import Call, root_keys
    from treegrad._outputs import uniq

    from ._bench import _tg_loss, _tg_model

    x = jax.random.normal(jax.random.key(1), (batch, sizes[0]))
    y = jax.random.normal(jax.random.key(2), (batch, sizes[-1]))
    m = _tg_model(sizes, jax.random.key(0))
    opt = optax.adam(1e-3)
    st = tg.setup(opt, m)
    ost = opt.init(m)
    loss = lambda m: _tg_loss(m, x, y)
    _, (g,) = tg.withgradient(loss, m)
    call = Call(P.GRAD, (True,), (loss,), (m,))
    entry = C._CACHE[call.key][0]
    cl = entry.guard.check(loss)
    assert cl is not None
    dyn = [*cl, *call.a_uniq]
    ct = P.cotangent()
    shape, *_ = C._RECENT[(P.GRAD, (True,), root_keys((loss,)))]
    flat_grads, _, _ = entry.jitted(*dyn, ct)
    vg = jax.jit(jax.value_and_grad(_tg_loss))

    @jax.jit
    def apply(m: Any, ost: Any, g: Any) -> Any:
        u, ost = opt.update(g, ost, m)
        return optax.apply_updates(m, u), ost

    return {
        "tg.withgradient (new lambda)": _per_call(
            lambda: tg.withgradient(lambda m: _tg_loss(m, x, y), m)
        ),
        "  its compiled program alone": _per_call(lambda: entry.jitted(*dyn, ct)),
        "  read arguments (generated code)": _per_call(lambda: uniq(shape.flatten((m,)) or [])),
        "    (a new structure: flatten, key)": _per_call(
            lambda: Call(P.GRAD, (True,), (loss,), (m,))
        ),
        "  guard (re-read what it captures)": _per_call(lambda: entry.guard.check(loss)),
        "  gradient tree from the flat outputs": _per_call(lambda: entry._grad_tree(flat_grads)),
        "  hand-written jax.jit(value_and_grad)": _per_call(lambda: vg(m, x, y)),
        "tg.update": _per_call(lambda: tg.update(st, m, g)),
        "  hand-written jax.jit(optax update)": _per_call(lambda: apply(m, ost, g)),
    }


def format_breakdown(parts: dict[str, float]) -> str:
    lines = [
        "per-call overhead breakdown (us per call, fastest of 7 runs; dispatch times, since jax "
        "runs asynchronously: meaningful for dispatch-bound sizes):"
    ]
    lines += [f"  {name:<40} {us:>8.2f}" for name, us in parts.items()]
    return "\n".join(lines)


def _leafy(n: int, shift: float) -> dict[str, Any]:
    return {f"p{i}": jnp.full((3,), float(i) + shift) for i in range(n)}


def first_calls(leaves: Sequence[int], repeats: int = 5) -> dict[int, tuple[float, float]]:
    """Seconds to the first gradient of a model of `n` leaves, one small operation per leaf:
    medians over `repeats` pairs (three from 1,000 leaves up: seconds each).

    `jax.jit(jax.grad(loss))` against `tg.gradient(loss, model)`; each uses a new
    function and shapes of its own, so neither reuses a compiled program. The two
    alternate which goes first: one sample of a tenth of a second moved by 40% on
    this 2-core host (2026-12-03), where the median of five moves by a few percent.
    """
    import treegrad as tg

    out = {}
    for n in leaves:
        times: dict[str, list[float]] = {"jax": [], "tg": []}
        for r in range(repeats if n < 1000 else min(repeats, 3)):
            order = ("jax", "tg") if r % 2 == 0 else ("tg", "jax")
            for which in order:
                size = 3 + 2 * r + (which == "tg")  # shapes no earlier call compiled
                model = {f"p{i}": jnp.full((size,), float(i)) for i in range(n)}
                loss = eval(  # a fresh code object: nothing cached by code either
                    "lambda m: sum(jnp.sum(jnp.sin(v)) for v in m.values())", {"jnp": jnp}
                )
                gc.collect()
                t = time.perf_counter()
                g = jax.jit(jax.grad(loss))(model) if which == "jax" else tg.gradient(loss, model)
                jax.block_until_ready(g)
                times[which].append(time.perf_counter() - t)
        out[n] = (statistics.median(times["jax"]), statistics.median(times["tg"]))
    return out


def format_first_calls(results: dict[int, tuple[float, float]]) -> str:
    lines = ["first call of a gradient (trace + compile + run), by number of leaves:"]
    for n, (plain, ours) in results.items():
        lines.append(
            f"  {n:>5} leaves: jax.jit(jax.grad) {plain:.3f}s, tg.gradient {ours:.3f}s "
            f"(ratio {ours / plain:.2f})"
        )
    return "\n".join(lines)


def resident_mb() -> float:
    """The process's resident memory in MB, after returning freed memory to the OS."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed pages otherwise
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise OSError("no VmRSS in /proc/self/status")


def memory(n_lambdas: int = 20_000, n_codes: int = 2_000, every: int = 500) -> list[str]:
    """Resident memory while differentiating many new lambdas and many distinct functions."""
    import treegrad as tg

    w = jnp.ones(8)
    x = jnp.ones(8)
    lines = [f"resident memory, cache bound {tg._cache.MAX_ENTRIES} programs:"]
    base = resident_mb()
    lines.append(f"  start: {base:.0f} MB")
    for _ in range(n_lambdas):
        tg.gradient(lambda v: jnp.sum(v * x), w)
    lines.append(
        f"  after {n_lambdas} new lambdas of one code: {resident_mb():.0f} MB, "
        f"{tg._cache.cache_size()} program(s) cached"
    )
    for k in range(n_codes):
        ns: dict[str, Any] = {"jnp": jnp}
        exec(f"def f(v):\n    return jnp.sum(jnp.sin(v) * {k})\n", ns)  # a new code object
        tg.gradient(ns["f"], w)
        if (k + 1) % every == 0:
            lines.append(
                f"  after {k + 1} distinct functions: {resident_mb():.0f} MB, "
                f"{tg._cache.cache_size()} programs cached"
            )
    return lines
