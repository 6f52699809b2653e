"""The trace engine shared by explicit mode, implicit mode and `tg.jit`.

A call goes through four named steps (steps 2 and 4 are in `_cache.py`):

1. `Call` (`_call.py`): the arguments are flattened once; array leaves are inputs, the
   treedef and the other leaves key the cache, with the function's code.
   A function called again with arguments of the structure it had last skips
   this: that structure is kept as generated code (`_fasttree.Shape`, filed
   in `_cache._RECENT` with the cache bucket), which checks it and reads the arrays.
2. `_cache.execute`: each cached entry for that key runs its guard (`_guard.Guard`) on
   the function being called. The guard re-reads every place the function can
   read a value from, checks the non-array values and returns the arrays.
   A new lambda of the same code with the same captured values hits.
3. On a miss, `Entry` walks the function (`_guard.Walk`), generates its guard
   and wraps `_trace` in `jax.jit`. The first call traces it with
   `jax.jit(...).trace` and reads the jaxpr (`_jaxpr`): inputs the outputs do
   not depend on are left out of differentiation (their gradient is `None`),
   and arrays captured where the walk could not see are reported. A later
   trace of the entry (new shapes or dtypes) is read again: one that says
   otherwise, or an integer array where a float one was (or back), sends the
   call to an entry of its own (`Refit`).
4. `Entry.run` calls the compiled program with the arrays and writes back any
   array the function rebound in its captured containers (an in-place update
   inside a compiled step), so the user sees what an uncompiled run would leave.
   Gradients and outputs come back as flat lists (jax rebuilds those in C) and
   are put into their trees by generated code (`Entry._flat_out`). The usual
   explicit gradient runs steps 2 and 4 in one (`Entry.run_plain`).

While tracing, the tracers are put into the user's own places (`_guard.Swap`)
and taken out again afterwards, so the function runs on its real objects.
The cache holds no user arrays: guards hold code, treedefs, numbers and weak
references; the program holds what jax compiled.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax

from . import _guard as G
from . import _jaxpr
from . import _kinds as K
from ._call import Call, dtypes, links, root_keys
from ._fasttree import TAKE, Shape
from ._guardcode import Guard, WriteBack
from ._layout import placements, several_devices
from ._outputs import DYN, Packed, Written, _Aux, expand, split_unique, uniq
from ._paths import get_at, put_at
from ._programs import CALL, GRAD, cotangent, is_cotangent, trace
from ._reach import is_plain_object, node_types, static_callables
from ._settle import holders
from ._swap import Swap, undo_writes
from ._tree import describe_leaf, is_inexact, picker
from ._walk import Walk

# --- step 3: one compiled program per entry ----------------------------------------


class Refit(Exception):
    """Raised by `Entry.run` when a new trace of the entry reads differentiation
    otherwise than its first: the call goes to another entry (`_cache._lookup`)."""


def signature(dyn: Sequence[Any]) -> tuple[Any, ...]:
    """The inputs' shapes and dtypes: what makes jax trace a program again."""
    return tuple((tuple(x.shape), x.dtype) for x in dyn)


def _jit_disabled() -> bool:
    """Whether `jax.disable_jit()` is in force."""
    return bool(jax.config.jax_disable_jit)  # type: ignore[attr-defined]  # made at run time


class Entry:
    """One compiled program for one cache key and one guard."""

    def __init__(
        self,
        program: str,
        api: str,
        options: Any,
        call: Call,
        *,
        params: Sequence[Any] | None = None,
        donate: Callable[[Entry], tuple[int, ...]] | None = None,
        shardings: Callable[[Entry], Any] | None = None,
        out_shardings: Any = None,
        statics: dict[Any, Any] | None = None,
    ):
        self.program = program
        self.api = api
        self.options = options
        self.implicit = params is not None
        # tg.jit: values of static arguments (by position or name), output shardings.
        self.statics = statics or {}
        self.out_shardings = out_shardings
        walk, self.nodes, self.absolute = _walk(call, params)
        # Captured numpy arrays that are inputs (a trace that fails on one is tried again
        # with them read as values: `_cache._new`), and those read as values.
        self.numpy_places = walk.numpy_places
        self.valued = walk.valued
        self.wrote = False  # a trace changed one of those in place (`_settle.Settle`)
        self.names = walk.names
        self.n_places = walk.places
        self.guard = Guard(self.nodes, self.absolute)
        self.a_def: Any = call.a_def
        self.a_statics, self.a_slots = call.a_statics, call.a_slots
        self.a_shared = call.a_shared
        self.n_args = len(call.a_uniq)
        self.stack: list[tuple[Any, ...]] = []  # roots of the calls in flight
        self.rebound: list[Any] = []  # during a trace: see `_settle.Settle.rebound`
        self.swap: Swap | None = None  # during a trace: the one putting its inputs in place
        # What the traces of this call wrote into the user's numpy arrays, with what was
        # there before (`Swap.overwritten`), so that a trace made again undoes it first.
        # Only during `first_run` (None otherwise): the entry keeps no user arrays.
        self.overwritten: list[tuple[Any, Any]] | None = None
        self.demoted = False
        self._writers: dict[tuple[int, ...], WriteBack] = {}
        self.cacheable = True
        self.hidden: list[str] = []
        self.lost: list[str] = []  # where the trace stored traced values, taken out again
        self.changed: list[str] = []  # values it can read that it changed (`Settle._changed`)
        self.consumed = walk.consumed  # random states and iterators it may draw from
        self.drew: list[tuple[str, bool]] = []  # those a trace drew from (`_draws`)
        self.cl_slots: tuple[int, ...] | None = None
        self.n_cl = 0
        self.param_pos: tuple[int, ...] = ()
        self.wrt: tuple[int, ...] = ()
        self.active: tuple[int, ...] = ()
        # `tg.jit`: for each argument array, the closure array it is (or -1); None: none.
        self.a_links: tuple[int, ...] | None = None
        self._pick_wrt: Callable[[Sequence[Any]], Sequence[Any]] = picker(())
        self._wrt_kinds: tuple[bool, ...] = ()
        self.plain = self.fast = False
        # What the first trace's jaxpr said about differentiation holds for its input
        # shapes and dtypes only: a later trace (new shapes) is checked (`_holds`), and
        # the signatures where it does not hold are refused (`fits`) for another entry.
        self.retraced = False
        self._analysed = False
        self._refused: set[tuple[Any, ...]] = set()
        self._donate_fn = donate
        self._shardings_fn = shardings
        self._multi = several_devices()  # fixed for the life of the process
        self.jitted: Any = None
        # While tracing: the mesh sharding of each input (None: not on a mesh).
        self.placement: tuple[Any, ...] | None = None
        # Gradients and call outputs leave the program as flat lists while every
        # trace gives them one structure, recorded here (see `_flat_out`).
        self.flat = program in (GRAD, CALL)
        self.out_sig: tuple[_Aux, tuple[int, ...], tuple[int, ...]] | None = None
        self._grad_shape: Shape | None = None

    def bind(self, cl: list[Any], a_uniq: list[Any], params: Sequence[Any] | None) -> list[Any]:
        """Fix what depends on the first call's inputs: ties, parameters, what to differentiate."""
        cl_uniq, self.cl_slots = uniq(cl)
        self.n_cl = len(cl_uniq)
        dyn = cl_uniq + a_uniq
        if params is not None:
            self.param_pos = _positions(cl_uniq, params)
            self.wrt = tuple(sorted({p for p in self.param_pos if p >= 0}))
        elif self.program != CALL:
            self.wrt = tuple(range(self.n_cl, len(dyn)))
        self.active = tuple(i for i in self.wrt if is_inexact(dyn[i].dtype))
        if self.program == CALL:
            self.a_links = links(cl_uniq, a_uniq)
        self._pick_wrt = picker(self.wrt)
        self._wrt_kinds = tuple(map(is_inexact, dtypes(self._pick_wrt(dyn))))
        # Explicit mode with no array captured twice, differentiating every argument
        # array: `matches` and `fits` then reduce to one tie check (`_cache._lookup`).
        self.plain = (
            params is None
            and self.program != CALL
            and self.cl_slots is None
            and self.wrt == tuple(range(self.n_cl, len(dyn)))
        )
        # ...and a gradient on one device: `run_plain` runs it in one step; so it does
        # a `tg.jit` call with no array captured twice and no argument captured.
        one = self.cl_slots is None and self.a_links is None
        self.fast = not self._multi and (
            (self.plain and self.program == GRAD) or (self.program == CALL and one)
        )
        self._build()
        return dyn

    def fits(self, dyn: list[Any]) -> bool:
        """Whether this entry takes these inputs: not of a signature it refused, and
        (`tg.jit`) an argument is the closure's array where the first call's was.

        A signature is refused when its trace reads differentiation otherwise than
        the first (`_reread`), or when an integer array comes where a float one was
        (or back): what the program differentiates was read from the first call's
        dtypes. jax traces each new dtype, so that is checked while tracing (`_make`).
        """
        if self._refused and signature(dyn) in self._refused:
            return False
        if self.program == CALL:
            return links(dyn[: self.n_cl], dyn[self.n_cl :]) == self.a_links
        return True

    def _build(self) -> None:
        kwargs: dict[str, Any] = {}
        if self._donate_fn is not None:
            kwargs["donate_argnums"] = self._donate_fn(self)
        if self._shardings_fn is not None:
            in_shardings = self._shardings_fn(self)
            if in_shardings is not None:
                kwargs["in_shardings"] = in_shardings
        self._jit_kwargs = kwargs
        self._given = kwargs.get("in_shardings")  # tg.jit's in_shardings: the inputs' layout
        self._placed: dict[tuple[Any, ...], Any] = {}
        self._grad_shape = None
        self.jitted = self._make(None)

    def _make(self, placed: tuple[Any, ...] | None) -> Any:
        n_extra = 1 if self.program == GRAD else 0  # the cotangent

        def program(*dyn: Any) -> Any:
            self.retraced = True  # runs only when jax traces: new shapes, or a new jit
            n = len(dyn) - n_extra
            inputs = list(dyn[:n])
            # An integer array where a float one was (or back): what the program
            # differentiates was read from the first call's dtypes. Checked here, as
            # jax traces each new dtype, so that no call pays for it.
            if self._wrt_kinds and self._wrt_kinds != tuple(
                map(is_inexact, dtypes(self._pick_wrt(inputs)))
            ):
                self._refuse(inputs)
            return self._flat_out(trace(self, inputs, dyn[n:], placed))

        return jax.jit(program, **self._jit_kwargs)

    def _flat_out(self, result: Any) -> Any:
        """A gradient or call program's outputs as flat lists of arrays.

        JAX would rebuild a structured output with a Python callback per Module;
        flat lists it returns at C speed, and `run` rebuilds the tree with
        generated code. The structure is recorded here, while tracing, so it must
        be the same for every trace of the entry (new input shapes trace again):
        when one differs, the outputs carry their structure from then on.
        """
        if not self.flat:
            return result
        if self.program == GRAD:
            grads, packed, written = result
        else:
            _, packed, grads, written = result
        if packed.aux is None:
            arrays, aux = split_unique(packed.payload)
        else:
            arrays, aux = packed.payload, packed.aux
        sig = (aux, written.places, written.index)
        if self.out_sig is None:
            self.out_sig = sig
        elif not (self.out_sig[0] == aux and self.out_sig[1:] == sig[1:]):
            self.flat = False
            self._placed.clear()
            self.jitted = self._make(None)
            return result
        return [grads, arrays, written.values]

    def compiled(self, dyn: Sequence[Any]) -> Any:
        """The program for these inputs' placement on a mesh (see `_shard`)."""
        placed = placements(dyn, self._given)
        if placed is None:
            return self.jitted
        # One program per placement: jax keys a traced program on shapes and
        # dtypes only, and the gradients' sharding constraints are baked in.
        jitted = self._placed.get(placed)
        if jitted is None:
            if len(self._placed) >= 8:
                self._placed.clear()
            jitted = self._placed[placed] = self._make(placed)
        return jitted

    def matches(self, cl: list[Any], params: Sequence[Any] | None) -> list[Any] | None:
        """The closure's unique inputs if this entry's ties and parameters fit, else None."""
        if params is None and self.cl_slots is None and len(set(map(id, cl))) == len(cl):
            return cl  # explicit mode, no array captured twice: the usual case, in C
        cl_uniq, slots = uniq(cl)
        if slots != self.cl_slots:
            return None
        if params is not None:
            # Each captured input is one object, so a parameter found at its
            # recorded position is nowhere else: checking those is enough,
            # unless some parameter was not captured at all.
            pos = self.param_pos
            moved = (
                len(pos) != len(params)
                or min(pos, default=0) < 0
                or not all(map(operator.is_, map(cl_uniq.__getitem__, pos), params))
            )
            if moved and _positions(cl_uniq, params) != pos:
                return None
        return cl_uniq

    def first_run(
        self, roots: tuple[Any, ...], dyn: list[Any], params: Sequence[Any] | None
    ) -> Any:
        """Trace once, read the jaxpr, and run. (The entry keeps no user arrays.)"""
        if _jit_disabled():
            # Under jax.disable_jit() the program would run its Python body, the function
            # with it, again after the trace (jax keys its traces by that setting too):
            # a counter advanced twice a call. Traced and run as always, the function
            # runs once a trace, as uncompiled.
            with jax.disable_jit(False):
                return self._first_run(roots, dyn, params)
        return self._first_run(roots, dyn, params)

    def _first_run(
        self, roots: tuple[Any, ...], dyn: list[Any], params: Sequence[Any] | None
    ) -> Any:
        before = {id(a) for a in jax.live_arrays()}
        self.overwritten = []
        self.stack.append(roots)
        try:
            traced = self.compiled(dyn).trace(*dyn, *self._extra())
        finally:
            self.stack.pop()
            overwritten, self.overwritten = self.overwritten, None
        closed = traced.jaxpr
        if _jaxpr.n_inputs(closed) != len(dyn) + len(self._extra()):
            self._leaked()
        hidden = [
            c
            for c in _jaxpr.constants(closed)
            if isinstance(c, jax.Array)
            and not _jaxpr.is_tracer(c)
            and id(c) in before
            and not is_cotangent(c)  # an inner gradient's cotangent, not a user array
        ]
        if hidden:
            self._hidden(hidden, params)
        live = self._live(closed, len(dyn))
        if live != self.active:
            self.active = live
            # Unused inputs: not differentiated; traced again, from the numpy arrays'
            # contents before the first trace (a write into one is made once a call).
            undo_writes(overwritten)
            self._build()
        out = self.run(roots, dyn)
        self._analysed = True
        return out

    def _live(self, closed: Any, n_dyn: int) -> tuple[int, ...]:
        """The differentiated inputs whose derivative this jaxpr says may be non-zero."""
        if not self.active:
            return ()
        if self.program == GRAD:
            # A gradient that does not depend on the cotangent (the last input)
            # is a structural zero: its input is unused.
            reached = _jaxpr.reached(closed, [n_dyn])
            deps: Collection[int] = {p for k, p in enumerate(self.grad_order()) if k in reached}
        elif self.live is not None:  # read from a pullback's or Jacobian's derivative
            deps = self.live
        else:
            deps = _jaxpr.dependencies(closed, range(self.n_deps))
        return tuple(i for i in self.active if i in deps)

    def _holds(self, dyn: list[Any]) -> bool:
        """Whether the first trace's reading of which inputs get a derivative holds for
        the trace of these inputs (new shapes or dtypes may take other code paths).

        Read as the first trace's was; an input left out then (unused) is not in
        this program, so with one the function is traced once more with it in.
        """
        # What `bind` differentiated, before the first trace left unused inputs out.
        differentiable = tuple(i for i, k in zip(self.wrt, self._wrt_kinds, strict=True) if k)
        if differentiable == self.active:
            closed = self.compiled(dyn).trace(*dyn, *self._extra()).jaxpr  # cached: no trace
            return self._live(closed, len(dyn)) == self.active
        kept, n = self.active, len(dyn)
        self.active = differentiable
        try:
            specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in [*dyn, *self._extra()]]
            closed = jax.make_jaxpr(lambda *d: trace(self, list(d[:n]), d[n:], None))(*specs)
            return self._live(closed, n) == kept
        finally:
            self.active = kept

    def _leaked(self) -> None:
        # jax made an input of a traced value the function read from outside its
        # inputs: a tracer of this very program (which the program would then
        # treat as a constant, dropping its derivative), or of an enclosing
        # transformation held where the walk cannot see (it would be baked in).
        raise TypeError(
            f"{self.api}: the function reads a traced value through a place treegrad cannot "
            "follow, so its derivative would be silently lost. Either a jax.custom_jvp or "
            "jax.custom_vjp rule reads an array being differentiated from its closure (JAX "
            "differentiates a custom rule only with respect to its arguments: pass the "
            "array as an argument of the custom function), or a value of an enclosing jax "
            "transformation is held in an object treegrad cannot see into (pass it as an "
            "argument, or hold it in a list, dict, plain object or tg.Module)."
        )

    # Set by the program while tracing: how many of its first outputs the inputs'
    # use is read from, or (`live`) the inputs whose derivative may be non-zero.
    n_deps = 0
    live: frozenset[int] | None = None

    def _extra(self) -> tuple[Any, ...]:
        return (cotangent(),) if self.program == GRAD else ()

    def grad_order(self) -> list[int]:
        """The active positions in the order their gradients are leaves of the output."""
        if self.implicit:
            return [i for i in self.wrt if i in self.active]
        order = []
        seen: set[int] = set()
        for u in range(self.n_args) if self.a_slots is None else self.a_slots:
            if u not in seen and self.n_cl + u in self.active:
                order.append(self.n_cl + u)
            seen.add(u)
        return order

    def _hidden(self, hidden: list[Any], params: Sequence[Any] | None) -> None:
        if params is not None:
            ids = {id(p): k for k, p in enumerate(params)}
            for h in hidden:
                if id(h) in ids:
                    raise TypeError(
                        f"{self.api}: the function reaches a registered parameter "
                        f"({describe_leaf(h)}) through an object treegrad cannot see into "
                        "(e.g. a plain object held by a tg.Module attribute, which the Module "
                        "keeps as static data; a collections.deque, ChainMap or "
                        "MappingProxyType; an Enum member's value), so its gradient cannot be "
                        "taken. Hold it in a "
                        "tg.Module attribute, a list or a dict (make the object holding it a "
                        "tg.Module), or reach it through a closure variable or a global."
                    )
        self.hidden = [describe_leaf(h) for h in hidden]  # descriptions, not the arrays
        self.cacheable = False

    def run(self, roots: tuple[Any, ...], dyn: list[Any]) -> Any:
        """Call the program; returns `(deps, packed, grads)`."""
        self.stack.append(roots)
        try:
            # On one device there is one program (`compiled` picks one per placement).
            program = self.compiled(dyn) if self._multi else self.jitted
            out = program(*dyn, cotangent()) if self.program == GRAD else program(*dyn)
            if self.retraced:
                self._reread(dyn)
        finally:
            self.stack.pop()
        return self._unpack(roots, out)

    def run_plain(self, roots: tuple[Any, ...], a_uniq: list[Any]) -> Any:
        """`run` for the usual call (`fast`), guard and all, in one step: an explicit
        gradient, or a `tg.jit` call whose arguments are not arrays it captures. None
        when the call is not this entry's (another guard, tied captured arrays, an
        argument that is a captured array, a trace that reads differentiation
        otherwise)."""
        cl = self.guard.check(*roots)
        if cl is None:
            return None
        call = self.program == CALL
        # No captured array twice; for `tg.jit`, no argument a captured array (`fits`).
        if cl and (len(set(map(id, cl))) != len(cl) or (call and links(cl, a_uniq))):
            return None
        dyn = cl + a_uniq
        self.stack.append(roots)
        try:
            out = self.jitted(*dyn) if call else self.jitted(*dyn, cotangent())
            if self.retraced:
                self._reread(dyn)
        except Refit:
            return None
        finally:
            self.stack.pop()
        sig = self.out_sig
        if type(out) is not list or sig is None or sig[1] or self.demoted:
            return self._unpack(roots, out)  # outputs written back, or of another form
        grads, arrays, _ = out
        if call:
            return [], Packed(arrays, sig[0]), grads
        shape = self._grad_shape or self._make_grad_shape()
        return None, Packed(arrays, sig[0]), shape.unflatten(grads)

    def _reread(self, dyn: list[Any]) -> None:
        """After jax traced the program again (new shapes or dtypes): check that what
        the first trace said about differentiation holds for it."""
        self.retraced = False
        if self._analysed and (not self.cacheable or not self._holds(dyn)):
            # `cacheable` turned False: this trace drew from a random state or stored
            # traced values (`_programs._user`), so its program must not be reused.
            self._refuse(dyn)

    def _refuse(self, dyn: list[Any]) -> None:
        self._refused.add(signature(dyn))
        self.plain = self.fast = False  # `fits` must see the refusal
        raise Refit

    def _unpack(self, roots: tuple[Any, ...], out: Any) -> Any:
        """The program's outputs as `(deps, packed, grads)`, with any array the function
        rebound in its captured containers written back."""
        if self.demoted:
            self.demoted = False
            self.guard = Guard(self.nodes, self.absolute)
        if type(out) is list:  # flat (see `_flat_out`)
            grads, arrays, values = out
            sig = self.out_sig
            if sig is None:  # pragma: no cover - the trace that made these outputs set it
                raise AssertionError("flat outputs without a recorded structure")
            aux, places, index = sig
            deps: list[Any] | None = None if self.program == GRAD else []
            packed = Packed(arrays, aux)
            if places:
                self._write_back(roots, Written(places, index, values))
        else:
            if self.program == GRAD:
                grads, packed, written = out
                deps = None
            else:
                deps, packed, grads, written = out
            if written.places:
                self._write_back(roots, written)
        if self.program == GRAD and not self.implicit:
            grads = self._grad_tree(grads)
        return deps, packed, grads

    def _grad_tree(self, grads: list[Any]) -> Any:
        """The explicit gradients (in `grad_order`) in the arguments' structure: None at
        static leaves, inputs not differentiated and a tied array's later places."""
        return (self._grad_shape or self._make_grad_shape()).unflatten(grads)

    def _make_grad_shape(self) -> Shape:
        shape = self._grad_shape
        if shape is None:
            spec: list[Any] = []
            first: set[int] = set()
            slots = iter(range(self.n_args) if self.a_slots is None else self.a_slots)
            for dyn in self.is_array_leaf():
                u = next(slots) if dyn else -1
                take = dyn and u not in first and self.n_cl + u in self.active
                spec.append(TAKE if take else None)
                first.add(u)
            shape = self._grad_shape = Shape(self.a_def, spec=spec)
        return shape

    def _write_back(self, roots: tuple[Any, ...], written: Written) -> None:
        writer = self._writers.get(written.places)
        if writer is None:
            writer = self._writers[written.places] = WriteBack(
                self.nodes,
                self.absolute,
                {p: k for k, p in enumerate(written.places)},
                list(roots),
            )
        vals = [written.values[k] for k in written.index]
        if writer.ok:
            writer.write(*roots, vals)
            return
        values: list[Any] = [G.MISSING] * self.n_places
        for place, v in zip(written.places, vals, strict=True):
            values[place] = v
        only = holders([*self.nodes, *self.absolute], set(written.places))
        swap = Swap(values, inline=False, record=False, only=only)
        for node, root in zip(self.nodes, roots, strict=True):
            swap.put(node, root)
        for node in self.absolute:
            swap.put(node, None)

    # Used while tracing.
    def args(self, vals: Sequence[Any]) -> Any:
        """The arguments rebuilt from the inputs (tracers while tracing): `vals` holds
        the closure's unique arrays, then the arguments'."""
        arrays = list(vals[self.n_cl :])
        if self.a_links is not None:
            # An argument that is an array the function also captures is that
            # array's tracer, as it is that object when the function runs uncompiled:
            # `step(model, x)` with `ps = tg.params(model)` captured.
            arrays = [a if k < 0 else vals[k] for a, k in zip(arrays, self.a_links, strict=True)]
        tree = self._in_arg_tree(expand(arrays, self.a_slots), keep_statics=True)
        for repeat, first in self.a_shared or ():
            # A sub-model held at two places is one object, as in the caller's model.
            tree = put_at(tree, repeat, get_at(tree, first))
        return tree

    def arg_trees(self, by_pos: dict[int, Any]) -> Any:
        """One value per argument array leaf, in the arguments' structure (None elsewhere).

        A tied array (the same object at several places) gets its value at its
        first place and None at the others, like `Grads.to_tree`.
        """
        first: set[int] = set()
        vals = []
        for u in range(self.n_args) if self.a_slots is None else self.a_slots:
            vals.append(None if u in first else by_pos.get(self.n_cl + u))
            first.add(u)
        return self._in_arg_tree(vals, keep_statics=False)

    def _in_arg_tree(self, arrays: list[Any], keep_statics: bool) -> Any:
        """`arrays` at the arguments' array leaves; statics (or None) at the others."""
        if self.a_statics is None:
            leaves = arrays
        else:
            it = iter(arrays)
            leaves = [
                next(it) if s is DYN else (s if keep_statics else None) for s in self.a_statics
            ]
        return jax.tree_util.tree_unflatten(self.a_def, leaves)

    def is_array_leaf(self) -> list[bool]:
        """For each leaf of the arguments: whether it is an array (an input)."""
        if self.a_statics is None:
            return [True] * self.a_def.num_leaves
        return [s is DYN for s in self.a_statics]

    def arg_groups(self) -> tuple[tuple[int, ...], ...]:
        """The input positions of each top-level argument's arrays, in leaf order."""
        is_dyn = self.is_array_leaf()
        groups = []
        leaf = array = 0
        for child in self.a_def.children():
            pos = []
            for _ in range(child.num_leaves):
                if is_dyn[leaf]:
                    u = array if self.a_slots is None else self.a_slots[array]
                    pos.append(self.n_cl + u)
                    array += 1
                leaf += 1
            groups.append(tuple(pos))
        return tuple(groups)


# The functions (by `root_keys`) whose captured numpy arrays are read as values: they
# sort or fill one in place, or a trace with them as inputs failed (`_cache._new`).
# A jax tracer cannot stand in for a numpy array such a function changes in place.
# Each with the number of walks since that found them changed, for `_cache._warn_valued`.
NUMPY_VALUES: dict[Any, int] = {}
# Per function in NUMPY_VALUES: what its numpy values were at its last walk (`_valued`).
VALUED_SEEN: dict[Any, list[Any]] = {}
_BOUND = 4096  # functions remembered (forgotten: the next trace fails once more)


def _walk(call: Call, params: Sequence[Any] | None = None) -> tuple[Walk, list[Any], list[Any]]:
    """A new entry's first step: walk what the call reads (its function, the classes of
    its arguments' structure, their static values and callables), numbering the array
    places. Returns the walk and the guard's root and absolute nodes."""
    key = root_keys(call.roots)
    keep = frozenset(map(id, params or ()))
    while True:
        as_values = key in NUMPY_VALUES
        walk = Walk(as_values=as_values, keep=keep)
        roots = [walk.root(r) for r in call.roots]
        for cls in node_types(call.a_def):
            if not K.is_library(cls):
                walk._absolute(cls)
        for s in call.a_statics or ():
            walk.fixed(s)
            if is_plain_object(s):
                # An argument jax takes for one leaf (a config object): keyed by identity,
                # so its attributes the function reads are checked, as a captured one's.
                walk.held(s, "an argument")
        for fn in static_callables(call.a_def):
            walk.fixed(fn)
        absolute = walk.finish(roots)
        if not (walk.in_place and walk.numpy_places):
            if as_values:
                _count_valued(key, walk)
            return walk, roots, absolute
        # `order.sort()` on a tracer would sort a copy and drop it, silently.
        values_mode(key)


def values_mode(key: Any) -> None:
    """Read the captured numpy arrays of the function filed under `key` as values."""
    if len(NUMPY_VALUES) >= _BOUND:
        NUMPY_VALUES.clear()
        VALUED_SEEN.clear()
    NUMPY_VALUES[key] = 0
    VALUED_SEEN.pop(key, None)


def _count_valued(key: Any, walk: Walk) -> None:
    """Count a new trace of a function reading numpy arrays as values when they are not
    what its last trace read (`_cache._warn_valued` blames them): a trace for a change
    elsewhere (a helper rebound, a number edited) is not theirs. Digests, not copies,
    are kept: the entry's guard holds the copies only while the entry lives."""
    seen = walk.valued_seen()
    if VALUED_SEEN.get(key) != seen or any(d is None for _, d in seen):
        NUMPY_VALUES[key] = NUMPY_VALUES.get(key, 0) + 1
    VALUED_SEEN[key] = seen


def _positions(cl_uniq: list[Any], params: Sequence[Any]) -> tuple[int, ...]:
    index = {id(a): i for i, a in enumerate(cl_uniq)}
    return tuple(index.get(id(p), -1) for p in params)


def deleted_input(
    api: str, program: str, roots: tuple[Any, ...], args: Any, error: BaseException
) -> Exception | None:
    """After a failed call: the error naming an input array that was deleted, or None.

    A buffer donated to an earlier call (`tg.update(..., donate=True)`, a `jax.jit`'s
    `donate_argnums`) or freed by `x.delete()`: XLA refuses it with "Invalid buffer
    passed to Execute() ... Buffer has been deleted or donated", jax with "Array has
    been deleted", and neither says which variable it was. An argument is named by its
    path, a captured array by the name the function reads it by (walked again: this
    runs only when a call failed so, never for the user's own errors).
    """
    if "deleted" not in str(error):
        return None

    def gone(x: Any) -> bool:
        return isinstance(x, jax.Array) and not _jaxpr.is_tracer(x) and x.is_deleted()

    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        if gone(leaf):
            if program == CALL:  # tg.jit's (positional, keywords)
                path = path[1:]
            where, rest = path[0], path[1:]
            arg = where.key if isinstance(where, jax.tree_util.DictKey) else where.idx
            where_ = f"argument {arg!r}{jax.tree_util.keystr(rest)} holds"
            return _deleted(api, where_, leaf)
    try:
        walk, nodes, absolute = _walk(Call(program, None, roots, args))
        read = Guard(nodes, absolute).check(*roots) or []
    except Exception:  # the function's own failure, whatever it is, is the message then
        return None
    for name, x in zip(walk.names, read, strict=False):
        if gone(x):
            return _deleted(api, f"the function reads, as {name},", x)
    return None


def _deleted(api: str, where: str, x: Any) -> Exception:
    return RuntimeError(
        f"{api}: {where} an array that was deleted ({describe_leaf(x)}): it was "
        "donated to an earlier call (tg.update's donate=True, a jax.jit's donate_argnums) "
        "or deleted. Pass the arrays that call returned, not the donated ones."
    )
