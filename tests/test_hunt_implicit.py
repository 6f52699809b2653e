"""Hostile-user hunt in implicit mode: Params, Grads and closures, against jax.grad."""

import functools
import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treegrad as tg
from treegrad import nn


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


class Holder:
    """A plain Python object (not a pytree) that holds a parameter."""

    def __init__(self, w):
        self.w = w


# --------------------------------------------------------------------------------------
# Bugs (strict xfail: each one flips to a failure once fixed, so the mark can go)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [np.float32(2.0), np.float64(2.0), np.asarray(2.0)], ids=repr)
def test_numpy_scalar_times_grads_scales_the_gradients(c):
    a, b = jnp.ones(2), jnp.full(2, 3.0)
    g = tg.gradient(lambda: jnp.sum(a * b), tg.Params([a, b]))
    out = c * g  # a learning rate that came out of numpy
    assert isinstance(out, tg.Grads), type(out)
    close(out[a], 2.0 * b)  # d/da sum(a*b) = b
    close(out[b], 2.0 * a)


def test_named_keeps_every_parameter_after_add():
    # A dict key "1" and an array added second (once named by its position, "1").
    a, b = jnp.ones(2), jnp.full(2, 2.0)
    ps = tg.Params({"1": a})
    ps.add(b)
    assert len(ps) == 2
    grads = tg.gradient(lambda: jnp.sum(a) + 3.0 * jnp.sum(b), ps)
    assert list(ps.named()) == ["1", "+1"]
    assert ps.named()["1"] is a and ps.named()["+1"] is b
    named = grads.named()
    assert list(named) == ["1", "+1"]
    close(named["1"], np.ones(2))  # d/da sum(a) + 3 sum(b)
    close(named["+1"], np.full(2, 3.0))


@pytest.mark.parametrize(
    "first, added",
    [
        ({"a.b": jnp.ones(1), "a": {"b": jnp.ones(3)}}, {"c": jnp.ones(2)}),  # print alike
        ({"+1": jnp.ones(1)}, jnp.ones(2)),  # a key spelled like an added array's name
        ({"+1": jnp.ones(1), "+1#2": jnp.ones(3)}, jnp.ones(2)),  # and like its suffix
    ],
    ids=["dotted-key", "plus-key", "plus-and-suffix-keys"],
)
def test_named_names_are_distinct_whatever_the_keys(first, added):
    ps = tg.Params(first)
    ps.add(added)
    arrays = list(ps)
    named = ps.named()
    assert len(named) == len(ps) == len(arrays)
    assert all(x is y for x, y in zip(named.values(), arrays, strict=True))
    grads = tg.gradient(lambda: sum(jnp.sum(k * p) for k, p in enumerate(arrays, 1)), ps)
    assert list(grads.named()) == list(named)
    for k, (g, p) in enumerate(zip(grads.named().values(), arrays, strict=True), 1):
        close(g, np.full(p.shape, float(k)))


@pytest.mark.parametrize("wrap", [lambda w: {"w": w}, lambda w: [w]], ids=["dict", "list"])
def test_remove_then_add_back_through_a_container(wrap):
    W, b = jnp.array([1.0, 2.0, 3.0]), jnp.zeros(2)
    ps = tg.Params({"W": W, "b": b})
    ps.remove(W)
    assert W not in ps
    ps.add(wrap(W))
    assert W in ps and len(ps) == 2
    grads = tg.gradient(lambda: jnp.sum(W**2) + jnp.sum(b), ps)
    close(grads[W], 2 * W)


@pytest.mark.slow  # many tries for an id to be reused: ~8 s
def test_removed_parameters_id_is_not_inherited_by_a_new_array():
    # Without id reuse a new array put in the container *is* a parameter:
    d = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    ps = tg.Params(d)
    keep = d["w"]
    ps.remove(keep)
    d["w"] = jnp.full(3, 5.0)
    assert d["w"] in ps and len(ps) == 2
    # The user drops the removed array and makes a new one, which CPython may put at
    # the freed address: it must be a parameter all the same, every time.
    for i in range(12):  # (each collects garbage: 40 s at 50 attempts in a full run)
        d = {"w": jnp.ones(3) * i, "b": jnp.zeros(2)}
        ps = tg.Params(d)
        ps.remove(d["w"])
        d["w"] = None
        gc.collect()
        new = jnp.ones(3) * (i + 1)
        d["w"] = new
        assert new in ps, f"a new array is excluded (attempt {i})"
        assert len(ps) == 2
        grads = tg.gradient(lambda: jnp.sum(d["w"] ** 2) + jnp.sum(d["b"]), ps)  # noqa: B023
        close(grads[new], 2.0 * (i + 1) * np.ones(3))


@pytest.mark.parametrize("fn", [tg.gradient, tg.withgradient], ids=["gradient", "withgradient"])
def test_no_gradient_warning_points_at_the_callers_line(fn):
    w = jnp.ones(2)
    out = jnp.sum(w)  # computed outside
    with pytest.warns(tg.NoGradientWarning, match="outside the function") as rec:
        fn(lambda: out, tg.Params([w]))
    assert rec[0].filename == __file__, rec[0].filename


def test_numpy_array_in_a_tuple_error_names_numpy():
    with pytest.raises(
        TypeError, match=r"'0' is a numpy array inside an immutable tuple.*jnp\.asarray"
    ):
        tg.Params((np.ones(2, dtype=np.float32),))
    ps = tg.Params()
    with pytest.raises(TypeError, match=r"Params\.add: '1' is a numpy array.*list or dict"):
        ps.add((jnp.ones(2), np.ones(2, dtype=np.float32)))
    assert len(ps) == 0


def test_to_tree_is_the_explicit_tree_at_the_parameters_for_a_module_with_trainable():
    # Explicit mode differentiates every float leaf; a Grads holds the registered
    # parameters only (here __trainable__), so to_tree has None at the others (its
    # docstring), and the optimiser, which trains the parameters only, steps the same.
    class Norm(tg.Module):
        __trainable__ = ("scale",)

        def __init__(self):
            self.scale = jnp.array([1.0, 2.0])
            self.running = jnp.array([0.5, -0.5])

    m = Norm()

    def loss(mm):
        return jnp.sum(mm.scale * mm.running)

    (explicit,) = tg.gradient(loss, m)
    close(explicit.running, m.scale)
    tree = tg.gradient(lambda: loss(m), tg.params(m)).to_tree(m)
    close(tree.scale, explicit.scale)
    close(tree.scale, m.running)  # d loss / d scale, closed form
    assert tree.running is None
    state = tg.setup(optax.sgd(0.1), m)
    _, a = tg.update(state, m, explicit)
    _, b = tg.update(state, m, tree)
    close(a.scale, b.scale)
    close(a.scale, m.scale - 0.1 * m.running)
    assert a.running is m.running and b.running is m.running


def test_loop_closure_with_default_arguments_is_a_zero_argument_function():
    w = jnp.array([1.0, -2.0])
    ps = tg.Params([w])
    for c in (1.0, 3.0):
        g = tg.gradient(lambda c=c: jnp.sum(c * w**2), ps)
        close(g[w], 2 * c * w)


# --------------------------------------------------------------------------------------
# Randomised closures: parameters living in different homes, against jax.grad
# --------------------------------------------------------------------------------------

TERMS = {
    "sin": lambda p, q, s, x: jnp.sum(jnp.sin(p) * x),
    "dot": lambda p, q, s, x: jnp.sum(p * q),
    "scaled": lambda p, q, s, x: s * jnp.sum(p**2),
    "tanh": lambda p, q, s, x: jnp.sum(jnp.tanh(p * s + q)),
    "exp": lambda p, q, s, x: jnp.exp(s) * jnp.sum(q),
}
USES = {"sin": "p", "dot": "pq", "scaled": "ps", "tanh": "pqs", "exp": "qs"}


class Box(tg.Module):
    def __init__(self, w):
        self.w = w


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
@settings(max_examples=12, deadline=None)
@given(
    terms=st.lists(
        st.tuples(st.sampled_from(sorted(TERMS)), st.permutations([0, 1, 2]), st.integers(0, 2)),
        min_size=1,
        max_size=4,
    ),
    registered=st.sets(st.integers(0, 3), min_size=1),
    seed=st.integers(0, 2**16),
)
def test_random_closures_over_parameters_in_many_homes(terms, registered, seed):
    rng = np.random.default_rng(seed)
    vecs = [jnp.asarray(rng.normal(size=3), dtype=jnp.float32) for _ in range(3)]
    scalar = jnp.asarray(rng.normal() * 0.5, dtype=jnp.float32)
    x = jnp.asarray(rng.normal(size=3), dtype=jnp.float32)
    # Four homes: a dict, a plain object in a list, a Module in a dict, a closure cell.
    homes = [{"v": vecs[0]}, [Holder(vecs[1])], {"m": Box(vecs[2])}]
    cell = scalar
    readers = [
        lambda: homes[0]["v"],
        lambda: homes[1][0].w,
        lambda: homes[2]["m"].w,
    ]
    arrays = [*vecs, scalar]

    def explicit(v0, v1, v2, s):
        vs = [v0, v1, v2]
        total = 0.0
        for name, perm, _ in terms:
            total = total + TERMS[name](vs[perm[0]], vs[perm[1]], s, x)
        return total

    def implicit():
        vs = [r() for r in readers]
        total = 0.0
        for name, perm, _ in terms:
            total = total + TERMS[name](vs[perm[0]], vs[perm[1]], cell, x)
        return total

    ps = tg.Params([arrays[i] for i in sorted(registered)])
    used = set()
    for name, perm, _ in terms:
        for role in USES[name]:
            used.add({"p": perm[0], "q": perm[1], "s": 3}[role])
    ref_value, ref = jax.value_and_grad(explicit, argnums=(0, 1, 2, 3))(*arrays)
    if used & registered:
        value, grads = tg.withgradient(implicit, ps)
    else:
        with pytest.warns(tg.NoGradientWarning, match="outside the function"):
            value, grads = tg.withgradient(implicit, ps)
    close(value, ref_value)
    assert len(grads) == len(registered)
    for i, a in enumerate(arrays):
        if i not in registered:
            assert a not in grads
            with pytest.raises(KeyError, match="not a registered parameter"):
                grads[a]
        elif i in used:
            close(grads[a], ref[i])
        else:
            assert grads[a] is None, (i, grads[a])


# --------------------------------------------------------------------------------------
# Randomised sequences of Params operations on a dict-backed Params
# --------------------------------------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["replace", "insert", "delete", "remove", "add_standalone", "grad"]),
        st.integers(0, 4),
    ),
    min_size=1,
    max_size=10,
)


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
@settings(max_examples=12, deadline=None)
@given(ops=OPS)
def test_sequences_of_params_operations_match_a_model(ops):
    d = {"k0": jnp.array([1.0, 2.0]), "k1": jnp.array(0.5)}
    ps = tg.Params(d)
    removed: list = []  # kept alive: ids are not reused in this test
    standalone: list = []
    counter = [2.0]

    def fresh(shape=(2,)):
        counter[0] += 1.0
        return jnp.full(shape, counter[0] / 3.0)

    def expected():
        out = [d[k] for k in sorted(d) if not any(d[k] is r for r in removed)]
        out += [s for s in standalone if not any(s is r for r in removed)]
        return out

    def weight(i):
        return float(i + 1)

    for op, k in ops:
        key = f"k{k}"
        if op == "replace" and key in d:
            d[key] = fresh(d[key].shape)
        elif op == "insert" and key not in d:
            d[key] = fresh((k + 1,))
        elif op == "delete" and key in d and len(d) > 1:
            del d[key]
        elif op == "remove":
            current = expected()
            if len(current) > 1:
                victim = current[k % len(current)]
                ps.remove(victim)
                removed.append(victim)
        elif op == "add_standalone":
            s = fresh()
            standalone.append(s)
            ps.add(s)
        exp = expected()
        assert [id(a) for a in ps] == [id(a) for a in exp]
        assert len(ps) == len(exp) and all(a in ps for a in exp)
        assert not any(r in ps for r in removed)
        if op == "grad":
            live = list(d.values()) + standalone
            grads = tg.gradient(
                lambda: sum(weight(i) * jnp.sum(v**2) for i, v in enumerate(live)),  # noqa: B023
                ps,
            )
            assert len(grads) == len(exp) and len(grads.named()) == len(exp)
            for i, v in enumerate(live):
                if v in ps:
                    close(grads[v], 2 * weight(i) * v)
                else:
                    assert v not in grads


# --------------------------------------------------------------------------------------
# Grads arithmetic: None as zero, dtypes kept, bad operands named
# --------------------------------------------------------------------------------------

ARITH = {
    "add": (lambda g, h: g + h, lambda a, b: a + b),
    "sub": (lambda g, h: g - h, lambda a, b: a - b),
    "rsub": (lambda g, h: h - g, lambda a, b: b - a),
}


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.complex64])
@pytest.mark.parametrize("op", sorted(ARITH))
def test_grads_arithmetic_none_is_zero_and_dtype_is_kept(op, dtype):
    u = jnp.array([1.0, 2.0], dtype=dtype)
    v = jnp.array([0.5, -1.0], dtype=dtype)
    w = jnp.array([3.0, 4.0], dtype=dtype)
    ps = tg.Params([u, v, w])
    # g depends on u only, h on u and v; nobody depends on w.
    g = tg.gradient(lambda: jnp.real(jnp.sum(u * u)), ps)
    h = tg.gradient(lambda: jnp.real(jnp.sum(u * 3.0 + v * v)), ps)
    grads_g = {"u": 2 * np.conj(np.asarray(u)), "v": 0.0, "w": None}
    grads_h = {"u": np.full(2, 3.0), "v": 2 * np.conj(np.asarray(v)), "w": None}
    close(g[u], grads_g["u"], 1e-2)
    assert g[v] is None and g[w] is None
    both, ref = ARITH[op]
    out = both(g, h)
    assert isinstance(out, tg.Grads) and list(out) == [u, v, w]
    assert out[w] is None  # None op None stays a structural zero
    for p, name in ((u, "u"), (v, "v")):
        assert out[p].dtype == dtype and out[p].shape == p.shape
        close(out[p], ref(grads_g[name], grads_h[name]), 1e-2)
    scaled = (-(h * 2.0) / 4.0).map(lambda t: t + 1.0)
    assert scaled[w] is None
    close(scaled[u], -grads_h["u"] / 2.0 + 1.0, 1e-2)
    assert scaled[u].dtype == dtype


@pytest.mark.parametrize(
    "expr, exc, words",
    [
        (lambda g, o: g * "a", TypeError, r"multiplied by a number or a 0-d array, got a str"),
        (lambda g, o: g * None, TypeError, r"multiplied by a number.*got a NoneType"),
        (lambda g, o: g * True, TypeError, r"got a bool"),
        (lambda g, o: g / [2.0], TypeError, r"divided by a number or a 0-d array, got a list"),
        (
            lambda g, o: g + o,
            ValueError,
            r"different parameter sets \(2 and 1 parameters\): '1' is only in the first\. Take",
        ),
        (
            lambda g, o: o - g,
            ValueError,
            r"different parameter sets \(1 and 2 parameters\): '1' is only in the second",
        ),
        (lambda g, o: g + 1.0, TypeError, r"unsupported operand.*'Grads' and 'float'"),
        (lambda g, o: g * g, TypeError, r"unsupported operand.*'Grads' and 'Grads'"),
        (lambda g, o: g.__setitem__(next(iter(g)), 1.0), TypeError, r"read-only.*map"),
    ],
    ids=["str", "None", "bool", "list", "plus-other-set", "minus-other-set", "float", "gg", "set"],
)
def test_grads_bad_operands_say_what_was_wrong(expr, exc, words):
    a, b = jnp.ones(2), jnp.ones(3)
    g = tg.gradient(lambda: jnp.sum(a) + jnp.sum(b), tg.Params([a, b]))
    other = tg.gradient(lambda: jnp.sum(a), tg.Params([a]))
    with pytest.raises(exc, match=words):
        expr(g, other)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_gradient_accumulation_over_microbatches_equals_the_full_batch():
    model = nn.Dense(3, 2, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (12, 3))
    ys = jax.random.normal(jax.random.key(2), (12, 2))
    ps = tg.params(model)
    total = None
    for i in range(0, 12, 4):
        xb, yb = xs[i : i + 4], ys[i : i + 4]
        g = tg.gradient(lambda: jnp.sum((model(xb) - yb) ** 2), ps)  # noqa: B023
        total = g if total is None else total + g
    mean = total / 12.0

    def full(m):
        return jnp.mean(jnp.sum((m(xs) - ys) ** 2, axis=-1))

    ref = jax.grad(full)(model)
    close(mean[model.weight], ref.weight)
    close(mean[model.bias], ref.bias)
    close(mean.named()["weight"], ref.weight)


# --------------------------------------------------------------------------------------
# Lookups and their KeyError messages
# --------------------------------------------------------------------------------------


def test_keyerror_messages_table():
    model = {"enc": jnp.ones((2, 3)), "dec": {"bias": jnp.zeros(3)}}
    ps = tg.params(model)
    grads = tg.gradient(lambda: jnp.sum(model["enc"] * 2.0) + jnp.sum(model["dec"]["bias"]), ps)
    old_bias = model["dec"]["bias"]
    tg.update_(tg.setup(optax.sgd(0.1), ps), ps, grads)
    assert model["dec"]["bias"] is not old_bias
    close(model["dec"]["bias"], -0.1 * np.ones(3))  # sgd reference: 0 - 0.1 * 1
    table = [
        (
            model["dec"]["bias"],
            r"float32\[3\].*not a registered.*'dec\.bias'.*may have been replaced",
        ),
        (model["enc"], r"float32\[2×3\].*not a registered.*'enc'.*may have been replaced"),
        (np.zeros(3, np.float32), r"not a registered.*may have been replaced"),
        ("dec.bias", r"looked up by parameter array, got a str.*named\(\)"),
        (0, r"got a int.*named\(\)"),
    ]
    for key, words in table:
        with pytest.raises(KeyError, match=words):
            grads[key]
        assert key not in grads
    # Same shape but another dtype, or another shape: no talk of replacement.
    for key in (old_bias.astype(jnp.float16), jnp.zeros(4)):
        with pytest.raises(KeyError, match="not a registered parameter") as e:
            grads[key]
        assert "replaced" not in str(e.value)
    close(grads[old_bias], np.ones(3))  # the registered arrays still work
    assert grads.get(model["enc"]) is None  # Mapping.get: missing -> default
    assert set(grads.named()) == {"enc", "dec.bias"}


def test_grads_mapping_views_are_by_identity():
    a, b = jnp.ones(2), jnp.ones(2)  # equal values, different objects
    grads = tg.gradient(lambda: jnp.sum(a * 3.0), tg.Params([a, b]))
    keys = grads.keys()  # a KeysView: membership by identity too
    assert a in keys and b in keys and jnp.ones(2) not in keys
    assert [k is a for k in grads] == [True, False]
    vals = list(grads.values())
    close(vals[0], [3.0, 3.0])
    assert vals[1] is None
    items = list(grads.items())
    assert items[0][0] is a and items[1][0] is b and items[1][1] is None


# --------------------------------------------------------------------------------------
# Params: construction errors, copies, equality, empty
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "xs, exc, words",
    [
        ("abc", TypeError, r"got a str.*parameters are arrays"),
        (3.0, TypeError, r"got a float.*parameters are arrays"),
        ({1, 2}, TypeError, r"got a set"),
        (np.ones(2), TypeError, r"numpy array.*jnp\.asarray"),
        (jnp.arange(3), ValueError, r"int32\[3\].*not differentiable"),
        (jnp.array([True]), ValueError, r"bool\[1\].*not differentiable"),
        (jax.random.key(0), ValueError, r"key.*not differentiable"),
        ({"a": jnp.arange(3)}, ValueError, r"'a' is int32\[3\].*not differentiable"),
        ({}, ValueError, r"no floating-point arrays in the dict"),
    ],
    ids=["str", "float", "set", "numpy", "int", "bool", "key", "dict-of-int", "empty-dict"],
)
def test_params_bad_inputs_table(xs, exc, words):
    with pytest.raises(exc, match=words):
        tg.Params(xs)


def test_params_copy_is_independent_and_equality_is_by_identity_and_order():
    a, b, c = jnp.ones(2), jnp.zeros(2), jnp.ones(1)
    ps = tg.Params([a, b])
    cp = tg.Params(ps)
    assert cp == ps
    cp.add(c)
    cp.remove(a)
    assert list(ps) == [a, b] and list(cp) == [b, c]
    assert tg.Params({"x": a, "y": b}) == tg.Params([a, b])  # contents, not container
    assert tg.Params([a, a]) == tg.Params(a) and len(tg.Params([a, a])) == 1
    assert tg.Params([a]) != tg.Params([a + 0])  # equal values, other object
    assert tg.Params() == tg.Params([]) and tg.Params() != tg.Params([a])
    assert tg.Params([a]) != [a]
    with pytest.raises(TypeError, match="unhashable"):
        hash(tg.Params([a]))


def test_empty_params_give_empty_grads_without_a_warning():
    w = jnp.array([1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value, grads = tg.withgradient(lambda: jnp.sum(w**2), tg.Params())
    close(value, 5.0)
    assert len(grads) == 0 and grads.named() == {} and w not in grads
    with pytest.raises(KeyError, match="not a registered parameter"):
        grads[w]


def test_params_from_numpy_dict_converts_in_place_and_differentiates():
    d = {"w": np.array([1.0, -2.0], dtype=np.float32), "n": np.arange(2)}
    ps = tg.Params(d)
    assert isinstance(d["w"], jax.Array) and d["w"] in ps and len(ps) == 1
    grads = tg.gradient(lambda: jnp.sum(d["w"] ** 3 * d["n"]), ps)
    close(grads[d["w"]], 3 * np.array([1.0, 4.0]) * np.arange(2))


# --------------------------------------------------------------------------------------
# Tied weights
# --------------------------------------------------------------------------------------


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_shared_submodule_to_tree_and_optimiser_match_an_untied_reference():
    layer = nn.Dense(2, 2, key=jax.random.key(0))
    model = [layer, layer]  # the same Module twice
    x = jnp.array([0.3, -0.7])
    ps = tg.params(model)
    assert len(ps) == 2 and list(ps.named()) == ["0.weight", "0.bias"]

    def run(m):
        return jnp.sum(jnp.tanh(m[1](jnp.tanh(m[0](x)))))

    grads = tg.gradient(lambda: run(model), ps)

    def untied(w, b):  # one weight used twice, through a copy of the layer
        lay = jax.tree_util.tree_map(lambda t: t, layer)
        lay.weight, lay.bias = w, b
        return jnp.sum(jnp.tanh(lay(jnp.tanh(lay(x)))))

    gw, gb = jax.grad(untied, argnums=(0, 1))(layer.weight, layer.bias)
    close(grads[layer.weight], gw)
    close(grads[layer.bias], gb)
    tree = grads.to_tree(model)
    close(tree[0].weight, gw)
    assert tree[1].weight is None and tree[1].bias is None
    (explicit,) = tg.gradient(run, model)
    st_a = tg.setup(optax.sgd(0.5), model)
    _, new_a = tg.update(st_a, model, tree)
    _, new_b = tg.update(st_a, model, explicit)
    close(new_a[0].weight, layer.weight - 0.5 * gw)
    close(new_b[0].weight, layer.weight - 0.5 * gw)
    assert new_a[0] is new_a[1] or new_a[0].weight is new_a[1].weight


def test_tied_array_in_trainable_and_frozen_attribute_is_updated_once():
    class M(tg.Module):
        __trainable__ = ("w",)

        def __init__(self):
            w = jnp.array([1.0, 2.0])
            self.frozen = w  # first in flatten order, not trainable
            self.w = w

    m = M()
    ps = tg.params(m)
    assert list(ps.named()) == ["w"]
    grads = tg.gradient(lambda: jnp.sum(m.w**2) + jnp.sum(m.frozen * 3.0), ps)
    w0 = np.array([1.0, 2.0])
    close(grads[m.w], 2 * w0 + 3.0)
    tg.update_(tg.setup(optax.sgd(0.1), ps), ps, grads)
    close(m.w, w0 - 0.1 * (2 * w0 + 3.0))
    assert m.w is m.frozen


# --------------------------------------------------------------------------------------
# Closures: the weight-decay idiom, plain holders, rebinding between calls
# --------------------------------------------------------------------------------------


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_weight_decay_reading_a_params_with_additions_inside_f():
    W = jnp.array([[1.0, -2.0], [0.5, 3.0]])
    b = jnp.array([0.1, -0.2])
    frozen = jnp.array([0.4, 0.4])
    c = jnp.array(0.7)
    x = jnp.array([0.3, -1.2])
    model = {"W": W, "b": b, "frozen": frozen}
    ps = tg.Params({"W": W, "b": b})
    ps.add(c)

    def f():
        base = jnp.sum(jnp.tanh(model["W"] @ x + model["b"] + model["frozen"]) * c)
        decay = 0.1 * sum(jnp.sum(p**2) for p in ps)
        named = sum(jnp.sum(v) for v in ps.named().values())
        return base + decay + named * len(ps)

    grads = tg.gradient(f, ps)

    def ref(W, b, c):
        base = jnp.sum(jnp.tanh(W @ x + b + frozen) * c)
        return (
            base + 0.1 * (jnp.sum(W**2) + jnp.sum(b**2) + c**2) + 3 * (jnp.sum(W) + jnp.sum(b) + c)
        )

    r = jax.grad(ref, argnums=(0, 1, 2))(W, b, c)
    assert frozen not in grads and len(grads) == 3
    for p, rp in zip((W, b, c), r, strict=True):
        close(grads[p], rp)


def test_weight_decay_over_a_params_with_a_removed_entry():
    W, frozen = jnp.ones(2), jnp.full(2, 5.0)
    ps = tg.Params({"W": W, "frozen": frozen})
    ps.remove(frozen)
    assert len(ps) == 1
    seen = []

    def f():
        seen.append((len(ps), list(ps.named())))
        return sum(jnp.sum(p**2) for p in ps)

    value, grads = tg.withgradient(f, ps)
    close(grads[W], 2 * W)
    close(value, 2.0)  # sum(W**2) only: the removed frozen would add 50
    assert seen and all(s == (1, ["W"]) for s in seen), seen
    # Cached: the second call runs the same program; adding frozen back traces again.
    close(tg.withgradient(f, ps)[0], 2.0)
    ps.add(frozen)
    value, grads = tg.withgradient(f, ps)
    close(value, 52.0)
    close(grads[frozen], 2 * frozen)
    assert seen[-1] == (2, ["W", "frozen"])


def test_compiled_step_over_a_params_with_a_removed_entry_leaves_it_alone():
    d = {"W": jnp.array([1.0, -2.0]), "frozen": jnp.full(2, 5.0)}
    frozen = d["frozen"]
    ps = tg.Params(d)
    ps.remove(frozen)
    state = tg.setup(optax.sgd(0.1), ps)

    @tg.jit
    def step():
        value, grads = tg.withgradient(lambda: sum(jnp.sum(p**2) for p in ps), ps)
        tg.update_(state, ps, grads)
        return value

    w = np.array([1.0, -2.0])
    for _ in range(2):
        close(step(), np.sum(w**2))
        w = w - 0.1 * 2 * w
        close(d["W"], w)
        assert d["frozen"] is frozen and frozen not in ps and len(ps) == 1


def test_parameters_held_by_plain_objects_in_dicts_inside_lists():
    class Net(tg.Module):
        def __init__(self):
            self.scale = jnp.array(3.0)

    net = Net()
    net_blocks = [{"h": Holder(jnp.array([1.0, 2.0]))}]
    registry = {"extra": [Holder(Holder(jnp.array([-1.0, 0.5])))]}
    w1 = net_blocks[0]["h"].w
    w2 = registry["extra"][0].w.w
    ps = tg.Params([w1, w2, net.scale])

    def f():
        return net.scale * jnp.sum(net_blocks[0]["h"].w ** 2) + jnp.sum(
            jnp.sin(registry["extra"][0].w.w) * net_blocks[0]["h"].w
        )

    grads = tg.gradient(f, ps)
    ref = jax.grad(lambda a, b, s: s * jnp.sum(a**2) + jnp.sum(jnp.sin(b) * a), argnums=(0, 1, 2))(
        w1, w2, net.scale
    )
    for p, rp in zip((w1, w2, net.scale), ref, strict=True):
        close(grads[p], rp)


def test_parameter_held_by_a_plain_object_on_a_module_attribute():
    # A plain object on a Module attribute is the Module's static data (API.md §1): the
    # array inside is a constant of the traced function, never a stale one.
    class Net(tg.Module):
        def __init__(self):
            self.h = Holder(jnp.array([1.0, 2.0]))

    net = Net()
    w = net.h.w
    with pytest.raises(
        TypeError,
        match=r"tg.gradient: the function reaches a registered "
        r"parameter \(float32\[2\]\) through .* plain object held by a "
        r"tg.Module attribute",
    ):
        tg.gradient(lambda: jnp.sum(net.h.w**2), tg.Params([w]))
    # Explicit mode: a value read through it is fresh after a rebinding.
    x = jnp.array([3.0, 4.0])
    f = lambda v: jnp.sum(net.h.w * v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        close(tg.gradient(f, x)[0], w)
        net.h.w = jnp.array([5.0, 6.0])
        close(tg.gradient(f, x)[0], net.h.w)


def test_rebinding_a_captured_array_between_calls():
    state = {"w": jnp.array([1.0, 2.0])}
    w0 = state["w"]
    standalone = tg.Params([w0])  # holds the object
    follows = tg.Params(state)  # re-reads the dict

    def f():
        return jnp.sum(state["w"] ** 3)

    g = tg.gradient(f, standalone)
    close(g[w0], 3 * w0**2)
    state["w"] = jnp.array([2.0, -1.0])  # rebind between calls
    with pytest.warns(tg.NoGradientWarning, match="outside the function"):
        value, g = tg.withgradient(f, standalone)
    close(value, 7.0)  # computed with the new array, never the stale one
    assert g[w0] is None and state["w"] not in g
    value, g = tg.withgradient(f, follows)
    close(value, 7.0)
    close(g[state["w"]], 3 * state["w"] ** 2)
    assert w0 not in g


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_same_lambda_code_with_changing_captured_values_is_never_stale():
    w = jnp.array([1.0, -2.0])
    ps = tg.Params([w])
    cfg = {"power": 2, "shift": jnp.array(0.0), "act": jnp.sin}
    for power, shift, act in [
        (2, 0.0, jnp.sin),
        (3, 0.0, jnp.sin),
        (3, 1.5, jnp.sin),
        (3, 1.5, jnp.cos),
        (2, -1.0, jnp.tanh),
    ]:
        cfg.update(power=power, shift=jnp.array(shift), act=act)
        g = tg.gradient(lambda: jnp.sum(cfg["act"](w + cfg["shift"]) ** cfg["power"]), ps)
        ref = jax.grad(lambda v, a=act, s=shift, k=power: jnp.sum(a(v + s) ** k))(w)
        close(g[w], ref)


def test_mutating_a_holder_in_place_between_calls_follows_it():
    h = Holder(jnp.array([1.0, 2.0]))
    things = {"h": [h]}
    for step in range(4):
        ps = tg.Params([h.w])
        g = tg.gradient(lambda: jnp.sum(jnp.exp(things["h"][0].w)), ps)
        close(g[h.w], np.exp(np.asarray(h.w)))
        h.w = h.w - 0.5 * g[h.w] + step


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_implicit_complex_parameter_uses_the_steepest_ascent_convention():
    z = jnp.array([1.0 + 2.0j, -0.5 + 0.3j])
    r = jnp.array([0.2, 0.4])
    g = tg.gradient(lambda: jnp.sum(jnp.abs(z * r) ** 2) + jnp.real(jnp.sum(z)), tg.Params([z, r]))

    def f(z, r):
        return jnp.sum(jnp.abs(z * r) ** 2) + jnp.real(jnp.sum(z))

    gz, gr = jax.grad(f, argnums=(0, 1))(z, r)
    close(g[z], jnp.conj(gz))
    close(g[r], gr)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_gradient_of_a_gradient_with_grads_arithmetic_inside():
    W = jnp.array([[1.0, -2.0], [0.5, 3.0]])
    b = jnp.array([0.1, -0.2])
    x = jnp.array([0.3, -1.2])
    ps = tg.Params([W, b])

    def outer():
        gi = tg.gradient(lambda: jnp.sum(jnp.sin(W @ x) * b), ps)
        h = (gi * 2.0 - gi / 4.0).map(jnp.square)
        return jnp.sum(h[W]) + jnp.sum(h[b])

    grads = tg.gradient(outer, ps)

    def ref(W, b):
        gi = jax.grad(lambda W, b: jnp.sum(jnp.sin(W @ x) * b), argnums=(0, 1))(W, b)
        return sum(jnp.sum((v * 2.0 - v / 4.0) ** 2) for v in gi)

    r = jax.grad(ref, argnums=(0, 1))(W, b)
    close(grads[W], r[0])
    close(grads[b], r[1])


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_partial_objects_over_changing_arguments_are_never_stale():
    w = jnp.array([1.0, -2.0])
    ps = tg.Params([w])

    def loss(c, v, p):
        return jnp.sum(c * v * p**2)

    for c, v in [(1.0, jnp.ones(2)), (2.0, jnp.ones(2)), (2.0, jnp.array([0.5, 3.0]))]:
        g = tg.gradient(functools.partial(loss, c, v, w), ps)
        close(g[w], jax.grad(lambda p, c=c, v=v: loss(c, v, p))(w))
    # A partial that binds the parameter itself: its gradient still flows.
    g = tg.gradient(functools.partial(loss, jnp.asarray(0.5), jnp.ones(2), w), ps)
    close(g[w], w)
