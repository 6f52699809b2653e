"""A captured numpy array the function needs as numpy: read as a value, never stale.

A captured array is a traced input, so that it is never stale. A jax tracer cannot
stand in for a numpy array that the function changes in place (`order[0] = 1.0`,
`np.random.shuffle(order)`, `order.sort()`) or whose value it needs (`w[mask]`,
`float(scale[0])`): treegrad then reads that function's captured numpy arrays as
values, compared with a copy on each call (`_engine.NUMPY_VALUES`). Each test
compares with the same function run uncompiled under `jax.grad`, the user's arrays
included, call after call.
"""

from __future__ import annotations

import collections
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

W = jnp.array([1.0, 2.0, 3.0])


def _writes(name):
    """A loss that changes its captured `buf` in place with numpy code, then reads it."""
    bodies = {
        "item": lambda buf: buf.__setitem__(0, buf[0] + 1.0),
        "slice": lambda buf: buf.__setitem__(slice(None, 2), buf[1:] * 2.0),
        "ellipsis-iadd": lambda buf: buf.__setitem__(Ellipsis, buf + 0.5),
        "view": lambda buf: buf[1:].__setitem__(0, 9.0),
        "out=": lambda buf: np.add(buf, 1.0, out=buf),
        "cumsum-out=": lambda buf: np.cumsum(buf, out=buf),
        "copyto": lambda buf: np.copyto(buf, buf[::-1] + 1.0),
        "put": lambda buf: np.put(buf, [2], [7.0]),
        "place": lambda buf: np.place(buf, buf > 1.5, [0.5]),
        "putmask": lambda buf: np.putmask(buf, buf < 2.5, 4.0),
        "ufunc.at": lambda buf: np.add.at(buf, [0, 0], 1.0),
        "fill": lambda buf: buf.fill(2.5),
        "partition": lambda buf: buf.partition(1),
        "shuffle": lambda buf: np.random.shuffle(buf),
        "generator-shuffle": lambda buf: RNG.shuffle(buf),
        # A draw before the write that fails on the tracer: undone before the retry.
        "draw-then-write": lambda buf: buf.__setitem__(0, np.random.rand()),
        "generator-draw-then-write": lambda buf: buf.__setitem__(1, RNG.normal()),
    }
    return bodies[name]


RNG = np.random.default_rng(0)
WRITES = [
    "item",
    "slice",
    "ellipsis-iadd",
    "view",
    "out=",
    "cumsum-out=",
    "copyto",
    "put",
    "place",
    "putmask",
    "ufunc.at",
    "fill",
    "partition",
    "shuffle",
    "generator-shuffle",
    "draw-then-write",
    "generator-draw-then-write",
]


def _run(grad, body, calls=3):
    """Each call's gradient and the captured array after it, seeded alike."""
    global RNG
    np.random.seed(0)
    RNG = np.random.default_rng(0)
    buf = np.array([3.0, 1.0, 2.0])

    def loss(w):
        body(buf)
        return jnp.sum(w * buf)

    out = []
    for _ in range(calls):
        out.append((np.asarray(grad(loss)).tolist(), buf.tolist()))
    return out


def _tg(loss):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        return tg.gradient(loss, W)[0]


@pytest.mark.parametrize("name", WRITES)
def test_numpy_code_writing_into_a_captured_array_runs_as_uncompiled(name):
    ref = _run(lambda loss: jax.grad(loss)(W), _writes(name))
    assert _run(_tg, _writes(name)) == ref


def test_sorting_a_captured_array_in_place_is_not_dropped():
    """`order.sort()` on the jax tracer standing in for it would sort a copy and drop
    it: the function would read the unsorted array, silently. No error to go by: the
    code's dropped call to an in-place method is what says so."""

    def run(grad):
        order = np.array([3.0, 1.0, 2.0])

        def loss(w):
            order.sort()
            return jnp.sum(w * order)

        out = [np.asarray(grad(loss)).tolist()]
        order[:] = [9.0, 8.0, 7.0]  # changed outside: read afresh, sorted again
        out.append(np.asarray(grad(loss)).tolist())
        return out, order.tolist()

    ref = run(lambda loss: jax.grad(loss)(W))
    assert ref == ([[1.0, 2.0, 3.0], [7.0, 8.0, 9.0]], [7.0, 8.0, 9.0])
    assert run(_tg) == ref


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_a_shuffled_index_array_in_a_compiled_step_matches_the_uncompiled_step():
    """A training step that shuffles its captured numpy index array in place: each call
    takes the next order, as uncompiled (the draw restored after the failed trace)."""
    data = jnp.arange(12.0).reshape(6, 2)

    def run(step_fn):
        np.random.seed(1)
        model = {"w": jnp.ones(2)}
        order = np.arange(6)
        state = tg.setup(optax.sgd(0.1), model)

        def step(model, state):
            np.random.shuffle(order)
            batch = data[order[:2]]
            loss, (g,) = tg.withgradient(lambda m: jnp.sum((batch @ m["w"]) ** 2), model)
            state, model = tg.update(state, model, g)
            return model, state, loss

        run_step = step_fn(step)
        losses = []
        for _ in range(3):
            model, state, loss = run_step(model, state)
            losses.append(float(loss))
        return losses, np.asarray(model["w"]).tolist(), order.tolist()

    ref = run(lambda f: f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        got = run(tg.jit)
    assert got[2] == ref[2]
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-6)


USES = {
    "bool-mask": lambda w, a: jnp.sum(w[a > 1.5]),
    "float": lambda w, a: jnp.sum(w) * float(a[0]),
    "if": lambda w, a: jnp.sum(w) * (2.0 if a[1] > 1.5 else 3.0),
    "tolist": lambda w, a: jnp.sum(w) * a.tolist()[2],
    "int-index": lambda w, a: w[int(a[1])],
    "shape": lambda w, a: jnp.sum(w) * jnp.ones(int(a[1]) + 1).sum(),
}


@pytest.mark.parametrize("use", sorted(USES))
def test_a_captured_numpy_array_used_as_a_python_value_works_and_stays_fresh(use):
    """Its value decides the program: compiled once while it stays the same, traced
    again when it is changed in place outside the function, never stale."""

    def run(grad):
        a = np.array([2.0, 1.0, 0.0])
        traces = []

        def loss(w):
            traces.append(1)
            return USES[use](w, a)

        out = []
        for step in range(4):
            out.append(np.asarray(grad(loss)).tolist())
            if step == 1:
                a[:] = [0.5, 2.0, 1.0]
        return out, len(traces)

    ref, _ = run(lambda loss: jax.grad(loss)(W))
    got, traces = run(lambda loss: tg.gradient(loss, W)[0])
    assert got == ref
    # The failed trace with the array as an input, then one per value of the array.
    assert traces == 3


def test_a_captured_numpy_array_holding_nan_is_compiled_once():
    a = np.array([np.nan, 1.0])
    traces = []

    def loss(w):
        traces.append(1)
        return jnp.sum(w) * (1.0 if a[1] > 0 else 2.0)

    for _ in range(3):
        g = tg.gradient(loss, W)[0]
    assert np.asarray(g).tolist() == [1.0, 1.0, 1.0]
    assert len(traces) == 2  # the failed trace, and one: NaN equals NaN here


def test_writing_into_a_captured_array_warns_once_with_the_fix():
    counts = np.zeros(2)

    def counted(w):
        counts[0] += 1
        return jnp.sum(w) * counts[0]

    with pytest.warns(tg.RetraceWarning) as caught:
        for _ in range(3):
            tg.gradient(counted, W)
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "tg.gradient: test_writing_into_a_captured_array_warns_once_with_the_fix.<locals>."
        "counted changes a numpy array it captures in place while traced (one of: counts). "
        "A jax tracer cannot stand in for it, so treegrad reads such arrays as values and "
        "the function is traced again on every call that finds one changed, as it would "
        "run uncompiled. To compile it once, keep that state in a jax array that the "
        "function returns, or change the array outside the function."
    )


def test_a_function_writing_the_same_values_is_compiled_once_they_are_there():
    buf = np.zeros(3)
    traces = []

    def loss(w):
        traces.append(1)
        buf[:] = 2.0  # the first call changes it; later calls write what is there
        return jnp.sum(w * buf)

    with pytest.warns(tg.RetraceWarning, match="changes a numpy array it captures"):
        gs = [np.asarray(tg.gradient(loss, W)[0]).tolist() for _ in range(4)]
    assert gs == [[2.0, 2.0, 2.0]] * 4
    # The failed trace, the one that changed buf, then one more that left it alone.
    assert len(traces) == 3


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_implicit_mode_reads_a_numpy_scale_as_a_value_beside_its_parameters():
    model = {"p": jnp.array([1.0, 2.0])}
    scale = np.array([3.0])
    ps = tg.params(model)
    loss = lambda: jnp.sum(model["p"] ** 2) * float(scale[0])
    p = model["p"]
    np.testing.assert_allclose(tg.gradient(loss, ps)[p], 6.0 * p)
    scale[0] = 5.0
    np.testing.assert_allclose(tg.gradient(loss, ps)[p], 10.0 * p)
    # In a compiled implicit step, as uncompiled.
    state = tg.setup(optax.sgd(0.01), ps)

    @tg.jit
    def step():
        tg.update_(state, ps, tg.gradient(loss, ps))

    step()
    np.testing.assert_allclose(model["p"], 0.9 * p, rtol=1e-6)


def test_a_parameter_used_as_a_python_value_is_still_the_clear_error():
    """Parameters are differentiated, so they stay traced inputs: no value to read."""
    model = {"p": jnp.array([1.0, 2.0])}
    ps = tg.params(model)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"concrete Python value is needed.*captured arrays"):
            tg.gradient(lambda: jnp.sum(model["p"]) * float(model["p"][0]), ps)


def test_an_unrelated_error_is_raised_as_it_was():
    """A trace that fails for another reason fails read either way: its own error."""
    a = np.ones(3)
    with pytest.raises(TypeError, match="mul got incompatible shapes") as first:
        tg.gradient(lambda w: jnp.sum(w * jnp.ones(4)) * a[0], W)
    with pytest.raises(TypeError, match="mul got incompatible shapes") as again:
        tg.gradient(lambda w: jnp.sum(w * jnp.ones(4)) * a[0], W)
    assert str(first.value) == str(again.value)


def test_an_array_the_trace_did_not_change_keeps_its_identity_and_contents():
    """The trace works on a copy; the user's array object is the one left in place."""
    mask = np.array([True, False, True])
    holder = {"mask": mask}
    g = tg.gradient(lambda w: jnp.sum(w[holder["mask"]]), W)[0]
    assert holder["mask"] is mask
    assert mask.tolist() == [True, False, True]
    assert np.asarray(g).tolist() == [1.0, 0.0, 1.0]


def test_traces_for_a_change_elsewhere_are_not_blamed_on_unchanged_numpy_values():
    """A function reading a numpy mask as a value, traced again because a number it
    reads changed (its numpy arrays did not): no warning that its numpy arrays keep
    changing. (It named arrays, reached through `sys.modules`, that never changed.)"""
    mask = np.array([True, False, True])
    cfg = {"scale": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(6):
            cfg["scale"] = float(k + 1)
            g = tg.gradient(lambda w: jnp.sum(w[mask]) * cfg["scale"], W)[0]
            np.testing.assert_allclose(g, np.where(mask, k + 1.0, 0.0), rtol=1e-6)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_a_numpy_batch_that_changes_each_step_beside_a_numpy_mask_is_said():
    """The mask makes the function read its numpy arrays as values; the batch then
    changes on every step and costs a trace each time: correct, and said once."""
    mask = np.array([True, False, True])
    batches = [np.random.default_rng(i).random(3) for i in range(6)]
    with pytest.warns(tg.RetraceWarning) as caught:
        for xb in batches:
            g = tg.gradient(lambda w: jnp.sum(w[mask] * xb[mask]), W)[0]  # noqa: B023
            np.testing.assert_allclose(g, np.where(mask, xb, 0.0), rtol=1e-6)
    assert [str(w.message) for w in caught] == [
        "tg.gradient: test_a_numpy_batch_that_changes_each_step_beside_a_numpy_mask_is_said"
        ".<locals>.<lambda> needs the numpy arrays it captures as numpy values (mask, "
        "xb), so they are compared on each call, and they changed: it was traced 4 times. "
        "Each change costs a trace. Pass an array that changes each step as a jax array "
        "(jnp.asarray(x)) or as an argument, and keep numpy for what stays fixed (a mask)."
    ]
    # Done as the warning says: compiled once.
    traces = []

    def loss(w, xb):
        traces.append(1)
        return jnp.sum(w[mask] * xb[mask])

    for xb in batches:
        xj = jnp.asarray(xb)
        g = tg.gradient(lambda w: loss(w, xj), W)[0]  # noqa: B023
        np.testing.assert_allclose(g, np.where(mask, xb, 0.0), rtol=1e-6)
    assert len(traces) == 2  # the failed trace with the mask as an input, and one


class _Bufs:
    def __init__(self):
        self.buf = np.array([1.0, 2.0, 3.0])
        self.bufs = [np.array([1.0, 2.0, 3.0])]


def _aliased(route):
    """A loss that adds 1 in place to a captured numpy array through a local name bound
    to it, then reads it: the array it returns, and the loss."""
    o = _Bufs()
    buf = o.buf

    def closure(w):
        b = buf
        b += 1.0
        return jnp.sum(w * buf)

    def attribute(w):
        h = o.buf
        h += 1.0
        return jnp.sum(w * o.buf)

    def item(w):
        c = o.bufs[0]
        c += 1.0
        return jnp.sum(w * o.bufs[0])

    def loop(w):
        for p in o.bufs:
            p += 1.0
        return jnp.sum(w * o.bufs[0])

    fns = {"closure": closure, "attribute": attribute, "item": item, "loop": loop}
    return (o.bufs[0] if route in ("item", "loop") else o.buf), fns[route]


@pytest.mark.parametrize("route", ["closure", "attribute", "item", "loop"])
def test_in_place_arithmetic_through_another_name(route):
    """`b = buf; b += 1`: numpy adds into `buf`; on a tracer it rebinds `b` only, and
    every call gave the first gradient with `buf` unchanged. The code's in-place
    operator on a name bound to a value read from elsewhere now has the function's
    captured numpy arrays read as values (`_codeinfo`), as `buf.sort()` does."""

    def run(grad):
        buf, loss = _aliased(route)
        return [np.asarray(grad(loss)).tolist() for _ in range(3)], buf.tolist()

    got = run(_tg)
    assert got == run(lambda loss: jax.grad(loss)(W))
    assert got == ([[2.0, 3.0, 4.0], [3.0, 4.0, 5.0], [4.0, 5.0, 6.0]], [4.0, 5.0, 6.0])


def test_in_place_arithmetic_on_a_local_accumulator_keeps_numpy_arrays_inputs():
    """`total = 0.0; total += ...` binds no value read from elsewhere: the captured numpy
    data stays a traced input (one trace, fresh when changed in place)."""
    data = np.array([1.0, 2.0, 3.0])
    traces = []

    def loss(w):
        traces.append(1)
        total = 0.0
        for k in range(2):
            total += jnp.sum(w * data) * k
        return total

    for _ in range(3):
        np.testing.assert_allclose(_tg(loss), data)
    data[0] = 5.0
    np.testing.assert_allclose(_tg(loss), data)
    assert len(traces) == 1


def _in_place_through(holder, grad):
    """Gradients over two calls of a loss reading `buf` through `holder`, with `buf`
    changed in place between them (and the user's `buf` after)."""
    buf = np.array([1.0, 2.0, 3.0])
    if holder == "deque":
        box = collections.deque([buf])
        read = lambda: box[0]
    elif holder == "MappingProxyType":
        box = types.MappingProxyType({"b": buf})
        read = lambda: box["b"]
    else:
        box = collections.ChainMap({"a": 1.0}, {"b": buf})
        read = lambda: box["b"]
    out = []
    for _ in range(2):
        out.append(np.asarray(grad(lambda w: jnp.sum(w * read()))).tolist())
        buf += 1.0
    return out, buf.tolist()


@pytest.mark.parametrize("holder", ["deque", "MappingProxyType", "ChainMap"])
def test_numpy_array_in_an_opaque_container_changed_in_place(holder):
    """A numpy array in a deque or a Mapping that is not a dict is compared by value on
    each call (such a container's items are compared by identity: this one is the same
    object), and traced on a copy written in its place: jax keeps the conversion of a
    numpy constant by the array object while a trace holding it is alive (plain jax
    too: `jax.make_jaxpr(f)(w)`, `buf += 1`, then `jnp.asarray(buf)` gives the old
    values; jax 0.10.2 and 0.12), so the user's own array, traced again, would give
    its old contents."""
    got = _in_place_through(holder, _tg)
    assert got == ([[1.0, 2.0, 3.0], [2.0, 3.0, 4.0]], [3.0, 4.0, 5.0])
    assert got == _in_place_through(holder, lambda loss: jax.grad(loss)(W))


def test_numpy_array_in_a_deque_the_function_changes_in_place():
    """The function adds into the deque's array while traced (into the copy): the user's
    array gets the change, as uncompiled, and the next call reads the new contents."""

    def run(grad):
        box = collections.deque([np.array([1.0, 2.0, 3.0])])

        def loss(w):
            box[0] += 1.0  # numpy's in-place add, then the same array stored back
            return jnp.sum(w * box[0])

        return [np.asarray(grad(loss)).tolist() for _ in range(3)], box[0].tolist()

    got = run(_tg)
    assert got == run(lambda loss: jax.grad(loss)(W))
    assert got == ([[2.0, 3.0, 4.0], [3.0, 4.0, 5.0], [4.0, 5.0, 6.0]], [4.0, 5.0, 6.0])


class _Slots:
    __slots__ = ("buf",)

    def __init__(self, buf):
        self.buf = buf


@pytest.mark.parametrize("where", ["attribute", "slots", "dict", "global", "nonlocal"])
def test_a_new_numpy_array_bound_in_place_of_a_value_read_one_stays(where):
    """The function sorts its array in place (so the arrays are read as values), then
    binds a new numpy array in its place: that new array is what the caller sees after
    the call, and what the next call reads, as uncompiled."""

    def run(grad):
        global _BUF
        holder = types.SimpleNamespace(buf=np.array([2.0, 1.0, 3.0]))
        slots = _Slots(np.array([2.0, 1.0, 3.0]))
        d = {"buf": np.array([2.0, 1.0, 3.0])}
        _BUF = np.array([2.0, 1.0, 3.0])
        buf = np.array([2.0, 1.0, 3.0])

        def loss(w):
            global _BUF
            nonlocal buf
            if where == "attribute":
                holder.buf.sort()
                holder.buf = holder.buf + 1.0
                now = holder.buf
            elif where == "slots":
                slots.buf.sort()
                slots.buf = slots.buf * 3.0
                now = slots.buf
            elif where == "dict":
                d["buf"].sort()
                d["buf"] = d["buf"] * 2.0
                now = d["buf"]
            elif where == "global":
                _BUF.sort()
                _BUF = _BUF - 1.0
                now = _BUF
            else:
                buf.sort()
                buf = buf / 2.0
                now = buf
            return jnp.sum(w * now)

        out = [np.asarray(grad(loss)).tolist() for _ in range(3)]
        after = [holder.buf, slots.buf, d["buf"], _BUF, buf]
        return out, [a.tolist() for a in after]

    assert run(_tg) == run(lambda loss: jax.grad(loss)(W))
