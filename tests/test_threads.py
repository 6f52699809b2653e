"""treegrad called from several threads at once.

While a function is traced, tracers stand in the places it reads its arrays from
(implicit mode's parameters, any captured array) until the trace ends. Calls from
two threads that traced at once read each other's tracers there, and with both
restoring, a tracer could stay in the user's model for good (`LinearizeTracer` in
`model["w"]` after every thread had finished). The engine's calls take turns.
"""

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg


@pytest.mark.slow  # over ~1 s (every call traces): CI's slow run
def test_threads_tracing_over_one_model_leave_it_intact_and_get_their_own_gradients():
    model = {"w": jnp.arange(3.0), "b": jnp.asarray(0.5)}
    w0, b0 = model["w"], model["b"]
    ps = tg.params(model)
    results, errors = [], []

    def worker(k):
        try:
            for i in range(4):
                c = float(10 * k + i + 1)
                ns = {"jnp": jnp, "model": model}
                # A new function each time (new code): every call traces.
                if i % 2:
                    exec(f"f = lambda: jnp.sum(model['w'] ** 2) * {c} + model['b'] * {c}", ns)
                    g = tg.gradient(ns["f"], ps)
                    gw, gb = g[w0], g[b0]
                else:
                    exec(f"f = lambda m: jnp.sum(m['w'] ** 2) * {c} + model['b'] * {c}", ns)
                    gw, gb = tg.gradient(ns["f"], model)[0]["w"], None
                results.append((c, gw, gb))
        except Exception as e:  # reported below, with the thread's index
            errors.append((k, repr(e)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert model["w"] is w0 and model["b"] is b0  # never a tracer left behind
    assert len(results) == 12
    for c, gw, gb in results:
        np.testing.assert_allclose(gw, 2 * np.arange(3.0) * c, rtol=1e-6)
        if gb is not None:
            np.testing.assert_allclose(gb, c, rtol=1e-6)
    # And each equals jax.grad of the same function.
    ref = jax.grad(lambda m: jnp.sum(m["w"] ** 2) * 3.0 + m["b"] * 3.0)(model)
    got = tg.gradient(lambda: jnp.sum(model["w"] ** 2) * 3.0 + model["b"] * 3.0, ps)
    np.testing.assert_allclose(got[w0], ref["w"])
    np.testing.assert_allclose(got[b0], ref["b"])


@pytest.mark.slow  # over ~1 s (every call traces): CI's slow run
def test_an_update_in_one_thread_while_another_traces_over_the_model():
    import optax

    model = {"w": jnp.arange(3.0), "b": jnp.asarray(0.5)}
    w0 = model["w"]
    ps = tg.params(model)
    state = tg.setup(optax.adam(0.1), model)
    grads = {"w": jnp.ones(3), "b": jnp.asarray(2.0)}
    # Plain optax on the same arrays: what every update must give.
    opt = optax.adam(0.1)
    upd, _ = opt.update(grads, opt.init(model), model)
    expected = optax.apply_updates(model, upd)
    errors = []
    done = threading.Event()

    def updater():
        try:
            while not done.is_set():
                _, new = tg.update(state, model, grads)
                for k in ("w", "b"):
                    np.testing.assert_allclose(new[k], expected[k], rtol=1e-6)
        except Exception as e:  # reported below
            errors.append(repr(e))

    t = threading.Thread(target=updater)
    t.start()
    # New functions over the same model: each call traces, long enough (a loop of 100
    # operations) for the other thread to run meanwhile.
    source = (
        "def f():\n    s = 0.0\n    for _ in range(100):\n"
        "        s = s + jnp.sum(model['w'] ** 2)\n    return s * {c} + model['b']"
    )
    for c in (1.0, 2.0, 3.0):
        ns = {"jnp": jnp, "model": model}
        exec(source.format(c=c), ns)
        np.testing.assert_allclose(
            tg.gradient(ns["f"], ps)[w0], 200 * np.arange(3.0) * c, rtol=1e-5
        )
    done.set()
    t.join()
    assert not errors, errors[:3]
    assert model["w"] is w0


def test_a_call_waits_for_another_threads_trace_before_reading_its_params():
    # Was a race: implicit mode read the Params' arrays before taking its turn, so a
    # call made while another thread traced over the same model read that trace's
    # tracers as its parameters, and its loss "depended on none of them".
    model = {"w": jnp.arange(3.0)}
    ps = tg.params(model)
    inside, go = threading.Event(), threading.Event()
    out, errors = {}, []

    def slow():
        inside.set()
        go.wait(10)  # the trace is under way: model["w"] holds its tracer
        return jnp.sum(model["w"] ** 2)

    def run(name, f):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a NoGradientWarning fails the thread
                out[name] = tg.gradient(f, ps)[model["w"]]
        except Exception as e:  # reported below
            errors.append((name, repr(e)))

    first = threading.Thread(target=run, args=("slow", slow))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=run, args=("other", lambda: jnp.sum(model["w"] * 3.0)))
    second.start()
    second.join(0.3)  # it reaches its turn while the trace waits
    go.set()
    first.join(30)
    second.join(30)
    assert not errors, errors
    np.testing.assert_allclose(out["slow"], 2 * np.arange(3.0))
    np.testing.assert_allclose(out["other"], jnp.full(3, 3.0))
    assert not isinstance(model["w"], jax.core.Tracer)
