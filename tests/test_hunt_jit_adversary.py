"""Adversarial hunt for silent wrong results in `tg.jit` (explicit and implicit steps).

A hostile user edits the model, the `Params`, the closure, the defaults and the
arguments between compiled calls, nests compiled functions, loops several optimiser
steps in one call, ties and freezes weights, donates buffers, and passes inputs
that should be refused. Every numerical check compares with an independent
reference: `jax.grad`/`jax.value_and_grad` of the explicit function, plain optax
applied by hand with `optax.apply_updates`, or the same step run uncompiled.
Bugs found are kept as strict xfails with a minimal reproduction in the reason.
"""

import argparse
import collections
import configparser
import dataclasses
import enum
import functools
import logging
import queue
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

pytestmark = pytest.mark.slow

K = jax.random.split(jax.random.key(0), 6)
X = jax.random.normal(jax.random.key(1), (8, 4))
Y = jnp.sum(X, axis=1, keepdims=True)


def make(k0=0, k1=1, hidden=6, act=jax.nn.tanh):
    return nn.Chain(nn.Dense(4, hidden, act, key=K[k0]), nn.Dense(hidden, 1, key=K[k1]))


def loss_fn(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def copy(tree):
    """A new tree of the same arrays: immune to in-place rebinding of the original."""
    return jax.tree_util.tree_map(lambda a: a, tree)


def close(a, b, tol=1e-5):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for u, v in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


def no_tracers(tree):
    return not any(isinstance(a, jax.core.Tracer) for a in leaves(tree))


def optax_run(model, rule, batches, loss=loss_fn):
    """Plain optax on a copy of `model`: the reference for every training test."""
    params = copy(model)
    state = rule.init(params)
    losses = []
    for x, y in batches:
        value, g = jax.value_and_grad(loss)(params, x, y)
        updates, state = rule.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(value)
    return params, losses


def implicit_step(model, ps, state, loss=loss_fn):
    def step(x, y):
        value = loss(model, x, y)
        tg.update_(state, ps, tg.gradient(lambda: loss(model, x, y), ps))
        return value

    return step


# --- the model edited between compiled calls ---------------------------------------


@pytest.mark.parametrize("by", ["closure", "argument"])
def test_layers_replaced_appended_removed_between_calls(by):
    model = make()
    fwd = tg.jit(lambda x: model(x)) if by == "closure" else tg.jit(lambda m, x: m(x))
    grad = (
        tg.jit(lambda x: tg.withgradient(lambda m: jnp.sum(m(x) ** 2), model))
        if by == "closure"
        else tg.jit(lambda m, x: tg.withgradient(lambda m: jnp.sum(m(x) ** 2), m))
    )
    call = (lambda f: f(X)) if by == "closure" else (lambda f: f(model, X))
    ref = jax.value_and_grad(lambda m: jnp.sum(m(X) ** 2))
    edits = [
        lambda: None,
        lambda: model.layers.__setitem__(1, nn.Dense(6, 3, key=K[2])),  # other shape
        lambda: model.layers.append(nn.Dense(3, 2, key=K[4])),
        lambda: (model.layers.pop(0), model.layers.insert(0, nn.Dense(4, 6, key=K[5]))),
    ]
    for edit in edits:
        edit()
        out = call(fwd)
        assert out.shape == model(X).shape
        close(out, model(X))
        v, (g,) = call(grad)
        rv, rg = ref(model)
        close(v, rv)
        close(g, rg)


def test_array_leaf_swapped_for_other_dtypes_forward_and_gradient():
    model = make()
    fwd = tg.jit(lambda x: model(x))
    ps = tg.params(model)
    grad = tg.jit(lambda x: tg.gradient(lambda: loss_fn(model, x, Y), ps).to_tree(model))
    for dt in [jnp.bfloat16, jnp.float32]:
        model[0].weight = model[0].weight.astype(dt)
        out, ref = fwd(X), model(X)
        assert out.dtype == ref.dtype
        close(out, ref, 1e-2)
        g, rg = grad(X), jax.grad(loss_fn)(model, X, Y)
        assert g[0].weight.dtype == rg[0].weight.dtype == dt
        close(g, rg, 1e-2)


def test_implicit_step_after_a_weight_changes_dtype_equals_uncompiled():
    def run(compiled):
        model = make()
        ps = tg.params(model)
        state = tg.setup(optax.adam(1e-2), ps)
        step = implicit_step(model, ps, state)
        step = tg.jit(step) if compiled else step
        step(X, Y)
        model[1].weight = model[1].weight.astype(jnp.bfloat16)
        step(X, Y)
        step(X, Y)
        return model, state

    (mc, sc), (mu, su) = run(True), run(False)
    assert mc[1].weight.dtype == mu[1].weight.dtype == jnp.bfloat16
    close(mc, mu, 1e-2)
    close(sc, su, 1e-2)


def test_activation_swapped_between_compiled_implicit_steps_equals_uncompiled():
    def run(compiled):
        model = make()
        ps = tg.params(model)
        state = tg.setup(optax.sgd(0.1, momentum=0.9), ps)
        step = implicit_step(model, ps, state)
        step = tg.jit(step) if compiled else step
        losses = []
        for act in [jax.nn.tanh, jnp.sin, jax.nn.tanh]:
            model[0].activation = act
            losses.append(step(X, Y))
        return model, state, losses

    (mc, sc, lc), (mu, su, lu) = run(True), run(False)
    close(mc, mu)
    close(sc, su)
    np.testing.assert_allclose(lc, lu, rtol=1e-5)


def test_activation_set_to_none_then_compiled_implicit_step_equals_optax():
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    step = tg.jit(implicit_step(model, ps, state))
    model[0].activation = None  # a static attribute: no parameter changes
    ref, _ = optax_run(model, optax.adam(1e-2), [(X, Y)] * 2)
    step(X, Y)
    step(X, Y)
    close(model, ref)


def test_layer_of_other_shape_in_implicit_step_fails_like_uncompiled_and_changes_nothing():
    errors = {}
    for compiled in (True, False):
        model = make()
        ps = tg.params(model)
        state = tg.setup(optax.adam(1e-2), ps)
        step = implicit_step(model, ps, state)
        step = tg.jit(step) if compiled else step
        step(X, Y)
        model.layers[1] = nn.Dense(6, 2, key=K[3])
        snap = [np.asarray(a) for a in leaves((model, state))]
        with pytest.raises(ValueError, match=r"'layers\.1\.weight'.*old shape") as e:
            step(X, jnp.concatenate([Y, Y], 1))
        errors[compiled] = str(e.value)
        for a, b in zip(leaves((model, state)), snap, strict=True):
            np.testing.assert_array_equal(a, b)
        assert no_tracers((model, state))
    assert errors[True] == errors[False]


# --- Params and optimiser state rebuilt, several models through one function -----------


def test_params_and_state_rebuilt_in_a_dict_between_calls_equal_optax():
    ns = {}

    def build(k):
        ns["model"] = make(k, k + 1)
        ns["ps"] = tg.params(ns["model"])
        ns["st"] = tg.setup(optax.adam(1e-2), ns["ps"])
        return ns["model"], copy(ns["model"])

    @tg.jit
    def step(x, y):
        tg.update_(ns["st"], ns["ps"], tg.gradient(lambda: loss_fn(ns["model"], x, y), ns["ps"]))

    m1, r1 = build(0)
    step(X, Y)
    step(X, Y)
    m2, r2 = build(2)
    step(X, Y)
    close(m1, optax_run(r1, optax.adam(1e-2), [(X, Y)] * 2)[0])
    close(m2, optax_run(r2, optax.adam(1e-2), [(X, Y)])[0])


def test_params_and_state_rebound_in_closure_cells_between_calls_equal_optax():
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)

    @tg.jit
    def step(x, y):
        tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))

    r1 = copy(model)
    step(X, Y)
    old = model
    model = make(2, 3, hidden=5)  # other structure too
    r2 = copy(model)
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    step(X, Y)
    step(X, Y)
    close(old, optax_run(r1, optax.adam(1e-2), [(X, Y)])[0])
    close(model, optax_run(r2, optax.adam(1e-2), [(X, Y)] * 2)[0])


def test_one_explicit_step_alternates_models_of_same_and_other_structure():
    rule = optax.adam(1e-2)
    models = {"a": make(), "b": make(2, 3, hidden=3, act=jax.nn.relu), "c": make(4, 5)}
    refs = {n: (copy(m), rule.init(m)) for n, m in models.items()}
    cur = {n: (tg.setup(rule, m), m) for n, m in models.items()}

    @tg.jit
    def step(st, m, x, y):
        v, (g,) = tg.withgradient(lambda m: loss_fn(m, x, y), m)
        st, m = tg.update(st, m, g)
        return st, m, v

    for n in "abcab":
        st, m, v = step(*cur[n], X, Y)
        cur[n] = (st, m)
        p, s = refs[n]
        rv, g = jax.value_and_grad(loss_fn)(p, X, Y)
        u, s = rule.update(g, s, p)
        refs[n] = (optax.apply_updates(p, u), s)
        np.testing.assert_allclose(v, rv, rtol=1e-5)
    for n in models:
        close(cur[n][1], refs[n][0])


@pytest.mark.parametrize("select", ["dict-entry", "static-argname"])
def test_one_implicit_step_alternates_models(select):
    rule = optax.sgd(0.1, momentum=0.9)
    models = {"a": make(), "b": make(2, 3, hidden=3), "c": make(4, 5)}
    refs = {n: (copy(m), rule.init(m)) for n, m in models.items()}
    pss = {n: tg.params(m) for n, m in models.items()}
    sts = {n: tg.setup(rule, p) for n, p in pss.items()}
    cur = {"n": "a"}

    def body(n, x, y):
        tg.update_(sts[n], pss[n], tg.gradient(lambda: loss_fn(models[n], x, y), pss[n]))

    if select == "dict-entry":
        jstep = tg.jit(lambda x, y: body(cur["n"], x, y))
        call = lambda n: (cur.__setitem__("n", n), jstep(X, Y))
    else:
        jstep = tg.jit(lambda x, y, which: body(which, x, y), static_argnames="which")
        call = lambda n: jstep(X, Y, which=n)
    for n in "acbaacb":
        call(n)
        p, s = refs[n]
        u, s = rule.update(jax.grad(loss_fn)(p, X, Y), s, p)
        refs[n] = (optax.apply_updates(p, u), s)
    for n in models:
        close(models[n], refs[n][0])


def test_compiled_and_uncompiled_implicit_steps_interleaved_equal_optax():
    model = make()
    ref = copy(model)
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    eager = implicit_step(model, ps, state)
    compiled = tg.jit(eager)
    batches = [(X * (k + 1), Y) for k in range(5)]
    losses = [(compiled if k % 2 else eager)(x, y) for k, (x, y) in enumerate(batches)]
    ref, ref_losses = optax_run(ref, optax.adam(1e-2), batches)
    close(model, ref)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


# --- several optimiser steps in one compiled call -----------------------------------


def test_python_loop_of_implicit_steps_in_one_call_equals_optax():
    model = make()
    ref = copy(model)
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)

    @tg.jit
    def steps(x, y):
        values = []
        for k in range(4):
            values.append(loss_fn(model, x * (k + 1), y))
            tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x * (k + 1), y), ps))  # noqa: B023
        return jnp.stack(values)

    losses = np.concatenate([steps(X, Y), steps(X, Y)])
    ref, ref_losses = optax_run(ref, optax.adam(1e-2), [(X * (k + 1), Y) for k in range(4)] * 2)
    close(model, ref)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert int(leaves(state)[0]) == 8  # adam's count written back
    assert no_tracers((model, state))


def test_python_loop_of_explicit_steps_in_one_call_equals_optax():
    model = make()
    rule = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))

    @tg.jit
    def steps(st, m, x, y):
        for _ in range(2):
            (g,) = tg.gradient(lambda m: loss_fn(m, x, y), m)
            st, m = tg.update(st, m, g)
        return st, m

    st, m = steps(tg.setup(rule, model), model, X, Y)
    st, m = steps(st, m, X, Y)
    close(m, optax_run(model, rule, [(X, Y)] * 4)[0])


def test_manual_sgd_with_a_python_learning_rate_edited_between_calls():
    cfg = {"lr": 0.1}

    def run(compiled):
        model = make()
        ps = tg.params(model)

        def step(x, y):
            grads = tg.gradient(lambda: loss_fn(model, x, y), ps)
            for layer in model.layers:
                layer.weight = layer.weight - cfg["lr"] * grads[layer.weight]
                layer.bias = layer.bias - cfg["lr"] * grads[layer.bias]

        step = tg.jit(step) if compiled else step
        for lr in [0.1, 0.0, 0.5, 0.1]:
            cfg["lr"] = lr
            step(X, Y)
        return model

    got = run(True)
    ref = make()
    for lr in [0.1, 0.0, 0.5, 0.1]:
        ref = jax.tree_util.tree_map(lambda p, g: p - lr * g, ref, jax.grad(loss_fn)(ref, X, Y))  # noqa: B023
    close(got, ref)
    close(run(False), ref)


# --- tied and frozen weights with tg.update_ inside tg.jit -------------------------------


class Tied(tg.Module):
    def __init__(self):
        self.w = 0.5 * jax.random.normal(K[2], (4, 4))
        self.v = self.w  # tied
        self.o = jax.random.normal(K[3], (4, 1))

    def __call__(self, x):
        return jnp.tanh(jnp.tanh(x @ self.w) @ self.v) @ self.o


def tied_optax(n, frozen=()):
    """Plain optax on {'w': the tied array, 'o'}; frozen entries get no update."""
    m = Tied()
    p = {"w": m.w, "o": m.o}

    def loss(p):
        return jnp.mean((jnp.tanh(jnp.tanh(X @ p["w"]) @ p["w"]) @ p["o"] - Y) ** 2)

    rule = optax.adam(1e-2)
    s = rule.init(p)
    for _ in range(n):
        u, s = rule.update(jax.grad(loss)(p), s, p)
        u = {k: jnp.zeros_like(v) if k in frozen else v for k, v in u.items()}
        p = optax.apply_updates(p, u)
    return p


@pytest.mark.parametrize("target", ["model", "params"])
@pytest.mark.parametrize("frozen", [(), ("o",)])
def test_tied_weight_and_frozen_parameter_in_compiled_update_(target, frozen):
    m = Tied()
    ps = tg.params(m)
    assert len(ps) == 2
    state = tg.setup(optax.adam(1e-2), m if target == "model" else ps)
    for name in frozen:
        tg.freeze_(getattr(state, name))
    o0 = m.o

    @tg.jit
    def step(x, y):
        grads = tg.gradient(lambda: loss_fn(m, x, y), ps)
        if target == "model":
            tg.update_(state, m, grads.to_tree(m))
        else:
            tg.update_(state, ps, grads)

    for _ in range(3):
        step(X, Y)
    ref = tied_optax(3, frozen)
    assert m.w is m.v
    close(m.w, ref["w"])
    if frozen:
        assert m.o is o0
    close(m.o, ref["o"])
    assert no_tracers((m, state))


def test_freezing_a_tied_weight_freezes_both_places_as_uncompiled():
    def run(compiled):
        m = Tied()
        state = tg.setup(optax.adam(1e-2), m)
        tg.freeze_(state.w)

        def step(x, y):
            tg.update_(state, m, tg.gradient(lambda m: loss_fn(m, x, y), m)[0])

        step = tg.jit(step) if compiled else step
        step(X, Y)
        step(X, Y)
        return m, state

    (mc, sc), (mu, su) = run(True), run(False)
    w0 = Tied().w
    assert mc.w is mc.v and mu.w is mu.v
    np.testing.assert_array_equal(mc.w, w0)
    close(mc, mu)
    close(sc, su)
    ref = tied_optax(2, frozen=("w",))
    close(mc.o, ref["o"])


# --- methods, keywords, defaults, closures ------------------------------------------


class Net(tg.Module):
    def __init__(self, k):
        self.l = nn.Dense(4, 1, key=K[k])
        self.scale = 1.0

    @tg.jit
    def __call__(self, x):
        return self.l(x) * self.scale

    @tg.jit
    def loss(self, x, y):
        return jnp.mean((self(x) - y) ** 2)


def test_tg_jit_methods_read_the_instance_fresh():
    def ref(n, x):
        return n.l(x) * n.scale

    n, other = Net(0), Net(1)
    for edit in [
        lambda: None,
        lambda: setattr(n, "scale", 3.0),
        lambda: setattr(n.l, "weight", n.l.weight * 2),
        lambda: setattr(n, "l", nn.Dense(4, 1, jnp.tanh, key=K[2])),
    ]:
        edit()
        close(n(X), ref(n, X))
        close(other(X), ref(other, X))
    v, (g,) = tg.withgradient(lambda m: m.loss(X, Y), n)
    rv, rg = jax.value_and_grad(lambda m: jnp.mean((ref(m, X) - Y) ** 2))(n)
    close(v, rv)
    close(g, rg)


def test_keyword_and_default_arguments_changed_between_calls():
    def f(x, scale=2.0, *, shift=0.0, fn=jnp.sin):
        return fn(x) * scale + shift

    jf = tg.jit(f)
    x = jnp.arange(3.0)
    calls = [
        ((), {}),
        ((), {"scale": 3.0}),
        ((5.0,), {}),
        ((), {"shift": 1.0}),
        ((), {"fn": jnp.cos}),
        ((), {"scale": jnp.array(4.0)}),
        ((), {"shift": 1}),
        ((), {"scale": 2}),
        ((), {"fn": lambda v: v**2, "shift": -1.0}),
        ((), {}),
    ]
    for args, kw in calls:
        out, ref = jf(x, *args, **kw), f(x, *args, **kw)
        assert out.dtype == ref.dtype
        close(out, ref)
    f.__defaults__ = (7.0,)
    close(jf(x), f(x))
    f.__kwdefaults__ = {"shift": 10.0, "fn": jnp.cos}
    close(jf(x), f(x))


def test_mutable_and_array_defaults_are_read_fresh():
    cfg = {"s": 1.0}

    def f(x, w=jnp.ones(3), c=cfg):  # noqa: B008
        return x * w * c["s"]

    jf = tg.jit(f)
    x = jnp.arange(3.0)
    close(jf(x), f(x))
    cfg["s"] = 5.0
    close(jf(x), f(x))
    f.__defaults__ = (jnp.full(3, 2.0), {"s": -1.0})
    close(jf(x), f(x))


def test_varargs_and_kwargs_of_changing_arity():
    def f(*args, **kw):
        return sum(args) * kw.get("s", 1.0) + kw.get("b", 0.0)

    jf = tg.jit(f)
    x = jnp.ones(2)
    for args, kw in [
        ((x,), {}),
        ((x, x), {}),
        ((x, x), {"s": 2.0}),
        ((x,), {"s": 2.0, "b": jnp.ones(2)}),
        ((x,), {"b": 1.0, "s": 2.0}),
    ]:
        close(jf(*args, **kw), f(*args, **kw))


def test_closure_cells_rebound_to_other_functions_and_numbers():
    def maker():
        act, n = jnp.sin, 2

        def f(x):
            return act(x) ** n

        def set_(a, b):
            nonlocal act, n
            act, n = a, b

        return f, set_

    f, set_ = maker()
    jf = tg.jit(f)
    x = jnp.arange(3.0)
    for a, b in [
        (jnp.sin, 2),
        (jnp.cos, 2),
        (jnp.cos, 3),
        (lambda v: v + 1, 3),
        (lambda v: v * 2, 3),  # a new lambda, other code
        (jnp.sin, 2.0),
    ]:
        set_(a, b)
        out, ref = jf(x), f(x)
        assert out.dtype == ref.dtype
        close(out, ref)


def test_partial_argument_with_changed_keywords_gradient_equals_jax():
    def loss(m, x, scale, power):
        return jnp.sum((m["w"] * x) ** power) * scale

    f = tg.jit(lambda fn, m, x: tg.withgradient(lambda m: fn(m, x), m))
    m, x = {"w": jnp.array([1.0, 2.0])}, jnp.array([0.5, -1.0])
    for sc, pw in [(1.0, 2), (3.0, 2), (3.0, 3), (1.0, 2)]:
        p = functools.partial(loss, scale=sc, power=pw)
        v, (g,) = f(p, m, x)
        rv, rg = jax.value_and_grad(lambda m: p(m, x))(m)  # noqa: B023
        close((v, g), (rv, rg))


def test_class_attribute_and_training_flag_edited_between_calls():
    class Drop(tg.Module):
        scale = 2.0

        def __init__(self):
            self.w = jnp.array([1.0, -2.0])
            self.training = True

        def __call__(self, x):
            y = self.w * x * self.scale
            return y * 0.5 if self.training else y

    n = Drop()
    x = jnp.array([1.0, 3.0])
    fwd = tg.jit(lambda x: n(x))
    grad = tg.jit(lambda m, x: tg.gradient(lambda m: jnp.sum(m(x) ** 2), m)[0])
    for edit in [
        lambda: None,
        lambda: setattr(Drop, "scale", 5.0),
        lambda: setattr(n, "training", False),
        lambda: setattr(n, "scale", 7.0),  # the instance shadows the class
        lambda: delattr(n, "scale"),
    ]:
        edit()
        close(fwd(x), n(x))
        close(grad(n, x), jax.grad(lambda m: jnp.sum(m(x) ** 2))(n))


@dataclasses.dataclass
class Cfg:
    s: float


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


def _containers():
    """(holder, read, edit): a value read through a container, then edited in place."""
    dc = Cfg(2.0)
    dq = collections.deque([2.0, 1.0])
    dd = collections.defaultdict(float, {"s": 2.0})
    od = collections.OrderedDict(a=jnp.ones(2), b=jnp.full(2, 5.0))
    cm = collections.ChainMap({}, {"s": 2.0})
    ud = collections.UserDict({"s": 2.0})
    col = [Colour.RED]
    return {
        "dataclass": (lambda: dc.s, lambda: setattr(dc, "s", 3.0)),
        "deque": (lambda: dq[0], lambda: dq.appendleft(3.0)),
        "defaultdict": (lambda: dd["s"], lambda: dd.__setitem__("s", 3.0)),
        "ordereddict-order": (lambda: next(iter(od.values())), lambda: od.move_to_end("a")),
        "chainmap-shadow": (lambda: cm["s"], lambda: cm.maps[0].__setitem__("s", 3.0)),
        "userdict": (lambda: ud["s"], lambda: ud.__setitem__("s", 3.0)),
        "enum": (
            lambda: 1.0 if col[0] is Colour.RED else -1.0,
            lambda: col.__setitem__(0, Colour.BLUE),
        ),
    }


@pytest.mark.parametrize("case", list(_containers()))
def test_values_read_through_library_containers_are_fresh(case):
    read, edit = _containers()[case]
    f = lambda x: x * read()
    jf = tg.jit(f)
    x = jnp.array([1.0, 2.0])
    close(jf(x), f(x))
    edit()
    close(jf(x), f(x))


def test_closure_dict_of_layers_reordered_between_calls():
    layers = {"a": nn.Dense(4, 4, jnp.tanh, key=K[0]), "b": nn.Dense(4, 4, key=K[1])}

    def fwd(x):
        for layer in layers.values():
            x = layer(x)
        return x

    jf = tg.jit(fwd)
    close(jf(X), fwd(X))
    layers["a"] = layers.pop("a")  # now b, then a: a new trace applies them so
    close(jf(X), fwd(X))
    close(jf(X), layers["a"](layers["b"](X)))


@pytest.mark.parametrize(
    "case",
    [
        "argparse",
        "make_dataclass",
        "userlist",
        "weakvaluedict",
        "queue",
        "userstring",
        "configparser",
        "configparser-section",
    ],
)
def test_values_read_through_stdlib_value_holders_are_fresh(case):
    # Once checked by identity only (a library's object): an edit in place was stale.
    class Box:
        s = 2.0

    box = Box()
    if case == "argparse":
        args = argparse.Namespace(lr=2.0)  # hyperparameters from the command line
        read, edit = (lambda: args.lr), (lambda: setattr(args, "lr", 3.0))
    elif case == "make_dataclass":
        cfg = dataclasses.make_dataclass("Cfg", [("s", float)])(2.0)  # 3.11: __module__ 'types'
        read, edit = (lambda: cfg.s), (lambda: setattr(cfg, "s", 3.0))
    elif case == "userlist":
        ul = collections.UserList([2.0])
        read, edit = (lambda: ul[0]), (lambda: ul.__setitem__(0, 3.0))
    elif case == "weakvaluedict":
        wv = weakref.WeakValueDictionary({"b": box})
        read, edit = (lambda: wv["b"].s), (lambda: setattr(box, "s", 3.0))
    elif case.startswith("configparser"):
        ini = configparser.ConfigParser()  # a config read from a file
        ini.read_dict({"train": {"lr": "2.0"}})
        section = ini["train"]
        if case == "configparser":
            read = lambda: ini.getfloat("train", "lr")
        else:
            read = lambda: float(section["lr"])
        edit = lambda: ini.set("train", "lr", "3.0")
    elif case == "userstring":
        us = collections.UserString("double")
        read, edit = (lambda: 2.0 if us == "double" else 3.0), (lambda: us.__init__("triple"))
    else:
        q = queue.Queue()
        q.put(2.0)
        read, edit = (lambda: q.queue[0]), (lambda: q.queue.__setitem__(0, 3.0))
    traces = []

    def f(x):
        traces.append(1)
        return x * read()

    jf = tg.jit(f)
    x = jnp.array([1.0, 2.0])
    close(jf(x), x * 2.0)
    close(jf(x), x * 2.0)
    assert len(traces) == 1  # nothing changed: not traced again
    edit()
    close(jf(x), x * 3.0)  # was [2, 4]
    assert len(traces) == 2


def test_a_logger_read_by_the_function_is_not_walked_into():
    # A library object that is no value holder stays checked by identity: its
    # internals (a cache of levels, handlers) change without tracing again.
    log = logging.getLogger("treegrad-test-logger")
    traces = []

    def f(x):
        traces.append(1)
        log.debug("step")
        return x * 2.0

    jf = tg.jit(f)
    x = jnp.array([1.0, 2.0])
    jf(x)
    log.setLevel(logging.DEBUG)  # clears the logger's level cache
    log.isEnabledFor(logging.INFO)
    jf(x)
    assert len(traces) == 1


def test_schedule_reading_a_user_list_through_optax_is_fresh():
    sched = [0.1]

    def run(compiled):
        model = {"w": jnp.ones(3)}
        ps = tg.params(model)
        state = tg.setup(optax.sgd(learning_rate=lambda count: sched[0]), ps)
        step = lambda x: tg.update_(state, ps, tg.gradient(lambda: jnp.sum(model["w"] * x), ps))
        step = tg.jit(step) if compiled else step
        out = []
        for lr in [0.1, 0.5, 0.0, 0.25]:
            sched[0] = lr
            step(jnp.ones(3))
            out.append(np.asarray(model["w"]))
        return out

    expected = 1 - np.cumsum([0.1, 0.5, 0.0, 0.25])
    np.testing.assert_allclose([v[0] for v in run(True)], expected, rtol=1e-6)
    np.testing.assert_allclose([v[0] for v in run(False)], expected, rtol=1e-6)


@pytest.mark.parametrize("lr_from", ["traced-argument", "closure-float"])
def test_adjust_inside_a_compiled_step_equals_uncompiled(lr_from):
    cfg = {"lr": 0.1}

    def run(compiled):
        model = {"w": jnp.ones(3)}
        ps = tg.params(model)
        state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), ps)

        def step(x, lr):
            tg.adjust_(state, learning_rate=lr if lr_from == "traced-argument" else cfg["lr"])
            tg.update_(state, ps, tg.gradient(lambda: jnp.sum((model["w"] * x) ** 2), ps))

        step = tg.jit(step) if compiled else step
        for v in [0.1, 0.5, 0.0, 0.2]:
            cfg["lr"] = v
            step(jnp.arange(3.0), jnp.asarray(v))
        return model, state

    (mc, sc), (mu, su) = run(True), run(False)
    close(mc, mu, 1e-6)
    close(sc, su, 1e-6)
    # plain optax with the same learning rates
    p = {"w": jnp.ones(3)}
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    s = rule.init(p)
    for v in [0.1, 0.5, 0.0, 0.2]:
        s.hyperparams["learning_rate"] = jnp.asarray(v)
        g = jax.grad(lambda p: jnp.sum((p["w"] * jnp.arange(3.0)) ** 2))(p)
        u, s = rule.update(g, s, p)
        p = optax.apply_updates(p, u)
    close(mc, p, 1e-6)


def test_integer_counter_leaf_rebound_next_to_update_():
    class Counted(tg.Module):
        def __init__(self):
            self.w = jnp.ones(3)
            self.count = jnp.array(0)

    def run(compiled):
        m = Counted()
        ps = tg.params(m)
        state = tg.setup(optax.sgd(0.1), ps)

        def step(x):
            tg.update_(state, ps, tg.gradient(lambda: jnp.sum(m.w * x) * (m.count + 1), ps))
            m.count = m.count + 1

        step = tg.jit(step) if compiled else step
        for _ in range(3):
            step(jnp.ones(3))
        return m

    got, ref = run(True), run(False)
    assert int(got.count) == int(ref.count) == 3
    assert len(tg.params(got)) == 1  # the counter is no parameter
    np.testing.assert_allclose(got.w, 1 - 0.1 * (1 + 2 + 3) * np.ones(3), rtol=1e-6)
    close(got, ref)


def test_numpy_parameters_in_a_compiled_implicit_step_equal_uncompiled():
    def run(compiled):
        model = {"w": np.ones(3, np.float32), "b": np.zeros((), np.float32)}
        ps = tg.params(model)
        state = tg.setup(optax.adam(0.1), ps)
        loss = lambda: jnp.sum((model["w"] * jnp.arange(3.0) + model["b"]) ** 2)
        step = lambda: tg.update_(state, ps, tg.gradient(loss, ps))
        step = tg.jit(step) if compiled else step
        for _ in range(3):
            step()
        return model, state

    (mc, sc), (mu, su) = run(True), run(False)
    assert type(mc["w"]) is type(mu["w"])
    close(mc, mu, 1e-6)
    close(sc, su, 1e-6)


# --- tg.jit inside tg.jit ---------------------------------------------------------------


def test_nested_tg_jit_static_arguments_and_closure_model():
    inner = tg.jit(lambda x, n: x * n, static_argnums=1)
    outer = tg.jit(lambda x, n: inner(x, n) + inner(x, 2 * n), static_argnums=1)
    x = jnp.arange(3.0)
    for n in (1, 2, 3.0):
        close(outer(x, n), x * n + x * 2 * n)
    # A traced value handed to the inner helper's static position is inlined, not baked.
    traced = tg.jit(lambda x, s: inner(x, s))
    for s in (2.0, -1.0):
        close(traced(x, jnp.asarray(s)), x * s)
    model = make()
    fwd = tg.jit(lambda m, x: m(x))
    via_closure = tg.jit(lambda x: fwd(model, x))
    for edit in [
        lambda: None,
        lambda: setattr(model[0], "weight", model[0].weight * 3),
        lambda: model.layers.__setitem__(1, nn.Dense(6, 2, key=K[3])),
    ]:
        edit()
        close(via_closure(X), model(X))


def test_nested_implicit_step_called_twice_by_an_outer_step_equals_optax():
    model = make()
    ref = copy(model)
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    inner = tg.jit(implicit_step(model, ps, state))
    outer = tg.jit(lambda x, y: inner(x, y) + inner(2 * x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [outer(X, Y), inner(X, Y), outer(X, Y)]
    # outer = two steps (x, then 2x), inner = one: five steps in all
    batches = [(X, Y), (2 * X, Y), (X, Y), (X, Y), (2 * X, Y)]
    ref, ref_losses = optax_run(ref, optax.adam(1e-2), batches)
    close(model, ref)
    np.testing.assert_allclose(
        losses,
        [ref_losses[0] + ref_losses[1], ref_losses[2], ref_losses[3] + ref_losses[4]],
        rtol=1e-5,
    )
    assert no_tracers((model, state))


# --- failures leave the user's objects intact -------------------------------------------


def test_error_raised_after_update_in_the_trace_leaves_model_and_state_intact():
    model = make()
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)

    @tg.jit
    def step(x, y):
        tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))
        if x.shape[0] == 3:
            raise RuntimeError("user error after the update")
        return loss_fn(model, x, y)

    ref = copy(model)
    step(X, Y)
    snap = [np.asarray(a) for a in leaves((model, state))]
    w = model[0].weight
    with pytest.raises(RuntimeError, match="user error after the update"):
        step(X[:3], Y[:3])
    with pytest.raises(ValueError, match=r"expected input with 4 features.*\(8, 3\)"):
        step(X[:, :3], Y)
    assert model[0].weight is w and no_tracers((model, state))
    for a, b in zip(leaves((model, state)), snap, strict=True):
        np.testing.assert_array_equal(a, b)
    step(X, Y)  # still usable, and the failed calls took no step
    close(model, optax_run(ref, optax.adam(1e-2), [(X, Y)] * 2)[0])


# --- donation -------------------------------------------------------------------------


def test_donated_explicit_step_equals_undonated_and_deletes_the_old_model():
    rule = optax.adam(1e-2)
    model = make()

    def step(st, m, x, y):
        (g,) = tg.gradient(lambda m: loss_fn(m, x, y), m)
        return tg.update(st, m, g)

    donating = tg.jit(step, donate_argnums=(0, 1))
    st = tg.setup(rule, model)
    for _ in range(3):
        old = model
        st, model = donating(st, model, X, Y)
    assert all(a.is_deleted() for a in leaves(old))
    close(model, optax_run(make(), rule, [(X, Y)] * 3)[0])


def test_donated_tied_weight_stays_tied_and_equals_optax():
    m = Tied()
    st = tg.setup(optax.adam(1e-2), m)
    step = tg.jit(
        lambda st, m, x, y: tg.update(st, m, tg.gradient(lambda m: loss_fn(m, x, y), m)[0]),
        donate_argnums=(0, 1),
    )
    for _ in range(3):
        st, m = step(st, m, X, Y)
    assert m.w is m.v
    ref = tied_optax(3)
    close(m.w, ref["w"])
    close(m.o, ref["o"])


def test_donated_argument_that_the_closure_also_holds_is_not_deleted():
    model = make()
    double = lambda t: jax.tree_util.tree_map(lambda p: p * 2, t)
    f = tg.jit(lambda a, x: double(a)(x) + model(x), donate_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # jax: some donated buffers not usable
        out = f(model, X)
    close(out, double(make())(X) + make()(X))
    assert not any(a.is_deleted() for a in leaves(model))
    close(f(model, X), out)


def test_reusing_a_donated_argument_is_a_clear_error():
    f = tg.jit(lambda m: {"w": m["w"] * 2}, donate_argnums=0)
    m = {"w": jnp.ones(3)}
    f(m)
    with pytest.raises(RuntimeError, match=r"deleted"):
        f(m)


# --- arguments are values: what the step writes into them ----------------------------


def test_optimiser_state_passed_as_an_argument_and_not_returned_is_refused():
    # Once silently dropped: the model trained while adam's count and moments stayed 0.
    model = make()
    ref = copy(model)
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)
    before = [np.asarray(a) for a in leaves(state)]

    @tg.jit
    def step(st, x, y):
        tg.update_(st, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))

    with pytest.raises(TypeError, match=r"assigns new arrays into one of its arguments.*Return"):
        step(state, X, Y)
    close(model, ref)  # nothing changed: neither the model nor the state
    assert all(np.array_equal(a, b) for a, b in zip(leaves(state), before, strict=True))

    # Returned, the advanced state comes back, as with jax.jit: equal to optax.
    @tg.jit
    def returning(st, x, y):
        tg.update_(st, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))
        return st

    for _ in range(3):
        state = returning(state, X, Y)
    close(model, optax_run(ref, optax.adam(1e-2), [(X, Y)] * 3)[0])
    assert int(leaves(state)[0]) == 3


def test_params_passed_as_an_argument_to_an_implicit_step_equals_optax():
    model = make()
    ref = copy(model)
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-2), ps)

    @tg.jit
    def step(ps, x, y):
        tg.update_(state, ps, tg.gradient(lambda: loss_fn(model, x, y), ps))

    for _ in range(3):
        step(ps, X, Y)
    close(model, optax_run(ref, optax.adam(1e-2), [(X, Y)] * 3)[0])


def test_plain_object_argument_rebound_inside_the_step_is_written_back():
    # Once a leaked DynamicJaxprTracer in obj.w; then refused. An argument that is a
    # plain object is read and written back as a captured one is, as uncompiled.
    class Holder:
        def __init__(self):
            self.w = jnp.ones(3)

    def upd(obj, x):
        obj.w = obj.w + x
        return jnp.sum(obj.w)

    h = Holder()
    step = tg.jit(upd)
    close(step(h, jnp.ones(3)), 6.0)
    assert np.asarray(h.w).tolist() == [2.0, 2.0, 2.0]
    close(step(h, jnp.ones(3)), 9.0)  # the new h.w is an input, not a constant
    assert np.asarray(h.w).tolist() == [3.0, 3.0, 3.0]
    # Captured instead of passed: the same.
    tg.jit(lambda x: upd(h, x))(jnp.ones(3))
    assert np.asarray(h.w).tolist() == [4.0, 4.0, 4.0]


def test_plain_object_inside_a_pytree_argument_rebound_is_refused_and_kept():
    # Inside a list, the object is one static leaf of a pytree, passed by reference.
    class Holder:
        def __init__(self):
            self.w = jnp.ones(3)

    def upd(objs, x):
        objs[0].w = objs[0].w + x

    h = Holder()
    with pytest.raises(TypeError, match=r"stores a traced array in attribute 'w'.*Holder"):
        tg.jit(upd)([h], jnp.ones(3))
    assert not isinstance(h.w, jax.core.Tracer)
    assert np.asarray(h.w).tolist() == [1.0, 1.0, 1.0]


class Trainer:
    """A plain Python class holding a model, its Params and state: a common layout."""

    def __init__(self):
        self.model = make()
        self.ps = tg.params(self.model)
        self.state = tg.setup(optax.adam(1e-2), self.ps)

    def eager_step(self, x, y):
        tg.update_(self.state, self.ps, tg.gradient(lambda: loss_fn(self.model, x, y), self.ps))
        return loss_fn(self.model, x, y)

    step = tg.jit(eager_step)


def test_trainer_method_compiled_through_a_closure_equals_optax():
    t = Trainer()
    ref = copy(t.model)
    step = tg.jit(lambda x, y: t.eager_step(x, y))
    for _ in range(3):
        step(X, Y)
    close(t.model, optax_run(ref, optax.adam(1e-2), [(X, Y)] * 3)[0])


def test_tg_jit_method_of_a_plain_trainer_class_equals_optax():
    # Once leaked tracers into self.model (self was static data, by reference).
    t = Trainer()
    ref = copy(t.model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)  # self's arrays are inputs
        for _ in range(3):
            t.step(X, Y)
    assert no_tracers((t.model, t.state))
    close(t.model, optax_run(ref, optax.adam(1e-2), [(X, Y)] * 3)[0])


# --- inputs refused with a clear message ----------------------------------------------


def test_refused_inputs_say_what_is_wrong():
    with pytest.raises(TypeError, match=r"tg\.jit expects a function, got int 3"):
        tg.jit(3)
    g = tg.jit(lambda x, mode: x, static_argnames="mode")
    with pytest.raises(TypeError, match=r"static argument 'mode' must be hashable.*dict"):
        g(jnp.ones(2), mode={"a": 1})
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'b'"):
        tg.jit(lambda a, b: a + b)(jnp.ones(2))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'c'"):
        tg.jit(lambda a: a)(jnp.ones(2), c=1)
    model = make()
    ps = tg.params(model)
    with pytest.raises(TypeError, match=r"returns a tg\.Grads.*to_tree"):
        tg.jit(lambda x: tg.gradient(lambda: loss_fn(model, x, Y), ps))(X)
    st = tg.setup(optax.sgd(0.1), model)
    with pytest.raises(ValueError, match=r"gradient tree does not match the model"):
        tg.jit(lambda st, m: tg.update(st, m, {"x": jnp.ones(1)}))(st, model)


def test_returning_params_from_tg_jit_is_refused_or_holds_no_tracers():
    @tg.jit
    def init():
        m = make()
        return m, tg.params(m)

    try:
        m, ps = init()
    except TypeError as e:
        assert "Params" in str(e)
        return
    assert no_tracers(list(ps))
    grads = tg.gradient(lambda: loss_fn(m, X, Y), ps)
    close(grads.to_tree(m), jax.grad(loss_fn)(m, X, Y))


@pytest.mark.parametrize(
    "options",
    [{"static_argnames": "scal"}, {"static_argnums": 3}, {"donate_argnums": 3}],
    ids=["unknown-static-argname", "static-argnum-out-of-range", "donate-argnum-out-of-range"],
)
def test_options_naming_no_argument_are_refused_like_jax_jit(options):
    def f(x, scale=1.0):
        return x * scale

    with pytest.raises(ValueError):
        jax.jit(f, **options)(jnp.ones(2))  # the reference behaviour
    with pytest.raises(
        ValueError, match=r"tg\.jit: (static|donate)_arg(nums=3|names='scal') names no"
    ):
        tg.jit(f, **options)(jnp.ones(2))


# --- plain objects passed as arguments: read and written back as captured ----------------


class _Box:
    def __init__(self, w, scale=2.0):
        self.w = w
        self.scale = scale


class _Slots:
    __slots__ = ("scale", "w")

    def __init__(self, w, scale=2.0):
        self.w = w
        self.scale = scale


def _bump(a, b, x):
    a.w = a.w + x * a.scale
    b.w = b.w * 2
    return jnp.sum(a.w * b.w)


def _plain_cases():
    """name -> (make the objects, call the step on them and x): run compiled and eager."""
    return {
        "two objects": (lambda: (_Box(jnp.ones(2)), _Box(jnp.ones(2))), lambda f, o, x: f(*o, x)),
        "the same object twice": (lambda: (_Box(jnp.ones(2)),), lambda f, o, x: f(o[0], o[0], x)),
        "slots": (lambda: (_Slots(jnp.ones(2)), _Slots(jnp.ones(2))), lambda f, o, x: f(*o, x)),
        "numpy attribute": (
            lambda: (_Box(np.ones(2, np.float32)), _Box(jnp.ones(2))),
            lambda f, o, x: f(*o, x),
        ),
        "keyword": (
            lambda: (_Box(jnp.ones(2)), _Box(jnp.ones(2))),
            lambda f, o, x: f(b=o[1], a=o[0], x=x),
        ),
    }


@pytest.mark.parametrize("case", list(_plain_cases()))
def test_plain_object_arguments_train_as_uncompiled(case):
    make_objs, call = _plain_cases()[case]
    x = jnp.array([1.0, 2.0])
    compiled, eager = make_objs(), make_objs()
    step = tg.jit(_bump)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)  # the objects' arrays are inputs
        for i in range(3):
            if i == 2:  # a non-array attribute edited between calls is read fresh
                for o in (*compiled, *eager):
                    o.scale = 5.0
            close(call(step, compiled, x), call(_bump, eager, x))
            close([o.w for o in compiled], [o.w for o in eager])


def test_plain_object_argument_alternating_instances_trace_once():
    traces = []

    def f(o, x):
        traces.append(1)
        return jnp.sum(o.w * x * o.scale)

    jf = tg.jit(f)
    a, b = _Box(jnp.ones(2)), _Box(jnp.array([3.0, 3.0]))
    x = jnp.array([1.0, 2.0])
    for o in (a, b, a, b):
        close(jf(o, x), f(o, x))
    assert len(traces) == 1 + 4  # one trace; then the eager references


def test_callable_object_argument_reads_its_arrays_fresh():
    class Scale:
        def __init__(self):
            self.k = jnp.array(3.0)

        def __call__(self, x):
            return self.k * x

    c = Scale()
    f = tg.jit(lambda h, x: h(x))
    x = jnp.array([1.0, 2.0])
    close(f(c, x), 3.0 * x)
    c.k = jnp.array(4.0)
    close(f(c, x), 4.0 * x)


def test_object_whose_getattr_raises_anything_is_read_by_its_slots():
    # Its __getattr__ was asked for __qualname__ and __dict__, and its RuntimeError
    # escaped from tg.jit and tg.gradient.
    class Strict:
        __slots__ = ("w",)

        def __init__(self):
            self.w = jnp.array([1.0, 2.0])

        def __getattr__(self, name):
            raise RuntimeError(f"no attribute {name}")

    s = Strict()
    x = jnp.array([3.0, 4.0])
    close(tg.jit(lambda o, x: o.w * x)(s, x), s.w * x)
    close(tg.jit(lambda x: s.w * x)(x), s.w * x)
    close(tg.gradient(lambda x: jnp.sum(s.w * x), x)[0], s.w)
    s.w = jnp.array([5.0, 6.0])  # read fresh through the slot
    close(tg.jit(lambda o, x: o.w * x)(s, x), s.w * x)
