"""Keeping each array's layout on a mesh (used by the engine, the optimiser and
destructure), and naming arrays on different devices once a step has failed.

What keeps a layout once it is chosen (API.md §6): on a mesh with `Auto` axes
(`jax.sharding.Mesh`, the classic kind), an array's sharding is not part of
its abstract value, so inside a compiled program XLA chooses the layout of
every result: a fully sharded (FSDP) parameter's gradient came back replicated
on all 8 devices in 10 of 12 layouts tried, with `jax.grad` as with treegrad.
The engine therefore reads the concrete sharding of each input
(`placements`), compiles one program per distinct placement (jax caches a
traced program by shapes and dtypes only, so a constraint baked in for one
placement would be stale for another), and constrains each gradient to its
input's sharding. Tracers of a program in flight are mapped back to the
concrete sharding of their input (`tracing`), so a gradient or optimiser step
taken inside `tg.jit` is constrained the same way, and so are tracers that
`tg.shard` placed inside any trace (`learn`). On `Explicit` axes the sharding
is part of the type and jax keeps it itself: nothing is added.

What cannot be kept: inside the user's own `jax.jit` on `Auto` axes, an
input's placement is not visible (`jax.typeof(x).sharding` of an input placed
`P("data", None)` reads `P(None, None)` in jax 0.10, and `x.sharding` raises
on a tracer), so its gradient is left to XLA, replicated as with `jax.grad`.
There, compile with `tg.jit`, use `Explicit` axes, or `tg.shard` the model
inside the function.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

from ._jaxpr import is_tracer

# --- keeping layouts (used by the engine, the optimiser and destructure) ---------------

_SEVERAL: list[bool] = []
# id of a tracer of a program being traced -> the concrete sharding of its input,
# or the sharding `tg.shard` gave it inside the trace.
_KNOWN: dict[int, NamedSharding] = {}


def several_devices() -> bool:
    """Whether this process sees more than one device (read once: it never changes)."""
    if not _SEVERAL:
        _SEVERAL.append(jax.device_count() > 1)
    return _SEVERAL[0]


def on_mesh(x: Any) -> NamedSharding | None:
    """The sharding of an array placed on a mesh (a tracer: its input's), else None."""
    if is_tracer(x):
        return _KNOWN.get(id(x))
    s = getattr(x, "sharding", None)
    return s if type(s) is NamedSharding else None


def placement_of(x: Any) -> NamedSharding | None:
    """The layout the engine keeps for `x`: a multi-device sharding on `Auto` axes, else None."""
    if is_tracer(x):
        return _KNOWN.get(id(x))
    return _auto(getattr(x, "sharding", None))


def placements(
    arrays: Sequence[Any], given: Sequence[Any] | None = None
) -> tuple[NamedSharding | None, ...] | None:
    """`placement_of` each array, or its sharding in `given` (a compiled function's
    `in_shardings`, None where not given); None when none has one (always, on one device).

    On one device this costs one list lookup per call; on several, about
    0.1 us per array (measured with 10 arrays on 8 CPU devices).
    """
    if not several_devices():
        return None
    if given is None:
        found = [placement_of(x) for x in arrays]
    else:
        found = [
            placement_of(x) if s is None else _auto(s) for x, s in zip(arrays, given, strict=True)
        ]
    return tuple(found) if any(s is not None for s in found) else None


def _auto(s: Any) -> NamedSharding | None:
    if type(s) is not NamedSharding or s.num_devices == 1:
        return None
    return None if AxisType.Explicit in s.mesh.axis_types else s


@contextmanager
def tracing(tracers: Sequence[Any], placed: tuple[Any, ...] | None) -> Iterator[None]:
    """While a program is traced: its input tracers stand for arrays placed as `placed`."""
    if placed is None:
        yield
        return
    added = {id(t): s for t, s in zip(tracers, placed, strict=True) if s is not None}
    _KNOWN.update(added)
    try:
        yield
    finally:
        for k in added:
            _KNOWN.pop(k, None)


def _learn(t: Any, s: Sharding) -> None:
    """Tracer `t` (from `tg.shard` inside a trace) stands for an array placed as `s`.

    A gradient taken of it later in the trace (`tg.jit`'s or the user's own
    `jax.jit`) is then constrained to `s` (`placements`). The entry leaves
    with the tracer: a weak reference's callback runs before its id can name
    another object.
    """
    auto = _auto(s)
    if auto is not None:
        _KNOWN[id(t)] = auto
        weakref.finalize(t, _KNOWN.pop, id(t), None)


def constrain(x: Any, s: Sharding | None) -> Any:
    """`x` constrained to `s` inside a trace (None: left to XLA)."""
    return x if s is None else jax.lax.with_sharding_constraint(x, s)


def keep(x: Any, like: Any) -> Any:
    """`x` placed like `like` (a concrete array), inside a trace or not."""
    s = on_mesh(like)
    return x if s is None else _put(x, s)


def mesh_of(arrays: Sequence[Any]) -> Any:
    """The mesh of the first array placed on a mesh (None: none is)."""
    for x in arrays:
        s = on_mesh(x)
        if s is not None:
            return s.mesh
    return None


def place_state(leaves: Sequence[Any], owners: Sequence[Any], params: Sequence[Any]) -> list[Any]:
    """Optimiser state leaves on their parameter's layout; shared ones replicated.

    `owners[j]` is the parameter state leaf `j` belongs to, or None for an
    entry shared by all (optax's step `count`), which is replicated on the
    mesh of `params`: created by optax on device 0, it would make every step
    mix devices.
    """
    mesh = mesh_of(params)
    if mesh is None:
        return list(leaves)
    replicated = NamedSharding(mesh, PartitionSpec())
    out = []
    for x, p in zip(leaves, owners, strict=True):
        if p is None or getattr(x, "shape", None) != p.shape:
            # Shared, or a per-parameter entry of another shape (a factored
            # second moment): replicated.
            out.append(_put(x, replicated))
        else:
            s = on_mesh(p)
            out.append(x if s is None else _put(x, s))
    return out


def _put(x: Any, s: NamedSharding) -> Any:
    if is_tracer(x):
        return _traced(x, s)
    if not isinstance(x, jax.Array) or x.sharding == s:
        return x
    return jax.device_put(x, s)


def _traced(x: Any, s: Sharding) -> Any:
    """A tracer placed on `s`: a constraint, or on `Explicit` axes (part of the type) a reshard."""
    if isinstance(s, NamedSharding) and AxisType.Explicit in s.mesh.axis_types:
        return jax.sharding.reshard(x, s)
    out = jax.lax.with_sharding_constraint(x, s)
    _learn(out, s)
    return out


# --- arrays on different devices (diagnosed once a step has failed) -----------------


def _devices(x: Any) -> frozenset[Any] | None:
    """The devices a committed array lives on (None: a tracer, numpy, or uncommitted,
    which jax moves where it is needed)."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, Sharding) or not getattr(x, "committed", True):
        return None
    return frozenset(s.device_set)


def _on(devices: frozenset[Any]) -> str:
    ids = sorted(d.id for d in devices)
    if len(ids) == 1:
        return f"device {ids[0]}"
    run = ids == list(range(ids[0], ids[-1] + 1))
    return f"{len(ids)} devices ({f'ids {ids[0]}-{ids[-1]}' if run else f'ids {ids}'})"


def different_devices(api: str, named: Iterable[tuple[str, Any]], error: Exception) -> None:
    """Raise naming two arrays of a failed call that live on different devices
    (`named`: each array with its description in a message, e.g. a quoted path).

    Called only after jax refused the call (its error names the compiled
    program's inputs, `dyn[0]`, not the user's paths), so a call that works
    costs nothing.
    """
    first: tuple[str, frozenset[Any]] | None = None
    for name, x in named:
        d = _devices(x)
        if d is None:
            continue
        if first is None:
            first = (name, d)
        elif d != first[1]:
            raise ValueError(
                f"{api}: {first[0]} is on {_on(first[1])} but {name} on {_on(d)}; one "
                "computation needs all its arrays on the same devices. Place them together, "
                "e.g. tg.shard(model, rules, mesh=mesh) (rules matching no array leave it "
                "where it is, so give every array a placement: P() replicates it), or "
                "jax.device_put."
            ) from error


def _state_owners(config: Any) -> list[int]:
    """For each optimiser state leaf: the parameter it belongs to, or -1 if shared by all."""
    owners: list[int] = []
    for part in config.parts:
        owners.extend(part.leaf_ids[local] if local >= 0 else -1 for local in part.statemap)
    return owners


def state_on_other_devices(
    state: Any, params: Sequence[Any], grads: Sequence[Any], api: str, error: Exception
) -> None:
    """After a failed optimiser step: name a state entry or gradient on other devices
    than its parameter (jax's error names `_step_impl`'s inputs)."""
    config = state._config
    path = [config.paths[config.first[u]] for u in range(config.n)]
    different_devices(api, zip(map(repr, path), params, strict=True), error)
    on = [_devices(p) for p in params]
    shared = next((d for d in on if d is not None), None)
    for j, (x, u) in enumerate(zip(state._leaves, _state_owners(config), strict=True)):
        d, want = _devices(x), (shared if u < 0 else on[u])
        if d is None or want is None or d == want:
            continue
        whose = f"the optimiser state of {path[u]!r}" if u >= 0 else "the shared optimiser state"
        raise ValueError(
            f"{api}: {whose} ({config.names[j]}) is on {_on(d)} but the parameter"
            f"{'' if u >= 0 else 's'} on {_on(want)}: the state was set up (or loaded) for "
            "the model placed elsewhere. Set it up again for the placed model, "
            "tg.setup(rule, model), or place "
            "it as the model is: tg.shard(state, rules, mesh=mesh) with the model's rules."
        ) from error
    for g, u in zip(grads, config.tslot, strict=True):
        d = None if g is None else _devices(g)
        if d is not None and on[u] is not None and d != on[u]:
            raise ValueError(
                f"{api}: the gradient of {path[u]!r} is on {_on(d)} but the parameter on "
                f"{_on(on[u])}. Take the gradient of the placed model (tg.gradient places "
                "each gradient like its parameter), or place the gradients like the model "
                "(tg.shard, jax.device_put)."
            ) from error
