"""Zygote.jl's implicit-parameter tests (`Params`, `Grads`), ported, and a hunt around them.

Ported from Zygote's test/deprecated.jl (its `Params`/`Grads` testsets), checked
against `jax.grad`/`jax.jacrev` of the equivalent explicit function, plain optax
or a closed form; then what a hostile user does around them: a `Params` mixed
with arrays in a list, a gradient scaled by a numpy learning rate for a bfloat16
model, `to_tree` of a model edited after the gradients were taken, a parameter
in a Module and a dict at once.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def ids(xs):
    return [id(x) for x in xs]


# ======================================================================================
# Defects found (each test fails without its fix)
# ======================================================================================

# --- Grads times a numpy scalar / 0-d array changed the gradients' dtype (silent) -----

SCALES = {
    "np.float32": np.float32(0.5),
    "np.float64": np.float64(0.5),
    "np.float16": np.float16(0.5),
    "np-0d-f32": np.asarray(0.5, np.float32),
    "jax-0d-f32": jnp.array(0.5, jnp.float32),  # strongly typed, unlike jnp.asarray(0.5)
    "jax-0d-bf16": jnp.array(0.5, jnp.bfloat16),
    "np.int64": np.int64(2),
}
DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float32": jnp.float32,
    "complex64": jnp.complex64,
}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_scaling_grads_by_a_numpy_or_0d_scalar_keeps_each_gradient_dtype(dtype):
    # A learning rate that came out of numpy, or a 0-d array, scales the gradients like
    # a Python number: `bf16_grads * np.float32(0.5)` was float32 (JAX promotes a
    # strongly typed scalar), and the optimiser's moments then changed dtype as well.
    dt = DTYPES[dtype]
    w = jnp.array([1.0, -2.0, 3.0], dt)
    v = jnp.array([0.5, 0.25], dt)
    ps = tg.Params([w, v])
    g = tg.gradient(lambda: jnp.real(jnp.sum(w * w)), ps)  # v unused: None
    ref = 2 * np.conj(np.asarray(w, np.complex128 if dtype == "complex64" else np.float64))
    close(g[w], ref, 2e-2)
    for scale, c in SCALES.items():
        cf = float(np.asarray(c, np.float64))
        for out, expected in ((g * c, ref * cf), (c * g, ref * cf), (g / c, ref / cf)):
            assert isinstance(out, tg.Grads)
            assert out[w].dtype == dt, (scale, out[w].dtype)
            assert out[v] is None
            close(out[w], expected, 2e-2)


def test_weak_typed_scalar_parameter_times_a_numpy_half_keeps_float32():
    # The gradient of `jnp.asarray(2.0)` is weakly typed float32: times an np.float16 it
    # was float16, a tenth of the precision, for a float32 parameter.
    s = jnp.asarray(2.0)
    g = tg.gradient(lambda: s**3, tg.Params(s))
    close(g[s], 12.0)  # d/ds s^3 = 3 s^2
    out = g * np.float16(0.1)
    assert out[s].dtype == jnp.float32
    close(out[s], 12.0 * np.float32(np.float16(0.1)), 1e-6)


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_bfloat16_model_scaled_grads_and_adam_keep_bfloat16_state_like_plain_optax():
    d = {"w": jnp.array([1.0, -2.0, 0.5], jnp.bfloat16), "b": jnp.array(0.25, jnp.bfloat16)}
    ps = tg.Params(d)
    rule = optax.adam(0.1)
    state = tg.setup(rule, ps)
    ref = dict(d)
    ref_state = rule.init(ref)
    dtypes = [x.dtype for x in jax.tree_util.tree_leaves(state)]

    def loss(p):
        return jnp.sum((p["w"].astype(jnp.float32) - 1.0) ** 2) * p["b"].astype(jnp.float32)

    # One step: the moments' dtype changed at the first.
    grads = tg.gradient(lambda: loss(d), ps) * np.float32(0.5)  # e.g. a mean over 2
    assert grads[d["w"]].dtype == jnp.bfloat16
    rg = jax.tree_util.tree_map(lambda t: t * jnp.bfloat16(0.5), jax.grad(loss)(ref))
    tg.update_(state, ps, grads)
    upd, ref_state = rule.update(rg, ref_state, ref)
    ref = optax.apply_updates(ref, upd)
    assert [x.dtype for x in jax.tree_util.tree_leaves(state)] == dtypes
    for k in d:
        assert d[k].dtype == jnp.bfloat16
        close(d[k].astype(jnp.float32), ref[k].astype(jnp.float32), 1e-2)


def test_a_traced_learning_rate_inside_tg_jit_keeps_bfloat16_gradients():
    d = {"w": jnp.array([1.0, -2.0], jnp.bfloat16)}
    ps = tg.Params(d)
    seen = []

    @tg.jit
    def step(lr):
        grads = tg.gradient(lambda: jnp.sum(d["w"].astype(jnp.float32) ** 2), ps) * lr
        seen.append(grads[d["w"]].dtype)
        d["w"] = d["w"] - grads[d["w"]]

    step(jnp.array(0.25, jnp.float32))
    assert seen == [jnp.bfloat16] and d["w"].dtype == jnp.bfloat16
    close(d["w"].astype(jnp.float32), np.array([1.0, -2.0]) * 0.5, 1e-2)  # w - 0.25 * 2w


# --- Grads.to_tree of a model edited after the gradients: silently None (silent) -------


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_to_tree_refuses_a_model_whose_parameter_was_replaced_since():
    m = nn.Dense(2, 2, key=jax.random.key(0))
    x = jnp.array([1.0, -1.0])
    grads = tg.gradient(lambda: jnp.sum(m(x) ** 2), tg.params(m))
    old = m.weight
    m.weight = jnp.clip(m.weight, -0.5, 0.5)  # a constraint applied after the gradient
    bias = m.bias
    # The weight's gradient was None in the tree and tg.update skipped it silently
    # (tg.update_ with these same Grads refuses the case: so does to_tree now).
    with pytest.raises(
        ValueError, match=r"to_tree: the model's 'weight' is not the array.*replaced.*again"
    ):
        grads.to_tree(m)
    assert m.bias is bias and old in grads  # nothing changed by the failed call
    m.weight = old  # the registered array back: the explicit tree, as before
    (explicit,) = tg.gradient(lambda mm: jnp.sum(mm(x) ** 2), m)
    tree = grads.to_tree(m)
    close(tree.weight, explicit.weight)
    close(tree.bias, explicit.bias)


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_to_tree_of_a_sub_model_or_with_an_extra_parameter_is_not_a_replacement():
    model = nn.Chain(nn.Dense(2, 2, key=jax.random.key(0)), nn.Dense(2, 1, key=jax.random.key(1)))
    extra = jnp.ones((1, 2))  # same shape and dtype as the second weight, not in the model
    ps = tg.params(model)
    ps.add(extra)
    x = jnp.array([0.3, -0.7])

    def loss(m, e):
        return jnp.sum(jnp.tanh(m(x))) + jnp.sum(e * m.layers[1].weight)

    grads = tg.gradient(lambda: loss(model, extra), ps)
    ref_m, ref_e = jax.grad(loss, argnums=(0, 1))(model, extra)
    close(grads[extra], ref_e)
    sub = grads.to_tree(model.layers[0])  # paths 'weight' vs 'layers.0.weight'
    close(sub.weight, ref_m.layers[0].weight)
    full = grads.to_tree(model)
    close(full.layers[1].weight, ref_m.layers[1].weight)
    other = [jnp.ones((2, 2)), extra]  # '0' names the first registered array: not here
    assert grads.to_tree(other)[0] is None


# --- A Params in a list with arrays: its parameters silently dropped (silent) ----------


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_params_of_a_list_mixing_params_and_arrays_is_their_union():
    W, b, c = jnp.array([[1.0, 2.0]]), jnp.array([0.5]), jnp.array(3.0)
    inner = tg.Params([W, b])
    ps = tg.Params([inner, c])  # held only c: W and b were an opaque leaf
    assert ids(ps) == ids([W, b, c]) and list(ps.named()) == ["0", "1", "+1"]
    x = jnp.array([2.0, -1.0])
    grads = tg.gradient(lambda: c * jnp.sum(jnp.tanh(W @ x + b)), ps)
    ref = jax.grad(lambda W, b, c: c * jnp.sum(jnp.tanh(W @ x + b)), argnums=(0, 1, 2))(W, b, c)
    for p, r in zip((W, b, c), ref, strict=True):
        close(grads[p], r)
    assert ids(tg.Params((c, inner))) == ids([c, W, b])  # a tuple too, in order


@pytest.mark.parametrize(
    "make, where",
    [
        (lambda ps, c: {"enc": ps, "c": c}, "'enc'"),
        (lambda ps, c: [[ps], c], "'0.0'"),
        (lambda ps, c: {"x": [c, {"y": ps}]}, "'x.1.y'"),
    ],
    ids=["dict", "nested-list", "deep"],
)
def test_a_params_nested_in_a_container_is_refused_by_name(make, where):
    W, c = jnp.ones(2), jnp.ones(3)
    inner = tg.Params([W])
    with pytest.raises(TypeError, match=rf"tg\.params: the .* holds a tg\.Params at {where}.*add"):
        tg.Params(make(inner, c))
    ps = tg.Params([c])
    with pytest.raises(TypeError, match=rf"Params\.add: .* holds a tg\.Params at {where}"):
        ps.add(make(inner, c))
    assert ids(ps) == ids([c]) and ids(inner) == ids([W])  # nothing changed by the failed calls


# --- Params indexing (Zygote's `ps[1] === x`): was "not subscriptable" (loud) ----------


def test_params_indexing_like_zygote():
    x, y = jnp.array([1.0, 2.0]), jnp.array([1.0])
    ps = tg.Params([x, y])
    assert ps[0] is x and ps[1] is y and ps[-1] is y
    assert ids(ps[0:2]) == ids([x, y]) and ids(ps[1:]) == ids([y])
    with pytest.raises(IndexError, match=r"Params index 2 is out of range: there are 2"):
        ps[2]
    with pytest.raises(TypeError, match=r"indexed by position.*got a str; by name.*named\(\)"):
        ps["0"]
    with pytest.raises(TypeError, match=r"indexed by position.*got a bool"):
        ps[True]
    # Inside the function, as Zygote users write `ps[1]`: read like the iteration.
    grads = tg.gradient(lambda: jnp.sum(ps[0] ** 2) * jnp.sum(ps[1]), ps)
    close(grads[x], 2 * x * 1.0)
    close(grads[y], np.array([5.0]))


# ======================================================================================
# Zygote's test/deprecated.jl, ported (checked against jax)
# ======================================================================================


def test_zygote_pullback_back_nothing_and_repeated_backs_are_independent():
    # Zygote's "copy" testset: there back(1) then back(nothing) overwrote g1 (its Grads
    # share one cache); here each back returns its own Grads.
    w = jnp.array([3.0, 1.0])
    x1 = jnp.array([2.0, 4.0])
    y, back = tg.pullback(lambda: jnp.sum(w * x1), tg.Params([w]))
    close(y, 10.0)
    g1 = back(1.0)
    g2 = back(None)
    assert g2[w] is None and len(g2) == 1
    g3 = back(jnp.asarray(2.0))
    close(g1[w], x1)  # unchanged by the later calls
    close(g3[w], 2 * x1)
    g3c = copy.copy(g3)
    assert ids(g3c) == ids(g3) == ids([w]) and g3c[w] is g3[w]


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_zygote_jacobian_of_params():
    xs = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    ys = jnp.array([5.0, 7.0, 9.0])

    def f(xs, ys):
        return ys[:2] + jnp.sum(xs**2)

    J = tg.jacobian(lambda: f(xs, ys), tg.Params([xs, ys]))
    jx, jy = jax.jacrev(f, argnums=(0, 1))(xs, ys)
    close(J[ys], jy)
    close(J[ys], [[1, 0, 0], [0, 1, 0]])
    close(J[xs], jx)
    assert J[xs].shape == (2, 2, 2)


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_zygote_params_nesting():
    W, b = jnp.ones((3, 3)), jnp.zeros(3)
    r = jnp.ones((3, 3))
    ps = tg.Params([W, b])

    def outer():
        p, pb = tg.pullback(lambda: jnp.sum(W @ r + b[:, None]), ps)
        return jnp.sum(pb(p)[W])

    close(tg.gradient(outer, ps)[W], np.full((3, 3), 81.0))
    l2 = tg.gradient(lambda: sum(jnp.sum(p**2) for p in ps), ps)  # L2 over ps
    close(l2[W], 2 * W)
    close(l2[b], 0 * b)
    # A Params built inside the function, over the captured arrays.
    sgs = tg.gradient(lambda: sum(jnp.sum(p) for p in tg.Params([W, b])), ps)
    close(sgs[W], np.ones((3, 3)))
    close(sgs[b], np.ones(3))


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_zygote_implicit_cases_table():
    # "#300", "Dict getindex", "mutable accum_param", "Dict iteration", each against
    # jax.grad of the explicit function.
    class Mut:
        def __init__(self, x):
            self.x = x

    t = (jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.ones((2, 2)))
    g = tg.gradient(lambda: jnp.sum(t[0] ** 2), tg.Params(t))
    close(g[t[0]], 2 * t[0])
    assert g[t[1]] is None

    d = {"key": jnp.array([1.0, 2.0, 3.0, 4.0])}
    g = tg.gradient(lambda: d["key"][1] ** 2, tg.Params([d["key"]]))
    close(g[d["key"]], jax.grad(lambda k: k[1] ** 2)(d["key"]))

    y1 = jnp.array([3.0])
    holders = (Mut(y1),)
    g = tg.gradient(lambda: jnp.sum(holders[0].x + holders[0].x) ** 3, tg.Params([y1]))
    close(g[y1], [216.0])

    arr = {"a": jnp.array([3.0]), "b": jnp.array([4.0]), "c": jnp.array([5.0])}

    def sumkv(dd):
        s = jnp.zeros_like(dd["c"])
        for k, v in dd.items():
            s = s + v + (v if k == "b" else 0.0)
        return jnp.sum(s)

    g = tg.gradient(lambda: sumkv(arr), tg.Params(list(arr.values())))
    ref = jax.grad(sumkv)(arr)
    for k in arr:
        close(g[arr[k]], ref[k])
    close(ref["b"], [2.0])


# ======================================================================================
# Hunt: several homes, aux outputs, copies
# ======================================================================================


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_parameter_in_a_module_and_a_dict_at_once_trains_like_plain_optax():
    m = nn.Dense(2, 2, key=jax.random.key(0))
    d = {"extra": m.weight, "c": jnp.array([0.5, -0.5])}
    ps = tg.Params([m, d])
    assert len(ps) == 3 and list(ps.named()) == ["0.weight", "0.bias", "1.c"]
    x = jnp.array([1.0, -1.0])
    rule = optax.adam(0.1)
    state = tg.setup(rule, ps)
    ref = {"w": m.weight, "b": m.bias, "c": d["c"]}
    ref_state = rule.init(ref)

    def loss(w, b, c):
        return jnp.sum(jnp.tanh(w @ x + b)) + jnp.sum(w**2) + jnp.sum(c * w[0])

    for _ in range(2):
        # The weight read through the Module and through the dict: one total gradient.
        grads = tg.gradient(
            lambda: (
                jnp.sum(jnp.tanh(m(x))) + jnp.sum(d["extra"] ** 2) + jnp.sum(d["c"] * m.weight[0])
            ),
            ps,
        )
        tg.update_(state, ps, grads)
        rg = jax.grad(lambda p: loss(p["w"], p["b"], p["c"]))(ref)
        upd, ref_state = rule.update(rg, ref_state, ref)
        ref = optax.apply_updates(ref, upd)
    assert m.weight is d["extra"]  # still one object in both homes
    close(m.weight, ref["w"], 1e-5)
    close(m.bias, ref["b"], 1e-5)
    close(d["c"], ref["c"], 1e-5)


@pytest.mark.slow  # over ~0.5 s on a busy 2-core host
def test_a_list_appended_to_after_params_is_re_read_with_names():
    lst = [jnp.array([1.0, 2.0])]
    ps = tg.Params(lst)
    lst.append(jnp.array(3.0))  # a 0-d parameter, appended later
    lst.append({"w": jnp.array([[0.5]])})
    assert list(ps.named()) == ["0", "1", "2.w"]

    def loss(a, s, w):
        return jnp.sum(a**2) * s + jnp.sum(w) * s

    grads = tg.gradient(lambda: loss(lst[0], lst[1], lst[2]["w"]), ps)
    ref = jax.grad(loss, argnums=(0, 1, 2))(lst[0], lst[1], lst[2]["w"])
    for g, r in zip(grads.named().values(), ref, strict=True):
        close(g, r)


def test_withgradient_implicit_aux_holds_the_parameters_values():
    W, s = jnp.array([1.0, 2.0]), jnp.asarray(0.5)
    ps = tg.Params({"W": W, "s": s})
    value, grads = tg.withgradient(lambda: (jnp.sum(W**2) * s, {"W": W, "n": 3}), ps)
    loss, aux = value
    close(loss, 2.5)
    assert aux["n"] == 3 and isinstance(aux["W"], jax.Array)
    np.testing.assert_array_equal(aux["W"], W)  # the value, not a leftover tracer
    ref = jax.grad(lambda W, s: jnp.sum(W**2) * s, argnums=(0, 1))(W, s)
    close(grads[W], ref[0])
    close(grads[s], ref[1])


def test_params_with_a_removed_entry_survive_pickle_and_deepcopy_together_with_the_model():
    d = {"w": jnp.array([1.0, 2.0]), "frozen": jnp.array([3.0])}
    ps = tg.Params(d)
    ps.remove(d["frozen"])
    for clone in (copy.deepcopy((d, ps)), pickle.loads(pickle.dumps((d, ps)))):
        d2, ps2 = clone
        assert list(ps2.named()) == ["w"] and ps2[0] is d2["w"] and d2["frozen"] not in ps2
        g = tg.gradient(lambda d2=d2: jnp.sum(d2["w"] ** 2) + jnp.sum(d2["frozen"]), ps2)
        close(g[d2["w"]], 2 * np.array([1.0, 2.0]))
        assert len(g) == 1
