"""A function that draws from a Python random state while traced (`np.random.rand`,
`random.random`, a `np.random.Generator` it captures): compiled, its first draw would be
repeated on every call (the same noise, the same dropout mask). It is traced again on
every call instead, drawing afresh exactly as the uncompiled function does, and a
`tg.RetraceWarning` says so once (`treegrad/_draws.py`). The same for an item taken
from an iterator the function captures (`next(batches)`)."""

import collections
import itertools
import queue
import random
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

W = jnp.array([1.0, -2.0, 3.0])
KEY = jax.random.key(5)


class MyRandom(random.Random):
    pass


class Holder:
    def __init__(self, rng):
        self.rng = rng


def _sources():
    """(name, reseed, draw(n) -> numpy array, label in the message) per random state."""
    gen = np.random.default_rng(0)
    rs = np.random.RandomState(0)
    pyr = random.Random(0)
    mine = MyRandom(0)
    held = Holder(np.random.default_rng(0))
    bound = gen.normal
    return [
        (
            "numpy global",
            lambda: np.random.seed(0),
            lambda n: np.random.rand(n),
            r"numpy's global random state \(np\.random\.rand\.\.\.\)",
        ),
        (
            "python global",
            lambda: random.seed(0),
            lambda n: np.array([random.random() for _ in range(n)]),
            r"Python's global random state \(random\.random\.\.\.\)",
        ),
        (
            "Generator",
            lambda: setattr(
                gen.bit_generator, "state", np.random.default_rng(0).bit_generator.state
            ),
            lambda n: gen.normal(size=n),
            r"a numpy\.Generator it captures",
        ),
        (
            "bound method",
            lambda: setattr(
                gen.bit_generator, "state", np.random.default_rng(0).bit_generator.state
            ),
            lambda n: bound(size=n),
            r"a numpy\.Generator it captures",
        ),
        (
            "RandomState",
            lambda: rs.seed(0),
            lambda n: rs.rand(n),
            r"a numpy\.RandomState it captures",
        ),
        (
            "random.Random",
            lambda: pyr.seed(0),
            lambda n: np.array([pyr.random() for _ in range(n)]),
            r"a random\.Random it captures",
        ),
        (
            "subclass",
            lambda: mine.seed(0),
            lambda n: np.array([mine.gauss(0, 1) for _ in range(n)]),
            r"a MyRandom it captures",
        ),
        (
            "attribute",
            lambda: setattr(
                held.rng.bit_generator, "state", np.random.default_rng(0).bit_generator.state
            ),
            lambda n: held.rng.normal(size=n),
            r"a numpy\.Generator it captures",
        ),
    ]


SOURCES = _sources()


def _message(api, label):
    return (
        rf"^{api}: \S+ draws from {label} while traced\. Compiled, that draw would be the same "
        r"on every call, so the function is traced again on every call, to draw afresh as it "
        r"would uncompiled\. To compile it once, draw with jax\.random from a key you pass in "
        r"and split each step \(`key, sub = jax\.random\.split\(key\)`\), or draw outside the "
        r"function and pass the values in\.$"
    )


def _table(rows, apis, default_rows, default_api):
    """`(row, api)` pairs; those off the default row and the default api are slow (the
    whole table runs in the slow selection, a cross of it by default)."""
    return [
        pytest.param(
            row,
            api,
            id=f"{api}-{name}",
            marks=() if name in default_rows or api == default_api else pytest.mark.slow,
        )
        for api in apis
        for name, row in rows
    ]


@pytest.mark.parametrize(
    ("source", "api"),
    _table(
        [(s[0], s) for s in SOURCES],
        ["tg.gradient", "tg.withgradient", "tg.jit", "implicit"],
        ("numpy global", "Generator"),
        "tg.gradient",
    ),
)
def test_each_call_draws_afresh_as_uncompiled(source, api):
    _, reseed, draw, label = source

    def loss(w):
        return jnp.sum(w * jnp.asarray(draw(3), jnp.float32) ** 2)

    # The reference: jax.grad, uncompiled, from the same state.
    reseed()
    with jax.disable_jit():
        ref = [np.asarray(jax.grad(loss)(W)) for _ in range(3)]
    assert not np.allclose(ref[0], ref[1])  # the draws differ call to call

    reseed()
    ps = tg.Params([W])
    step = tg.jit(lambda w: jax.grad(loss)(w))
    run = {
        "tg.gradient": lambda: tg.gradient(loss, W)[0],
        "tg.withgradient": lambda: tg.withgradient(lambda w: loss(w), W)[1][0],
        "tg.jit": lambda: step(W),
        "implicit": lambda: tg.gradient(lambda: loss(W), ps)[W],
    }[api]
    name = "tg.gradient" if api == "implicit" else api
    with pytest.warns(tg.RetraceWarning, match=_message(name.replace(".", r"\."), label)) as w:
        got = [np.asarray(run()) for _ in range(3)]
    assert len([x for x in w if issubclass(x.category, tg.RetraceWarning)]) == 1  # once
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6)


def _traced_once_reading(held):
    """A loss that captures `held` without drawing from it: traced once, never warned."""
    traces = []

    def loss(w):
        traces.append(1)
        return jnp.sum(w**2) if held is not None else 0.0

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            np.testing.assert_allclose(tg.gradient(loss, W)[0], 2 * W)
    assert len(traces) == 1


def test_a_function_that_draws_nothing_is_traced_once_and_not_warned():
    _traced_once_reading(np.random.default_rng(0))  # captured, never drawn from


def test_a_draw_on_the_first_call_only_is_cached_from_the_second_trace():
    # Lazy initialisation from numpy's global generator: only the trace that draws is
    # not reused; the next one draws nothing and is cached, as uncompiled it reads the
    # value drawn the first time.
    box = {}
    traces = []

    def loss(w):
        traces.append(1)
        if "noise" not in box:
            box["noise"] = np.random.normal(size=3).tolist()
        return jnp.sum(w * jnp.asarray(box["noise"]))

    np.random.seed(3)
    got = []
    with pytest.warns(tg.RetraceWarning, match="draws from numpy's global random state"):
        for _ in range(4):
            got.append(tg.gradient(loss, W)[0])
    np.random.seed(3)
    ref = np.random.normal(size=3)
    for g in got:
        np.testing.assert_allclose(g, ref, rtol=1e-6)
    assert len(traces) == 2


def test_a_generator_made_and_seeded_inside_the_function_is_deterministic():
    # Not a captured state: every call draws the same values, so one trace is right.
    traces = []

    def loss(w):
        traces.append(1)
        return jnp.sum(w * jnp.asarray(np.random.default_rng(3).normal(size=3), jnp.float32))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            g = tg.gradient(loss, W)[0]
    np.testing.assert_allclose(g, np.random.default_rng(3).normal(size=3), rtol=1e-6)
    assert len(traces) == 1


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_noise_injected_with_numpy_trains_as_the_uncompiled_loop():
    # A PyTorch habit: input noise drawn with numpy inside the loss. Compiled once, every
    # step would see the first step's noise.
    x = jnp.linspace(-1.0, 1.0, 8)
    y = 3.0 * x

    def loss(m):
        noise = np.random.normal(scale=0.1, size=8).astype(np.float32)
        return jnp.mean((m["a"] * (x + noise) - y) ** 2)

    def train(grad_fn):
        np.random.seed(7)
        m = {"a": jnp.array(0.5)}
        rule = optax.sgd(0.1)
        st = rule.init(m)
        for _ in range(5):
            g = grad_fn(m)
            u, st = rule.update(g, st)
            m = optax.apply_updates(m, u)
        return m["a"]

    with jax.disable_jit():
        ref = train(jax.grad(loss))
    with pytest.warns(tg.RetraceWarning, match="numpy's global random state"):
        got = train(lambda m: tg.gradient(loss, m)[0])
    np.testing.assert_allclose(got, ref, rtol=1e-6)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_a_draw_first_made_when_a_captured_array_changes_shape():
    # A captured array's new shape makes jax trace the cached program again, and that
    # trace takes a branch that draws: its program is not reused (it was, with the draw
    # baked in, before `_engine._reread` asked whether the new trace may be cached).
    cap = {"v": jnp.ones(3)}

    def loss(w):
        noise = np.random.rand() if cap["v"].shape[0] == 4 else 1.0
        return jnp.sum(w) * jnp.sum(cap["v"]) * noise

    w = jnp.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [float(tg.gradient(loss, w)[0][0]) for _ in range(2)] == [3.0, 3.0]
    cap["v"] = jnp.ones(4)
    with pytest.warns(tg.RetraceWarning, match="draws from numpy's global random state"):
        got = [float(tg.gradient(loss, w)[0][0]) for _ in range(4)]
    assert len(set(got)) == 4  # a new draw each call
    assert all(0.0 <= g / 4.0 < 1.0 for g in got)  # 4 * rand()
    cap["v"] = jnp.ones(3)
    assert [float(tg.gradient(loss, w)[0][0]) for _ in range(2)] == [3.0, 3.0]


# --- iterators -------------------------------------------------------------------------

ITEMS = [np.array([1.0, 2.0, 0.5]), np.array([3.0, -1.0, 2.0]), np.array([0.0, 4.0, 1.0])]


def _generator():
    yield from ITEMS


def _looping_generator():
    for item in ITEMS:  # noqa: UP028 -- a loop variable in the frame, unlike `yield from`
        yield item


ITERATORS = {
    "list_iterator": lambda: iter(ITEMS),
    "tuple_iterator": lambda: iter(tuple(ITEMS)),
    "numpy rows": lambda: iter(np.stack(ITEMS)),
    "generator": _looping_generator,
    "yield from": _generator,
    "generator expression": lambda: (x * 1.0 for x in ITEMS),
    "itertools.cycle": lambda: itertools.cycle(ITEMS),
    "itertools.islice": lambda: itertools.islice(ITEMS, 3),
    "itertools.chain": lambda: itertools.chain(ITEMS[:1], ITEMS[1:]),
    "map": lambda: map(np.asarray, ITEMS),
    "zip": lambda: (a for a, _ in zip(ITEMS, range(3), strict=True)),
    "enumerate": lambda: (a for _, a in enumerate(ITEMS)),
    "dict values": lambda: iter(dict(enumerate(ITEMS)).values()),
}


@pytest.mark.parametrize(
    ("make", "api"),
    _table(list(ITERATORS.items()), ["tg.gradient", "tg.jit"], ("generator",), "tg.gradient"),
)
def test_each_call_takes_the_next_item_as_uncompiled(make, api):
    # `next(batches)` inside the loss: compiled once, every call would see the first batch.
    def run(grad, batches):
        loss = lambda w: jnp.sum(w**2 * jnp.asarray(next(batches), jnp.float32))
        return [np.asarray(grad(loss)) for _ in range(3)]

    ref = run(lambda loss: jax.grad(loss)(W), make())
    with jax.disable_jit():
        np.testing.assert_allclose(ref, run(lambda loss: jax.grad(loss)(W), make()))
    assert not np.allclose(ref[0], ref[1])
    compiled = {
        "tg.gradient": lambda loss: tg.gradient(loss, W)[0],
        "tg.jit": lambda loss: tg.jit(lambda w: jax.grad(loss)(w))(W),
    }[api]
    with pytest.warns(tg.RetraceWarning) as caught:
        got = run(compiled, make())
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages  # once, and not the hidden-array warning
    assert re.fullmatch(
        re.escape(api) + r": \S+ takes items from an? \S+ it captures while traced\. "
        r"Compiled, that item would be the same on every call, so the function is traced "
        r"again on every call, to take the next item as it would uncompiled\. To compile it "
        r"once, take the items outside the function and pass them in \(`x, y = "
        r"next\(batches\)`, then `tg\.gradient\(lambda m: loss\(m, x, y\), model\)`\)\.",
        messages[0],
    ), messages[0]
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6)


def test_itertools_count_is_named():
    counter = itertools.count(1)
    with pytest.warns(tg.RetraceWarning, match=r"takes items from an itertools\.count it captures"):
        got = [float(tg.gradient(lambda w: jnp.sum(w) * next(counter), W)[0][0]) for _ in range(3)]
    assert got == [1.0, 2.0, 3.0]


def test_an_iterator_captured_but_not_advanced_is_traced_once():
    batches = iter(ITEMS)
    _traced_once_reading(batches)
    assert next(batches) is ITEMS[0]


def test_a_generator_that_yields_the_same_object_is_traced_once():
    # Its position does not move (the same instruction, the same locals): every call
    # would take the same item uncompiled too, so one trace is right.
    scale = np.array([2.0, 2.0, 2.0])

    def forever():
        while True:
            yield scale

    source = forever()
    next(source)
    traces = []

    def loss(w):
        traces.append(1)
        return jnp.sum(w * jnp.asarray(next(source), jnp.float32))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            np.testing.assert_allclose(tg.gradient(loss, W)[0], scale)
    assert len(traces) == 1


def test_a_users_iterator_class_gives_the_next_item_each_call():
    # Its position is an attribute of the user's object, which the function changes
    # itself while traced: a number it can read, so each call reads it afresh, as
    # uncompiled (before, the second call reused the first item, silently).
    class Loader:
        def __init__(self):
            self.i = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.i += 1
            return ITEMS[self.i - 1]

    loader = Loader()
    with pytest.warns(tg.RetraceWarning, match=r"changes values it can read .*'i' of a"):
        got = [tg.gradient(lambda w: jnp.sum(w * next(loader)), W)[0] for _ in range(3)]
    np.testing.assert_allclose(np.stack(got), np.stack(ITEMS[:3]))
    assert loader.i == 3


def test_rows_of_a_jax_array_taken_inside_the_function_are_a_clear_error():
    # jax's own iterator over an array slices it lazily, so the first trace computes the
    # rows (as its tracers) into the iterator: the next call's row is a value of a trace
    # that is over. Named as such, never a stale or wrong gradient.
    rows = iter(jnp.asarray(np.stack(ITEMS)))
    loss = lambda w: jnp.sum(w**2 * next(rows))
    with pytest.warns(tg.RetraceWarning, match="takes items from a generator it captures"):
        np.testing.assert_allclose(tg.gradient(loss, W)[0], 2 * W * ITEMS[0], rtol=1e-6)
    with pytest.raises(TypeError, match="reads a traced value through a place treegrad cannot"):
        tg.gradient(loss, W)


def _noise(n):
    return np.random.normal(size=n)  # a helper of the user's: walked with the function


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_a_helper_that_draws_is_seen_and_another_threads_draws_are_not():
    # Only the states the function's code may reach are compared, so a data loader's
    # thread drawing from numpy's generator meanwhile does not make a function that
    # never draws trace again on every call (it did, before the states were chosen by
    # what the function reads).
    stop = threading.Event()

    def augment():
        while not stop.is_set():
            np.random.rand(8)
            random.random()

    worker = threading.Thread(target=augment, daemon=True)
    worker.start()
    try:
        traces = []

        def pure(w):
            # jax.random reads an attribute named `random` too, but reaches no numpy.
            traces.append(1)
            return jnp.sum(jnp.sin(w) ** 2) + jnp.sum(w * jax.random.normal(KEY, (3,)))

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(5):
                ref = jax.grad(pure)(W)
                np.testing.assert_allclose(tg.gradient(pure, W)[0], ref, rtol=1e-6)
        assert len(traces) == 6  # 5 by jax.grad, 1 by treegrad
        with pytest.warns(tg.RetraceWarning, match="numpy's global random state"):
            got = [tg.gradient(lambda w: jnp.sum(w * _noise(3)), W)[0] for _ in range(3)]
        assert not np.allclose(got[0], got[1])
    finally:
        stop.set()
        worker.join()


# --- containers the function takes entries out of ----------------------------------------

CONSUMERS = {
    "list.pop": (list, lambda c: c.pop()),
    "list.pop(0)": (list, lambda c: c.pop(0)),
    "del list[0]": (list, lambda c: (c[0], c.__delitem__(0))[0]),
    "dict.popitem": (lambda xs: dict(enumerate(xs)), lambda c: c.popitem()[1]),
    "dict.pop": (lambda xs: dict(enumerate(xs)), lambda c: c.pop(min(c))),
    "OrderedDict.popitem": (
        lambda xs: collections.OrderedDict(enumerate(xs)),
        lambda c: c.popitem(last=False)[1],
    ),
    "defaultdict.pop": (
        lambda xs: collections.defaultdict(float, enumerate(xs)),
        lambda c: c.pop(min(c)),
    ),
    "dict with __missing__": (lambda xs: _AutoDict(enumerate(xs)), lambda c: c.pop(min(c))),
    "deque.popleft": (collections.deque, lambda c: c.popleft()),
    "queue.Queue.get": (lambda xs: _queue(xs), lambda c: c.get_nowait()),
}


class _AutoDict(dict):
    """Fills a missing key (its `__missing__`): putting the arrays back must not add the
    key the function took out (it did, with its entry, before `_swap._at`)."""

    def __missing__(self, key):
        self[key] = 0.0
        return 0.0


def _queue(xs):
    q = queue.Queue()
    for x in xs:
        q.put(x)
    return q


def _size(c):
    return c.qsize() if isinstance(c, queue.Queue) else len(c)


@pytest.mark.parametrize(
    ("consumer", "kind"),
    _table(list(CONSUMERS.items()), ["jax", "numpy", "float"], ("list.pop",), "jax"),
)
def test_entries_taken_out_of_a_captured_container_as_uncompiled(consumer, kind):
    # `batch = batches.pop()` inside the loss. Before: a list or dict of arrays crashed
    # (IndexError from putting the arrays back at their old places, or the popped entry
    # put back), and a deque, a Queue or numbers gave the first entry on every call.
    make, take = consumer
    items = {
        "numpy": [np.array([1.0, 2.0, 0.5]), np.array([3.0, -1.0, 2.0]), np.array([0.0, 4.0, 1.0])],
        "jax": [
            jnp.array([1.0, 2.0, 0.5]),
            jnp.array([3.0, -1.0, 2.0]),
            jnp.array([0.0, 4.0, 1.0]),
        ],
        "float": [2.0, -3.0, 5.0],
    }[kind]

    def run(grad, batches):
        loss = lambda w: jnp.sum(w**2 * take(batches))
        return [np.asarray(grad(loss)) for _ in range(2)], batches

    ref, left_ref = run(lambda loss: jax.grad(loss)(W), make(items))
    with pytest.warns(
        tg.RetraceWarning, match=r"takes items from an? \w+ it captures \(entries taken out\)"
    ):
        got, left = run(lambda loss: tg.gradient(loss, W)[0], make(items))
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6)
    assert _size(left) == _size(left_ref) == 1  # what the calls took is gone, as uncompiled
    last = (
        left.get_nowait()
        if isinstance(left, queue.Queue)
        else next(iter(left.values() if isinstance(left, dict) else left))
    )
    assert not isinstance(last, jax.core.Tracer)
    expected = (
        left_ref.get_nowait()
        if isinstance(left_ref, queue.Queue)
        else next(iter(left_ref.values() if isinstance(left_ref, dict) else left_ref))
    )
    assert last is expected or np.array_equal(last, expected)


def test_a_list_of_arrays_popped_inside_a_compiled_step():
    # The arrays left in the list are the user's own (not tracers), at their new places.
    batches = [jnp.full(3, float(i)) for i in range(4)]
    kept = list(batches)

    @tg.jit
    def step(w):
        return jnp.sum(w * batches.pop(0))

    with pytest.warns(tg.RetraceWarning, match=r"takes items from a list it captures"):
        got = [float(step(W)) for _ in range(2)]
    assert got == [float(jnp.sum(W * kept[0])), float(jnp.sum(W * kept[1]))]
    assert len(batches) == 2 and batches[0] is kept[2] and batches[1] is kept[3]


def test_a_log_file_written_inside_is_not_taken_for_an_iterator(tmp_path):
    # Writing is a side effect while traced (as with jax.jit), not items taken: one trace.
    traces = []
    with open(tmp_path / "log.txt", "w") as log:

        def loss(w):
            traces.append(1)
            log.write("traced\n")
            return jnp.sum(w**2)

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                np.testing.assert_allclose(tg.gradient(loss, W)[0], 2 * W)
    assert len(traces) == 1


def test_a_file_read_line_by_line_inside_gives_the_next_line(tmp_path):
    path = tmp_path / "scales.txt"
    path.write_text("1.5\n-2\n4\n")
    with (
        open(path) as src,
        pytest.warns(tg.RetraceWarning, match="takes items from a TextIOWrapper"),
    ):
        got = [
            float(tg.gradient(lambda w: jnp.sum(w) * float(src.readline()), W)[0][0])
            for _ in range(3)
        ]
    assert got == [1.5, -2.0, 4.0]


def test_a_generator_whose_locals_hold_themselves():
    # Its position is read through its locals: a list holding itself must not recurse.
    def batches():
        box = [1.0]
        box.append(box)
        for i in range(3):
            yield float(i + 1)

    source = batches()
    with pytest.warns(tg.RetraceWarning, match="takes items from a generator"):
        got = [float(tg.gradient(lambda w: jnp.sum(w) * next(source), W)[0][0]) for _ in range(3)]
    assert got == [1.0, 2.0, 3.0]


class _Stack(tg.Module):
    def __init__(self):
        self.layers = [nn.Dense(2, 2, key=jax.random.key(i)) for i in range(4)]


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_layers_popped_or_swapped_in_a_captured_model_keep_their_own_weights():
    # The arrays put in the model for the trace were put back by position: after
    # `model.layers.pop(0)` every remaining layer got the weights of the one before it,
    # silently (and a swap of two layers swapped their weights back). Now each goes back
    # to the layer that holds it, as uncompiled.
    x = jnp.ones((1, 2))

    def run(grad):
        m = _Stack()

        def pop(w):
            layer = m.layers.pop(0)
            return jnp.sum(layer(x) * w)

        def swap(w):
            m.layers[0], m.layers[1] = m.layers[1], m.layers[0]
            return jnp.sum(m.layers[0](x) * w)

        grads = [np.asarray(grad(pop)) for _ in range(2)] + [
            np.asarray(grad(swap)) for _ in range(3)
        ]
        return grads, m

    ref, m_ref = run(lambda f: jax.grad(f)(jnp.ones(2)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        got, m = run(lambda f: tg.gradient(f, jnp.ones(2))[0])
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6)
    assert len(m.layers) == len(m_ref.layers) == 2
    for a, b in zip(jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(m_ref), strict=True):
        assert not isinstance(a, jax.core.Tracer)
        np.testing.assert_array_equal(a, b)


_BATCHES = []


def _take_from_global(w):
    global _BATCHES
    first, _BATCHES = _BATCHES[0], _BATCHES[1:]
    return jnp.sum(w**2 * first)


@pytest.mark.parametrize("where", ["global", "attribute", "nonlocal", "dict entry"])
def test_a_captured_list_rebound_to_a_slice_of_itself(where):
    # `batches = batches[1:]` on a captured variable: the new list held the trace's
    # values in place of the user's arrays, so the user's state held tracers after the
    # call and the next call failed with UnexpectedTracerError. The user's own arrays
    # are now in the new list, as uncompiled.
    global _BATCHES
    items = [jnp.full(3, float(i + 1)) for i in range(3)]

    class Holder:
        pass

    holder, box = Holder(), {}

    def make():
        nonlocal_batches = list(items)

        def take(w):
            nonlocal nonlocal_batches
            first, nonlocal_batches = nonlocal_batches[0], nonlocal_batches[1:]
            return jnp.sum(w**2 * first)

        return take, lambda: nonlocal_batches

    def from_attribute(w):
        first, holder.batches = holder.batches[0], holder.batches[1:]
        return jnp.sum(w**2 * first)

    def from_dict(w):
        first, box["batches"] = box["batches"][0], box["batches"][1:]
        return jnp.sum(w**2 * first)

    _BATCHES, holder.batches, box["batches"] = list(items), list(items), list(items)
    take_nonlocal, left_nonlocal = make()
    loss, left = {
        "global": (_take_from_global, lambda: _BATCHES),
        "attribute": (from_attribute, lambda: holder.batches),
        "nonlocal": (take_nonlocal, left_nonlocal),
        "dict entry": (from_dict, lambda: box["batches"]),
    }[where]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        got = [tg.gradient(loss, W)[0] for _ in range(2)]
    for k, g in enumerate(got):
        np.testing.assert_allclose(g, 2 * W * items[k], rtol=1e-6)
    assert len(left()) == 1 and left()[0] is items[2]  # the user's own array, not a tracer


_LAST_SEEN = None


@pytest.mark.parametrize("api", ["tg.gradient", "tg.jit"])
def test_captured_arrays_stored_by_the_function_stay_as_uncompiled(api):
    # `history.append(model["w"])`, `tracker.best = model["w"]`, a default filled in a
    # dict, a global: the stored value is one of the function's own inputs, so the
    # user's array (not a tracer, not nothing) is what uncompiled leaves there. These
    # were taken out again (a history that stayed empty), or left as a tracer of the
    # trace that the next call tripped over (UnexpectedTracerError).
    global _LAST_SEEN

    class Tracker:
        best = None

    def run(grad):
        global _LAST_SEEN
        _LAST_SEEN = None
        model = {"w": jnp.array([1.0, 2.0, 3.0])}
        history, saved, tracker = [], {}, Tracker()

        def loss(v):
            global _LAST_SEEN
            history.append(model["w"])
            tracker.best = model["w"]
            saved.setdefault("w0", model["w"])
            _LAST_SEEN = model["w"]
            return jnp.sum(v * model["w"])

        grads, seen = [], []
        for _ in range(3):
            grads.append(np.asarray(grad(loss)))
            seen.append(model["w"])
            model["w"] = model["w"] + 1.0
        return grads, seen, history, saved, tracker, _LAST_SEEN

    ref = run(lambda loss: jax.grad(loss)(jnp.ones(3)))
    compiled = {
        "tg.gradient": lambda loss: tg.gradient(loss, jnp.ones(3))[0],
        "tg.jit": lambda loss: tg.jit(lambda v: jax.grad(loss)(v))(jnp.ones(3)),
    }[api]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads, seen, history, saved, tracker, last = run(compiled)
    for g, r in zip(grads, ref[0], strict=True):
        np.testing.assert_allclose(g, r)
    assert len(history) == 3
    for h, s in zip(history, seen, strict=True):
        assert not isinstance(h, jax.core.Tracer)
        np.testing.assert_array_equal(h, s)
    assert saved["w0"] is seen[0]  # the user's own array, filled on the first call
    np.testing.assert_array_equal(tracker.best, seen[2])
    np.testing.assert_array_equal(last, seen[2])
    assert not any(isinstance(x, jax.core.Tracer) for x in (tracker.best, last))


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_a_history_of_weights_kept_by_a_compiled_implicit_step():
    # The weights before each update, appended by the step: the user's arrays, as the
    # step run uncompiled leaves them (the second call raised a TypeError, "changed where
    # its arrays live", once the history held an array).
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))

    def setup():
        model = nn.Chain(
            nn.Dense(2, 3, key=jax.random.key(0)), nn.Dense(3, 1, key=jax.random.key(1))
        )
        ps = tg.params(model)
        return model, ps, tg.setup(optax.sgd(0.1), ps), []

    def body(model, ps, state, history):
        grads = tg.gradient(lambda: jnp.mean((model(x) - y) ** 2), ps)
        history.append(model[0].weight)
        tg.update_(state, ps, grads)

    model_ref, ps_ref, st_ref, hist_ref = setup()
    for _ in range(3):
        body(model_ref, ps_ref, st_ref, hist_ref)
    model, ps, state, history = setup()
    step = tg.jit(lambda: body(model, ps, state, history))
    for _ in range(3):
        step()
    assert len(history) == 3
    for h, r in zip(history, hist_ref, strict=True):
        assert not isinstance(h, jax.core.Tracer)
        np.testing.assert_allclose(h, r, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(model_ref), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_a_parameter_stored_by_an_implicit_loss_is_the_users_array():
    # In implicit mode the parameters sit on two layers of the trace's values (the
    # closure's, and the differentiated ones on them): both are taken off.
    model = nn.Chain(nn.Dense(2, 3, key=jax.random.key(0)), nn.Dense(3, 1, key=jax.random.key(1)))
    ps = tg.params(model)
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    snap = []

    def loss():
        snap.append(model[0].weight)
        return jnp.mean((model(x) - y) ** 2)

    grads = tg.gradient(loss, ps)
    assert len(snap) == 1 and snap[0] is model[0].weight
    ref = jax.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    np.testing.assert_allclose(grads[model[0].weight], ref[0].weight, rtol=1e-6)


def test_captured_numpy_array_shuffled_in_place():
    """A jax tracer cannot be shuffled in place: the array is read as a value instead
    (tests/test_numpy_values.py), and the draw the failed trace made is undone."""

    def run(grad):
        np.random.seed(0)
        order = np.array([1.0, 2.0, 3.0, 4.0, 5.0])

        def loss(w):
            np.random.shuffle(order)
            return jnp.sum(w) * float(order[0])

        return [float(grad(loss)[0]) for _ in range(3)]

    ref = run(lambda loss: jax.grad(loss)(W))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        assert run(lambda loss: tg.gradient(loss, W)[0]) == ref
