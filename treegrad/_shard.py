"""Placement on a mesh: `tg.shard`, `tg.shard_batch`, and keeping each array's layout.

Built on `jax.sharding` alone. Two public functions place trees: `shard` (a
model, optimiser state or batch, by sharding, spec, pytree prefix or path
rules) and `shard_batch` (the global batch from each process's local part).

The rest is what keeps a layout once it is chosen (API.md §6). On a mesh with
`Auto` axes (`jax.sharding.Mesh`, the classic kind), an array's sharding is
not part of its abstract value, so inside a compiled program XLA chooses the
layout of every result: a fully sharded (FSDP) parameter's gradient came back
replicated on all 8 devices in 10 of 12 layouts tried, with `jax.grad` as
with treegrad. The engine therefore reads the concrete sharding of each input
(`placements`), compiles one program per distinct placement (jax caches a
traced program by shapes and dtypes only, so a constraint baked in for one
placement would be stale for another), and constrains each gradient to its
input's sharding. Tracers of a program in flight are mapped back to the
concrete sharding of their input (`tracing`), so a gradient or optimiser step
taken inside `tg.jit` is constrained the same way. On `Explicit` axes the
sharding is part of the type and jax keeps it itself: nothing is added.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding

from ._tree import describe_leaf, path_str

_SPECS = (Sharding, PartitionSpec)
DATA = PartitionSpec("data")

# --- keeping layouts (used by the engine, the optimiser and destructure) ---------------

_SEVERAL: list[bool] = []
# id of a tracer of a program being traced -> the concrete sharding of its input.
_KNOWN: dict[int, NamedSharding] = {}


def several_devices() -> bool:
    """Whether this process sees more than one device (read once: it never changes)."""
    if not _SEVERAL:
        _SEVERAL.append(jax.device_count() > 1)
    return _SEVERAL[0]


def on_mesh(x: Any) -> NamedSharding | None:
    """The sharding of an array placed on a mesh (a tracer: its input's), else None."""
    if isinstance(x, jax.core.Tracer):
        return _KNOWN.get(id(x))
    s = getattr(x, "sharding", None)
    return s if type(s) is NamedSharding else None


def placement_of(x: Any) -> NamedSharding | None:
    """The layout the engine keeps for `x`: a multi-device sharding on `Auto` axes, else None."""
    if isinstance(x, jax.core.Tracer):
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
    if isinstance(x, jax.core.Tracer):
        return _traced(x, s)
    if not isinstance(x, jax.Array) or x.sharding == s:
        return x
    return jax.device_put(x, s)


def _traced(x: Any, s: Sharding) -> Any:
    """A tracer placed on `s`: a constraint, or on `Explicit` axes (part of the type) a reshard."""
    if isinstance(s, NamedSharding) and AxisType.Explicit in s.mesh.axis_types:
        return jax.sharding.reshard(x, s)
    return jax.lax.with_sharding_constraint(x, s)


# --- tg.shard ------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, _SPECS)


def _mesh_for(mesh: Any, api: str) -> Mesh | None:
    if mesh is None:
        ctx = jax.sharding.get_mesh()
        return None if ctx.empty else ctx
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{api}: mesh must be a jax.sharding.Mesh, got {mesh!r:.60}; build one "
            "with jax.make_mesh((2, 4), ('data', 'model'))."
        )
    return mesh


def _sharding(spec: Any, mesh: Mesh | None, api: str) -> Sharding | None:
    if spec is None or isinstance(spec, Sharding):
        return spec
    if mesh is None:
        raise ValueError(
            f"{api}: {spec} is a PartitionSpec, which needs a mesh: pass mesh=... (e.g. "
            "mesh=jax.make_mesh((8,), ('data',))), give a NamedSharding(mesh, spec), or call "
            "inside `with jax.set_mesh(mesh):`."
        )
    missing = [a for a in _axes(spec) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{api}: {spec} names the axis {missing[0]!r}, which the mesh lacks; its axes are "
            f"{tuple(mesh.axis_names)}."
        )
    return NamedSharding(mesh, spec)


def _axes(spec: PartitionSpec) -> list[str]:
    out: list[str] = []
    for entry in spec:
        if isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, tuple):
            out.extend(a for a in entry if isinstance(a, str))
    return out


def _misfit(shape: tuple[int, ...], s: Sharding) -> str | None:
    """Why an array of `shape` cannot be placed with `s` (None: it can)."""
    if not isinstance(s, NamedSharding):
        return None
    spec = s.spec
    if len(spec) > len(shape):
        return f"{spec} has {len(spec)} entries but the array has {len(shape)} dimension(s)"
    sizes = dict(s.mesh.shape)
    for d, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else entry if isinstance(entry, tuple) else ()
        parts = int(np.prod([sizes[a] for a in names])) if names else 1
        if shape[d] % parts:
            return (
                f"{spec} splits dimension {d} (size {shape[d]}) into {parts} parts over "
                f"{'×'.join(names)}, which does not divide it"
            )
    return None


def _glob(rule: str) -> str:
    # `*` matches within one path component.
    return "".join("[^.]*" if c == "*" else re.escape(c) for c in rule)


def _is_rules(spec: Any) -> bool:
    return (
        isinstance(spec, Mapping)
        and bool(spec)
        and all(isinstance(k, str) for k in spec)
        and all(_is_spec(v) for v in spec.values())
    )


def _by_rules(
    rules: Mapping[str, Any], paths: list[str], arrays: list[bool], api: str
) -> list[Any]:
    """The spec of the first rule matching each path (None: no rule matches)."""
    # A rule also covers everything under the path it names ("enc" places all of model.enc).
    compiled = [(r, re.compile(rf"{_glob(r)}(\..*)?"), s) for r, s in rules.items()]
    out: list[Any] = [None] * len(paths)
    used: set[str] = set()
    for k, (path, is_array) in enumerate(zip(paths, arrays, strict=True)):
        if not is_array:
            continue
        for rule, pattern, s in compiled:
            if pattern.fullmatch(path):
                out[k] = s
                used.add(rule)
                break
    unused = [r for r in rules if r not in used]
    if unused:
        shown = [p for p, a in zip(paths, arrays, strict=True) if a]
        listing = ", ".join(shown[:8]) + (f" (and {len(shown) - 8} more)" if len(shown) > 8 else "")
        raise ValueError(
            f"{api}: the rule {unused[0]!r} matches no array of the tree; rules are dotted "
            f"paths as in tg.params(model).named(), with * for one component (e.g. "
            f"'layers.*.weight'). The tree's array paths: {listing or 'none'}."
        )
    return out


def by_prefix(spec: Any, tree: Any, api: str) -> list[Any]:
    """One spec per leaf of `tree`, from a pytree prefix of specs."""
    s_leaves, s_def = jax.tree_util.tree_flatten(spec, is_leaf=_is_spec)
    bad = next((s for s in s_leaves if not _is_spec(s)), None)
    if bad is not None:
        raise TypeError(
            f"{api}: spec holds a {type(bad).__name__} ({bad!r:.40}); a spec is a Sharding, a "
            "PartitionSpec, None (leave as is), a pytree prefix of them, or a dict of path "
            "rules like {'layers.*.weight': P('model', None)}."
        )
    prefix: Any = s_def  # jaxlib's stub lacks flatten_up_to
    try:
        subtrees = prefix.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{api}: spec is not a pytree prefix of the tree ({str(e).splitlines()[0]}); give "
            "one spec for the whole tree, a prefix of its structure, or path rules."
        ) from None
    out: list[Any] = []
    for s, sub in zip(s_leaves, subtrees, strict=True):
        out.extend([s] * len(jax.tree_util.tree_leaves(sub)))
    return out


def _state_paths(state: Any) -> tuple[list[str], list[bool]]:
    """For each optimiser state leaf: its parameter's model path, or its own name if shared."""
    config = state._config
    paths, shared = [], []
    for k, part in enumerate(config.parts):
        names = config.names[config.offsets[k] : config.offsets[k + 1]]
        for local, name in zip(part.statemap, names, strict=True):
            if local >= 0:
                paths.append(config.paths[config.first[part.leaf_ids[local]]])
                shared.append(False)
            else:
                paths.append(name)
                shared.append(True)
    return paths, shared


def shard(tree: Any, spec: Any, *, mesh: Mesh | None = None) -> Any:
    """Place a model, optimiser state or batch on devices.

    Outside a trace each array is `jax.device_put` on its sharding; inside
    one (`tg.jit`, `jax.jit`) it is constrained with
    `jax.lax.with_sharding_constraint`. A `jax.ShapeDtypeStruct` leaf (from
    `jax.eval_shape`) gets the sharding in its type, which makes an abstract
    model to `tg.load` into. Leaves that are not arrays are left alone.

    Arguments:
        tree: any pytree: a model, a `tg.OptState`, a batch.
        spec: how to place it, one of
            - a `jax.sharding.Sharding` for every array;
            - a `PartitionSpec` for every array (with `mesh`);
            - a pytree prefix of the tree holding those (`None` leaves a
              subtree as it is);
            - path rules `{"layers.*.weight": P("model", None), ...}` matched
              against the dotted paths of `tg.params(model).named()`: `*`
              stands for one path component, a rule covers everything under
              the path it names, the first matching rule wins, and arrays no
              rule matches are left as they are. For a `tg.OptState` the rules
              are matched against the paths of the parameters each entry
              belongs to, and entries shared by all parameters (the step
              count) are replicated on the mesh.
        mesh: the `jax.sharding.Mesh` for PartitionSpecs; default: the mesh
            set by `jax.set_mesh`, if any.

    Returns:
        The tree with every array placed (a new tree; the input is unchanged).

    Raises:
        ValueError: a rule matching no array, a spec that does not fit an
            array's shape (naming its path), a PartitionSpec without a mesh,
            or an axis the mesh lacks.
        TypeError: a spec that is none of the above.

    Examples:
        >>> import jax, jax.numpy as jnp, treegrad as tg
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("model",))
        >>> model = {"layers": [{"weight": jnp.ones((4, 2)), "bias": jnp.zeros(4)}]}
        >>> model = tg.shard(model, {"layers.*.weight": P("model", None)}, mesh=mesh)
        >>> model["layers"][0]["weight"].sharding.spec
        P('model', None)
    """
    api = "tg.shard"
    m = _mesh_for(mesh, api)
    from ._optview import OptState

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in flat]
    arrays = [_is_array(x) for x in leaves]
    shared: list[bool] = [False] * len(leaves)
    if isinstance(tree, OptState):
        paths, shared = _state_paths(tree)
    else:
        paths = [path_str(p) or "<root>" for p, _ in flat]
    if _is_rules(spec):
        per_leaf = _by_rules(spec, paths, arrays, api)
    elif isinstance(tree, OptState) and not _is_spec(spec):
        raise TypeError(
            f"{api}: place an optimiser state with one Sharding or PartitionSpec, or with path "
            "rules (matched against its parameters' paths); or set it up from the placed "
            "model: tg.setup(rule, tg.shard(model, ...))."
        )
    else:
        per_leaf = by_prefix(spec, tree, api)
    shardings = [_sharding(s, m, api) for s in per_leaf]
    if any(shared):
        mesh_here = m or next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
        if mesh_here is not None:
            rep = NamedSharding(mesh_here, PartitionSpec())
            shardings = [rep if sh else s for s, sh in zip(shardings, shared, strict=True)]
    out = []
    for x, s, path, is_array in zip(leaves, shardings, paths, arrays, strict=True):
        if s is None or not is_array:
            out.append(x)
            continue
        problem = _misfit(tuple(x.shape), s)
        if problem:
            raise ValueError(
                f"{api}: cannot place {path!r} ({describe_leaf(x)}) with {s}: {problem}. "
                "Change its spec (or the rule that matched it), e.g. P() to replicate it."
            )
        out.append(_place(x, s))
    return jax.tree_util.tree_unflatten(treedef, out)


def _place(x: Any, s: Sharding) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    if isinstance(x, jax.core.Tracer):
        return _traced(x, s)
    return jax.device_put(x, s)


# --- tg.shard_batch ------------------------------------------------------------------


def shard_batch(local_batch: Any, mesh: Mesh, spec: Any = DATA) -> Any:
    """The global batch on `mesh`, from this process's part of it.

    Each process passes the rows it loaded; the result is one global array
    per leaf (`jax.make_array_from_process_local_data`), split over `mesh` as
    `spec` says. With one process the local batch is the whole batch, so the
    same script runs on one machine or many.

    Arguments:
        local_batch: an array, or a tuple/dict/pytree of arrays (numpy or
            jax), this process's rows. Leaves that are not arrays are left alone.
        mesh: the `jax.sharding.Mesh` to place the batch on.
        spec: a `PartitionSpec` (default `P("data")`: rows split over the
            `"data"` axis), or a pytree prefix of them for the batch.

    Returns:
        The batch with each array a global `jax.Array` on `mesh`.

    Raises:
        ValueError: the local rows do not split evenly over this process's
            devices, or the spec names an axis the mesh lacks.

    Examples:
        >>> import jax, numpy as np, treegrad as tg
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> x, y = tg.shard_batch((np.ones((4, 3)), np.zeros(4)), mesh)
        >>> x.shape, x.sharding.spec
        ((4, 3), P('data',))
    """
    api = "tg.shard_batch"
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{api}: mesh must be a jax.sharding.Mesh, got {mesh!r:.60}; the call is "
            "tg.shard_batch(local_batch, mesh, spec=P('data'))."
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(local_batch)
    per_leaf = by_prefix(spec, local_batch, api)
    out = []
    for (path, x), s in zip(flat, per_leaf, strict=True):
        if s is None or not isinstance(x, (jax.Array, np.ndarray)):
            out.append(x)
            continue
        sharding = _sharding(s, mesh, api)
        if isinstance(x, jax.Array) and x.sharding == sharding:
            out.append(x)
            continue
        out.append(_global(x, sharding, path_str(path) or "the batch", api))
    return jax.tree_util.tree_unflatten(treedef, out)


def _global(x: Any, s: Any, where: str, api: str) -> Any:
    spec = s.spec
    if len(spec) > x.ndim:
        raise ValueError(
            f"{api}: {where!r} ({describe_leaf(x)}) has {x.ndim} dimension(s), fewer than the "
            f"{len(spec)} entries of {spec}; give it its own spec (e.g. P() for a scalar)."
        )
    # The local rows split over the devices this process holds along each axis.
    local = {d.id for d in jax.local_devices()}
    ids = np.vectorize(lambda d: d.id in local)(s.mesh.devices)
    for d, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else entry if isinstance(entry, tuple) else ()
        parts = 1
        for a in names:
            axis = s.mesh.axis_names.index(a)
            parts *= int(np.any(ids, axis=tuple(i for i in range(ids.ndim) if i != axis)).sum())
        if x.shape[d] % parts:
            raise ValueError(
                f"{api}: {where!r} has {x.shape[d]} rows in dimension {d} in this process, "
                f"which do not split evenly over its {parts} devices along "
                f"{'×'.join(names)}; use a local batch size divisible by {parts}."
            )
    return jax.make_array_from_process_local_data(s, x)


__all__ = ["shard", "shard_batch"]
