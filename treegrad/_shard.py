"""Placement on a mesh: `tg.shard` and `tg.shard_batch`.

Built on `jax.sharding` alone. `shard` places a model, optimiser state or
batch, by sharding, spec, pytree prefix or path rules; `shard_batch` builds the
global batch from each process's local part. Keeping a layout once it is
chosen is `_layout`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from ._jaxpr import is_tracer
from ._layout import _state_owners, _traced
from ._tree import describe_leaf, path_str, unique_by_id

_SPECS = (Sharding, PartitionSpec)
DATA = PartitionSpec("data")

# --- tg.shard ------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, _SPECS)


def _mesh_for(mesh: Any, api: str) -> Mesh | None:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"{api}: mesh must be a jax.sharding.Mesh, got {mesh!r:.60}; build one "
            "with jax.make_mesh((2, 4), ('data', 'model'))."
        )
    return mesh


def _context_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (None: none is): concrete outside a trace, abstract
    inside one, where `jax.sharding.get_mesh` raises and constraints take the abstract mesh."""
    try:
        ctx: Mesh | AbstractMesh = jax.sharding.get_mesh()
    except ValueError:
        ctx = jax.sharding.get_abstract_mesh()
    return None if ctx.empty else ctx


def _sharding(spec: Any, mesh: Any, api: str, where: str | None = None) -> Sharding | None:
    """`spec` as a Sharding on `mesh` (a Mesh, an AbstractMesh, or None: the context's)."""
    if spec is None or isinstance(spec, Sharding):
        return spec
    if mesh is None:
        mesh = _context_mesh()
    if mesh is None:
        raise ValueError(
            f"{api}: {spec} is a PartitionSpec, which needs a mesh: pass mesh=... (e.g. "
            "mesh=jax.make_mesh((8,), ('data',))), give a NamedSharding(mesh, spec), or call "
            "inside `with jax.set_mesh(mesh):`."
        )
    axes = _axes(spec)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{api}: {spec} names the axis {missing[0]!r}, which the mesh lacks; its axes are "
            f"{tuple(mesh.axis_names)}."
        )
    twice = next((a for k, a in enumerate(axes) if a in axes[:k]), None)
    if twice is not None:
        # jax raises its DuplicateSpecError, which is not a ValueError and names no path.
        at = f" for {where!r}" if where else ""
        raise ValueError(
            f"{api}: {spec}{at} names the axis {twice!r} twice; a mesh axis splits at most one "
            "dimension. Name it in one entry only (a tuple entry, P(('data', 'model')), splits "
            "one dimension over several axes; None replicates a dimension)."
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


def _resolve(specs: Sequence[Any], paths: Sequence[str], mesh: Any, api: str) -> list[Any]:
    """Each spec as a Sharding (None stays None); one resolution per distinct spec."""
    done: dict[Any, Any] = {}
    out = []
    for spec, path in zip(specs, paths, strict=True):
        if spec is None or isinstance(spec, Sharding):
            out.append(spec)
            continue
        if spec not in done:
            if mesh is None:
                mesh = _context_mesh()
            done[spec] = _sharding(spec, mesh, api, path)
        out.append(done[spec])
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
        _unused_rule(unused[0], compiled, shown, api)
    return out


def _unused_rule(rule: str, compiled: list[Any], shown: list[str], api: str) -> None:
    """Raise for a rule that places nothing: shadowed by earlier rules, or matching no path."""
    pattern = next(p for r, p, _ in compiled if r == rule)
    matched = [p for p in shown if pattern.fullmatch(p)]
    if matched:
        earlier = []
        for r, p, _ in compiled:
            if r == rule:
                break
            if any(p.fullmatch(path) for path in matched):
                earlier.append(r)
        names = ", ".join(map(repr, earlier))
        raise ValueError(
            f"{api}: the rule {rule!r} is shadowed: every array it matches ({matched[0]!r}"
            f"{f' and {len(matched) - 1} more' if len(matched) > 1 else ''}) is matched first "
            f"by the earlier rule(s) {names} (the first matching rule wins), so it places "
            "nothing. Remove it, or move it before them."
        )
    listing = ", ".join(shown[:8]) + (f" (and {len(shown) - 8} more)" if len(shown) > 8 else "")
    raise ValueError(
        f"{api}: the rule {rule!r} matches no array of the tree; rules are dotted "
        f"paths as in tg.params(model).named(), with * for one component (e.g. "
        f"'layers.*.weight'). The tree's array paths: {listing or 'none'}."
    )


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


def _one_per_place(
    shardings: list[Any],
    slots: Sequence[int],
    n: int,
    paths: Sequence[str],
    ndims: Sequence[int],
    api: str,
) -> tuple[list[Any], list[str]]:
    """One sharding per object from the shardings of its places (`slots[k]`: the object at
    place `k`), and the path that gave it; a tied array's places must agree."""
    chosen: list[Any] = [None] * n
    where = [""] * n
    for s, u, path, ndim in zip(shardings, slots, paths, ndims, strict=True):
        if s is None or u < 0:
            continue
        prev = chosen[u]
        if prev is None:
            chosen[u], where[u] = s, path
        elif prev != s and not prev.is_equivalent_to(s, ndim):
            raise ValueError(
                f"{api}: {where[u]!r} and {path!r} are one (tied) array, but the spec places "
                f"them differently ({prev} and {s}); one array has one placement. Give both "
                "paths the same spec, or a rule for one of them only."
            )
    return chosen, where


def _place_checked(x: Any, s: Sharding, path: str, api: str) -> Any:
    problem = _misfit(tuple(x.shape), s)
    if problem:
        raise ValueError(
            f"{api}: cannot place {path!r} ({describe_leaf(x)}) with {s}: {problem}. "
            "Change its spec (or the rule that matched it), e.g. P() to replicate it."
        )
    return _place(x, s)


def _replicated(s: Sharding) -> Sharding:
    return NamedSharding(s.mesh, PartitionSpec()) if isinstance(s, NamedSharding) else s


def _place_state(state: Any, spec: Any, mesh: Mesh | None, api: str) -> list[Any]:
    """The leaves of an optimiser state placed as `tg.setup` places them for a model
    placed by `spec`: each parameter's entries of its shape on its placement, the
    others (shared scalars, factored moments) replicated on its mesh."""
    config = state._config
    if _is_rules(spec):
        # Matched against every place of the model, as tg.shard(model, rules) would
        # be: a rule for parameters with no state entries (masked, plain sgd) is fine.
        per_place = _by_rules(spec, config.paths, [True] * len(config.paths), api)
    elif _is_spec(spec):
        per_place = [spec] * len(config.paths)
    else:
        raise TypeError(
            f"{api}: place an optimiser state with one Sharding or PartitionSpec, or with path "
            "rules (matched against its parameters' paths); or set it up from the placed "
            "model: tg.setup(rule, tg.shard(model, ...))."
        )
    ndims = [len(config.avals[u][0]) if u >= 0 else 0 for u in config.slots]
    shardings = _resolve(per_place, config.paths, mesh, api)
    by_param, where = _one_per_place(shardings, config.slots, config.n, config.paths, ndims, api)
    named = [s for s in by_param if isinstance(s, NamedSharding)]
    on = mesh if mesh is not None else named[0].mesh if named else None
    shared = None if on is None else NamedSharding(on, PartitionSpec())
    leaves = state._leaves
    out = []
    for x, u in zip(leaves, _state_owners(config), strict=True):
        if not _is_array(x):
            out.append(x)
        elif u >= 0 and tuple(x.shape) == tuple(config.avals[u][0]):
            s = by_param[u]
            out.append(x if s is None else _place_checked(x, s, where[u], api))
        else:
            # As tg.setup: shared entries, and entries of another shape than their
            # parameter's (factored moments), replicated on the mesh, even for a
            # parameter left where it is.
            s = shared if u < 0 or by_param[u] is None else _replicated(by_param[u])
            out.append(x if s is None else _place(x, s))
    return _shared_once(leaves, out)


def _shared_once(before: list[Any], after: list[Any]) -> list[Any]:
    """`after`, with one object wherever `before` had one object at several places."""
    seen: dict[int, Any] = {}
    return [seen.setdefault(id(b), a) for b, a in zip(before, after, strict=True)]


def shard(tree: Any, spec: Any, *, mesh: Mesh | None = None) -> Any:
    """Place a model, optimiser state or batch on devices.

    Outside a trace each array is `jax.device_put` on its sharding; inside
    one (`tg.jit`, `jax.jit`) it is constrained with
    `jax.lax.with_sharding_constraint`, and a gradient taken of the result
    later in the trace keeps that placement (in `tg.jit` and in your own
    `jax.jit`, where the layout of the inputs cannot be read on `Auto` axes:
    see docs/scaling.md). A `jax.ShapeDtypeStruct`
    leaf (from `jax.eval_shape`) gets the sharding in its type, which makes
    an abstract model to `tg.load` into. Leaves that are not arrays are left
    alone. A tied array (one array object at several places) is placed once,
    so its places stay one object.

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
              rule matches are left as they are. A rule that places nothing
              (matching no array, or only arrays an earlier rule matches) is
              an error.
            For a `tg.OptState` (one spec or rules) the state is placed as
            `tg.setup` places it for the model placed with the same spec:
            the rules are matched against the model's paths, each
            parameter's entries of its shape take its placement, and the
            rest (shared scalars such as the step count, factored moments)
            is replicated on the mesh.
        mesh: the `jax.sharding.Mesh` for PartitionSpecs; default: the mesh
            set by `jax.set_mesh`, if any (inside a trace, its abstract mesh).

    Returns:
        The tree with every array placed (a new tree; the input tree is not
        modified). As with `jax.device_put`, a placed array may share memory
        with the input array (one already placed so; a replicated placement
        keeps the input's buffer on its device): donating the result (e.g.
        `tg.update(..., donate=True)`) then deletes the input too. Place a
        copy (`jax.tree_util.tree_map(jnp.copy, model)`) to keep using the
        input after donating.

    Raises:
        ValueError: a rule placing nothing, a spec that does not fit an
            array's shape (naming its path), a PartitionSpec without a mesh,
            an axis the mesh lacks or named twice, or two different specs for
            the places of one tied array.
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
    given = _mesh_for(mesh, api)
    from ._optview import OptState

    if isinstance(tree, OptState):
        treedef = jax.tree_util.tree_structure(tree)
        return jax.tree_util.tree_unflatten(treedef, _place_state(tree, spec, given, api))
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in flat]
    paths = [path_str(p) or "<root>" for p, _ in flat]
    arrays = [_is_array(x) for x in leaves]
    if _is_rules(spec):
        per_leaf = _by_rules(spec, paths, arrays, api)
    else:
        per_leaf = by_prefix(spec, tree, api)
    per_leaf = [s if a else None for s, a in zip(per_leaf, arrays, strict=True)]
    shardings = _resolve(per_leaf, paths, given, api)
    uniq, slots = unique_by_id(leaves)
    ndims = [len(x.shape) if a else 0 for x, a in zip(leaves, arrays, strict=True)]
    by_object, where = _one_per_place(shardings, slots, len(uniq), paths, ndims, api)
    placed = [
        x if s is None else _place_checked(x, s, path, api)
        for x, s, path in zip(uniq, by_object, where, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, [placed[u] for u in slots])


def _place(x: Any, s: Sharding) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    if is_tracer(x):
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
            `"data"` axis) or a `NamedSharding`, or a pytree prefix of them
            for the batch.

    Returns:
        The batch with each array a global `jax.Array` on `mesh`.

    Raises:
        ValueError: the local rows do not split evenly over this process's
            devices, or the spec names an axis the mesh lacks (or one twice).
        TypeError: a spec that is another kind of `Sharding` (a batch is
            split over a mesh; `jax.device_put` puts one on one device).

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
        where = path_str(path) or "the batch"
        sharding = _sharding(s, mesh, api, where)
        if not isinstance(sharding, NamedSharding):
            at = f" at {where!r}" if path else ""
            raise TypeError(
                f"{api}: the spec{at} is a {type(sharding).__name__}; a batch is "
                "split over a mesh, so give a PartitionSpec (or a NamedSharding). To put a "
                "batch on one device, use jax.device_put."
            )
        if isinstance(x, jax.Array) and x.sharding == sharding:
            out.append(x)
            continue
        out.append(_global(x, sharding, where, api))
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
