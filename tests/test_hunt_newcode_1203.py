"""Hunt: the NEWEST code, 2026-12-03 (the last session's, least tested).

1. Counter or log (`_codeinfo.read_names`/`read_attrs`, `_walk.Walk._counter`, `Seq.read`,
   `_settle`): a list the function appends to is its output (a log, appended when
   traced); one it also reads is a counter, traced on every call. Reference: `jax.grad`
   of the same function under `jax.disable_jit()` (run afresh on each call), and the
   list's contents after N calls.
2. The deferred read check (`Params._retire`/`stale_read`, `_paramerrors.unread_message`).
   Reference: plain optax on the same leaves, step by step.
3. flax nnx Variables read and written with `get_raw_value`/`set_raw_value`
   (`_paths.raw_value`, `get_attr`). Reference: `nnx.Optimizer` / plain optax.
4. The numpy-values digest (`_engine._count_valued`, `Walk.valued_seen`).

Found and fixed:
- SILENT wrong results: a list the function appends to and reads was taken for a log
  (traced once, its length read as it was when traced, forever, in tg.gradient and
  tg.jit alike) whenever it was read through anything but its own name or attribute:
  an item of a dict or list (`d["log"].append(1); len(d["log"])`, `logs[0]`, `pair[0]`,
  `sum(len(v) for v in d.values())`), the same list also held in a dict
  (`state["hist"] is log`), a `functools.partial(len, log)`, a bound method
  (`n = log.__len__`), a helper's default argument (`def helper(h=log)`). `_codeinfo`
  sees reads by name only, and `_walk.Walk._counter` marked only a list that a name
  read resolved to directly. Fixed in `_walk.Walk.node`: a list reached other than by
  a name the code spells (a global, a closure variable, an attribute: `Walk._by_name`)
  is a counter (`Seq.read`). The cost: a list only appended to but held in a dict (or
  appended through a stored `log.append`) is a counter too: traced on every call, its
  contents those of the uncompiled function, said once by `tg.RetraceWarning`
  (docs/pitfalls.md and docs/compilation.md say so).
- SILENT: the same for a list attribute read through `operator.attrgetter("hist")` or
  `functools.partial(getattr, o, "hist")`: `Walk._reads_by_name` added those names to
  the attributes walked but not to those read (`attr_reads`); now to both.
- SILENT: a `collections.deque` or `set` the function adds to and reads (`len(seen)`)
  was a log (`_settle.Settle.node` demoted a grown Snap as a log, unconditionally). Now
  `Snap.read` (set by `Walk._counter` and for a set or deque reached not by name) makes
  it a counter; `_codeinfo._appends` knows `add` and `update` as adding only, so a set
  only added to stays a log.

Found, not fixed (strict xfail, diagnosis in its reason):
- SILENT: a list appended to by one object's method and read by ANOTHER class's method
  (`trainer.late()` reads `len(self.log.history)`) stays a log (`_walk.Walk._attr_read`
  counts a method's attribute reads only for its own class's instances).
- SILENT: a list attribute read by a computed name (`getattr(o, NAME)`) stays a log.
- SILENT: Flux's weight-decay idiom over a Params of standalone arrays whose data term
  reads the global variables (`loss = data(W) + sum(sum(p**2) for p in ps)`) trains
  only the decay term: `Params.stale_read` lets an old array through when the current
  one is read too (meant for an anchor, `(W - W0) ** 2`).

Fixed by the lead after the hunt:
- SILENT: a `tg.Params([W])` built afresh each step from the same global variables
  repeated the first step forever: each new Params had no retired arrays to check. Now
  `_params.RETIRED` remembers them for every Params, and the second gradient is refused
  with its own message (`_paramerrors.unread_message(other=True)`).
- SILENT / crash under `jax.disable_jit()`: the program ran its Python body, the
  function with it, again after each trace, so a list counter advanced twice a call,
  and a first call that added an instance attribute shadowing a class attribute
  (`t.n += 1`) raised a bare `KeyError: 'n'`. `_engine.Entry.first_run` now traces and
  runs with jit enabled.

Checked, no defect: nnx models (Linear, a scalar Param, BatchNorm's BatchStat updated by
the loss) in explicit and implicit style, uncompiled and tg.jit, equal nnx.Optimizer;
the stale-array refusal (message, nothing changed, trains once rebound); arrays made
afresh each step while retired ones die (ids reused) are not refused; numpy values
rebound with the same bytes and another shape or dtype are seen, and said once after
four traces.
"""

from __future__ import annotations

import collections
import functools
import operator
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad._paramerrors import UnreadParameterError

W3 = jnp.array([0.5, -1.0, 2.0])
X3 = jnp.array([1.0, 2.0, -1.0])
COUNTER = r"changes values it can read while traced"

# ----------------------------------------------------------------------------- helpers


def _run_compiled(loss, n):
    """`tg.gradient` n times; the gradients and the warnings said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [np.asarray(tg.gradient(loss, W3)[0]) for _ in range(n)]
    return got, [str(w.message) for w in caught]


def _run_uncompiled(loss, n):
    """The reference: `jax.grad` run afresh on each call (`jax.disable_jit`)."""
    with jax.disable_jit():
        return [np.asarray(jax.grad(loss)(W3)) for _ in range(n)]


def _check_like_uncompiled(make, n=4):
    """`make()` builds a fresh (loss, contents) pair; compiled and uncompiled runs on two
    fresh pairs give the same gradients and leave the same list contents."""
    loss, contents = make()
    got, said = _run_compiled(loss, n)
    loss_ref, contents_ref = make()
    want = _run_uncompiled(loss_ref, n)
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6)
    assert contents() == contents_ref()
    return said


# ------------------------------------------------ 1. counter or log: reads it missed


def _dict_item():
    d = {"log": []}

    def loss(w):
        d["log"].append(1)
        return jnp.sum(w**2) * len(d["log"])

    return loss, lambda: list(d["log"])


def _list_item():
    logs = [[]]

    def loss(w):
        logs[0].append(1)
        return jnp.sum(w**2) * len(logs[0])

    return loss, lambda: list(logs[0])


def _tuple_item():
    log = []
    pair = (log, 3)

    def loss(w):
        pair[0].append(1)
        return jnp.sum(w**2) * len(pair[0])

    return loss, lambda: list(log)


def _same_list_in_a_dict():
    log = []
    state = {"hist": log}

    def loss(w):
        log.append(1)  # by name: only appended
        return jnp.sum(w**2) * len(state["hist"])  # the same list, read as an item

    return loss, lambda: list(log)


def _dict_values():
    d = {"a": [], "b": []}

    def loss(w):
        d["a"].append(1)
        return jnp.sum(w**2) * sum(len(v) for v in d.values())

    return loss, lambda: list(d["a"])


def _partial_len():
    log = []
    n = functools.partial(len, log)

    def loss(w):
        log.append(1)
        return jnp.sum(w**2) * n()

    return loss, lambda: list(log)


def _bound_len():
    log = []
    n = log.__len__

    def loss(w):
        log.append(1)
        return jnp.sum(w**2) * n()

    return loss, lambda: list(log)


def _default_argument():
    log = []

    def helper(h=log):
        return len(h)

    def loss(w):
        log.append(1)
        return jnp.sum(w**2) * helper()

    return loss, lambda: list(log)


class _Obj:
    pass


def _attrgetter():
    o = _Obj()
    o.hist = []
    get = operator.attrgetter("hist")

    def loss(w):
        o.hist.append(1)
        return jnp.sum(w**2) * len(get(o))

    return loss, lambda: list(o.hist)


def _partial_getattr():
    o = _Obj()
    o.hist = []
    get = functools.partial(getattr, o, "hist")

    def loss(w):
        o.hist.append(1)
        return jnp.sum(w**2) * len(get())

    return loss, lambda: list(o.hist)


# Each was SILENT before the fix: every call gave the first call's gradient (2w, the
# length 1 read when traced), and the list held one item; uncompiled, call k reads k.
@pytest.mark.parametrize(
    "make",
    [
        _dict_item,
        _list_item,
        _tuple_item,
        _same_list_in_a_dict,
        _dict_values,
        _partial_len,
        _bound_len,
        _default_argument,
        _attrgetter,  # (fixed: `Walk._reads_by_name` files the names it reads)
        _partial_getattr,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_list_appended_to_and_read_through_anything_but_its_name_is_a_counter(make):
    said = _check_like_uncompiled(make)
    assert len(said) == 1 and COUNTER in said[0], said


@pytest.mark.parametrize(
    "make",
    [_dict_item, _same_list_in_a_dict, _partial_len, _default_argument, _attrgetter],
    ids=lambda f: f.__name__.strip("_"),
)
def test_the_same_counters_in_a_tg_jit_function_give_the_uncompiled_values(make):
    loss, contents = make()
    f = tg.jit(loss)
    with pytest.warns(tg.RetraceWarning, match=COUNTER):
        got = [float(f(W3)) for _ in range(4)]
    loss_ref, contents_ref = make()
    want = [float(loss_ref(W3)) for _ in range(4)]  # plain Python calls: uncompiled
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert contents() == contents_ref() == [1, 1, 1, 1]


def _by_name_reads():
    """Reads that were already seen (kept passing with the fix)."""
    log = []

    def helper():
        return sum(1 for _ in log)

    def loss(w):
        alias = log
        alias.append(1)
        s = 2.0 if log else 1.0
        return jnp.sum(w**2) * (helper() + s + log.count(1))

    return loss, lambda: list(log)


def test_reads_by_name_alias_genexpr_truth_and_count_stay_counters():
    said = _check_like_uncompiled(_by_name_reads)
    assert len(said) == 1 and COUNTER in said[0], said


def test_a_log_only_appended_to_by_name_or_attribute_is_still_traced_once():
    # Not a spurious counter: the trace log by name and by attribute, and a second
    # list appended to by a helper, stay outputs (appended when traced, once).
    traces = []

    class Holder:
        def __init__(self):
            self.log = []

        def note(self):
            self.log.append("traced")

    h = Holder()
    seen = set()
    queue = collections.deque()

    def loss(w):
        traces.append(1)
        traces.extend([2])
        h.note()
        seen.add("traced")
        seen.update({"again"})
        queue.append(1)
        return jnp.sum(w**3)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [np.asarray(tg.gradient(loss, W3)[0]) for _ in range(4)]
    np.testing.assert_allclose(np.stack(got), np.stack([3 * np.asarray(W3) ** 2] * 4), rtol=1e-6)
    assert traces == [1, 2] and h.log == ["traced"]
    assert seen == {"traced", "again"} and list(queue) == [1]


def test_a_log_held_in_a_dict_is_a_counter_with_the_uncompiled_contents():
    # The price of the fix: treegrad cannot tell `d["log"].append(1)` from a read of
    # the item, so the log is traced on every call (its contents the uncompiled ones),
    # said once.
    d = {"log": []}

    def loss(w):
        d["log"].append(1)
        return jnp.sum(w**2)

    got, said = _run_compiled(loss, 3)
    np.testing.assert_allclose(np.stack(got), np.stack([2 * np.asarray(W3)] * 3), rtol=1e-6)
    assert d["log"] == [1, 1, 1]
    assert len(said) == 1 and said[0].startswith(
        "tg.gradient: test_a_log_held_in_a_dict_is_a_counter_with_the_uncompiled_contents"
        ".<locals>.loss changes values it can read while traced"
    )


_NAME = "hist"


@pytest.mark.xfail(
    strict=True,
    reason="SILENT: an attribute read by a computed name (`getattr(o, NAME)`, NAME a "
    "global) is not in _codeinfo.read_attrs (only names the code or its string "
    "constants spell), and _walk.Walk.finish deliberately does not take `dynamic` code "
    "for a read of every list attribute (it would make every log of a library-like "
    "function a counter): the list stays a log",
)
def test_a_list_attribute_read_by_a_computed_name_is_a_counter():
    def make():
        o = _Obj()
        o.hist = []

        def loss(w):
            o.hist.append(1)
            return jnp.sum(w**2) * len(getattr(o, _NAME))

        return loss, lambda: list(o.hist)

    _check_like_uncompiled(make)


class _History:
    def __init__(self):
        self.history = []

    def add(self, v):
        self.history.append(v)


class _Late:
    def __init__(self, log):
        self.log = log

    def late(self):
        return len(self.log.history)


@pytest.mark.xfail(
    strict=True,
    reason="SILENT: the list is appended to by _History.add and read by _Late.late, a "
    "method of another class: _walk.Walk._attr_read counts a method's attribute reads "
    "(owner_reads) only for instances of its own class, so `history` stays a log and "
    "every call reads the length seen when traced. (Counting them for every class "
    "would make each library-like class's log a counter: a method walked is not a "
    "method called; telling them apart needs the calls the code makes.)",
)
def test_a_list_another_class_reads_is_a_counter():
    def make():
        lg = _History()
        tr = _Late(lg)

        def loss(w):
            lg.add(1)
            return jnp.sum(w**2) * tr.late()

        return loss, lambda: list(lg.history)

    _check_like_uncompiled(make)


# Was SILENT (fixed: `Snap.read`, `_codeinfo._appends` knows `add`/`update`).
@pytest.mark.parametrize("kind", ["deque", "set"])
def test_a_deque_or_set_added_to_and_read_is_a_counter(kind):
    def make():
        box = collections.deque() if kind == "deque" else set()

        def loss(w):
            if kind == "deque":
                box.append(len(box))
            else:
                box.add(len(box))
            return jnp.sum(w**2) * len(box)

        return loss, lambda: sorted(box)

    said = _check_like_uncompiled(make)
    assert len(said) == 1 and COUNTER in said[0], said


# ------------------------------------------------------------ 2. the deferred read check


def _optax_steps(f, leaves, rule, steps):
    """Plain optax on the same leaves: the list of leaves after each step."""
    leaves = list(leaves)
    opt = rule.init(leaves)
    out = []
    for _ in range(steps):
        g = jax.grad(lambda ls: f(*ls))(leaves)
        u, opt = rule.update(g, opt, leaves)
        leaves = optax.apply_updates(leaves, u)
        out.append(list(leaves))
    return out


@pytest.mark.slow  # three gradients and two updates traced (~0.5 s)
def test_a_stale_global_is_refused_naming_it_and_changing_nothing_then_trains_when_rebound():
    W = jnp.array([0.5, -0.3, 0.2])
    ps = tg.Params([W])
    state = tg.setup(optax.adam(0.1), ps)
    g = tg.gradient(lambda: jnp.sum(W * X3) ** 2, ps)
    tg.update_(state, ps, g)  # the first step reads the current array: it trains
    after_one = ps[0]
    leaves = jax.tree.leaves(state)
    msg = (
        "tg.gradient: the loss reads, as W, the old array of the Params' parameter 0 "
        "(float32[3]), which tg.update_ replaced only inside the containers the Params "
        "holds, so the loss would keep reading the old array and never train (jax arrays "
        "are immutable; Flux's update! mutates them). Nothing was changed."
    )
    with pytest.raises(TypeError, match="^" + re.escape(msg)):
        tg.gradient(lambda: jnp.sum(W * X3) ** 2, ps)
    assert ps[0] is after_one
    assert all(a is b for a, b in zip(jax.tree.leaves(state), leaves, strict=True))
    W = ps[0]  # the fix the message names: read the current array
    g = tg.gradient(lambda: jnp.sum(W * X3) ** 2, ps)
    tg.update_(state, ps, g)
    want = _optax_steps(
        lambda w: jnp.sum(w * X3) ** 2, [jnp.array([0.5, -0.3, 0.2])], optax.adam(0.1), 2
    )
    np.testing.assert_allclose(ps[0], want[-1][0], rtol=1e-5)


def test_fresh_arrays_each_step_after_the_old_ones_died_are_not_taken_for_them():
    # The retired arrays are remembered weakly by id: arrays made afresh each step
    # (ids of freed arrays may be reused) are not refused; it trains like optax.
    W, b = jnp.array([0.5, -0.3, 0.2]), jnp.array(0.1)
    ps = tg.Params([W, b])
    state = tg.setup(optax.sgd(0.05), ps)
    del W, b
    xs = []
    for k in range(5):
        Wl, bl = ps
        xk = X3 + float(k)  # a new array each step, read by the loss
        xs.append(xk)
        g = tg.gradient(lambda: jnp.sum(Wl * xk + bl) ** 2, ps)  # noqa: B023
        tg.update_(state, ps, g)  # the next step's unpack drops the old arrays
    leaves = [jnp.array([0.5, -0.3, 0.2]), jnp.array(0.1)]
    rule = optax.sgd(0.05)
    opt = rule.init(leaves)
    for xk in xs:
        grads = jax.grad(lambda ls: jnp.sum(ls[0] * xk + ls[1]) ** 2)(leaves)  # noqa: B023
        u, opt = rule.update(grads, opt, leaves)
        leaves = optax.apply_updates(leaves, u)
    for a, r in zip(ps, leaves, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)


@pytest.mark.xfail(
    strict=True,
    reason="SILENT: Params.stale_read lets an old array through when the parameter's "
    "current array is read too (meant for an anchor, (W - W0)**2); here the current "
    "array is read only by the weight-decay term over ps, and the data term reads the "
    "global W, the first step's array, forever: only the decay term trains, no error",
)
def test_flux_weight_decay_over_params_with_a_data_term_on_globals_trains_like_optax():
    W = jnp.array([0.5, -0.3, 0.2])
    ps = tg.Params([W])
    state = tg.setup(optax.sgd(0.1), ps)

    def loss():
        return jnp.sum(W * X3) ** 2 + sum(jnp.sum(p**2) for p in ps)

    for _ in range(3):
        tg.update_(state, ps, tg.gradient(loss, ps))
    want = _optax_steps(lambda w: jnp.sum(w * X3) ** 2 + jnp.sum(w**2), [W], optax.sgd(0.1), 3)
    np.testing.assert_allclose(ps[0], want[-1][0], rtol=1e-5)


def test_a_params_rebuilt_each_step_over_unchanged_globals_is_refused_after_one_step():
    # Was silent: each step's new Params had no retired arrays of its own, so every step
    # repeated the first. Now `_params.RETIRED` remembers them for every Params.
    W = jnp.array([0.5, -0.3, 0.2])
    state = None
    steps = 0
    with pytest.raises(
        UnreadParameterError,
        match=re.escape(
            "tg.gradient: the loss reads, as W, an array (float32[3]) that an earlier "
            "tg.update_ replaced, as the parameter 0 of the Params it updated, only inside "
            "the containers that Params holds; a Params built again from the same variables "
            "starts from the old array at every step, so the loss would never train"
        ),
    ):
        for _ in range(3):
            ps = tg.Params([W])
            if state is None:
                state, first = tg.setup(optax.sgd(0.1), ps), ps
            tg.update_(state, ps, tg.gradient(lambda: jnp.sum(W * X3) ** 2, ps))
            steps += 1
    assert (
        steps == 1
    )  # the first step was right (the loss read the current W); refused at the second
    want = _optax_steps(lambda w: jnp.sum(w * X3) ** 2, [W], optax.sgd(0.1), 1)
    np.testing.assert_allclose(first[0], want[-1][0], rtol=1e-5)  # the first step's Params
    assert ps[0] is W  # the refused step's Params: unchanged


def test_after_the_refusal_the_fixed_loop_over_the_same_arrays_trains_like_optax():
    # The refusal is said once: the loop the user writes next, over the same global
    # arrays, reading ps[0] as the message says, is not refused for the old loop's
    # retired array (a Params built again each step, and one kept, both train).
    W = jnp.array([0.5, -0.3, 0.2])
    state = tg.setup(optax.sgd(0.1), tg.Params([W]))
    with pytest.raises(UnreadParameterError, match="built again from the same variables"):
        for _ in range(2):
            ps = tg.Params([W])
            tg.update_(state, ps, tg.gradient(lambda: jnp.sum(W * X3) ** 2, ps))
    want = _optax_steps(lambda w: jnp.sum(w * X3) ** 2, [W], optax.sgd(0.1), 3)
    ps = tg.Params([W])
    state = tg.setup(optax.sgd(0.1), ps)
    for k in range(3):
        tg.update_(state, ps, tg.gradient(lambda: jnp.sum(ps[0] * X3) ** 2, ps))
        np.testing.assert_allclose(ps[0], want[k][0], rtol=1e-5)


def test_a_params_rebuilt_each_step_from_a_model_trains_like_optax():
    # The same loop over a dict the loss reads from: each update reaches the loss, and no
    # array is retired, so nothing is refused.
    model = {"W": jnp.array([0.5, -0.3, 0.2])}
    state = tg.setup(optax.sgd(0.1), tg.Params(model))
    for _ in range(3):
        ps = tg.Params(model)
        tg.update_(state, ps, tg.gradient(lambda: jnp.sum(model["W"] * X3) ** 2, ps))
    want = _optax_steps(
        lambda w: jnp.sum(w * X3) ** 2, [jnp.array([0.5, -0.3, 0.2])], optax.sgd(0.1), 3
    )
    np.testing.assert_allclose(model["W"], want[-1][0], rtol=1e-5)


# ------------------------------------------------------------------- 3. flax nnx models


def _nnx_model(nnx, batchnorm):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs) if batchnorm else None
            self.l2 = nnx.Linear(4, 2, rngs=rngs)
            self.scale = nnx.Param(jnp.array(1.5))

        def __call__(self, x):
            h = self.l1(x)
            if self.bn is not None:
                h = self.bn(h)
            return self.l2(jax.nn.relu(h)) * self.scale

    return Net(nnx.Rngs(0))


@pytest.mark.slow  # over ~0.5 s: four training runs of an nnx model and their references
@pytest.mark.parametrize("style", ["update", "update_", "jit_update", "jit_update_"])
def test_nnx_model_trains_like_nnx_optimizer(style):
    nnx = pytest.importorskip("flax.nnx")
    x = jax.random.normal(jax.random.key(1), (5, 3))
    y = jax.random.normal(jax.random.key(2), (5, 2))

    def loss(m):
        return jnp.mean((m(x) - y) ** 2)

    ref = _nnx_model(nnx, batchnorm=False)
    opt = nnx.Optimizer(ref, optax.adam(0.05), wrt=nnx.Param)
    m = _nnx_model(nnx, batchnorm=False)
    if style in ("update", "jit_update"):
        state = tg.setup(optax.adam(0.05), m)

        def step(state, m):
            (g,) = tg.gradient(loss, m)
            return tg.update(state, m, g)

        step = tg.jit(step) if style == "jit_update" else step
    else:
        ps = tg.params(m)
        state = tg.setup(optax.adam(0.05), ps)

        def step(state, model):  # the API's implicit step: model and state captured
            tg.update_(state, ps, tg.gradient(lambda: loss(m), ps))
            return state, model

        if style == "jit_update_":
            captured = tg.jit(lambda: tg.update_(state, ps, tg.gradient(lambda: loss(m), ps)))

            def step(state, model):
                captured()
                return state, model

    for _ in range(3):
        opt.update(ref, nnx.grad(loss)(ref))
        state, m = step(state, m)
        got = jax.tree.leaves(nnx.state(m, nnx.Param))
        want = jax.tree.leaves(nnx.state(ref, nnx.Param))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two nnx training runs (over ~0.5 s)
def test_nnx_batchnorm_stats_follow_nnx_in_implicit_style():
    # The loss updates the BatchStat Variables in place (set_raw_value after the trace);
    # the stats and the Params after each step equal nnx.grad + nnx.Optimizer's.
    nnx = pytest.importorskip("flax.nnx")
    x = jax.random.normal(jax.random.key(1), (5, 3))

    def loss(m):
        out = m(x)
        return jnp.mean(out**2 + out)

    ref = _nnx_model(nnx, batchnorm=True)
    opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    m = _nnx_model(nnx, batchnorm=True)
    ps = tg.params(m)
    state = tg.setup(optax.sgd(0.1), ps)
    for _ in range(2):
        opt.update(ref, nnx.grad(loss)(ref))
        tg.update_(state, ps, tg.gradient(lambda: loss(m), ps))
        for a, b in zip(
            jax.tree.leaves(nnx.state(m)), jax.tree.leaves(nnx.state(ref)), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ 4. numpy arrays as values


def test_numpy_values_rebound_with_the_same_bytes_but_another_dtype_or_shape_are_seen():
    # A numpy mask makes the function read its numpy arrays as values; `s` is then
    # rebound to arrays with the same bytes but another shape, then another dtype.
    mask = np.array([True, False, True])
    box = {"s": np.array([1.0, 2.0], np.float32)}

    def f(v):
        s = box["s"]
        return jnp.sum(v[mask] ** 2) * (s.ndim + 10 * (s.dtype == np.int32))

    with pytest.warns(tg.RetraceWarning) as caught:
        for change in (None, "reshape", "another shape", "view"):
            if change == "reshape":
                box["s"] = box["s"].reshape(2, 1)
            elif change == "another shape":
                box["s"] = box["s"].reshape(1, 2, 1)
            elif change == "view":
                box["s"] = box["s"].view(np.int32)
            got = tg.gradient(f, W3)[0]
            np.testing.assert_allclose(got, _run_uncompiled(f, 1)[0], rtol=1e-6)
    # Four traces (the first, then one a change): said once, naming both arrays.
    assert [str(w.message) for w in caught] == [
        "tg.gradient: test_numpy_values_rebound_with_the_same_bytes_but_another_dtype_or_"
        "shape_are_seen.<locals>.f needs the numpy arrays it captures as numpy values "
        "(box['s'], mask), so they are compared on each call, and they changed: it was "
        "traced 4 times. Each change costs a trace. Pass an array that changes each step "
        "as a jax array (jnp.asarray(x)) or as an argument, and keep numpy for what stays "
        "fixed (a mask)."
    ]


# ----------------------------------------- found on the way: counters under disable_jit


class _ClassCounter:
    n = 0  # a class attribute: the first `self.n += 1` adds an instance attribute


# Was a strict xfail (silent, and a crash): under jax.disable_jit() the program ran its
# Python body, the function with it, again after each trace. `_engine.Entry.first_run`
# now traces and runs with jit enabled.
@pytest.mark.parametrize("kind", ["list_counter", "new_instance_attribute"])
def test_a_counter_under_jax_disable_jit_is_advanced_once_a_call(kind):
    log = []
    t = _ClassCounter()

    def loss(w):
        if kind == "list_counter":
            log.append(1)
            k = len(log)
        else:
            t.n += 1
            k = t.n
        return jnp.sum(w**2) * k

    with jax.disable_jit(), warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        got = [np.asarray(tg.gradient(loss, W3)[0]) for _ in range(3)]
    # Uncompiled: call k (from 1) reads k: d/dw k sum(w^2) = 2 k w.
    np.testing.assert_allclose(np.stack(got), np.stack([2 * k * np.asarray(W3) for k in (1, 2, 3)]))


def test_under_jax_disable_jit_plain_calls_and_a_tg_jit_step_equal_uncompiled_and_optax():
    # Calls that hit the cache run the program's Python body under disable_jit: each
    # must still give the uncompiled gradient, and a compiled training step optax's.
    scale = {"s": 2.0}
    model = {"w": W3}

    def loss(m):
        return jnp.sum(jnp.sin(m["w"]) * X3) * scale["s"]

    @tg.jit
    def step(state, m):
        g = tg.gradient(loss, m)[0]
        return tg.update(state, m, g)

    rule = optax.sgd(0.1)
    state = tg.setup(rule, model)
    opt, ref = rule.init(model), model
    with jax.disable_jit():
        for s in (2.0, 2.0, 3.0):
            scale["s"] = s
            want = jax.grad(loss)(model)
            np.testing.assert_allclose(tg.gradient(loss, model)[0]["w"], want["w"], rtol=1e-6)
            state, model = step(state, model)
            u, opt = rule.update(jax.grad(loss)(ref), opt, ref)
            ref = optax.apply_updates(ref, u)
            np.testing.assert_allclose(model["w"], ref["w"], rtol=1e-6)


def test_a_value_changed_on_every_walk_is_refused_after_the_rewalks(monkeypatch):
    # A thread that changes what the function reads between each walk and the guard's
    # first check: walked again `_cache._REWALKS` times, then a clear error (0 rewalks
    # stands for a value changed on every one). Nothing is cached.
    from treegrad import _cache

    monkeypatch.setattr(_cache, "_REWALKS", 0)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "treegrad: what the function reads changed 0 times while it was being compiled "
            "(another thread changes it without pause): change it between calls, or pass "
            "the value as an argument."
        ),
    ):
        tg.gradient(lambda v: jnp.sum(v**3) * 1.25, W3)
    monkeypatch.setattr(_cache, "_REWALKS", 20)
    (g,) = tg.gradient(lambda v: jnp.sum(v**3) * 1.25, W3)
    np.testing.assert_allclose(g, jax.grad(lambda v: jnp.sum(v**3) * 1.25)(W3), rtol=1e-6)
