"""Python values the function changes itself while traced, and reads.

Before 2026-12-02 a value the function changed (a counter, a default it filled in, a
cached_property) was taken for its output and no longer checked: the next call reused
the first trace, so a loss scaled by a counter, a Python learning-rate schedule read
from `self.step`, or a default the user edited after the first call gave the old
result, silently. Each case here is compared with the same function run uncompiled
(`jax.disable_jit` + `jax.grad`), call after call, from the same starting state.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

W = jnp.array([1.0, -2.0, 0.5])
CHANGES = r"changes values it can read while traced"


def _run(make, calls, api="gradient"):
    """`calls` results of a fresh function from `make()` (its own state), through `api`."""
    f = make()
    out = []
    for _ in range(calls):
        if api == "gradient":
            out.append(np.asarray(tg.gradient(f, W)[0]))
        elif api == "withgradient":
            value, (g,) = tg.withgradient(f, W)
            out.append(np.append(np.asarray(g), float(value)))
        elif api == "jit":
            out.append(np.asarray(tg.jit(jax.grad(f))(W)))
        else:  # implicit
            ps = tg.Params([W])
            out.append(np.asarray(tg.gradient(lambda: f(W), ps)[W]))
    return out


def _reference(make, calls, api="gradient"):
    f = make()
    out = []
    with jax.disable_jit():
        for _ in range(calls):
            if api == "withgradient":
                value, g = jax.value_and_grad(f)(W)
                out.append(np.append(np.asarray(g), float(value)))
            else:
                out.append(np.asarray(jax.grad(f)(W)))
    return out


def _dict_doubling():
    d = {"a": 1.0}

    def f(v):
        d["a"] = d["a"] * 2
        return jnp.sum(v**2) * d["a"]

    return f


COUNTER = {"n": 0}


def _global_counter():
    COUNTER["n"] = 0

    def f(v):
        COUNTER["n"] += 1
        return jnp.sum(v**2) / COUNTER["n"]

    return f


def _helper_with_nonlocal():
    n = 0

    def lr():
        nonlocal n
        n += 1
        return 1.0 / n

    return lambda v: jnp.sum(v**2) * lr()


def _property_counter():
    class Sched:
        def __init__(self):
            self.k = 0

        @property
        def scale(self):
            self.k += 1
            return float(self.k)

    s = Sched()
    return lambda v: jnp.sum(v**2) * s.scale


def _python_schedule():
    class Trainer:
        step = 0  # a class attribute first, then the instance's own

    t = Trainer()

    def f(v):
        t.step += 1
        lr = 0.1 if t.step < 3 else 0.01
        return jnp.sum(v**2) * lr

    return f


def _list_entry_counter():
    box = [0]

    def f(v):
        box[0] += 1
        return jnp.sum(v**2) * box[0]

    return f


def _swapped_helper():
    fns = {"act": jnp.sin}

    def f(v):
        act = fns["act"]
        fns["act"] = jnp.cos if act is jnp.sin else jnp.sin  # alternates itself
        return jnp.sum(act(v))

    return f


CASES = {
    "dict-doubling": _dict_doubling,
    "global-counter": _global_counter,
    "helper-nonlocal": _helper_with_nonlocal,
    "property-counter": _property_counter,
    "python-schedule": _python_schedule,
    "list-entry": _list_entry_counter,
    "swapped-helper": _swapped_helper,
}


@pytest.mark.parametrize(
    "api", ["gradient", pytest.param("withgradient", marks=pytest.mark.slow), "implicit"]
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_value_the_function_changes_is_read_fresh_on_each_call(case, api):
    want = _reference(CASES[case], 4, api)
    assert not all(np.allclose(want[0], w) for w in want[1:])  # the calls differ
    with pytest.warns(tg.RetraceWarning, match=CHANGES):
        got = _run(CASES[case], 4, api)
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6)


def test_the_counter_advances_once_per_call_as_uncompiled():
    box = {"n": 0}

    def f(v):
        box["n"] += 1
        return jnp.sum(v**2) * box["n"]

    with pytest.warns(tg.RetraceWarning, match=CHANGES + r" \(dict entry \['n'\]\)") as said:
        for i in range(1, 6):
            np.testing.assert_allclose(tg.gradient(f, W)[0], 2 * W * i, rtol=1e-6)
    assert box["n"] == 5
    assert len([w for w in said if issubclass(w.category, tg.RetraceWarning)]) == 1  # once


def test_a_compiled_step_with_a_python_schedule_trains_as_uncompiled():
    # A training step compiled with tg.jit reading and advancing a Python step counter:
    # the learning rate it picks must follow the counter, as uncompiled.
    class Trainer:
        def __init__(self):
            self.step = 0

    def make():
        t = Trainer()
        model = {"w": W}

        def step(x):
            t.step += 1
            lr = 0.1 if t.step <= 2 else 0.01
            g = jax.grad(lambda m: jnp.sum((m["w"] * x) ** 2))(model)
            model["w"] = model["w"] - lr * g["w"]
            return model["w"]

        return step, model

    step, model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)  # said: traced each call
        fast = tg.jit(step)
        for _ in range(4):
            fast(jnp.ones(3))
    ref_step, ref_model = make()
    with jax.disable_jit():
        for _ in range(4):
            ref_step(jnp.ones(3))
    np.testing.assert_allclose(model["w"], ref_model["w"], rtol=1e-6)


def test_an_implicit_compiled_step_reading_a_counter_matches_optax():
    # `tg.update_` inside tg.jit, with the learning rate from a Python counter.
    model = {"w": W}
    ps = tg.params(model)
    state = tg.setup(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), ps)
    clock = {"t": 0}

    @tg.jit
    def step(x):
        clock["t"] += 1
        grads = tg.gradient(lambda: jnp.sum((model["w"] * x) ** 2) * clock["t"], ps)
        tg.update_(state, ps, grads)

    w = np.asarray(W)
    with pytest.warns(tg.RetraceWarning, match=CHANGES):
        for t in range(1, 4):
            step(jnp.ones(3))
            w = w - 0.1 * (2 * w * t)  # plain SGD on the same loss, by hand
    np.testing.assert_allclose(model["w"], w, rtol=1e-5)
    assert clock["t"] == 3


def _setdefault(cfg):
    return lambda v: jnp.sum(v) * cfg.setdefault("scale", 2.0)


def _lazy_attribute(holder):
    def f(v):
        if not hasattr(holder, "scale"):
            holder.scale = 2.0
        return jnp.sum(v) * holder.scale

    return f


class _Cached:
    @functools.cached_property
    def scale(self):
        return 2.0


def _cached_property(obj):
    return lambda v: jnp.sum(v) * obj.scale


@pytest.mark.parametrize(
    ("make", "edit"),
    [
        (lambda: {}, lambda c: c.__setitem__("scale", 5.0)),
        (lambda: type("Holder", (), {})(), lambda h: setattr(h, "scale", 5.0)),
        (_Cached, lambda o: setattr(o, "scale", 5.0)),
    ],
    ids=["setdefault", "lazy-attribute", "cached-property"],
)
def test_a_default_filled_in_on_first_use_is_read_fresh_when_edited(make, edit):
    holder = make()
    f = {dict: _setdefault, _Cached: _cached_property}.get(type(holder), _lazy_attribute)(holder)
    traces = []
    counted = lambda v: (traces.append(1), f(v))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a write made once is not a counter: no warning
        for _ in range(3):
            np.testing.assert_allclose(tg.gradient(counted, W)[0], [2.0] * 3)
        assert len(traces) == 2  # one trace more (the default is read from then on)
        edit(holder)  # the user's edit after the first calls: read, not the old 2.0
        np.testing.assert_allclose(tg.gradient(counted, W)[0], [5.0] * 3)
        np.testing.assert_allclose(tg.gradient(counted, W)[0], [5.0] * 3)
    assert len(traces) == 3


def test_a_write_of_the_same_value_each_call_is_cached_after_one_more_trace():
    flags = {"training": False}
    traces = []

    def f(v):
        traces.append(1)
        flags["training"] = True
        return jnp.sum(v) * (2.0 if flags["training"] else 1.0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            np.testing.assert_allclose(tg.gradient(f, W)[0], [2.0] * 3)
    assert len(traces) == 2
    flags["training"] = False  # the user's edit: read (the function sets it again)
    tg.gradient(f, W)
    assert len(traces) == 3


def test_a_log_the_function_appends_to_is_its_output_and_not_retraced():
    # The jax.jit idiom, kept: `traces.append(1)` runs when traced, not on every call.
    log = []

    def f(v):
        log.append("traced")
        return jnp.sum(v)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            np.testing.assert_allclose(tg.gradient(f, W)[0], np.ones(W.shape))
    assert log == ["traced"]


def test_a_log_the_function_also_reads_is_a_counter_read_as_uncompiled():
    # It reads the log's length (into a set here; a branch could read it as well), so
    # its result may depend on how many calls came before: traced on every call, said
    # once, and every call sees the length the last one left, as uncompiled. (It was
    # taken for an output: `seen == {1}`, the length when first traced, forever.)
    log, seen = [], set()

    def f(v):
        log.append("traced")
        seen.add(len(log))
        return jnp.sum(v)

    with pytest.warns(
        tg.RetraceWarning, match=r"changes values it can read.*closure variable 'log'"
    ):
        for _ in range(4):
            np.testing.assert_allclose(tg.gradient(f, W)[0], np.ones(W.shape))
    assert log == ["traced"] * 4 and seen == {1, 2, 3, 4}


def test_an_entry_the_function_deletes_is_read_as_gone():
    cfg = {"extra": 3.0}

    def f(v):
        scale = cfg.pop("extra", 1.0)
        return jnp.sum(v) * scale

    with pytest.warns(tg.RetraceWarning, match="takes items from a dict it captures"):
        got = [float(tg.gradient(f, W)[0][0]) for _ in range(2)]
    assert got == [3.0, 1.0]  # uncompiled: the entry is gone on the second call
    cfg["extra"] = 7.0
    assert float(tg.gradient(f, W)[0][0]) == 7.0


def test_an_attribute_the_function_deletes_is_read_as_gone():
    class Holder:
        pass

    h = Holder()
    h.extra = 3.0

    def f(v):
        scale = getattr(h, "extra", 1.0)
        if hasattr(h, "extra"):
            del h.extra
        return jnp.sum(v) * scale

    got = [float(tg.gradient(f, W)[0][0]) for _ in range(3)]
    assert got == [3.0, 1.0, 1.0]
    h.extra = 7.0
    assert float(tg.gradient(f, W)[0][0]) == 7.0


class _Counted(tg.Module):
    def __init__(self):
        self.w = W
        self.calls = 0  # static data of the Module


def test_a_static_counter_of_a_captured_module_is_read_fresh_and_said():
    m = _Counted()

    def f(v):
        m.calls += 1
        return jnp.sum(v * m.w) * m.calls

    with pytest.warns(tg.RetraceWarning, match=CHANGES + r" \(the static data of a _Counted"):
        got = [np.asarray(tg.gradient(f, W)[0]) for _ in range(3)]
    np.testing.assert_allclose(np.stack(got), np.stack([W * k for k in (1, 2, 3)]))
    assert m.calls == 3
