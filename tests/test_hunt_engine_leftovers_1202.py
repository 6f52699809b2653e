"""Three leftovers of the engine hunt of 2026-12-02.

1. A function run more than once in one call (the Hessian's second derivatives, the
   Jacobian's complex path, the trace made again when an argument is unused) made
   its in-place writes once per run: a captured numpy array counted twice, silently.
2. A function that raised while traced left tracers in the user's objects (a log it
   appended to, a new attribute, entry or global); so did one that returned, for a
   value stored inside a captured tg.Module whose structure it changed.
3. A `Grads` taken outside a `tg.jit` function could not be used inside it: its keys
   were the user's arrays, the parameters there are tracers.

Each result is compared with the function run uncompiled (`jax.disable_jit`, plain
`jax.hessian`/`jax.jacrev`), or with the uncompiled treegrad call.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad._jaxpr import is_tracer

X = jnp.array([0.3, -0.7])
Y = jnp.array([1.0, 2.0])


def _bumping(kind):
    """A function that adds 1 to a captured numpy array in place, then reads it."""

    def make():
        buf = np.array([1.0, 2.0], np.float32)

        def f(x):
            buf[0] = buf[0] + 1
            y = jnp.sin(x) * buf[0]
            return jnp.sum(y) if kind == "scalar" else y * (1j if kind == "complex" else 1)

        return f, buf

    return make


# --- 1. one write per call ------------------------------------------------------------


def test_hessian_counts_a_numpy_write_once():
    f, buf = _bumping("scalar")()
    with pytest.warns(tg.RetraceWarning, match=r"changes a numpy array it captures in place"):
        (h,) = tg.hessian(f, X)
    # Uncompiled, f runs once: buf[0] is 2 during the run and after it (it was 3).
    np.testing.assert_allclose(h, jnp.diag(-jnp.sin(X)) * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(buf, [2.0, 2.0])


@pytest.mark.parametrize("kind", ["real", "complex"])
def test_jacobian_counts_a_numpy_write_once(kind):
    f, buf = _bumping(kind)()
    with pytest.warns(tg.RetraceWarning, match=r"changes a numpy array it captures in place"):
        (j,) = tg.jacobian(f, X)
    unit = 1j if kind == "complex" else 1.0
    np.testing.assert_allclose(j, jnp.diag(jnp.cos(X)) * 2.0 * unit, rtol=1e-6)
    np.testing.assert_array_equal(buf, [2.0, 2.0])


def test_two_argument_hessian_counts_a_numpy_write_once():
    buf = np.array([1.0], np.float32)

    def f(x, y):
        buf[0] = buf[0] + 1
        return jnp.sum(jnp.sin(x) * y**2) * buf[0]

    with pytest.warns(tg.RetraceWarning, match=r"changes a numpy array it captures in place"):
        hx, hy = tg.hessian(f, X, Y)
    assert buf[0] == 2.0
    np.testing.assert_allclose(hx, jnp.diag(-jnp.sin(X) * Y**2) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(hy, jnp.diag(jnp.sin(X) * 2.0) * 2.0, rtol=1e-6)


def test_gradient_with_an_unused_argument_counts_a_numpy_write_once():
    """The unused argument makes the engine trace again in the same call."""
    f, buf = _bumping("scalar")()
    with pytest.warns(tg.RetraceWarning, match=r"changes a numpy array it captures in place"):
        gx, gy = tg.gradient(lambda x, y: f(x), X, Y)
    assert gy is None and buf[0] == 2.0
    np.testing.assert_allclose(gx, jnp.cos(X) * 2.0, rtol=1e-6)


@pytest.mark.parametrize("kind", ["real", "complex"])
def test_jacobian_rebinding_a_captured_array_once(kind):
    """It was an error saying a traced value was read through a place treegrad
    cannot follow: the run that read the output's type left its tracer in `c`."""
    c = {"s": jnp.array(1.0)}
    unit = 1j if kind == "complex" else 1.0

    def f(x):
        c["s"] = c["s"] + 1
        return jnp.sin(x) * c["s"] * unit

    (j,) = tg.jacobian(f, X)
    assert float(c["s"]) == 2.0 and not is_tracer(c["s"])
    np.testing.assert_allclose(j, jnp.diag(jnp.cos(X)) * 2.0 * unit, rtol=1e-6)


@pytest.mark.parametrize("api", ["jacobian", "hessian"])
def test_a_python_counter_advances_once(api):
    # tg.hessian runs f for the value and again for each argument's Hessian: each run
    # starts from the values the call found, and the last run's changes are made once
    # (`_settle.CHANGES`; before, the counter advanced once a run).
    c = {"n": 1.0}

    def f(x):
        c["n"] = c["n"] + 1
        y = jnp.sin(x) * c["n"]
        return y if api == "jacobian" else jnp.sum(y)

    (out,) = getattr(tg, api)(f, X)
    assert c["n"] == 2.0
    want = jnp.diag(jnp.cos(X) if api == "jacobian" else -jnp.sin(X)) * 2.0
    np.testing.assert_allclose(out, want, rtol=1e-6)


# --- 2. nothing left behind by a failed call --------------------------------------------

GLOBAL = {"v": None}
G_NAME = None


class M(tg.Module):
    def __init__(self):
        self.w = jnp.ones(2)
        self.hist = []


def _routes(fail):
    """Each route rebinds a place to a value computed from the traced arrays."""
    m = M()
    d = {"a": jnp.zeros(())}
    cell = jnp.zeros(())

    def done(y):
        if fail:
            raise RuntimeError("boom")
        return y

    def list_rebind(y):
        m.hist = [*m.hist, y]

    def list_append(y):
        m.hist.append(y)

    def dict_entry(y):
        d["a"] = y

    def dict_new(y):
        d["b"] = y

    def new_attribute(y):
        m.extra = y

    def cell_rebind(y):
        nonlocal cell
        cell = y

    def global_rebind(y):
        global G_NAME
        G_NAME = y

    def global_dict(y):
        GLOBAL["v"] = y

    def several(y):  # a structure changed beside the other places: each still cleared
        m.hist.append(y)
        d["b"] = y
        global_dict(y)

    table = {
        f.__name__: f
        for f in (
            list_rebind,
            list_append,
            dict_entry,
            dict_new,
            new_attribute,
            cell_rebind,
            global_rebind,
            global_dict,
            several,
        )
    }

    def check():
        assert m.hist == [] and "extra" not in vars(m)
        assert set(d) == {"a"} and not is_tracer(d["a"])
        assert not is_tracer(cell) and cell.shape == ()
        assert G_NAME is None and GLOBAL["v"] is None

    return m, table, done, check


APIS = {
    "gradient": lambda f: tg.gradient(lambda x: jnp.sum(f(x)), X),
    "withgradient": lambda f: tg.withgradient(lambda x: jnp.sum(f(x)), X),
    "pullback": lambda f: tg.pullback(f, X),
    "jacobian": lambda f: tg.jacobian(f, X),
    "hessian": lambda f: tg.hessian(lambda x: jnp.sum(f(x)), X),
    "jit": lambda f: tg.jit(f)(X),
}


@pytest.mark.parametrize("api", list(APIS))
def test_a_failed_call_leaves_every_place_as_it_was(api):
    global G_NAME
    for name in list(_routes(True)[1]):
        G_NAME, GLOBAL["v"] = None, None
        m, table, done, check = _routes(True)
        route = table[name]

        def f(x, route=route, m=m, done=done):
            y = jnp.sum(x * m.w)
            route(y)
            return done(x * y)

        w = m.w
        with pytest.raises(RuntimeError, match="boom"):
            APIS[api](f)
        check()
        assert m.w is w, name


def test_a_failed_implicit_call_leaves_the_log_as_it_was():
    m = M()
    ps = tg.params(m)

    def loss():
        m.hist = [*m.hist, jnp.sum(m.w)]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        tg.gradient(loss, ps)
    assert m.hist == []
    with pytest.raises(RuntimeError, match="boom"):
        tg.jit(lambda: tg.gradient(loss, ps))()
    assert m.hist == []


@pytest.mark.parametrize("route", ["list_rebind", "list_append", "new_attribute"])
def test_a_traced_value_stored_in_a_module_is_taken_out_with_a_warning(route):
    """The success path: no tracer stays in the model (it did); the value goes, as
    from a plain list, and the warning says so."""
    m, table, _, check = _routes(False)

    def f(x):
        y = jnp.sum(x * m.w)
        table[route](y)
        return y

    with pytest.warns(tg.RetraceWarning, match=r"stores values computed from its traced arrays"):
        (g,) = tg.gradient(f, X)
    np.testing.assert_array_equal(g, jax.grad(lambda x: jnp.sum(x * jnp.ones(2)))(X))
    check()


# --- 3. a Grads taken outside tg.jit ----------------------------------------------------


def test_a_grads_taken_outside_is_looked_up_inside_tg_jit():
    W = jnp.ones((2, 2))
    ps = tg.Params([W])
    step = tg.jit(lambda x: g[W] * x)
    g = tg.gradient(lambda: jnp.sum(W @ W), ps)
    np.testing.assert_array_equal(step(Y), g[W] * Y)
    g = tg.gradient(lambda: jnp.sum(3.0 * W), ps)  # a new Grads: its gradient, not stale
    np.testing.assert_array_equal(step(Y), 3.0 * jnp.ones((2, 2)) * Y)
    assert g[W] is g[W] and W in g  # looked up with the user's array again afterwards


def test_update_with_a_grads_taken_outside_tg_jit_equals_uncompiled():
    losses = [lambda W: jnp.sum(W @ W), lambda W: jnp.sum(jnp.sin(W))]

    def train(compiled):
        ps = tg.Params([jnp.arange(4.0).reshape(2, 2)])
        state = tg.setup(optax.adam(0.1), ps)
        step = tg.jit(lambda: tg.update_(state, ps, g))
        for loss in losses:
            g = tg.gradient(lambda loss=loss: loss(ps.arrays()[0]), ps)
            step() if compiled else tg.update_(state, ps, g)
            yield ps.arrays()[0]

    for want, got in zip(train(False), train(True), strict=True):
        assert not is_tracer(got)
        np.testing.assert_allclose(got, want, rtol=1e-6)
