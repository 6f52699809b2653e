"""Hostile hunt: treegrad under threads (sweeps, loaders, evaluators, savers).

Every result is compared with an independent reference (`jax.grad` on the explicit
function, plain optax on the same leaves, a closed form); every join has a timeout, so
a deadlock fails the test instead of hanging it.
"""

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

JOIN = 60  # seconds: a deadlock fails instead of hanging


def _results(futures, timeout=JOIN):
    return [f.result(timeout=timeout) for f in futures]


# --- N threads, each training its own model with the same loss code ------------------


def _loss(m, x, y):
    return jnp.mean((x @ m["w"] + m["b"] - y) ** 2)


def _data(k):
    kx, ky = jax.random.split(jax.random.key(k))
    return jax.random.normal(kx, (8, 3)), jax.random.normal(ky, (8,))


def _init(k):
    # A float32 (not weakly typed) bias: the steps' signatures do not change.
    b = jnp.asarray(0.1 * k, dtype=jnp.float32)
    return {"w": jax.random.normal(jax.random.key(100 + k), (3,)), "b": b}


STEPS = 3
# One rule object for every thread (a new optax rule object compiles its update anew).
_RULE = optax.adam(0.05)


def _optax_reference(k):
    m = _init(k)
    x, y = _data(k)
    opt = optax.adam(0.05)
    s = opt.init(m)
    for _ in range(STEPS):
        m, s = _REF_STEP(opt, m, s, x, y)
    return m


@jax.jit
def _ref_step(m, s, x, y):
    u, s = optax.adam(0.05).update(jax.grad(_loss)(m, x, y), s, m)
    return optax.apply_updates(m, u), s


def _REF_STEP(opt, m, s, x, y):
    return _ref_step(m, s, x, y)


def _explicit(k, bar):
    m = _init(k)
    x, y = _data(k)
    st = tg.setup(_RULE, m)
    bar.wait(JOIN)
    for _ in range(STEPS):
        (g,) = tg.gradient(lambda m: _loss(m, x, y), m)
        st, m = tg.update(st, m, g)
    return m


def _implicit(k, bar):
    m = _init(k)
    x, y = _data(k)
    ps = tg.params(m)
    st = tg.setup(_RULE, ps)
    bar.wait(JOIN)
    for _ in range(STEPS):
        g = tg.gradient(lambda: _loss(m, x, y), ps)
        tg.update_(st, ps, g)
    return m


def _jitted(k, bar):
    m = _init(k)
    x, y = _data(k)
    ps = tg.params(m)
    st = tg.setup(_RULE, ps)

    @tg.jit
    def step(x, y):
        tg.update_(st, ps, tg.gradient(lambda: _loss(m, x, y), ps))

    bar.wait(JOIN)
    for _ in range(STEPS):
        step(x, y)
    return m


def _trained(k, bar):
    m = _init(k)
    x, y = _data(k)
    st = tg.setup(_RULE, m)
    bar.wait(JOIN)
    st, m, _ = tg.train(_loss, m, [(x, y)] * STEPS, st)
    return m


@pytest.mark.parametrize(
    "style", [_explicit, _implicit, _jitted, _trained], ids=lambda f: f.__name__
)
def test_threads_training_their_own_models_match_plain_optax(style):
    n = 4
    bar = threading.Barrier(n)  # all threads start their steps together
    with ThreadPoolExecutor(n) as ex:
        models = _results([ex.submit(style, k, bar) for k in range(n)])
    for k, m in enumerate(models):
        ref = _optax_reference(k)
        for key in ("w", "b"):
            np.testing.assert_allclose(m[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=(k, key))


# --- a thread reading a threading.local scale -----------------------------------------

_TL = threading.local()


def test_threading_local_scale_is_each_threads_own():
    w = jnp.arange(3.0)
    box = {"w": w}
    ps = tg.Params([w])

    @tg.jit
    def jitted(v):
        return _TL.s * jnp.sum(v**2)

    def worker(k, bar):
        _TL.s = float(k + 1)
        bar.wait(JOIN)
        out = []
        for _ in range(2):
            out.append(tg.gradient(lambda v: _TL.s * jnp.sum(v**2), w)[0])
            out.append(tg.gradient(lambda: _TL.s * jnp.sum(box["w"] ** 2), ps)[w])
            out.append(jax.grad(jitted)(w))
            out.append(jitted(w) / jnp.sum(w**2) * 2 * w)
        return out

    n = 3
    bar = threading.Barrier(n)
    with ThreadPoolExecutor(n) as ex:
        res = _results([ex.submit(worker, k, bar) for k in range(n)])
    for k, out in enumerate(res):
        ref = jax.grad(lambda v, k=k: (k + 1.0) * jnp.sum(v**2))(w)
        for g in out:
            np.testing.assert_allclose(g, ref, rtol=1e-6, err_msg=k)


# --- a config mutated by another thread -----------------------------------------------


# Each new value of s re-traces (as documented): said once, not an error here.
@pytest.mark.filterwarnings("ignore::treegrad.RetraceWarning")
def test_a_config_toggled_by_another_thread_gives_a_consistent_and_fresh_gradient():
    cfg = {"s": 1.0}
    w = jnp.arange(3.0)

    def loss(v):
        s = cfg["s"]  # read once: uncompiled, one value of s
        return s * jnp.sum(v**2) + s**2 * jnp.sum(v)

    def ref(s):
        return np.asarray(jax.grad(lambda v: s * jnp.sum(v**2) + s**2 * jnp.sum(v))(w))

    refs = [ref(1.0), ref(2.0)]
    stop = threading.Event()

    def toggler():
        n = 0
        while not stop.is_set():
            cfg["s"] = 2.0 if cfg["s"] == 1.0 else 1.0
            n += 1
            time.sleep(0.0002)
        return n

    with ThreadPoolExecutor(1) as ex:
        t = ex.submit(toggler)
        try:
            got = [np.asarray(tg.gradient(loss, w)[0]) for _ in range(40)]
        finally:
            stop.set()
        assert t.result(timeout=JOIN) > 0
    for g in got:  # one value of s or the other, never a mix of the two
        assert any(np.allclose(g, r, rtol=1e-6) for r in refs), g
    # The mutation completed: a new value is read (1.0 and 2.0 themselves: see the ABA
    # test below).
    for s in (3.0, 0.5):
        cfg["s"] = s
        np.testing.assert_allclose(tg.gradient(loss, w)[0], ref(s), rtol=1e-6)


@pytest.mark.xfail(
    strict=True,
    reason="_engine.Entry.__init__ walks (the guard records s) before first_run traces: "
    "another thread that changes s and changes it back while the trace reads it (A-B-A) "
    "leaves an entry guarded by s=1 whose program was traced with s=2; Settle's "
    "before/after comparison cannot see it, and every later call with s=1 is stale",
)
def test_a_value_changed_and_changed_back_during_a_trace_is_never_cached_stale():
    cfg = {"s": 1.0}
    # Events are library objects (checked by identity): the hooks change nothing the
    # guard checks, so the trace stays cacheable, as a plain loss would.
    go2, wrote2, go1, wrote1 = (threading.Event() for _ in range(4))

    def before():
        if not go2.is_set():
            go2.set()
            assert wrote2.wait(JOIN)

    def after():
        if not go1.is_set():
            go1.set()
            assert wrote1.wait(JOIN)

    def loss(v):
        before()
        s = cfg["s"]  # 2.0: the other thread's value while it is read
        after()
        return s * jnp.sum(v**2)

    w = jnp.arange(3.0)

    def other():
        assert go2.wait(JOIN)
        cfg["s"] = 2.0
        wrote2.set()
        assert go1.wait(JOIN)
        cfg["s"] = 1.0  # and back
        wrote1.set()

    with ThreadPoolExecutor(2) as ex:
        g, _ = _results([ex.submit(lambda: tg.gradient(loss, w)[0]), ex.submit(other)])
    np.testing.assert_allclose(g, 4.0 * np.arange(3.0), rtol=1e-6)  # s=2 when read: fine
    assert cfg["s"] == 1.0
    # The other thread is done, s is 1.0: the gradient must be jax.grad's at s=1.
    np.testing.assert_allclose(tg.gradient(loss, w)[0], jax.grad(loss)(w), rtol=1e-6)


def _write_during_trace(on_written):
    """Thread B writes cfg["s"] = 2.0 while thread A's first call is inside its trace
    (made deterministic by a hook the loss calls), then calls `on_written(cfg, done)`.
    Returns (A's gradient, what on_written returned, cfg, loss, w)."""
    cfg = {"s": 1.0}
    started, written, done = threading.Event(), threading.Event(), threading.Event()
    first = [True]

    def hook():
        if first[0]:
            first[0] = False
            started.set()
            assert written.wait(JOIN)

    def loss(v):
        hook()
        return cfg["s"] * jnp.sum(v**2)

    w = jnp.arange(3.0)

    def trainer():
        try:
            return np.asarray(tg.gradient(loss, w)[0])
        finally:
            done.set()

    def mutator():
        assert started.wait(JOIN)
        cfg["s"] = 2.0
        written.set()
        return on_written(cfg, done)

    with ThreadPoolExecutor(2) as ex:
        a, b = ex.submit(trainer), ex.submit(mutator)
        g, seen = _results([a, b])
    return g, seen, cfg, loss, w


def test_another_threads_later_write_is_not_overwritten_by_a_call_that_traced():
    # Thread B writes s = 2.0 during A's trace, then s = 3.0 as soon as it sees any other
    # value (treegrad undoes the trace's Python changes until the call ends). Its last
    # write must stay: it was the user's newest value, not the trace's.
    def rewrite(cfg, done):
        while not done.is_set():
            if cfg["s"] != 2.0:
                cfg["s"] = 3.0
                return 3.0
            time.sleep(0)
        cfg["s"] = 3.0  # (none seen: write it after the call, the same end state)
        return 3.0

    g, last, cfg, loss, w = _write_during_trace(rewrite)
    # A's gradient is jax.grad at the value its trace read (B wrote before the read).
    np.testing.assert_allclose(g, jax.grad(lambda v: 2.0 * jnp.sum(v**2))(w), rtol=1e-6)
    assert cfg["s"] == last == 3.0  # before the fix: 2.0, B's write lost
    for s in (3.0, 1.0, 2.0):  # and every later call is fresh
        cfg["s"] = s
        np.testing.assert_allclose(
            tg.gradient(loss, w)[0], jax.grad(lambda v, s=s: s * jnp.sum(v**2))(w), rtol=1e-6
        )


@pytest.mark.xfail(
    strict=True,
    reason="_programs.py (Settle.undo_changes after each run) / _cache._new (changes_made "
    "after the compile): another thread's write made during a trace is undone until the "
    "call ends, so that thread reads its old value meanwhile",
)
def test_another_threads_write_is_never_reverted_while_a_call_compiles():
    def watch(cfg, done):
        seen = set()
        while not done.is_set():
            seen.add(cfg["s"])
            time.sleep(0)
        seen.add(cfg["s"])
        return seen

    _, seen, _, _, _ = _write_during_trace(watch)
    assert seen == {2.0}, f"thread B wrote 2.0 and then read {sorted(seen)}"


# --- threads sharing one model ----------------------------------------------------------


class _Leaf(tg.Module):
    def __init__(self):
        self.v = jnp.zeros(())


class _Many(tg.Module):
    def __init__(self, n):
        self.items = [_Leaf() for _ in range(n)]


def _shared_training(trainer_mode, reader, n_reads):
    """One thread trains a model of many scalar leaves (each step adds exactly 1 to every
    leaf, so a consistent snapshot has all leaves equal); `reader(model)` returns the
    values it saw, `n_reads` times, in another thread."""
    model = _Many(60)
    ps = tg.params(model)
    st = tg.setup(optax.sgd(1.0), ps)

    def loss():
        return -sum(leaf.v for leaf in model.items)

    @tg.jit
    def step():
        tg.update_(st, ps, tg.gradient(loss, ps))

    stop = threading.Event()

    def train():
        n = 0
        while not stop.is_set():
            if trainer_mode == "jit":
                step()
            else:
                tg.update_(st, ps, tg.gradient(loss, ps))
            n += 1
        return n

    def read():
        try:
            return [reader(model) for _ in range(n_reads)]
        finally:
            stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: expose the races
    try:
        with ThreadPoolExecutor(2) as ex:
            t, r = ex.submit(train), ex.submit(read)
            snaps = r.result(timeout=JOIN)
            steps = t.result(timeout=JOIN)
    finally:
        sys.setswitchinterval(old)
    assert steps > 0
    for leaf in model.items:  # nothing the trainer owns is left holding a tracer
        assert isinstance(leaf.v, jax.Array) and not isinstance(leaf.v, jax.core.Tracer)
    final = {float(leaf.v) for leaf in model.items}
    assert final == {float(steps)}, final  # every step applied to every leaf, once
    return snaps


@pytest.mark.slow  # ~2 s: many saves while the other thread trains
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_save_while_another_thread_trains_stores_one_steps_snapshot(tmp_path, mode):
    def reader(model):
        p = os.path.join(tmp_path, "ckpt")
        tg.save(p, model)
        return sorted({float(leaf.v) for leaf in tg.load(p, model).items})

    snaps = _shared_training(mode, reader, 12)
    mixed = [s for s in snaps if len(s) != 1]
    assert not mixed, f"saved snapshots mixing two steps: {mixed[:3]}"


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_jit_eval_while_another_thread_trains_sees_one_steps_snapshot(mode):
    @tg.jit
    def evaluate(m):
        return jnp.stack([leaf.v for leaf in m.items])

    def reader(model):
        return sorted(set(np.asarray(evaluate(model)).tolist()))

    snaps = _shared_training(mode, reader, 30)
    mixed = [s for s in snaps if len(s) != 1]
    assert not mixed, f"evaluations mixing two steps: {mixed[:3]}"


def test_a_thread_failing_mid_trace_leaves_the_model_intact_and_others_unaffected():
    model = {"w": jnp.arange(3.0), "b": jnp.asarray(0.5)}
    w0, b0 = model["w"], model["b"]
    ps = tg.params(model)
    inside = threading.Event()

    def bad():
        jnp.sum(model["w"] ** 2)
        inside.set()
        time.sleep(0.05)  # the other thread is waiting for its turn meanwhile
        raise ValueError("boom in the trace")

    def failing():
        with pytest.raises(ValueError, match="boom in the trace"):
            tg.gradient(bad, ps)
        return True

    def other():
        assert inside.wait(JOIN)
        out = []
        for c in (1.0, 2.0, 3.0):
            (g,) = tg.gradient(lambda m: c * jnp.sum(m["w"] ** 2) + m["b"], model)  # noqa: B023 (called at once)
            out.append((c, g))
        return out

    with ThreadPoolExecutor(2) as ex:
        ok, out = _results([ex.submit(failing), ex.submit(other)])
    assert ok
    assert model["w"] is w0 and model["b"] is b0  # unchanged, no tracer left
    assert list(ps) == [b0, w0] or list(ps) == [w0, b0]
    for c, g in out:
        ref = jax.grad(lambda m, c=c: c * jnp.sum(m["w"] ** 2) + m["b"])(model)
        np.testing.assert_allclose(g["w"], ref["w"], rtol=1e-6)
        np.testing.assert_allclose(g["b"], ref["b"], rtol=1e-6)
    # Afterwards, implicit mode over the same model is right too.
    g = tg.gradient(lambda: 2.0 * jnp.sum(model["w"] ** 2) + model["b"], ps)
    np.testing.assert_allclose(g[w0], 4.0 * np.arange(3.0), rtol=1e-6)
    np.testing.assert_allclose(g[b0], 1.0)


# Found here, fixed meanwhile by commit 291c96a (the Params read in the call's turn).
def test_implicit_gradient_started_while_another_thread_traces_gets_its_gradients():
    model = {"w": jnp.arange(3.0), "b": jnp.asarray(0.5)}
    w0, b0 = model["w"], model["b"]
    ps = tg.params(model)
    inside, release = threading.Event(), threading.Event()

    def slow():
        v = jnp.sum(model["w"] ** 2)
        inside.set()
        release.wait(0.3)  # the other thread's call has started meanwhile
        return v

    def tracer_thread():
        return tg.gradient(slow, ps)[w0]

    def other():
        assert inside.wait(JOIN)
        return tg.gradient(lambda: 2.0 * jnp.sum(model["w"] ** 2) + model["b"], ps)

    with ThreadPoolExecutor(2) as ex:
        g_slow, g = _results([ex.submit(tracer_thread), ex.submit(other)])
    np.testing.assert_allclose(g_slow, 2.0 * np.arange(3.0), rtol=1e-6)
    assert model["w"] is w0 and model["b"] is b0
    named = g.named()
    assert named["w"] is not None and named["b"] is not None, named
    np.testing.assert_allclose(g[w0], 4.0 * np.arange(3.0), rtol=1e-6)
    np.testing.assert_allclose(g[b0], 1.0)


# --- tg.clear_cache from one thread while others compute ------------------------------


@pytest.mark.slow  # over ~1 s: every cleared call compiles again
def test_clear_cache_while_other_threads_compute():
    # Was loud: a KeyError from _LRU.move_to_end in the computing threads (clear_cache
    # now takes its own turn).
    stop = threading.Event()

    def clearer():
        n = 0
        while not stop.is_set():
            tg.clear_cache()
            n += 1
            time.sleep(0.0005)
        return n

    def user(k):
        m = {"w": jnp.arange(3.0) + k}
        for i in range(30):
            c = float(i % 3 + 1)
            (g,) = tg.gradient(lambda m: c * jnp.sum(m["w"] ** 2), m)  # noqa: B023 (called at once)
            np.testing.assert_allclose(g["w"], 2 * c * (np.arange(3.0) + k), rtol=1e-6)
        return True

    with ThreadPoolExecutor(4) as ex:
        cf = ex.submit(clearer)
        try:
            assert all(_results([ex.submit(user, k) for k in range(3)]))
        finally:
            stop.set()
        assert cf.result(timeout=JOIN) > 0
