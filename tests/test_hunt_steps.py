"""Hostile hunt for silent wrong results in whole training programs run as sequences.

A "world" is a model, its `Params`, an optimiser state and a few step functions.
Two worlds run the same random sequence of operations (hypothesis): one with its
steps under `tg.jit` (implicit, explicit, donating, nested), one uncompiled. The
operations are those a user mixes between steps: replacing a layer, rebinding or
tying/untying weights, `Params` add/remove/union, freeze/thaw, `tg.adjust_`,
static Python values the loss reads, batches of another shape, `tg.save`/`tg.load`
to continue, `tg.train` with a `Params` and with a model. After every operation
the two worlds must hold the same model arrays (and ties), optimiser state and
parameters; a failing operation must fail the same way in both, with nothing the
user had changed. Trace counters check that nothing re-traces where nothing
structural changed. Targeted tests compare with plain optax / `jax.grad` written
by hand, and bit for bit with the explicit style where API.md promises it.
Bugs found are kept as strict xfails with a minimal reproduction (`test_bug_*`).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treegrad as tg
from treegrad import nn

K = jax.random.split(jax.random.key(7), 16)
X8 = jax.random.normal(K[10], (8, 4))
Y8 = jnp.sum(jnp.sin(X8), axis=1, keepdims=True)
X5 = jax.random.normal(K[11], (5, 4))
Y5 = jnp.sum(jnp.sin(X5), axis=1, keepdims=True)
BATCHES = [(X8, Y8), (X5, Y5)]


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def ties(tree):
    """Which leaves are the same object: for each leaf, the index of its first place."""
    ls = leaves(tree)
    return [next(j for j, b in enumerate(ls) if b is a) for a in ls]


def assert_same(a, b, *, exact=False, tol=2e-5):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for u, v in zip(la, lb, strict=True):
        assert not isinstance(u, jax.core.Tracer) and not isinstance(v, jax.core.Tracer)
        u, v = np.asarray(u), np.asarray(v)
        assert u.shape == v.shape and u.dtype == v.dtype, (u.shape, v.shape, u.dtype, v.dtype)
        if exact:
            np.testing.assert_array_equal(u, v)
        else:
            np.testing.assert_allclose(u, v, rtol=tol, atol=tol)


# --- three kinds of model -----------------------------------------------------------


class Net(tg.Module):
    def __init__(self):
        self.l1 = nn.Dense(4, 4, key=K[0])
        self.l2 = nn.Dense(4, 4, key=K[1])
        self.l3 = nn.Dense(4, 1, key=K[2])
        self.scale = 1.0  # static data the forward pass reads

    def __call__(self, x):
        return self.l3(jnp.tanh(self.l2(jnp.tanh(self.l1(x))))) * self.scale


class Eqx(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    c: eqx.nn.Linear

    def __init__(self):
        self.a = eqx.nn.Linear(4, 4, key=K[0])
        self.b = eqx.nn.Linear(4, 4, key=K[1])
        self.c = eqx.nn.Linear(4, 1, key=K[2])

    def __call__(self, x):
        return jax.vmap(lambda v: self.c(jnp.tanh(self.b(jnp.tanh(self.a(v))))))(x)


def dict_model():
    w = lambda k, s: 0.5 * jax.random.normal(k, s)
    return {
        "enc": {"w1": w(K[0], (4, 4)), "w2": w(K[1], (4, 4)), "b": jnp.zeros(4)},
        "head": {"out": w(K[2], (4, 1))},
    }


def dict_apply(m, x):
    e = m["enc"]
    return jnp.tanh(jnp.tanh(x @ e["w1"].T) @ e["w2"].T + e["b"]) @ m["head"]["out"]


class Kind:
    """How to build, call and edit one kind of model (paths of its two 4x4 weights...)."""

    def __init__(self, name):
        self.name = name

    def build(self):
        return {"module": Net, "dict": dict_model, "eqx": Eqx}[self.name]()

    def apply(self, m, x):
        return dict_apply(m, x) if self.name == "dict" else m(x)

    # where the tieable weights, the removable bias and the replaceable layer live
    def get(self, m, what):
        if self.name == "module":
            return {"w1": m.l1.weight, "w2": m.l2.weight, "bias": m.l3.bias}[what]
        if self.name == "dict":
            return {"w1": m["enc"]["w1"], "w2": m["enc"]["w2"], "bias": m["enc"]["b"]}[what]
        return {"w1": m.a.weight, "w2": m.b.weight, "bias": m.c.bias}[what]

    def set(self, m, what, value):
        """Set in place; an equinox model is immutable, so a new one is returned."""
        if self.name == "module":
            {"w1": m.l1, "w2": m.l2}[what].weight = value
            return m
        if self.name == "dict":
            m["enc"][what] = value
            return m
        where = {"w1": lambda t: t.a.weight, "w2": lambda t: t.b.weight}[what]
        return eqx.tree_at(where, m, value)

    def replace_layer(self, m, k):
        key = jax.random.fold_in(K[5], k)
        if self.name == "module":
            m.l2 = nn.Dense(4, 4, key=key)
            return m
        if self.name == "dict":
            m["enc"]["w2"] = 0.5 * jax.random.normal(key, (4, 4))
            return m
        return eqx.tree_at(lambda t: t.b, m, eqx.nn.Linear(4, 4, key=key))

    def parts(self, m):
        """Sub-models for a Params union."""
        if self.name == "module":
            return [m.l1, m.l2, m.l3]
        if self.name == "dict":
            return [m["enc"], m["head"]]
        return [m.a, m.b, m.c]

    def substate(self, state, union):
        if union:
            return state[0]
        if self.name == "module":
            return state.l1
        if self.name == "dict":
            return state["enc"]
        return state.a


RULES = {
    "adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.02),
    "clip-sgd": lambda: optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9),
    ),
}


# --- a world: one run of the program ----------------------------------------------------


class Box:
    """What the step functions read: nothing else changes between their calls."""


class World:
    # Bookkeeping (counters, flags) lives on the World, which the steps never see.
    # (An attribute the steps never read may also change between calls on an object
    # they capture: test_unread_counter_on_a_captured_object_does_not_retrace.)
    model = property(lambda w: w.b.model, lambda w, v: setattr(w.b, "model", v))
    ps = property(lambda w: w.b.ps, lambda w, v: setattr(w.b, "ps", v))
    state = property(lambda w: w.b.state, lambda w, v: setattr(w.b, "state", v))

    def __init__(self, kind, rule, compiled, folder):
        self.kind, self.rule, self.compiled, self.folder = kind, rule, compiled, folder
        self.b = b = Box()
        b.model = kind.build()
        b.ps = tg.params(b.model)
        b.state = tg.setup(RULES[rule](), b.ps)
        b.cfg = {"flag": False, "rate": 1.0}  # static values the loss reads
        # One entry per trace of a step body; held by the World, not by the Box: a list
        # reached twice crashes (test_bug_list_reached_twice_crashes_the_guard).
        self.log = log = []
        self.batch = 0
        self.union = False
        self.n = 0  # counts replaced layers, saved files
        self.losses = []
        self.ps_edited = self.ps_replaced = False
        jit = tg.jit if compiled else (lambda f, **kw: f)

        def loss(m, x, y):
            h = kind.apply(m, x)
            if b.cfg["flag"]:
                h = h * b.cfg["rate"]
            return jnp.mean((h - y) ** 2)

        self.loss = loss

        def implicit(x, y):
            log.append("implicit")
            v, g = tg.withgradient(lambda: loss(b.model, x, y), b.ps)
            tg.update_(b.state, b.ps, g)
            return v

        def implicit_plain(x, y):
            v, g = tg.withgradient(lambda: loss(b.model, x, y), b.ps)
            tg.update_(b.state, b.ps, g)
            return v

        def explicit(s, m, x, y):
            log.append("explicit")
            v, (g,) = tg.withgradient(lambda m: loss(m, x, y), m)
            s, m = tg.update(s, m, g)
            return s, m, v

        self.steps = {
            "implicit": jit(implicit),
            "implicit_plain": implicit_plain,
            "explicit": jit(explicit),
            "explicit_donate": jit(explicit, donate_argnums=(0, 1)),
        }
        inner = jit(implicit)
        self.steps["nested"] = jit(lambda x, y: inner(x, y))

    # the operations ------------------------------------------------------------------
    def xy(self):
        return BATCHES[self.batch]

    def op(self, name):
        getattr(self, "op_" + name)()

    def _implicit(self, which):
        self.losses.append(float(self.steps[which](*self.xy())))

    def op_implicit(self):
        self._implicit("implicit")

    def op_implicit_plain(self):
        self._implicit("implicit_plain")

    def op_nested(self):
        self._implicit("nested")

    def _explicit(self, which):
        s, m, v = self.steps[which](self.state, self.model, *self.xy())
        self.state, self.model = s, m
        # The user's new Params for the new model; one made after a discard (or a
        # union) differs from it in what it holds, which a step reading it sees.
        self.ps_replaced, self.ps_edited = self.ps_edited or self.union, False
        self.ps = tg.params(m)
        self.union = False
        self.losses.append(float(v))

    def op_explicit(self):
        self._explicit("explicit")

    def op_explicit_donate(self):
        self._explicit("explicit_donate")

    def _rebuilt(self, m):
        if m is not self.model:  # equinox: a new model, new Params, the same state
            self.model, self.ps, self.union = m, tg.params(m), False

    def op_replace(self):
        self.n += 1
        self._rebuilt(self.kind.replace_layer(self.model, self.n))

    def op_rebind(self):
        self._rebuilt(self.kind.set(self.model, "w1", self.kind.get(self.model, "w1") * 0.5))

    def op_tie(self):
        self._rebuilt(self.kind.set(self.model, "w2", self.kind.get(self.model, "w1")))

    def op_untie(self):
        self._rebuilt(self.kind.set(self.model, "w2", self.kind.get(self.model, "w2") + 0.0))

    def op_setup(self):
        self.state = tg.setup(RULES[self.rule](), self.ps)

    def op_remove(self):
        self.ps.discard(self.kind.get(self.model, "bias"))
        self.ps_edited = True

    def op_fresh_params(self):
        self.ps, self.union = tg.params(self.model), False

    def op_union(self):
        ps = tg.Params([tg.params(p) for p in self.kind.parts(self.model)])
        self.ps, self.union = ps, True
        self.state = tg.setup(RULES[self.rule](), ps)

    def op_freeze(self):
        tg.freeze_(self.kind.substate(self.state, self.union))

    def op_thaw(self):
        tg.thaw_(self.kind.substate(self.state, self.union))

    def op_adjust(self):
        self.n += 1
        tg.adjust_(self.state, learning_rate=[0.0, 0.01, 0.05][self.n % 3])

    def op_flag(self):
        self.b.cfg["flag"] = not self.b.cfg["flag"]

    def op_rate(self):
        self.b.cfg["rate"] = {1.0: 0.5, 0.5: 2.0, 2.0: 1.0}[self.b.cfg["rate"]]

    def op_scale(self):  # a static attribute of the model, edited in place
        if self.kind.name == "module":
            self.model.scale = -self.model.scale

    def op_batch(self):
        self.batch = 1 - self.batch

    def op_save_load(self):
        self.n += 1
        path = os.path.join(self.folder, f"{'cu'[self.compiled]}{self.n}")
        tree = {"model": self.model, "state": self.state}
        tg.save(path, tree)
        back = tg.load(path, tree)
        assert_same(back, tree, exact=True)
        assert ties(back["model"]) == ties(self.model)
        self.model, self.state = back["model"], back["state"]
        parts = self.kind.parts(self.model)
        self.ps = tg.Params([tg.params(p) for p in parts]) if self.union else tg.params(self.model)

    def op_train_ps(self):
        data = [BATCHES[self.batch], BATCHES[1 - self.batch]]
        if self.compiled:
            loss = lambda x, y: self.loss(self.model, x, y)
            _, _, losses = tg.train(loss, self.ps, data, self.state, progress=False)
            self.losses.extend(losses)
        else:
            for x, y in data:
                self.losses.append(float(self.steps["implicit_plain"](x, y)))

    def op_train_model(self):
        data = [BATCHES[self.batch]] * 2
        if self.compiled:
            s, m, losses = tg.train(self.loss, self.model, data, self.state, progress=False)
            self.state, self.model = s, m
            self.ps, self.union = tg.params(m), False
            self.losses.extend(losses)
        else:
            for _ in data:
                self._explicit("explicit")


STEP_OPS = ["implicit", "implicit_plain", "explicit", "explicit_donate", "nested"]
OTHER_OPS = [
    "replace",
    "rebind",
    "tie",
    "untie",
    "setup",
    "remove",
    "fresh_params",
    "union",
    "freeze",
    "thaw",
    "adjust",
    "flag",
    "rate",
    "scale",
    "batch",
    "save_load",
    "train_ps",
    "train_model",
]
TRACED = {"implicit", "explicit", "explicit_donate", "nested"}
EXPLICIT = {"explicit", "explicit_donate"}


def snapshot(w):
    return (
        [np.asarray(a) for a in leaves(w.model)],
        ties(w.model),
        [np.asarray(a) for a in leaves(w.state)],
        list(w.ps.named()),
    )


def assert_unchanged(w, snap):
    now = snapshot(w)
    for a, b in zip(snap[0] + snap[2], now[0] + now[2], strict=True):
        np.testing.assert_array_equal(a, b)
    assert snap[1] == now[1] and snap[3] == now[3]


def assert_worlds_agree(c, u, where):
    try:
        assert type(c.model) is type(u.model)
        assert ties(c.model) == ties(u.model)
        assert_same(c.model, u.model)
        assert_same(c.state, u.state)
        assert list(c.ps.named()) == list(u.ps.named())
        assert_same(list(c.ps), list(u.ps))
        assert all(a in c.ps for a in c.ps.arrays())
        np.testing.assert_allclose(c.losses, u.losses, rtol=2e-5, atol=1e-6)
    except AssertionError as e:
        raise AssertionError(f"after {where}: {e}") from None


def run_program(kind, rule, ops):
    with tempfile.TemporaryDirectory() as folder:
        c = World(Kind(kind), rule, True, folder)
        u = World(Kind(kind), rule, False, folder)
        last = None
        shape = None
        replaced = False
        for i, name in enumerate(ops):
            where = f"op {i} {name!r} of {ops}"
            snaps = snapshot(c), snapshot(u)
            traces = len(c.log)
            # An explicit step's arguments: the step returns the state it is given next.
            before, shape = shape, jax.tree_util.tree_structure((c.state, c.model))
            errors = []
            for w, snap in zip((u, c), snaps[::-1], strict=True):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("error")
                        w.op(name)
                    errors.append(None)
                except (
                    ValueError,
                    TypeError,
                    KeyError,
                    AttributeError,
                    UserWarning,
                    RuntimeError,
                ) as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    assert_unchanged(w, snap)  # a failed step changed nothing
            assert errors[0] == errors[1], (
                f"{where}: uncompiled {errors[0]!r}, compiled {errors[1]!r}"
            )
            assert_worlds_agree(c, u, where)
            # An explicit step is given the state and model the previous call returned.
            given = name not in EXPLICIT or (before is not None and before == shape)
            same = given and not replaced
            if name in TRACED and last == name and errors[1] is None and same:
                # The same compiled step again, nothing changed in between: no re-trace.
                # (Things do change after an explicit step: it returns a state of another
                # structure than it was given when that was set up for a Params with a
                # parameter discarded, and the World then replaces such a Params.)
                assert len(c.log) == traces, f"{where}: re-traced"
            replaced, c.ps_replaced = c.ps_replaced, False
            last = name if errors[1] is None else None
        return c, u


ops_strategy = st.lists(st.sampled_from(STEP_OPS * 3 + OTHER_OPS), min_size=3, max_size=6)


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
@settings(
    max_examples=3,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    kind=st.sampled_from(["module", "dict", "eqx"]),
    rule=st.sampled_from(list(RULES)),
    ops=ops_strategy,
)
def test_random_programs_compiled_equal_uncompiled(kind, rule, ops):
    run_program(kind, rule, ops)


@pytest.mark.slow
@settings(
    # 212 s at 40, 127 s at 24 on a 2-core machine (2026-12-01). CI runs it once, on the
    # newest jax, and its whole run is to stay well under 30 minutes.
    max_examples=14,
    derandomize=True,  # the same programs in every run: CI gets one try
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    kind=st.sampled_from(["module", "dict", "eqx"]),
    rule=st.sampled_from(list(RULES)),
    ops=st.lists(st.sampled_from(STEP_OPS * 3 + OTHER_OPS), min_size=3, max_size=20),
)
def test_random_programs_compiled_equal_uncompiled_broad(kind, rule, ops):
    run_program(kind, rule, ops)


# --- targeted programs -------------------------------------------------------------------


class _Scaled(tg.Module):
    def __init__(self):
        self.w = jnp.arange(6.0).reshape(3, 2) / 6
        self.scale = 1.0

    def __call__(self, x):
        return (x @ self.w) * self.scale


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_static_edit_with_a_stateless_rule_then_a_compiled_step_twice_traces_once():
    # optax.sgd keeps no state arrays; the step after an edit of a static attribute
    # traces once, and every step equals the uncompiled one.
    worlds = []
    for compiled in (True, False):
        model = _Scaled()
        ps = tg.params(model)
        state = tg.setup(optax.sgd(0.1), ps)
        traces = []

        def step(x, model=model, ps=ps, state=state, traces=traces):
            traces.append(1)
            tg.update_(state, ps, tg.gradient(lambda: jnp.sum(model(x) ** 2), ps))

        worlds.append((tg.jit(step) if compiled else step, model, traces))
    x = jnp.ones((4, 3))
    for edit in (False, True, False, False):
        for step, model, _ in worlds:
            if edit:
                model.scale = -2.0
            step(x)
    (_, compiled_model, traces), (_, plain_model, _) = worlds
    assert len(traces) == 2  # the first call, and the first after the edit
    np.testing.assert_allclose(compiled_model.w, plain_model.w, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["module", "eqx"])
def test_static_edit_then_the_same_compiled_step_twice_traces_once(kind):
    # Found by the broad random programs: the first step after an edit of a static
    # attribute made the optimiser state follow the edit inside the trace, so the
    # step's guard (which had read the old configuration) traced the second call again.
    run_program(kind, "adam", ["scale", "implicit", "implicit"])
    run_program(kind, "adam", ["implicit", "scale", "nested", "nested"])


def adam_by_hand(n_steps, loss, params, lrs=None, batches=None):
    """Plain optax + jax.grad on a params tree: the reference for whole runs."""
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.02)
    s = opt.init(params)
    step = jax.jit(
        lambda s, p, x, y: (
            lambda g: (lambda u, s: (s, optax.apply_updates(p, u)))(*opt.update(g, s, p))
        )(jax.grad(loss)(p, x, y))
    )
    for i in range(n_steps):
        if lrs is not None:
            s.hyperparams["learning_rate"] = jnp.asarray(lrs[i], jnp.float32)
        x, y = (batches or [(X8, Y8)] * n_steps)[i]
        s, params = step(s, params, x, y)
    return params


@pytest.mark.slow
def test_compiled_implicit_program_equals_optax_by_hand_with_rebinds_and_adjusts():
    """Steps, a rebound weight, a new learning rate, another batch shape, back: vs optax."""
    model = dict_model()
    ps = tg.params(model)
    state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.02), ps)
    traces = []

    @tg.jit
    def step(x, y):
        traces.append(x.shape)
        tg.update_(state, ps, tg.gradient(lambda: jnp.mean((dict_apply(model, x) - y) ** 2), ps))

    plan = [(X8, Y8, 0.02), (X8, Y8, 0.02), (X5, Y5, 0.05), (X8, Y8, 0.05), (X5, Y5, 0.001)]
    for i, (x, y, _) in enumerate(plan):
        if i == 2:
            tg.adjust_(state, learning_rate=0.05)
        if i == 4:
            tg.adjust_(state, learning_rate=0.001)
        step(x, y)
    assert traces == [(8, 4), (5, 4)]  # the learning rate is data, the old shape a cache hit
    ref = adam_by_hand(
        len(plan),
        lambda p, x, y: jnp.mean((dict_apply(p, x) - y) ** 2),
        dict_model(),
        lrs=[lr for *_, lr in plan],
        batches=[(x, y) for x, y, _ in plan],
    )
    assert_same(model, ref, tol=1e-5)


def explicit_jit(loss):
    @tg.jit
    def step(s, m, x, y):
        v, (g,) = tg.withgradient(lambda m: loss(m, x, y), m)
        s, m = tg.update(s, m, g)
        return s, m, v

    return step


def net_loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


@pytest.mark.slow
def test_implicit_and_explicit_programs_bit_identical_through_edits():
    """The same program in both styles under tg.jit: equal bit for bit after every step."""
    rule = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.02)
    mi, me = Net(), Net()
    ps = tg.params(mi)
    si, se = tg.setup(rule(), ps), tg.setup(rule(), me)
    flags = {"scale": 1.0}

    def loss(m, x, y):
        return net_loss(m, x, y) * flags["scale"]

    @tg.jit
    def implicit(x, y):
        tg.update_(si, ps, tg.gradient(lambda: loss(mi, x, y), ps))

    explicit = explicit_jit(loss)
    edits = [
        lambda m, s: None,
        lambda m, s: tg.adjust_(s, learning_rate=0.05),
        lambda m, s: tg.freeze_(s.l2),
        lambda m, s: flags.update(scale=2.0),  # read by both losses: once only
        lambda m, s: tg.thaw_(s.l2),
        lambda m, s: setattr(m.l1, "weight", m.l1.weight * 0.5),
        lambda m, s: setattr(m, "l2", nn.Dense(4, 4, key=K[9])),
    ]
    for i, (edit, (x, y)) in enumerate(zip(edits, [BATCHES[0], BATCHES[1]] * 4, strict=False)):
        edit(mi, si)
        if i != 3:
            edit(me, se)
        implicit(x, y)
        se, me, _ = explicit(se, me, x, y)
        assert_same(mi, me, exact=True)
        assert_same(si, se, exact=True)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_no_retrace_over_a_program_that_changes_no_structure():
    """Rebinding weights, replacing a layer by a like one, adjusting: data, not structure."""
    model = Net()
    ps = tg.params(model)
    state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.02), ps)
    traces = []

    @tg.jit
    def step(x, y):
        traces.append(1)
        tg.update_(state, ps, tg.gradient(lambda: net_loss(model, x, y), ps))

    ref = Net()
    ref_ps = tg.params(ref)
    ref_state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.02), ref_ps)
    edits = [
        lambda m, s: None,
        lambda m, s: setattr(m.l1, "weight", m.l1.weight + 0.1),
        lambda m, s: setattr(m, "l2", nn.Dense(4, 4, key=K[9])),
        lambda m, s: tg.adjust_(s, learning_rate=0.1),
        lambda m, s: setattr(m.l3, "bias", jnp.zeros(1)),
    ]
    for edit in edits * 2:
        edit(model, state)
        edit(ref, ref_state)
        step(X8, Y8)
        tg.update_(ref_state, ref_ps, tg.gradient(lambda: net_loss(ref, X8, Y8), ref_ps))
        assert_same(model, ref)
    assert len(traces) == 1


@pytest.mark.slow
def test_static_values_the_loss_reads_retrace_and_come_back_from_the_cache():
    """A dropout rate and a flag in a dict: each new value traces once, old ones hit."""

    drop = nn.Dropout(0.5)  # outside the model: see test_bug_static_edit_...

    class Drop(tg.Module):
        def __init__(self):
            self.l1 = nn.Dense(4, 6, key=K[0])
            self.l2 = nn.Dense(6, 1, key=K[1])

        def __call__(self, x, key):
            return self.l2(drop(jnp.tanh(self.l1(x)), key=key))

    cfg = {"l1": False}
    traces = []

    def loss(m, x, y, key):
        e = m(x, key) - y
        return jnp.mean(jnp.abs(e)) if cfg["l1"] else jnp.mean(e**2)

    def run(compiled):
        model = Drop()
        ps = tg.params(model)
        state = tg.setup(optax.sgd(0.1), ps)

        def step(x, y, key):
            traces.append((drop.rate, cfg["l1"]))
            tg.update_(state, ps, tg.gradient(lambda: loss(model, x, y, key), ps))

        step = tg.jit(step) if compiled else step
        plan = [(0.5, False), (0.5, False), (0.25, False), (0.25, True), (0.5, False), (0.25, True)]
        for i, (rate, l1) in enumerate(plan):
            drop.rate = rate
            cfg["l1"] = l1
            step(X8, Y8, jax.random.key(i))
        return model

    mu = run(False)
    traces.clear()
    mc = run(True)
    assert traces == [(0.5, False), (0.25, False), (0.25, True)]
    assert_same(mc, mu, tol=1e-6)


@pytest.mark.slow
def test_save_mid_run_load_and_continue_equals_the_uninterrupted_run(tmp_path):
    def run(stop):
        model = Net()
        ps = tg.params(model)
        box = {"state": tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.02), ps)}

        @tg.jit
        def step(x, y):
            tg.update_(box["state"], ps, tg.gradient(lambda: net_loss(model, x, y), ps))

        for i in range(6):
            if i == 3:
                tg.adjust_(box["state"], learning_rate=0.05)
            if i == stop:
                tg.save(tmp_path / "ck", {"model": model, "state": box["state"]})
                back = tg.load(tmp_path / "ck", {"model": Net(), "state": box["state"]})
                # continue with the loaded model's arrays in the same model and Params
                for name in ("l1", "l2", "l3"):
                    setattr(model, name, getattr(back["model"], name))
                box["state"] = back["state"]
            step(*BATCHES[i % 2])
        return model, box["state"]

    m_ref, s_ref = run(None)
    for stop in (0, 2, 4):
        m, s = run(stop)
        assert_same(m, m_ref, exact=True)
        assert_same(s, s_ref, exact=True)


# --- failed steps: a clear message, nothing changed ---------------------------------------


def user_view(model, state, ps):
    return (
        [np.asarray(a) for a in leaves(model)],
        ties(model),
        [np.asarray(a) for a in leaves(state)],
        list(ps.named()),
        list(leaves(model)),  # the very objects
    )


def assert_nothing_changed(before, after):
    for a, b in zip(before[0] + before[2], after[0] + after[2], strict=True):
        np.testing.assert_array_equal(a, b)
    assert before[1] == after[1] and before[3] == after[3]
    assert all(a is b for a, b in zip(before[4], after[4], strict=True))


def compiled_world(rule=None):
    model = Net()
    ps = tg.params(model)
    box = {"state": tg.setup((rule or optax.adam)(0.02), ps)}

    @tg.jit
    def step(x, y):
        tg.update_(box["state"], ps, tg.gradient(lambda: net_loss(model, x, y), ps))

    return model, ps, box, step


@pytest.mark.slow
def test_tying_after_setup_is_an_error_then_a_new_setup_trains_the_tie():
    model, ps, box, step = compiled_world()
    step(X8, Y8)
    model.l2.weight = model.l1.weight
    before = user_view(model, box["state"], ps)
    with pytest.raises(
        ValueError, match=r"'l1\.weight' and 'l2\.weight' are now one array.*tg\.setup"
    ):
        step(X8, Y8)
    assert_nothing_changed(before, user_view(model, box["state"], ps))
    box["state"] = tg.setup(optax.adam(0.02), ps)
    ref = jax.tree_util.tree_map(lambda a: a, model)  # the same arrays: still tied
    assert ref.l1.weight is ref.l2.weight
    ref_ps = tg.params(ref)
    ref_state = tg.setup(optax.adam(0.02), ref_ps)
    for _ in range(3):
        step(X8, Y8)
        tg.update_(ref_state, ref_ps, tg.gradient(lambda: net_loss(ref, X8, Y8), ref_ps))
        assert model.l1.weight is model.l2.weight
    assert_same(model, ref)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_untying_after_a_tied_setup_is_an_error_with_the_way_out():
    model, ps, box, step = compiled_world()
    model.l2.weight = model.l1.weight
    box["state"] = tg.setup(optax.adam(0.02), ps)
    step(X8, Y8)
    model.l2.weight = model.l2.weight + 0.0  # untied by assignment
    before = user_view(model, box["state"], ps)
    with pytest.raises(
        ValueError, match=r"were one array \(a tied weight\).*now two.*Tie them again.*tg\.setup"
    ):
        step(X8, Y8)
    assert_nothing_changed(before, user_view(model, box["state"], ps))
    model.l2.weight = model.l1.weight  # tied again: the step runs
    step(X8, Y8)
    assert model.l1.weight is model.l2.weight


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_params_add_of_a_new_array_is_a_state_error_and_changes_nothing():
    model, ps, box, step = compiled_world()
    step(X8, Y8)
    ps.add(jnp.ones(3))
    before = user_view(model, box["state"], ps)
    with pytest.raises(ValueError, match=r"optimiser state does not match the model.*tg\.setup"):
        step(X8, Y8)
    assert_nothing_changed(before, user_view(model, box["state"], ps))


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_adjust_without_inject_hyperparams_between_compiled_steps_says_how():
    model, ps, box, step = compiled_world()
    step(X8, Y8)
    before = user_view(model, box["state"], ps)
    with pytest.raises(
        TypeError, match=r"no adjustable hyperparameters.*optax\.inject_hyperparams"
    ):
        tg.adjust_(box["state"], learning_rate=0.1)
    assert_nothing_changed(before, user_view(model, box["state"], ps))
    step(X8, Y8)  # still usable


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_stale_grads_across_a_compiled_step_are_refused_and_change_nothing():
    model, ps, box, step = compiled_world()
    grads = tg.gradient(lambda: net_loss(model, X8, Y8), ps)
    step(X8, Y8)  # rebinds every parameter: grads are for the old arrays
    before = user_view(model, box["state"], ps)
    with pytest.raises(ValueError, match=r"taken before the parameters were replaced"):
        tg.update_(box["state"], ps, grads)
    assert_nothing_changed(before, user_view(model, box["state"], ps))


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_reusing_a_donated_model_is_an_error_that_says_donated():
    m = Net()
    s = tg.setup(optax.adam(0.02), m)
    step = tg.jit(explicit_jit(net_loss).__wrapped__, donate_argnums=(0, 1))
    s2, m2, _ = step(s, m, X8, Y8)
    with pytest.raises((ValueError, RuntimeError), match=r"deleted|donated"):
        step(s, m, X8, Y8)
    s3, m3, _ = step(s2, m2, X8, Y8)  # the returned ones go on
    ref_m, ref_s = Net(), tg.setup(optax.adam(0.02), Net())
    for _ in range(2):
        ref_s, ref_m, _ = explicit_jit(net_loss)(ref_s, ref_m, X8, Y8)
    assert_same(m3, ref_m, exact=True)
    assert_same(s3, ref_s, exact=True)


@pytest.mark.slow
def test_loading_into_a_model_whose_layer_was_replaced_names_path_and_file(tmp_path):
    model, _, _, step = compiled_world()
    step(X8, Y8)
    tg.save(tmp_path / "ck", model)
    model.l2 = nn.Dense(4, 5, key=K[3])
    with pytest.raises(ValueError, match=r"'l2\.weight' is float32\[5, 4\].*\[4, 4\].*ck"):
        tg.load(tmp_path / "ck", model)


# --- bugs found (strict xfails asserting the correct behaviour) ---------------------------


class Plain:
    """A plain object a step captures (a user's trainer or config holder)."""


@pytest.mark.parametrize("how", ["jit", "gradient"])
def test_list_reached_twice_crashes_the_guard(how):
    # The same list in a closure variable and on a captured object; the function
    # calls one of its methods. Seen: KeyError(<an id>) from _guardcode.Guard._gen.
    b = Plain()
    b.w = jnp.ones(3)
    b.log = log = []

    def f(x):
        log.append(1)
        return jnp.sum(x * b.w)

    if how == "jit":
        np.testing.assert_allclose(tg.jit(f)(jnp.ones(3)), 3.0)
    else:
        np.testing.assert_allclose(tg.gradient(f, jnp.ones(3))[0], [1.0, 1.0, 1.0])


def test_unread_counter_on_a_captured_object_does_not_retrace():
    class Trainer:
        def __init__(self):
            self.model = {"w": jnp.ones((4, 1))}
            self.ps = tg.params(self.model)
            self.state = tg.setup(optax.sgd(0.1), self.ps)
            self.steps_done = 0  # bookkeeping, never read by the compiled step

    t = Trainer()
    traces = []

    @tg.jit
    def step(x, y):
        traces.append(1)
        g = tg.gradient(lambda: jnp.mean((x @ t.model["w"] - y) ** 2), t.ps)
        tg.update_(t.state, t.ps, g)

    for _ in range(3):
        step(X8, Y8)
        t.steps_done += 1
    assert len(traces) == 1  # was 3: one trace (and compile) per step, no warning


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
@pytest.mark.parametrize("compiled", [False, True])
def test_static_edit_of_the_model_rejects_the_optimiser_state(compiled):
    class Drop(tg.Module):
        def __init__(self):
            self.l1 = nn.Dense(4, 6, key=K[0])
            self.drop = nn.Dropout(0.5)
            self.l2 = nn.Dense(6, 1, key=K[1])

        def __call__(self, x, key):
            return self.l2(self.drop(jnp.tanh(self.l1(x)), key=key))

    model = Drop()
    ps = tg.params(model)
    state = tg.setup(optax.adam(0.02), ps)

    def step(key):
        tg.update_(state, ps, tg.gradient(lambda: net_loss_key(model, key), ps))

    step = tg.jit(step) if compiled else step
    step(jax.random.key(0))
    model.drop.rate = 0.25  # a dropout schedule: static data, no array changed
    # Seen: ValueError "the optimiser state does not match the model (same paths,
    # different static data or types)": the only way on is tg.setup, losing the moments.
    step(jax.random.key(1))
    assert int(leaves(state)[0]) == 2  # adam's count: both steps taken


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_pure_update_after_a_static_edit_keeps_the_edit_and_a_new_array_still_errors():
    model = {"l": nn.Dense(4, 1, jnp.tanh, key=K[0])}
    state = tg.setup(optax.adam(0.02), model)
    g = tg.gradient(lambda m: jnp.mean(m["l"](X8) ** 2), model)[0]
    ref = optax.adam(0.02)
    u, _ = ref.update(g, ref.init(model), model)  # plain optax, before the edit
    model["l"].activation = jax.nn.relu  # static data only
    new_state, new = tg.update(state, model, g)  # g: taken before the edit
    assert new["l"].activation is jax.nn.relu  # not reverted to the setup-time structure
    np.testing.assert_allclose(new["l"].weight, model["l"].weight + u["l"].weight, rtol=1e-6)
    model["l"].extra = jnp.ones(2)  # a new array: the state no longer fits
    with pytest.raises(ValueError, match=r"optimiser state does not match the model"):
        tg.update(new_state, model, g)


def net_loss_key(m, key):
    return jnp.mean((m(X8, key) - Y8) ** 2)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_remove_then_add_back_breaks_the_state():
    model, ps, _, step = compiled_world()
    b = model.l3.bias
    ps.remove(b)
    step(X8, Y8)
    assert model.l3.bias is b  # removed: not trained
    ps.add(b)  # "an array removed before is a parameter again when it is added"
    assert list(ps.named()) == list(tg.params(model).named())
    # Seen: ValueError "the optimiser state does not match the model (first difference
    # at '0.l1.weight')": ps.source became [model, b], so the state no longer fits.
    step(X8, Y8)
    assert model.l3.bias is not b


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
@pytest.mark.parametrize("program", ["dict-write", "implicit-training"])
def test_object_holding_its_compiled_step_twice_loses_the_updates(program):
    # SILENT WRONG RESULT: the compiled step runs, returns, and nothing it rebound is
    # written back; it is also re-traced on every call. Holding the step only once
    # (self.step, or only in the dict) works.
    class Trainer:
        def __init__(self):
            self.w = {"a": jnp.ones(3)}
            self.model = Net()
            self.ps = tg.params(self.model)
            self.state = tg.setup(optax.adam(0.02), self.ps)

            def write(x):
                self.w["a"] = self.w["a"] * x

            def train(x, y):
                g = tg.gradient(lambda: net_loss(self.model, x, y), self.ps)
                tg.update_(self.state, self.ps, g)

            self.step = tg.jit(write if program == "dict-write" else train)
            self.steps = {"train": self.step}  # as a trainer keeps its train/eval steps

    t = Trainer()
    w0 = t.model.l1.weight
    for _ in range(3):
        if program == "dict-write":
            t.step(jnp.full(3, 2.0))
        else:
            t.step(X8, Y8)
    if program == "dict-write":
        np.testing.assert_array_equal(t.w["a"], [8.0, 8.0, 8.0])  # seen: [1, 1, 1]
    else:
        assert t.model.l1.weight is not w0  # seen: the model never moves
        assert int(leaves(t.state)[0]) == 3  # seen: adam's count stays 0


# --- more programs: train, unions, equinox, nested helpers, several updates per step ------


@pytest.mark.slow
def test_train_with_params_and_with_model_mixed_with_compiled_steps_bit_identical():
    data = [BATCHES[0], BATCHES[1], BATCHES[0]]
    rule = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.02)
    # implicit: tg.train(ps) then a compiled implicit step, then tg.train(ps) again
    m1 = Net()
    ps = tg.params(m1)
    s1 = tg.setup(rule(), ps)

    @tg.jit
    def step(x, y):
        v, g = tg.withgradient(lambda: net_loss(m1, x, y), ps)
        tg.update_(s1, ps, g)
        return v

    _, _, l_a = tg.train(lambda x, y: net_loss(m1, x, y), ps, data, s1, progress=False)
    tg.adjust_(s1, learning_rate=0.05)
    l_b = [float(step(*BATCHES[1]))]
    _, _, l_c = tg.train(lambda x, y: net_loss(m1, x, y), ps, data, s1, progress=False)
    # explicit: tg.train(model) and the compiled explicit step
    m2 = Net()
    s2 = tg.setup(rule(), m2)
    s2, m2, l_d = tg.train(net_loss, m2, data, s2, progress=False)
    s2 = tg.adjust(s2, learning_rate=0.05)
    s2, m2, v = explicit_jit(net_loss)(s2, m2, *BATCHES[1])
    s2, m2, l_f = tg.train(net_loss, m2, data, s2, progress=False)
    assert [*l_a, *l_b, *l_c] == [*l_d, float(v), *l_f]
    assert_same(m1, m2, exact=True)
    assert_same(s1, s2, exact=True)
    ref = adam_by_hand(
        7,
        lambda p, x, y: net_loss(p, x, y),
        Net(),
        lrs=[0.02] * 3 + [0.05] * 4,
        batches=[*data, BATCHES[1], *data],
    )
    assert_same(m1, ref, tol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_union_of_sub_params_trains_like_the_whole_model(compiled):
    rule = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.02))
    model, whole = Net(), Net()
    ps = tg.Params([tg.params(model.l1), tg.params(model.l2), tg.params(model.l3)])
    assert list(ps.named()) == ["weight", "bias", "+1.weight", "+1.bias", "+2.weight", "+2.bias"]
    state = tg.setup(rule(), ps)
    wps = tg.params(whole)
    wstate = tg.setup(rule(), wps)

    def step(x, y):
        tg.update_(state, ps, tg.gradient(lambda: net_loss(model, x, y), ps))

    step = tg.jit(step) if compiled else step
    for i in range(4):
        step(*BATCHES[i % 2])
        tg.update_(wstate, wps, tg.gradient(lambda: net_loss(whole, *BATCHES[i % 2]), wps))  # noqa: B023
        assert_same(model, whole, tol=1e-6)  # one global norm over the union, as optax
    # the union follows a layer replaced inside a part it holds, not a replaced part
    model.l1.weight = model.l1.weight * 0.5
    whole.l1.weight = whole.l1.weight * 0.5
    step(X8, Y8)
    tg.update_(wstate, wps, tg.gradient(lambda: net_loss(whole, X8, Y8), wps))
    assert_same(model, whole, tol=1e-6)


@pytest.mark.slow
def test_equinox_program_compiled_equals_optax_by_hand():
    box = {"m": Eqx()}
    ps = tg.params(box)
    state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.02), ps)
    traces = []

    @tg.jit
    def step(x, y):
        traces.append(1)
        tg.update_(state, ps, tg.gradient(lambda: net_loss(box["m"], x, y), ps))

    plan = [BATCHES[0], BATCHES[0], BATCHES[1], BATCHES[0]]
    for i, (x, y) in enumerate(plan):
        if i == 2:
            tg.adjust_(state, learning_rate=0.05)
        step(x, y)
    assert len(traces) == 2
    ref = adam_by_hand(4, net_loss, Eqx(), lrs=[0.02, 0.02, 0.05, 0.05], batches=plan)
    assert_same(box["m"], ref, tol=1e-5)


@pytest.mark.slow
def test_nested_tg_jit_helpers_inside_a_compiled_implicit_step():
    def run(compiled):
        jit = tg.jit if compiled else (lambda f: f)
        model = Net()
        ps = tg.params(model)
        state = tg.setup(optax.adam(0.02), ps)
        loss = jit(lambda m, x, y: net_loss(m, x, y))  # a compiled helper
        apply = jit(lambda g: tg.update_(state, ps, g))  # a compiled helper that rebinds

        @jit
        def step(x, y):
            apply(tg.gradient(lambda: loss(model, x, y), ps))
            return loss(model, x, y)  # after the update: the new arrays

        out = [float(step(*BATCHES[i % 2])) for i in range(3)]
        return model, state, out

    mu, su, lu = run(False)
    mc, sc, lc = run(True)
    np.testing.assert_allclose(lc, lu, rtol=1e-6)
    assert_same(mc, mu, tol=1e-6)
    assert_same(sc, su, tol=1e-6)


@pytest.mark.slow
def test_two_optimisers_and_gradient_accumulation_in_one_compiled_step():
    def run(compiled):
        model = Net()
        enc = tg.params([model.l1, model.l2])
        head = tg.params(model.l3)
        s_enc = tg.setup(optax.adam(0.02), enc)
        s_head = tg.setup(optax.sgd(0.1, momentum=0.9), head)

        def step(x, y):
            # the head: two micro-batches accumulated; then the encoder on the new head
            g = tg.gradient(lambda: net_loss(model, x[:4], y[:4]), head)
            g = (g + tg.gradient(lambda: net_loss(model, x[4:], y[4:]), head)) / 2
            tg.update_(s_head, head, g)
            tg.update_(s_enc, enc, tg.gradient(lambda: net_loss(model, x, y), enc))

        step = tg.jit(step) if compiled else step
        for _ in range(3):
            step(X8, Y8)
        return model, (s_enc, s_head)

    mu, su = run(False)
    mc, sc = run(True)
    assert_same(mc, mu, tol=1e-6)
    assert_same(sc, su, tol=1e-6)
    # and by hand: sgd+momentum on the head, then adam on the encoder with the new head
    m = Net()
    p_enc, p_head = [m.l1, m.l2], m.l3
    o_enc, o_head = optax.adam(0.02), optax.sgd(0.1, momentum=0.9)
    se, sh = o_enc.init(p_enc), o_head.init(p_head)
    for _ in range(3):
        lh = lambda h, a, b, e=p_enc: net_loss(Net_from(e, h), X8[a:b], Y8[a:b])
        gh = jax.tree_util.tree_map(
            lambda u, v: (u + v) / 2, jax.grad(lh)(p_head, 0, 4), jax.grad(lh)(p_head, 4, 8)
        )
        u, sh = o_head.update(gh, sh, p_head)
        p_head = optax.apply_updates(p_head, u)
        ge = jax.grad(lambda e, h=p_head: net_loss(Net_from(e, h), X8, Y8))(p_enc)
        u, se = o_enc.update(ge, se, p_enc)
        p_enc = optax.apply_updates(p_enc, u)
    assert_same(mc, Net_from(p_enc, p_head), tol=1e-5)


def Net_from(enc, head):
    m = Net()
    m.l1, m.l2 = enc
    m.l3 = head
    return m


@pytest.mark.slow
def test_state_and_params_rebound_in_closure_cells_between_compiled_steps():
    """`state = tg.adjust(state, ...)` and `ps = new Params`: the step reads them fresh."""

    def run(compiled):
        model = Net()
        ps = tg.params(model)
        state = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.02), ps)

        def step(x, y):
            tg.update_(state, ps, tg.gradient(lambda: net_loss(model, x, y), ps))

        step = tg.jit(step) if compiled else step
        step(X8, Y8)
        state = tg.adjust(state, learning_rate=0.1)  # a new state object in the cell
        step(X8, Y8)
        ps = tg.params(model)  # a new Params without the last bias
        ps.remove(model.l3.bias)
        bias = model.l3.bias
        step(X5, Y5)
        assert model.l3.bias is bias
        ps = tg.params(model)
        step(X8, Y8)
        return model, state

    mu, su = run(False)
    mc, sc = run(True)
    assert_same(mc, mu, tol=1e-6)
    assert_same(sc, su, tol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_replacing_a_layer_by_another_activation_and_back(compiled):
    traces = []
    model = Net()
    ps = tg.params(model)
    box = {}
    rule = optax.sgd(0.1)  # one rule object: a new state of it is no new structure

    def step(x, y):
        traces.append(model.l2.activation)
        tg.update_(box["state"], ps, tg.gradient(lambda: net_loss(model, x, y), ps))

    jstep = tg.jit(step) if compiled else step
    ref = Net()
    acts = [None, jax.nn.relu, jax.nn.relu, None, jnp.sin, None]
    for act in acts:
        for m in (model, ref):
            m.l2 = nn.Dense(4, 4, act, key=K[8])
        # static data of the model: a new state (test_bug_static_edit_...); sgd has none
        box["state"] = tg.setup(rule, ps)
        jstep(X8, Y8)
        g = jax.grad(net_loss)(ref, X8, Y8)
        ref = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, ref, g)
        assert_same(model, ref, tol=1e-6)  # never stale: each activation's own program
    # one trace per distinct activation compiled (a layer put back hits its program)
    assert len(traces) == (3 if compiled else len(acts))
    assert set(map(id, traces)) == set(map(id, acts))
