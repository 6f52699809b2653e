"""More hostile cases for values the function changes itself (the rule of 2026-12-02).

A trace that changed a Python value the function can read (a counter `c["n"] += 1`)
is not reused, so each call must run the function's Python code exactly once, as the
uncompiled call does: a second run of the same call advances the counter twice and
the result reads the doubled value. Each case is compared with the same function run
uncompiled (`jax.disable_jit` + jax's own transform) from the same starting state,
call after call, or with a closed form. Every test here failed when written (a
Hessian, a complex Jacobian, a retrace for unused inputs, the numpy retry,
`jax.disable_jit` each advanced the counter twice a call; a container that grew taken
for a log; NaNs of other types retraced forever; a `jax.jit` helper of a partial or
method, a module imported in the function, and the function's own new attribute not
checked); each is fixed.
"""

import functools
import re
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

W = jnp.array([1.0, -2.0, 0.5])
B = jnp.array([0.3, 0.7])
CHANGES = r"changes values it can read while traced"


def _counted(power=2):
    """A loss scaled by a counter it advances, and the counter."""
    c = {"n": 0}

    def f(v):
        c["n"] += 1
        return jnp.sum(v**power) * c["n"]

    return f, c


def _quiet(fn, calls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)  # said: traced each call
        return [np.asarray(fn()) for _ in range(calls)]


def _uncompiled(fn, calls):
    with jax.disable_jit():
        return [np.asarray(fn()) for _ in range(calls)]


# --- Programs that run the function more than once for one call ----------------------


def _hessian_one():
    f, c = _counted(3)
    return (lambda: tg.hessian(f, W)[0]), (lambda: jax.hessian(f)(W)), c


def _hessian_two():
    c = {"n": 0}

    def f(v, a):
        c["n"] += 1
        return (jnp.sum(v**3) + jnp.sum(a**3)) * c["n"]

    return (lambda: tg.hessian(f, W, B)[1]), (lambda: jax.hessian(f, 1)(W, B)), c


def _jacobian_complex():
    c = {"n": 0}

    def f(v):
        c["n"] += 1
        return v**2 * (1 + 1j) * c["n"]

    return (lambda: tg.jacobian(f, W)[0]), (lambda: jax.jacfwd(f)(W)), c


def _hessian_in_jit():
    f, c = _counted(3)
    compiled = tg.jit(lambda v: tg.hessian(f, v)[0])
    return (lambda: compiled(W)), (lambda: jax.hessian(f)(W)), c


def _unused_argument():
    c = {"n": 0}

    def f(v, b):  # b: differentiated, unused (its gradient is None)
        c["n"] += 1
        return jnp.sum(v**2) * c["n"]

    return (lambda: tg.gradient(f, W, B)[0]), (lambda: jax.grad(f)(W, B)), c


def _unused_parameter():
    f, c = _counted()
    model = {"w": W, "frozen": B}  # a parameter the loss does not read
    ps = tg.params(model)
    return (lambda: tg.gradient(lambda: f(model["w"]), ps)[model["w"]]), (lambda: jax.grad(f)(W)), c


def _numpy_read_as_value():
    # `float(scale[0])` fails on the tracer standing in for the numpy array, and the
    # trace is tried again with the array read as a value (`_cache._new`).
    c = {"n": 0}
    scale = np.array([2.0])

    def f(v):
        c["n"] += 1
        return jnp.sum(v**2) * float(scale[0]) * c["n"]

    return (lambda: tg.gradient(f, W)[0]), (lambda: jax.grad(f)(W)), c


# Each runs the function more than once for one call (the Hessian's runs, the complex
# Jacobian's forward runs, a trace made again once the first says an input is unused,
# the retry with numpy arrays read as values): each run must start from the values the
# call found, and the changes be made once.
TWICE = {
    "hessian": _hessian_one,
    "hessian-of-two-arguments": _hessian_two,
    "jacobian-complex-output": _jacobian_complex,
    "hessian-inside-tg.jit": _hessian_in_jit,
    "unused-argument": _unused_argument,
    "unused-parameter-implicit": _unused_parameter,
    "numpy-read-as-value": _numpy_read_as_value,
}


@pytest.mark.parametrize(
    "case",
    [
        # (The Hessians and the complex Jacobian take over ~1 s each: slow tests.)
        pytest.param(c, marks=pytest.mark.slow) if "hessian" in c or "complex" in c else c
        for c in TWICE
    ],
)
def test_one_call_advances_a_counter_once_as_uncompiled(case):
    ours, _, c = TWICE[case]()
    got = _quiet(ours, 3)
    advanced = c["n"]
    _, jaxs, c = TWICE[case]()
    want = _uncompiled(jaxs, 3)
    assert (advanced, c["n"]) == (3, 3)
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6)


@pytest.mark.parametrize("api", ["gradient", "withgradient", "jacobian", "pullback"])
def test_the_usual_programs_advance_a_counter_once_per_call(api):
    # The programs that run the function once: kept so.
    f, c = _counted()
    ours = {
        "gradient": lambda: tg.gradient(f, W)[0],
        "withgradient": lambda: tg.withgradient(f, W)[1][0],
        "jacobian": lambda: tg.jacobian(lambda v: f(v) * v, W)[0],
        "pullback": lambda: tg.pullback(f, W)[1](1.0)[0],
    }[api]
    got = _quiet(ours, 3)
    assert c["n"] == 3
    g, _ = _counted()
    jaxs = {
        "gradient": lambda: jax.grad(g)(W),
        "withgradient": lambda: jax.grad(g)(W),
        "jacobian": lambda: jax.jacrev(lambda v: g(v) * v)(W),
        "pullback": lambda: jax.vjp(g, W)[1](1.0)[0],
    }[api]
    np.testing.assert_allclose(np.stack(got), np.stack(_uncompiled(jaxs, 3)), rtol=1e-6)


@pytest.mark.slow  # about 1 s each
@pytest.mark.parametrize("style", ["explicit", "implicit"])
def test_train_with_an_unused_parameter_and_a_counter_in_the_loss_matches_sgd(style):
    # A bias the loss does not read makes each step's first trace run again (unused
    # inputs): a Python schedule in the loss must still advance once a step.
    x = jnp.ones(3)
    c = {"n": 0}

    def loss(m, x):
        c["n"] += 1
        return jnp.sum((m["w"] * x) ** 2) / c["n"]

    model = {"w": W, "unused_bias": jnp.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        if style == "explicit":
            state = tg.setup(optax.sgd(0.1), model)
            _, model, _ = tg.train(loss, model, [(x,)] * 4, state, progress=False)
        else:
            ps = tg.params(model)
            state = tg.setup(optax.sgd(0.1), ps)
            tg.train(lambda x: loss(model, x), ps, [(x,)] * 4, state, progress=False)
    w = np.asarray(W)
    for t in range(1, 5):  # plain SGD on the same losses, by hand
        w = w - 0.1 * 2 * w / t
    assert c["n"] == 4
    np.testing.assert_allclose(model["w"], w, rtol=1e-5)


@pytest.mark.parametrize("api", ["gradient", "jit"])
def test_under_disable_jit_one_call_runs_the_function_once(api):
    # Debugging with jax.disable_jit: the program traced, then run eagerly, is a second
    # run of the function in the same call.
    f, c = _counted()
    ours = (lambda: tg.gradient(f, W)[0]) if api == "gradient" else (lambda: tg.jit(f)(W))
    with jax.disable_jit(), warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        got = [float(np.ravel(ours())[0]) for _ in range(3)]
    first = 2.0 if api == "gradient" else float(np.sum(W**2))  # d/dv0 sum(v**2) = 2 v0
    assert c["n"] == 3
    np.testing.assert_allclose(got, [first * k for k in (1, 2, 3)], rtol=1e-6)


# --- Containers that grow: a log only when the old contents are kept ------------------


def _append_and_bump():
    box = [0]

    def f(v):
        box[0] += 1  # an item changed...
        box.append("x")  # ...and the list grew: not a log
        return jnp.sum(v**2) * box[0]

    return f


def _pop_then_append_two():
    queue = [1.0, 2.0]

    def f(v):
        x = queue.pop(0)
        queue.extend([x + 2, x + 3])
        return jnp.sum(v**2) * queue[0]

    return f


def _set_drop_and_add():
    live = {1}

    def f(v):
        top = max(live)
        live.discard(min(live))
        live.update({top + 1, top + 2})
        return jnp.sum(v**2) * min(live)

    return f


def _tuple_rebound():
    d = {"hist": ()}

    def f(v):
        d["hist"] = d["hist"] + (1.0,)  # a new tuple: an assignment, not an append
        return jnp.sum(v**2) * len(d["hist"])

    return f


def _frozenset_rebound():
    d = {"seen": frozenset()}

    def f(v):
        d["seen"] = d["seen"] | {len(d["seen"])}
        return jnp.sum(v**2) * len(d["seen"])

    return f


GROWN = {
    "list-item-changed-and-appended": _append_and_bump,
    "list-popped-then-extended": _pop_then_append_two,
    "set-element-dropped-two-added": _set_drop_and_add,
    "tuple-rebound-longer": _tuple_rebound,
    "frozenset-rebound-larger": _frozenset_rebound,
}


@pytest.mark.parametrize("case", sorted(GROWN))
def test_a_container_that_grew_but_is_not_a_log_is_read_fresh(case):
    f = GROWN[case]()
    got = _quiet(lambda: tg.gradient(f, W)[0], 4)
    g = GROWN[case]()
    want = _uncompiled(lambda: jax.grad(g)(W), 4)
    assert not all(np.allclose(want[0], w) for w in want[1:])  # the calls differ
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6)


def test_a_dict_given_a_new_entry_each_call_is_said_once():
    memo: dict[int, float] = {}

    def f(v):
        memo[len(memo)] = 1.0  # a new key each call: traced each call, as uncompiled
        return jnp.sum(v) * len(memo)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = [float(tg.gradient(f, W)[0][0]) for _ in range(4)]
    assert got == [1.0, 2.0, 3.0, 4.0]
    retraced = [w for w in said if issubclass(w.category, tg.RetraceWarning)]
    assert len(retraced) == 1 and re.search(CHANGES, str(retraced[0].message))


# --- NaN: written unchanged, it must not cost a trace each call ----------------------


@pytest.mark.parametrize(
    "nan",
    [
        pytest.param(lambda: float("nan"), id="float"),
        pytest.param(lambda: np.float64("nan"), id="np.float64"),
        pytest.param(
            lambda: complex(float("nan"), 1.0),
            id="complex",
        ),
        pytest.param(
            lambda: np.float32("nan"),
            id="np.float32",
        ),
    ],
)
def test_a_nan_written_again_each_call_is_cached_after_one_more_trace(nan):
    stats: dict[str, object] = {"last": 0.0}
    traces = []

    def f(v):
        traces.append(1)  # a log: counts the traces
        stats["last"] = nan()  # the same value each call
        return jnp.sum(v)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a counter: no warning
        for _ in range(5):
            np.testing.assert_allclose(tg.gradient(f, W)[0], np.ones(3))
    assert len(traces) == 2


def test_a_value_changed_and_changed_back_in_one_call_is_cached():
    cfg = {"n": 1, "mode": "eval"}
    traces = []

    def f(v):
        traces.append(1)
        cfg["n"], cfg["mode"] = 1.0, "train"  # another type, another string...
        out = jnp.sum(v**2) * cfg["n"]
        cfg["n"], cfg["mode"] = 1, "eval"  # ...and back: no net change
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            np.testing.assert_allclose(tg.gradient(f, W)[0], 2 * W)
    assert len(traces) == 1
    cfg["n"] = 3  # the user's edit: read
    np.testing.assert_allclose(tg.gradient(f, W)[0], 2 * W)  # f sets 1.0 before use
    assert cfg == {"n": 1, "mode": "eval"}


# --- Routes to the counter ------------------------------------------------------------


def _in_cond():
    c = {"n": 0}

    def branch(v):
        c["n"] += 1
        return v * c["n"]

    return lambda v: jnp.sum(jax.lax.cond(v[0] > 0, branch, lambda v: v, v) ** 2)


def _in_scan():
    c = {"n": 0}

    def body(carry, _):
        c["n"] += 1
        return carry * c["n"], None

    return lambda v: jnp.sum(jax.lax.scan(body, v, None, length=1)[0] ** 2)


def _in_fori_loop():
    c = {"n": 0}

    def body(_, x):
        c["n"] += 1
        return x * c["n"]

    return lambda v: jnp.sum(jax.lax.fori_loop(0, 1, body, v) ** 2)


def _in_custom_jvp_rule():
    c = {"n": 0}

    @jax.custom_jvp
    def g(v):
        return v

    @g.defjvp
    def g_jvp(primals, tangents):
        c["n"] += 1
        return primals[0] * c["n"], tangents[0] * c["n"]

    return lambda v: jnp.sum(g(v) ** 2)


def _in_jit_helper(jit):
    c = {"n": 0}

    @jit
    def helper(v):
        c["n"] += 1
        return v * c["n"]

    return lambda v: jnp.sum(helper(v) ** 2)


def _class_attribute():
    class Sched:
        k = 0

        @classmethod
        def scale(cls):
            cls.k += 1
            return cls.k

    return lambda v: jnp.sum((v * Sched.scale()) ** 2)


ROUTES = {
    "lax.cond-branch": _in_cond,
    "lax.scan-body": _in_scan,
    "fori_loop-body": _in_fori_loop,
    "custom_jvp-rule": _in_custom_jvp_rule,
    "tg.jit-helper": functools.partial(_in_jit_helper, tg.jit),
    "jax.jit-helper": functools.partial(_in_jit_helper, jax.jit),
    "classmethod-on-class-attribute": _class_attribute,
}


@pytest.mark.parametrize("case", sorted(ROUTES))
def test_a_counter_reached_through_a_transform_or_helper_advances_each_call(case):
    # Each body above runs once per call uncompiled (a cond branch taken, a scan of
    # length 1), so the k-th call's gradient of sum((v * k)**2) is 2 v k**2.
    f = ROUTES[case]()
    got = _quiet(lambda: tg.gradient(f, W)[0], 3)
    np.testing.assert_allclose(np.stack(got), np.stack([2 * W * k**2 for k in (1, 2, 3)]))


def _jit_of_partial():
    c = {"n": 0}

    def helper(v, k):
        c["n"] += k
        return v * c["n"]

    return jax.jit(functools.partial(helper, k=1))


def _jit_of_bound_method():
    class Layer:
        def __init__(self):
            self.calls = 0

        def __call__(self, v):
            self.calls += 1
            return v * self.calls

    return jax.jit(Layer().__call__)


@pytest.mark.parametrize("make", [_jit_of_partial, _jit_of_bound_method], ids=["partial", "method"])
def test_a_jax_jit_helper_of_a_partial_or_method_advancing_a_counter(make):
    helper = make()
    got = _quiet(lambda: tg.gradient(lambda v: jnp.sum(helper(v) ** 2), W)[0], 3)
    np.testing.assert_allclose(np.stack(got), np.stack([2 * W * k**2 for k in (1, 2, 3)]))


def test_a_counter_on_a_module_imported_inside_the_function(monkeypatch):
    mod = types.ModuleType("tg_hunt_counters_more_imported")
    mod.k = 0
    monkeypatch.setitem(sys.modules, mod.__name__, mod)

    def f(v):
        import tg_hunt_counters_more_imported as cfg  # type: ignore[import-not-found]

        cfg.k += 1
        return jnp.sum(v**2) * cfg.k

    got = _quiet(lambda: tg.gradient(f, W)[0][0], 3)
    mod.k = 10  # the user's edit between calls
    got += _quiet(lambda: tg.gradient(f, W)[0][0], 1)
    assert list(map(float, got)) == [2.0, 4.0, 6.0, 22.0]
    assert mod.k == 11


def test_a_counter_on_the_function_s_own_attribute_created_on_first_call():
    def f(v):
        f.calls = getattr(f, "calls", 0) + 1  # type: ignore[attr-defined]
        return jnp.sum(v**2) * f.calls  # type: ignore[attr-defined]

    got = _quiet(lambda: tg.gradient(f, W)[0][0], 3)
    assert list(map(float, got)) == [2.0, 4.0, 6.0]
    assert f.calls == 3  # type: ignore[attr-defined]


def test_one_counter_two_functions_and_the_user_all_advance_it():
    # f advances the counter, g only reads it, the user resets it between calls: each
    # result is the uncompiled one, and no tracer is left in the user's objects.
    shared = {"n": 0, "last": None}

    def f(v):
        shared["n"] += 1
        shared["last"] = shared["n"]
        return jnp.sum(v) * shared["n"]

    def g(v):
        return jnp.sum(v) * shared["n"]

    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        for k in range(3):
            got += [float(tg.gradient(f, W)[0][0]), float(tg.gradient(g, W)[0][0])]
            shared["n"] = 10 * (k + 1) if k else shared["n"]
    assert got == [1.0, 1.0, 2.0, 2.0, 21.0, 21.0]
    assert shared["last"] == 21 and not isinstance(shared["last"], jax.core.Tracer)


def test_an_implicit_compiled_step_with_a_static_module_counter_and_unread_rule_state():
    # The counter is static data of the Module (a Python int) that the step advances;
    # the learning rate follows it, under tg.jit with tg.update_, as plain SGD by hand.
    class Model(tg.Module):
        def __init__(self):
            self.w = W
            self.step = 0

    model = Model()
    ps = tg.params(model)
    state = tg.setup(optax.sgd(1.0), ps)

    @tg.jit
    def step(x):
        model.step += 1
        grads = tg.gradient(lambda: jnp.sum((model.w * x) ** 2) * (0.1 / model.step), ps)
        tg.update_(state, ps, grads)

    w = np.asarray(W)
    with pytest.warns(tg.RetraceWarning, match=CHANGES):
        for t in range(1, 5):
            step(jnp.ones(3))
            w = w - (0.1 / t) * 2 * w
    assert model.step == 4
    np.testing.assert_allclose(model.w, w, rtol=1e-5)
    assert not isinstance(model.w, jax.core.Tracer)
