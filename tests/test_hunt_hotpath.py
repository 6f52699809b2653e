"""Hunt: silent wrong results on the second and later calls of the same code (the fast paths).

A call of a function seen before takes the cached fast paths: `_cache.execute` reads the
arguments with the structure's generated code (`_fasttree.Shape.flatten`) and runs the
usual explicit gradient in one step (`Entry.run_plain`: distinct captured arrays, a
dtype kind the program was traced for) without `Entry.matches`/`Entry.fits`; `tg.update`
runs the usual step in one (`_optim._update_plain`) and `tg.update_` reads a gradient
tree of the model's own structure inline (`_optim._run`). Here the SAME code object is
called again and again (each lambda is written once, inside a helper) while the user
changes things between calls: ties made and broken, dtypes cycled, numpy and Python
scalars where arrays were, models edited in place, gradient trees edited after
`tg.gradient` returned them, two models and two gradient styles interleaved. Every
result is compared with an independent reference (`jax.value_and_grad` of the same
function, or plain optax run by hand), and trace counters check that an unchanged call
does not trace again. The four defects this hunt found are fixed; each test that found
one says so ("Was a bug").
"""

from __future__ import annotations

import random
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

from .helpers import restore_own_entries

# The default run stays under 3 minutes; CI runs this file in the slow run.
pytestmark = pytest.mark.slow

X = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)
Y = jnp.arange(4.0).reshape(4, 1) / 4
X5 = jnp.linspace(-0.5, 1.5, 10).reshape(5, 2)
Y5 = jnp.linspace(0.0, 1.0, 5).reshape(5, 1)
LOW = (jnp.bfloat16, jnp.float16)
TRACES: list[int] = []  # appended to while a loss below is traced


def per_leaf(model, grads):
    """The gradient at each array leaf of `model` (None where there is none)."""
    return jax.tree_util.tree_structure(model).flatten_up_to(grads)


def assert_close(got, want, rtol=1e-6, atol=1e-7):
    got, want = list(got), list(want)
    assert len(got) == len(want), (len(got), len(want))
    for x, y in zip(got, want, strict=True):
        if x is None or y is None:
            assert x is None and y is None, (x, y)
            continue
        assert jnp.dtype(x.dtype) == jnp.dtype(y.dtype), (x.dtype, y.dtype)
        np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol
        )


def fold_ties(model, grads):
    """jax.grad's per-place gradients, as treegrad's explicit tree gives them: a tied
    array's total at its first place and None at the others; None for non-float leaves."""
    m_leaves = jax.tree_util.tree_leaves(model)
    g_leaves = jax.tree_util.tree_leaves(grads)
    first: dict[int, int] = {}
    out: list = []
    for k, (m, g) in enumerate(zip(m_leaves, g_leaves, strict=True)):
        if not jnp.issubdtype(m.dtype, jnp.inexact):
            out.append(None)
            continue
        j = first.setdefault(id(m), k)
        if j == k:
            out.append(g)
        else:
            out[j] = out[j] + g
            out.append(None)
    return out


def make_chain(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return nn.Chain(nn.Dense(2, 3, key=k1), nn.Dense(3, 1, key=k2))


def loss(m, x=X, y=Y):
    return jnp.mean((m(x) - y) ** 2)


def counted_loss(m, x=X, y=Y):
    TRACES.append(1)
    return loss(m, x, y)


_GRAD_LOSS = jax.jit(jax.grad(loss))  # compiled: one program, not one per eager op
_APPLY = jax.jit(optax.apply_updates)


class Ref:
    """Plain optax on the model's flat list of arrays, run by hand; a None gradient
    skips its parameter (value and own state entries kept, `count` advancing)."""

    def __init__(self, rule, model):
        self.rule = rule
        self.update = jax.jit(rule.update)  # the same XLA numerics as treegrad's step
        leaves, self.treedef = jax.tree_util.tree_flatten(model)
        self.leaves = [jnp.array(x) for x in leaves]  # copies: the model may be donated
        self.state = rule.init(self.leaves)

    def model(self):
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def grads(self, x=X, y=Y):
        return jax.tree_util.tree_leaves(_GRAD_LOSS(self.model(), x, y))

    def step(self, g):
        skip = [x is None for x in g]
        filled = [
            jnp.zeros_like(p) if x is None else x for p, x in zip(self.leaves, g, strict=True)
        ]
        u, new = self.update(filled, self.state, self.leaves)
        moved = _APPLY(self.leaves, u)
        self.leaves = [p if s else q for p, q, s in zip(self.leaves, moved, skip, strict=True)]
        self.state = restore_own_entries(self.rule, self.state, new, skip)

    def check(self, model, state, rtol=1e-6):
        assert_close(jax.tree_util.tree_leaves(model), self.leaves, rtol=rtol)
        assert_close(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(self.state), rtol)


def snapshot(*trees):
    return [
        (list(jax.tree_util.tree_leaves(t)), [np.array(x) for x in jax.tree_util.tree_leaves(t)])
        for t in trees
    ]


def assert_unchanged(snap, *trees):
    for (objects, values), t in zip(snap, trees, strict=True):
        now = jax.tree_util.tree_leaves(t)
        assert len(now) == len(objects) and all(a is b for a, b in zip(now, objects, strict=True))
        for v, x in zip(values, now, strict=True):
            np.testing.assert_array_equal(np.asarray(x), v)


# --- explicit calls: captured arrays and arguments edited between calls ---------------


def _body(u, v, a, b):
    return jnp.sum(jnp.sin(u) * a) + jnp.sum(u * v * b) + jnp.sum(jnp.cos(v) * a * b)


def _traced_body(u, v, a, b):
    TRACES.append(1)
    return _body(u, v, a, b)


def _withgradient(a, b, u, v):
    # One code object for every call: the fast path is the one taken from the second on.
    return tg.withgradient(lambda u, v: _traced_body(u, v, a, b), u, v)


_REFS: dict = {}


def _reference(a, b, u, v):
    """jax.value_and_grad of the same function, compiled; None for what is not a float array."""
    diff = tuple(
        i
        for i, x in enumerate((u, v))
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)
    )
    if not diff:
        return _body(u, v, a, b), (None, None)
    fn = _REFS.get(diff)
    if fn is None:
        fn = _REFS[diff] = jax.jit(jax.value_and_grad(_body, argnums=diff))
    value, gs = fn(u, v, a, b)
    grads = [None, None]
    for i, g in zip(diff, gs, strict=True):
        grads[i] = g
    return value, tuple(grads)


def _fresh(rng, shape=(3,)):
    return jnp.asarray(np.asarray(rng.uniform(-1, 1, shape), np.float32))


_CYCLE = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.float32)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_explicit_calls_with_captures_and_arguments_edited_between_calls():
    rng = np.random.default_rng(0)
    a, b, u, v = (_fresh(rng) for _ in range(4))
    dtype_at = 0
    edits = [
        "repeat",
        "tie-captures",  # a is b
        "untie-captures",
        "new-capture",
        "arg-is-capture",  # u is a
        "same-arg-twice",  # v is u
        "fresh-args",
        "dtype",  # u: float32 -> bfloat16 -> float16 -> int32 -> float32
        "numpy",
        "numpy64",
        "zero-d",
        "python-scalar",
        "v-zero-d",
        "capture-python",  # a: a Python float where an array was
        "capture-0d",
        "capture-numpy",
        "capture-broadcast",  # a: shape (1,) where (3,) was
    ]
    pick = random.Random(1)
    sequence = edits + [pick.choice(edits) for _ in range(20)]
    for step, edit in enumerate(sequence):
        if edit == "tie-captures":
            b = a
        elif edit == "untie-captures":
            b = _fresh(rng)
        elif edit == "new-capture":
            a = _fresh(rng)
        elif edit == "arg-is-capture":
            u = a
        elif edit == "same-arg-twice":
            v = u
        elif edit == "fresh-args":
            u, v = _fresh(rng), _fresh(rng)
        elif edit == "dtype":
            dtype_at = (dtype_at + 1) % (len(_CYCLE) - 1)
            base = _fresh(rng) * 3
            u = base.astype(_CYCLE[dtype_at])
        elif edit == "numpy":
            u = np.asarray(rng.uniform(-1, 1, 3), np.float32)
        elif edit == "numpy64":
            u = np.asarray(rng.uniform(-1, 1, 3), np.float64)
        elif edit == "zero-d":
            u = jnp.asarray(float(rng.uniform(-1, 1)), jnp.float32)
        elif edit == "python-scalar":
            u = float(rng.uniform(-1, 1))
        elif edit == "v-zero-d":
            v = jnp.asarray(float(rng.uniform(-1, 1)), jnp.float32)
        elif edit == "capture-python":
            a = float(rng.uniform(-1, 1))
        elif edit == "capture-0d":
            a = jnp.asarray(float(rng.uniform(-1, 1)), jnp.float32)
        elif edit == "capture-numpy":
            a = np.asarray(rng.uniform(-1, 1, 3), np.float32)
        elif edit == "capture-broadcast":
            a = _fresh(rng, (1,))
        value, (gu, gv) = _withgradient(a, b, u, v)
        want_value, (wu, wv) = _reference(a, b, u, v)
        low = any(getattr(x, "dtype", None) in LOW for x in (u, v))
        rtol = 2e-2 if low else 1e-6
        np.testing.assert_allclose(float(value), float(want_value), rtol=rtol, atol=1e-5)
        assert_close([gu, gv], [wu, wv], rtol=rtol, atol=1e-2 if low else 1e-6)
        # The same call again changes nothing and traces nothing.
        n = len(TRACES)
        value2, (gu2, gv2) = _withgradient(a, b, u, v)
        assert len(TRACES) == n, f"step {step} ({edit}): an unchanged call traced again"
        assert float(value2) == float(value)
        assert_close([gu2, gv2], [gu, gv], rtol=0, atol=0)


def test_an_argument_that_is_also_captured_is_differentiated_as_the_argument_only():
    # The captured array is a constant of the function and the argument is the
    # variable, even when they are one object; then each moves on its own.
    w = jnp.array([0.5, -1.0, 2.0])

    def grad_of(c, v):
        return tg.gradient(lambda v: jnp.sum(v * c * v), v)[0]

    c = w
    for k in range(6):
        v = w if k % 2 == 0 else w * (k + 1)
        if k == 3:
            c = w + 1
        np.testing.assert_allclose(grad_of(c, v), 2 * c * v, rtol=1e-6)


# --- explicit and implicit gradients of a model edited in place between calls ----------


class Net(tg.Module):
    def __init__(self, key, hidden=3):
        k1, k2 = jax.random.split(key)
        self.body = nn.Chain(nn.Dense(2, hidden, key=k1), nn.Dense(hidden, 2, key=k2))
        self.head = {"w": jnp.array([0.7, -0.4]), "b": jnp.asarray(0.1)}
        self.scale = 2.0  # static data
        self.act = jnp.tanh  # static data
        self.extra = []  # arrays appended later

    def __call__(self, x):
        h = self.act(self.body(x)) * self.scale
        out = h @ self.head["w"] + self.head["b"]
        for e in self.extra:
            out = out + jnp.sum(e * e)
        return out


def _net_loss(m, x):
    TRACES.append(1)
    return jnp.mean((m(x) - 0.5) ** 2)


def _net_explicit(model, x):
    return tg.gradient(lambda m: _net_loss(m, x), model)[0]


def _net_implicit(model, x):
    return tg.gradient(lambda: _net_loss(model, x), tg.params(model))


def _net_reference(model, x):
    g = jax.grad(lambda m: jnp.mean((m(x) - 0.5) ** 2))(model)
    return fold_ties(model, g)


def _edit_net(model, edit, rng, x):
    if edit == "new-value":
        model.head["w"] = _fresh(rng, (2,))
    elif edit == "bf16-leaf":
        model.head["w"] = model.head["w"].astype(jnp.bfloat16)
    elif edit == "f32-leaf":
        model.head["w"] = model.head["w"].astype(jnp.float32)
    elif edit == "swap-layer":
        model.body.layers[1] = nn.Dense(
            model.body.layers[0].weight.shape[0], 2, key=jax.random.key(int(rng.integers(99)))
        )
    elif edit == "resize":
        hidden = int(rng.choice([3, 4]))
        model.body = nn.Chain(
            nn.Dense(2, hidden, key=jax.random.key(5)), nn.Dense(hidden, 2, key=jax.random.key(6))
        )
    elif edit == "tie":  # two places hold one array
        model.head["w"] = model.body.layers[-1].bias
    elif edit == "untie":
        model.head["w"] = jnp.array(model.head["w"])  # a copy: its own object
    elif edit == "scale":
        model.scale = float(rng.choice([2.0, 3.0, 0.5]))
    elif edit == "act":
        model.act = jnp.sin if model.act is jnp.tanh else jnp.tanh
    elif edit == "append":
        model.extra.append(_fresh(rng, (2,)))
    elif edit == "clear":
        model.extra.clear()
    elif edit == "new-bias-0d":
        model.head["b"] = jnp.asarray(float(rng.uniform(-1, 1)), jnp.float32)
    elif edit == "batch":
        x = X5 if x.shape[0] == 4 else X
    return x


NET_EDITS = [
    "repeat",
    "new-value",
    "bf16-leaf",
    "f32-leaf",
    "swap-layer",
    "resize",
    "tie",
    "untie",
    "scale",
    "act",
    "append",
    "clear",
    "new-bias-0d",
    "batch",
]


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_model_edited_in_place_between_calls_explicit_and_implicit():
    rng = np.random.default_rng(3)
    pick = random.Random(4)
    model = Net(jax.random.key(0))
    x = X
    sequence = [*NET_EDITS, "tie", "swap-layer", "untie", "tie", "bf16-leaf", "clear"]
    sequence += [pick.choice(NET_EDITS) for _ in range(2)]
    for step, edit in enumerate(sequence):
        x = _edit_net(model, edit, rng, x)
        want = _net_reference(model, x)
        low = any(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(model))
        rtol, atol = (2e-2, 2e-3) if low else (1e-5, 1e-6)
        got = per_leaf(model, _net_explicit(model, x))
        assert_close(got, want, rtol=rtol, atol=atol)
        grads = _net_implicit(model, x)
        assert_close(per_leaf(model, grads.to_tree(model)), want, rtol=rtol, atol=atol)
        n = len(TRACES)
        assert_close(per_leaf(model, _net_explicit(model, x)), got, rtol=0, atol=0)
        again = _net_implicit(model, x)
        assert_close(
            per_leaf(model, again.to_tree(model)), per_leaf(model, grads.to_tree(model)), 0, 0
        )
        assert len(TRACES) == n, f"step {step} ({edit}): nothing changed, yet a trace"


def test_a_mutable_static_attribute_edited_in_place_is_seen():
    # A list of Python numbers is static data of the Module, compared by a snapshot.
    class Scaled(tg.Module):
        def __init__(self):
            self.w = jnp.array([1.0, 2.0])
            self.factors = [2.0, 3.0]

        def __call__(self):
            return jnp.sum(self.w * self.factors[0]) * self.factors[1]

    def grad_of(m):
        return tg.gradient(lambda m: m(), m)[0].w

    m = Scaled()
    for k in range(5):
        np.testing.assert_allclose(grad_of(m), [m.factors[0] * m.factors[1]] * 2, rtol=1e-6)
        m.factors[k % 2] = float(k + 4)


# --- the optimiser's inline path: gradient trees edited before update --------------------


def _chain_grads(model):
    return tg.gradient(lambda m: counted_loss(m), model)[0]


def _double_first(g, m, other):
    g.layers[0].weight = 2 * g.layers[0].weight  # the tree tg.gradient returned, edited
    return g


def _none_bias(g, m, other):
    g.layers[1].bias = None
    return g


def _grads_of_other(g, m, other):
    return _chain_grads(other)


def _the_model_itself(g, m, other):
    return m  # weight decay written by hand


def _bf16(g, m, other):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), g)


def _numpy64(g, m, other):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), g)


def _grads_mapping(g, m, other):
    return tg.gradient(lambda: counted_loss(m), tg.params(m))


def _grads_reordered(g, m, other):
    ps = tg.Params(list(reversed(list(tg.params(m)))))
    return tg.gradient(lambda: counted_loss(m), ps) * 0.5


GRAD_EDITS = {
    "as-returned": lambda g, m, other: g,
    "double-first-in-place": _double_first,
    "none-leaf": _none_bias,
    "other-model": _grads_of_other,
    "model-itself": _the_model_itself,
    "bf16": _bf16,
    "numpy-float64": _numpy64,
    "grads-mapping": _grads_mapping,
    "grads-reordered-scaled": _grads_reordered,
}


def _reference_grads(name, ref, m, other):
    """The gradient list the reference is given for edit `name` (None: skipped)."""
    g = ref.grads()
    if name == "double-first-in-place":
        g[0] = 2 * g[0]
    elif name == "none-leaf":
        g[3] = None
    elif name == "other-model":
        g = jax.tree_util.tree_leaves(jax.grad(loss)(other))
    elif name == "model-itself":
        g = list(ref.leaves)
    elif name == "bf16":
        g = [x.astype(jnp.bfloat16) for x in g]
    elif name == "grads-reordered-scaled":
        g = [0.5 * x for x in g]
    return g


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
def test_gradient_trees_edited_before_update_match_plain_optax(in_place):
    rule = optax.adam(1e-2)
    model, other = make_chain(0), make_chain(7)
    state = tg.setup(rule, model)
    ref = Ref(rule, model)
    names = list(GRAD_EDITS)
    sequence = names + names[::-1] + random.Random(5).choices(names, k=2)
    for name in sequence:
        g = GRAD_EDITS[name](_chain_grads(model), model, other)
        if in_place:
            tg.update_(state, model, g)
        else:
            state, model = tg.update(state, model, g)
        ref.step(_reference_grads(name, ref, model, other))
        ref.check(model, state, rtol=2e-5 if name == "bf16" else 1e-6)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_dict_gradient_edited_in_place_and_a_leaf_dropped():
    rule = optax.adam(0.1)
    model = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5]), "s": jnp.asarray(0.3)}
    state = tg.setup(rule, model)
    ref = Ref(rule, model)

    def grad_of(m):
        return tg.gradient(lambda m: jnp.sum(m["w"] ** 2) * m["s"] + jnp.sum(m["b"]) * m["s"], m)[0]

    for k in range(6):
        g = grad_of(model)
        g_ref = jax.tree_util.tree_leaves(g)  # order: b, s, w
        if k % 3 == 1:
            g["w"] = g["w"] * 3.0
            g_ref[2] = g_ref[2] * 3.0
        elif k % 3 == 2:
            g["s"] = None
            g_ref[1] = None
        state, model = tg.update(state, model, g)
        ref.step(g_ref)
        ref.check(model, state)


def test_donated_steps_reuse_the_returned_model_and_the_old_one_is_refused():
    rule = optax.adam(1e-2)
    model = make_chain(1)
    state = tg.setup(rule, model)
    ref = Ref(rule, model)
    for k in range(4):
        g = _chain_grads(model) if k != 2 else model  # the model itself, donated too
        old_model = model
        state, model = tg.update(state, model, g, donate=True)
        ref.step(ref.grads() if k != 2 else list(ref.leaves))
        ref.check(model, state)
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.weight' is an array that was deleted.*Use the model that call returned",
    ):
        tg.update(state, old_model, _chain_grads(model))
    ref.check(model, state)  # nothing changed by the refused call


# Was a bug: jax's bare "Array has been deleted with shape=int32[]" (the adam count).
def test_the_donated_state_used_again_is_a_clear_error():
    model = {"w": jnp.array([1.0, 2.0])}
    state = tg.setup(optax.adam(0.1), model)
    g = {"w": jnp.array([1.0, -1.0])}
    _, model2 = tg.update(state, model, g, donate=True)
    with pytest.raises(ValueError, match=r"(?i)state.*deleted.*(returned|donate)"):
        tg.update(state, model2, g)


def test_tied_weight_given_per_place_gradients_on_the_inline_path():
    # jax.grad's per-place gradients (an array at every leaf) are read inline; the
    # places of a tied weight are summed, and the weight stays one object.
    rule = optax.adam(0.1)
    w, z = jnp.array([1.0, 2.0]), jnp.array([0.5, -0.5])
    model = {"a": w, "b": w, "c": z}
    state = tg.setup(rule, model)
    ref = Ref(rule, {"w": w, "z": z})

    def f(m):
        return jnp.sum(m["a"] ** 2) + jnp.sum(m["b"] * 3.0) + jnp.sum(m["c"] * m["a"])

    def grad_of(m):
        return tg.gradient(f, m)[0]

    for k in range(5):
        g = jax.grad(f)(model) if k % 2 == 0 else grad_of(model)
        if k % 2:
            assert g["b"] is None  # the total is at the first place
        state, model = tg.update(state, model, g)
        assert model["a"] is model["b"]
        r = ref.model()
        gr = jax.grad(lambda r: f({"a": r["w"], "b": r["w"], "c": r["z"]}))(r)
        ref.step([gr["w"], gr["z"]])
        assert_close([model["a"], model["c"]], ref.leaves)


def test_untrained_leaves_and_frozen_parameters_on_the_inline_path():
    class Scaled(tg.Module):
        __trainable__ = ("w", "v")

        def __init__(self):
            self.w = jnp.array([1.0, 2.0])
            self.v = jnp.array([0.5])
            self.buf = jnp.array([3.0])  # a float array the optimiser does not train
            self.n = jnp.array(0)  # an integer leaf

    def f(m):
        return jnp.sum(m.w**2 * m.buf) + jnp.sum(m.v * m.w[0])

    def grad_of(m):
        return tg.gradient(f, m)[0]

    rule = optax.adam(0.1)
    m = Scaled()
    state = tg.setup(rule, m)
    ref = Ref(rule, {"v": m.v, "w": m.w})  # (v, w): the Module's attribute order is w, v
    buf, n = m.buf, m.n
    for k in range(7):
        g = m if k == 3 else grad_of(m)  # the model itself: an array at every leaf
        gw, gv = g.w, g.v
        if k == 4:
            tg.freeze_(state.v)
        if k == 6:
            tg.thaw_(state.v)
        tg.update_(state, m, g)
        ref.step([None if k in (4, 5) else gv, gw])
        assert m.buf is buf and m.n is n
        assert_close([m.v, m.w], ref.leaves)


def test_implicit_parameters_captured_in_another_order_each_call():
    w, b, c = jnp.array([1.0, 2.0]), jnp.array([0.5, -0.5]), jnp.array([3.0, 4.0])
    ps = tg.Params([w, b])

    def grads_of(cap):
        return tg.gradient(lambda: jnp.sum(cap[0] * 2.0 + cap[1] ** 2), ps)

    orders = ([w, b], [b, w], [w, w], [b, b], [c, b], [w, c], [c, c], [w, b], [b, w])
    for cap in orders:
        g = grads_of(cap)
        for p in (w, b):
            want = None
            if cap[0] is p:
                want = 2.0 * jnp.ones(2)
            if cap[1] is p:
                want = 2 * p if want is None else want + 2 * p
            if want is None:
                assert g[p] is None, cap
            else:
                np.testing.assert_allclose(g[p], want, rtol=1e-6)


# --- two models, two styles, many steps ------------------------------------------------


def _explicit_step(world):
    return tg.gradient(lambda m: counted_loss(m), world["model"])[0]


def _implicit_step(world):
    model = world["model"]
    return tg.gradient(lambda: counted_loss(model), world["ps"])


def test_two_models_and_both_styles_interleaved_match_plain_optax_without_retracing():
    rule = optax.adam(3e-2)
    worlds = []
    for seed in (0, 11):
        model = make_chain(seed)
        worlds.append(
            {
                "model": model,
                "ps": tg.params(model),
                "state": tg.setup(rule, model),
                "ref": Ref(rule, model),
            }
        )
    styles = ("explicit-pure", "explicit-in-place", "implicit")
    plan = [(w, s) for s in styles for w in (0, 1)]  # every combination once: the warm-up
    # A layer swapped for a new one of the same shape, the Params and state kept (plain
    # optax: the same state on the new arrays); then each style once more.
    plan += [(0, "swap-layer"), (1, "swap-layer")] + [(w, s) for s in styles for w in (0, 1)]
    pick = random.Random(6)
    plan += [(pick.randrange(2), pick.choice(styles)) for _ in range(12)]
    warm = None
    for k, (w, style) in enumerate(plan):
        if k == 14:
            warm = len(TRACES)
        world = worlds[w]
        if style == "swap-layer":
            layer = nn.Dense(3, 1, key=jax.random.key(40 + w))
            world["model"].layers[1] = layer
            world["ref"].leaves[2:4] = [jnp.array(layer.weight), jnp.array(layer.bias)]
            continue
        if style == "implicit":
            tg.update_(world["state"], world["ps"], _implicit_step(world))
        else:
            g = _explicit_step(world)
            if style == "explicit-pure":
                world["state"], world["model"] = tg.update(world["state"], world["model"], g)
                world["ps"] = tg.params(world["model"])
            else:
                tg.update_(world["state"], world["model"], g)
        world["ref"].step(world["ref"].grads())
        for other in worlds:  # the other world is untouched
            other["ref"].check(other["model"], other["state"], rtol=2e-6)
    assert len(TRACES) == warm, "the same two architectures in the same two styles traced again"


def test_a_failed_update_on_the_inline_path_changes_nothing():
    rule = optax.adam(0.1)
    model = make_chain(2)
    state = tg.setup(rule, model)
    ref = Ref(rule, model)
    for _ in range(2):  # the second step reads the gradient inline
        tg.update_(state, model, _chain_grads(model))
        ref.step(ref.grads())
    bad = [
        (
            lambda g: jax.tree_util.tree_map(lambda a: a.astype(jnp.int32), g),
            ValueError,
            r"'layers\.0\.weight' has dtype int32",
        ),
        (
            lambda g: jax.tree_util.tree_map(lambda a: a[..., None], g),
            ValueError,
            r"'layers\.0\.weight' has shape \(3, 2, 1\)",
        ),
        (
            lambda g: jax.tree_util.tree_map(lambda a: a.astype(jnp.complex64), g),
            ValueError,
            r"complex but its parameter is real",
        ),
    ]
    for make_bad, error, match in bad:
        g = make_bad(_chain_grads(model))
        before = snapshot(model, state)
        with pytest.raises(error, match=match):
            tg.update_(state, model, g)
        assert_unchanged(before, model, state)
        with pytest.raises(error, match=match):
            tg.update(state, model, g)
        assert_unchanged(before, model, state)
    tg.update_(state, model, _chain_grads(model))
    ref.step(ref.grads())
    ref.check(model, state)


def test_tie_made_after_setup_is_refused_on_the_inline_path_and_nothing_changes():
    rule = optax.sgd(0.1)
    model = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0])}
    state = tg.setup(rule, model)
    g = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tg.update_(state, model, g)
    tg.update_(state, model, g)  # inline from here
    model["b"] = model["a"]
    before = snapshot(model, state)
    with pytest.raises(ValueError, match=r"'a' and 'b' are now one array.*tg\.setup"):
        tg.update_(state, model, g)
    assert_unchanged(before, model, state)
    model["b"] = jnp.array([2.8, 3.8])  # untied again: the state still fits
    tg.update_(state, model, g)
    np.testing.assert_allclose(model["a"], [0.7, 1.7], rtol=1e-6)
    np.testing.assert_allclose(model["b"], [2.7, 3.7], rtol=1e-6)


def test_parameter_dtype_changed_since_setup_matches_plain_optax():
    rule = optax.adam(0.1)
    model = {"w": jnp.ones(3), "b": jnp.ones(2)}
    state = tg.setup(rule, model)
    ref = Ref(rule, model)
    g = {"w": jnp.array([1.0, -1.0, 0.5]), "b": jnp.ones(2)}
    for k in range(4):
        if k == 2:  # a leaf replaced by one of another float dtype: plain optax runs on
            model = {"w": model["w"].astype(jnp.bfloat16), "b": model["b"]}
            ref.leaves[1] = ref.leaves[1].astype(jnp.bfloat16)
        state, model = tg.update(state, model, g)
        ref.step(jax.tree_util.tree_leaves(g))
        ref.check(model, state, rtol=1e-2)


# Was a bug: the (1,) weight was broadcast against its (3,) adam moments and came back (3,).
def test_a_parameter_of_another_shape_than_at_setup_is_refused():
    model = {"w": jnp.ones(3)}
    state = tg.setup(optax.adam(0.1), model)
    state, model = tg.update(state, model, {"w": jnp.ones(3)})
    state, model = tg.update(state, model, {"w": jnp.ones(3)})  # the inline path
    model["w"] = jnp.ones(1)
    before = snapshot(model, state)
    with pytest.raises(
        ValueError,
        match=r"'w' is float32\[1\] but was float32\[3\] when the optimiser state was set up",
    ):
        tg.update(state, model, {"w": jnp.ones(1)})
    assert_unchanged(before, model, state)


def test_a_rule_with_no_state_per_parameter_takes_a_new_shape_as_optax_does():
    # Plain sgd keeps nothing per parameter, so a reshaped parameter is no mismatch there:
    # the step follows optax (and a frozen one keeps its array).
    rule = optax.sgd(0.1)
    model = {"w": jnp.ones(3), "v": jnp.ones(2)}
    state = tg.setup(rule, model)
    state, model = tg.update(state, model, {"w": jnp.ones(3), "v": jnp.ones(2)})
    model["w"] = jnp.array([2.0])
    state, model = tg.update(state, model, {"w": jnp.array([1.0]), "v": jnp.ones(2)})
    u, _ = rule.update({"w": jnp.array([1.0])}, rule.init({"w": jnp.array([2.0])}))
    np.testing.assert_allclose(model["w"], optax.apply_updates({"w": jnp.array([2.0])}, u)["w"])
    np.testing.assert_allclose(model["v"], [0.8, 0.8], rtol=1e-6)


# Was a bug: the compiled step kept the numpy array's first value (compared by identity).
def test_a_schedule_reading_a_numpy_array_edited_in_place():
    lr = np.array(0.1, np.float32)
    rule = optax.sgd(lambda count: lr)
    model = {"w": jnp.array([1.0, 2.0])}
    state = tg.setup(rule, model)
    g = {"w": jnp.ones(2)}
    state, model = tg.update(state, model, g)
    lr[...] = 0.5
    state, model = tg.update(state, model, g)
    np.testing.assert_allclose(model["w"], [0.4, 1.4], rtol=1e-6)  # what plain optax gives


def test_a_schedule_reading_a_replaced_array_is_fresh_every_step():
    box = [jnp.asarray(0.1)]
    rule = optax.sgd(lambda count: box[0])
    model = {"w": jnp.array([1.0, 2.0])}
    state = tg.setup(rule, model)
    g = {"w": jnp.ones(2)}
    for k in range(5):
        box[0] = jnp.asarray(0.1 * (k + 1))
        before = model["w"]
        state, model = tg.update(state, model, g)
        np.testing.assert_allclose(before - model["w"], [0.1 * (k + 1)] * 2, rtol=1e-5)


# --- the set of inputs differentiated, read on the first trace -----------------------------


def _grad_shape_dependent(v):
    return tg.gradient(lambda v: jnp.sum(v) if v.shape[0] == 3 else jnp.float32(1.0), v)[0]


def _grad_dtype_dependent(v):
    return tg.gradient(lambda v: jnp.sum(v) if v.dtype == jnp.float32 else jnp.float32(1.0), v)[0]


_BOX: list = []


def _grad_capture_dependent(v):
    return tg.gradient(
        lambda v: jnp.sum(v * _BOX[0]) if _BOX[0].ndim == 1 else jnp.sum(_BOX[0]), v
    )[0]


def _empty_batch_guarded(model, x, y):
    if x.shape[0] == 0:  # a common guard: an empty batch has loss 0
        return jnp.zeros(())
    return loss(model, x, y)


def _chain_grad_on(model, x, y):
    return tg.gradient(lambda m: _empty_batch_guarded(m, x, y), model)[0]


def _case_shape():
    assert _grad_shape_dependent(jnp.ones(2)) is None
    return _grad_shape_dependent(jnp.ones(3)), jnp.ones(3)


def _case_dtype():
    assert _grad_dtype_dependent(jnp.ones(2, jnp.bfloat16)) is None
    return _grad_dtype_dependent(jnp.ones(2)), jnp.ones(2)


def _case_capture():
    _BOX[:] = [jnp.ones((2, 2))]
    assert _grad_capture_dependent(jnp.ones(2)) is None
    _BOX[:] = [jnp.array([2.0, 3.0])]
    return _grad_capture_dependent(jnp.ones(2)), jnp.array([2.0, 3.0])


def _case_reverse():
    # The other way round: a gradient that became a structural zero comes back as zeros.
    np.testing.assert_allclose(_grad_shape_dependent(jnp.ones(3)), jnp.ones(3))
    return _grad_shape_dependent(jnp.ones(2)), None


def _case_empty_batch():
    model = make_chain(3)
    assert _chain_grad_on(model, X5[:0], Y5[:0]).layers[0].weight is None
    # (X5 and Y5 themselves: X and Y are captured too, as `loss`'s defaults, and passing
    # the same objects would make a tie, hence another cache entry.)
    got = _chain_grad_on(model, X5, Y5).layers[0].weight
    return got, jax.grad(loss)(model, X5, Y5).layers[0].weight


# Was a bug: which inputs get a derivative was read on an entry's first trace only; a new
# shape or dtype traced it again and kept that reading (None where the new code path
# uses the input, zeros where it no longer does). A later trace is now read too, and
# one that reads otherwise goes to an entry of its own.
@pytest.mark.parametrize(
    "case",
    [_case_shape, _case_dtype, _case_capture, _case_reverse, _case_empty_batch],
    ids=["arg-shape", "arg-dtype", "captured-shape", "reverse-zeros-not-none", "empty-first-batch"],
)
def test_a_new_shape_differentiates_what_the_new_trace_depends_on(case):
    got, want = case()
    if want is None:
        assert got is None
    else:
        assert got is not None
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_implicit_parameters_replaced_and_tied_between_calls():
    # Params of a dict re-read it; the captured model moves with it.
    model = {"w": jnp.array([1.0, 2.0]), "v": jnp.array([0.5, -0.5]), "n": jnp.array([3, 4])}

    def grads_of(m, x):
        return tg.withgradient(
            lambda: jnp.sum(m["w"] * x * m["v"]) + jnp.sum(m["w"] ** 2), tg.params(m)
        )

    def ref(m, x):
        f = lambda w, v: jnp.sum(w * x * v) + jnp.sum(w**2)
        if m["w"] is m["v"]:
            return {"tied": jax.grad(lambda w: f(w, w))(m["w"])}
        gw, gv = jax.grad(f, argnums=(0, 1))(m["w"], m["v"])
        return {"w": gw, "v": gv}

    x = jnp.array([1.5, -1.0])
    steps = ["same", "new-w", "tie", "same", "untie", "new-x", "int-n", "tie", "new-w"]
    for step in steps:
        if step == "new-w":
            model["w"] = model["w"] + 1.0
        elif step == "tie":
            model["v"] = model["w"]
        elif step == "untie":
            model["v"] = jnp.array([0.25, 0.75])
        elif step == "new-x":
            x = x * 2
        elif step == "int-n":
            model["n"] = jnp.array([5, 6])
        value, grads = grads_of(model, x)
        want = ref(model, x)
        if "tied" in want:  # one parameter, named by its first place
            assert list(grads.named()) == ["v"]
            np.testing.assert_allclose(grads[model["w"]], want["tied"], rtol=1e-6)
        else:
            assert sorted(grads.named()) == ["v", "w"]
            for name, g in grads.named().items():
                np.testing.assert_allclose(g, want[name], rtol=1e-6)
        np.testing.assert_allclose(
            value, jnp.sum(model["w"] * x * model["v"]) + jnp.sum(model["w"] ** 2), rtol=1e-6
        )


def test_under_jax_transforms_and_outside_alternately():
    a = jnp.array([1.0, 2.0, 3.0])
    w = jnp.array([0.3, -0.2, 0.5])

    def body(w, a):
        return jnp.sum(jnp.sin(w) * a) + jnp.sum(w**3)

    def tgg(w, a):
        return tg.gradient(lambda w: body(w, a), w)[0]

    second = jax.grad(lambda w: jnp.sum(jax.grad(body)(w, a) ** 2))(w)
    for _ in range(2):
        np.testing.assert_allclose(tgg(w, a), jax.grad(body)(w, a), rtol=1e-6)
        np.testing.assert_allclose(jax.jit(tgg)(w, a), jax.grad(body)(w, a), rtol=1e-6)
        np.testing.assert_allclose(
            jax.grad(lambda w: jnp.sum(tgg(w, a) ** 2))(w), second, rtol=1e-6
        )
        ws = jnp.stack([w, 2 * w])
        want = jax.vmap(jax.grad(body), in_axes=(0, None))(ws, a)
        np.testing.assert_allclose(jax.vmap(tgg, in_axes=(0, None))(ws, a), want, rtol=1e-6)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.NoGradientWarning)
        yield
