"""`Shape`, the generated flatten/unflatten: equal to JAX's on every tree it accepts,
None on every tree that differs, and the paths built on it (the engine's argument
fast path, flat program outputs, the optimiser step, Params) never stale."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treegrad as tg
from treegrad import nn
from treegrad._fasttree import TAKE, Shape

NT = collections.namedtuple("NT", "a b")


class Box(tg.Module):
    def __init__(self, child, extra=None):
        self.child = child
        self.extra = extra
        self.name = "box"  # static
        self.scale = 2.0  # static


def _leaf(i):
    return jnp.full((2,), float(i))


def _trees():
    """Random trees of arrays: dicts, lists, tuples, namedtuples, None, Modules."""
    leaf = st.integers(0, 99).map(_leaf)
    return st.recursive(
        leaf | st.just(None),
        lambda kids: st.one_of(
            st.lists(kids, max_size=3),
            st.lists(kids, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from("abcd"), kids, max_size=3),
            st.tuples(kids, kids).map(lambda t: NT(*t)),
            st.tuples(kids, kids).map(lambda t: Box(*t)),
        ),
        max_leaves=8,
    )


def _same_tree(a, b):
    """Same structure, the same leaf objects, the same types and Module attribute order."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    assert len(la) == len(lb) and all(x is y for x, y in zip(la, lb, strict=True))
    assert type(a) is type(b)
    if isinstance(a, tg.Module):
        assert list(vars(a)) == list(vars(b))
        for k in vars(a):
            _same_tree(vars(a)[k], vars(b)[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            _same_tree(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same_tree(a[k], b[k])


@settings(max_examples=60, deadline=None)
@given(tree=_trees())
def test_shape_agrees_with_jax_on_random_trees(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shape = Shape(treedef, leaves)
    got = shape.flatten(tree)
    assert got is not None
    assert len(got) == len(leaves) and all(x is y for x, y in zip(got, leaves, strict=True))
    _same_tree(shape.unflatten(leaves), jax.tree_util.tree_unflatten(treedef, leaves))


def test_unflatten_with_constant_leaves():
    tree = {"a": jnp.ones(1), "b": (jnp.zeros(1), jnp.ones(2))}
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shape = Shape(treedef, spec=[TAKE, "s", TAKE])
    out = shape.unflatten([leaves[0], leaves[2]])
    assert out["a"] is leaves[0] and out["b"] == ("s", leaves[2])


def _model():
    m = Box([nn.Dense(2, 3, key=jax.random.key(0)), {"w": jnp.ones(3)}], NT(jnp.ones(1), None))
    jax.tree_util.tree_flatten(m)  # caches each Module's split into children
    return m


def _edits():
    """Edits after which the tree is another structure, or holds a leaf that is not an array."""

    def setattr_static(m):
        m.name = "other"

    def setattr_array_to_none(m):
        m.child[0].weight = None

    def dict_extra_key(m):
        m.child[1]["z"] = jnp.ones(1)

    def dict_other_key(m):
        m.child[1]["v"] = m.child[1].pop("w")

    def dict_leaf_to_float(m):
        m.child[1]["w"] = 1.0

    def dict_leaf_to_list(m):
        m.child[1]["w"] = [jnp.ones(3)]

    def list_append(m):
        m.child.append(jnp.ones(1))

    def list_to_tuple(m):
        object.__setattr__(m, "child", tuple(m.child))  # no setattr: only the value changes

    def none_to_array(m):
        m.extra = NT(m.extra.a, jnp.ones(1))

    def namedtuple_to_tuple(m):
        m.extra = tuple(m.extra)

    def module_other_class(m):
        class Other(tg.Module):
            pass

        o = Other()
        vars(o).update(vars(m.child[0]))
        m.child[0] = o

    def vars_gains_entry(m):
        vars(m.child[0])["bias2"] = jnp.ones(3)  # bypasses __setattr__

    def leaf_to_numpy_scalar(m):
        m.child[1]["w"] = np.float32(1.0)

    return [
        setattr_static,
        setattr_array_to_none,
        dict_extra_key,
        dict_other_key,
        dict_leaf_to_float,
        dict_leaf_to_list,
        list_append,
        list_to_tuple,
        none_to_array,
        namedtuple_to_tuple,
        module_other_class,
        vars_gains_entry,
        leaf_to_numpy_scalar,
    ]


@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_flatten_refuses_every_other_structure(edit):
    m = _model()
    leaves, treedef = jax.tree_util.tree_flatten(m)
    shape = Shape(treedef, leaves)
    assert shape.flatten(m) == leaves
    edit(m)
    assert shape.flatten(m) is None


def test_flatten_reads_replaced_arrays_fresh():
    m = _model()
    leaves, treedef = jax.tree_util.tree_flatten(m)
    shape = Shape(treedef, leaves)
    new = jnp.zeros(3)
    m.child[1]["w"] = new  # same structure, another array
    vars(m.child[0])["bias"] = new + 1  # bypassing __setattr__ too
    got = shape.flatten(m)
    assert got == jax.tree_util.tree_leaves(m)
    assert any(x is new for x in got)


def test_a_fresh_model_of_the_same_layout_takes_jax_path_then_agrees():
    a, b = _model(), Box([nn.Dense(2, 3, key=jax.random.key(1)), {"w": jnp.ones(3)}], None)
    leaves, treedef = jax.tree_util.tree_flatten(a)
    shape = Shape(treedef, leaves)
    assert shape.flatten(b) is None  # b's Modules have their own split: JAX decides


# --- the paths built on Shape, end to end ------------------------------------------------


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_gradient_after_each_edit_matches_jax(edit):
    m = _model()
    x = jnp.arange(2.0)

    def loss(m):
        w = m.child[1].get("w", m.child[1].get("v"))
        weight = m.child[0].weight
        y = x @ (weight.T if weight is not None else jnp.ones((2, 3)))
        return jnp.sum(jnp.tanh(y) * jnp.sum(jnp.asarray(w))) + jnp.sum(m.extra[0] ** 2)

    tg.gradient(loss, m)  # compiled, and the arguments' structure remembered
    edit(m)
    (g,) = tg.gradient(loss, m)
    # Reference: jax.grad with respect to the differentiable leaves only.
    leaves, treedef = jax.tree_util.tree_flatten(m)
    diff = [i for i, leaf in enumerate(leaves) if tg.is_differentiable(leaf)]

    def of_leaves(arrays):
        new = list(leaves)
        for i, a in zip(diff, arrays, strict=True):
            new[i] = a
        return loss(treedef.unflatten(new))

    ref = jax.grad(of_leaves)([leaves[i] for i in diff])
    got = treedef.flatten_up_to(g)
    for i, r in zip(diff, ref, strict=True):
        if got[i] is None:  # an input the loss does not use: a structural zero
            assert not np.any(r)
        else:
            np.testing.assert_allclose(got[i], r, rtol=1e-6)
    assert any(got[i] is not None for i in diff)
    assert all(got[i] is None for i in range(len(leaves)) if i not in diff)


def test_tg_jit_output_structure_that_depends_on_input_shape():
    @tg.jit
    def f(x):
        if x.shape[0] == 2:
            return {"a": x * 2}
        return (x + 1, "static", x * 3)

    a, b = jnp.ones(2), jnp.ones(3)
    for _ in range(2):  # the second round runs compiled programs traced in the first
        ra, rb = f(a), f(b)
        assert list(ra) == ["a"]
        np.testing.assert_array_equal(ra["a"], [2.0, 2.0])
        assert rb[1] == "static"
        np.testing.assert_array_equal(rb[0], [2.0, 2.0, 2.0])
        np.testing.assert_array_equal(rb[2], [3.0, 3.0, 3.0])


def test_withgradient_aux_structure_that_depends_on_input_shape():
    def loss(w):
        if w.shape[0] == 2:
            return jnp.sum(w**2), {"n": 2}
        return jnp.sum(w**3), [w]

    for _ in range(2):
        for w in (jnp.ones(2), jnp.full(3, 2.0)):
            (value, aux), (g,) = tg.withgradient(loss, w)
            ref_value, ref_aux = loss(w)
            np.testing.assert_allclose(value, ref_value)
            np.testing.assert_allclose(g, jax.grad(lambda w: loss(w)[0])(w))
            assert jax.tree_util.tree_structure(aux) == jax.tree_util.tree_structure(ref_aux)


def test_alternating_argument_structures_give_each_its_own_gradient():
    x = jnp.arange(3.0)
    trees = [{"a": x}, {"a": x, "b": 2 * x}, [x], {"a": x}]
    for _ in range(2):
        for t in trees:
            (g,) = tg.gradient(
                lambda t: sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(t)), t
            )
            assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(t)
            for gv, v in zip(
                jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(t), strict=True
            ):
                np.testing.assert_allclose(gv, 2 * v)


def test_tied_arguments_after_untied_ones_are_not_confused():
    w, v = jnp.ones(2), jnp.full(2, 3.0)

    def loss(p):
        return jnp.sum(p["a"] * p["b"])

    (g1,) = tg.gradient(loss, {"a": w, "b": v})
    (g2,) = tg.gradient(loss, {"a": w, "b": w})  # same structure, now tied
    np.testing.assert_allclose(g1["a"], v)
    np.testing.assert_allclose(g2["a"], 2 * w)  # the tied array's gradient, at its first place
    assert g2["b"] is None


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_update_fast_path_matches_optax_after_an_attribute_is_replaced():
    opt = optax.adam(0.1)
    m = nn.Chain(nn.Dense(2, 2, key=jax.random.key(0)), nn.Dense(2, 1, key=jax.random.key(1)))
    x = jnp.ones((3, 2))
    state = tg.setup(opt, m)
    ref_params = jax.tree_util.tree_map(lambda a: a, m)
    ref_state = opt.init(ref_params)

    def loss(m):
        return jnp.sum(m(x) ** 2)

    for step in range(4):
        if step == 2:  # a new array of the same shape, by assignment: same structure
            m.layers[0].bias = m.layers[0].bias + 1.0
            ref_params.layers[0].bias = ref_params.layers[0].bias + 1.0
        (g,) = tg.gradient(loss, m)
        state, m = tg.update(state, m, g)
        rg = jax.grad(loss)(ref_params)
        u, ref_state = opt.update(rg, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
        for a, r in zip(
            jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(ref_params), strict=True
        ):
            np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)


def test_params_see_a_layer_appended_after_the_fast_path_was_built():
    m = nn.Chain(nn.Dense(2, 2, key=jax.random.key(0)))
    ps = tg.params(m)
    assert len(ps) == 2
    len(ps)  # the structure is now read by generated code
    m.layers.append(nn.Dense(2, 2, key=jax.random.key(1)))
    assert len(ps) == 4
    m.layers[0].weight = jnp.zeros((2, 2))
    assert any(p is m.layers[0].weight for p in ps)


@pytest.mark.slow  # over ~1.5 s: the default run stays under 3 minutes
def test_steady_state_generates_no_code():
    """Every training loop, once warm, runs generated code without generating more
    (a guard that compiled its Shape on every call made the implicit loop 8x slower)."""
    from treegrad._codegen import CodeGen

    opt = optax.adam(1e-3)
    x, y = jnp.ones((4, 2)), jnp.ones((4, 1))

    def net(seed):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return nn.Chain(nn.Dense(2, 3, jax.nn.relu, key=k1), nn.Dense(3, 1, key=k2))

    def loss(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    explicit, imp, imp_jit, jit_model = net(0), net(1), net(2), net(3)
    s = {"m": explicit, "st": tg.setup(opt, explicit), "jm": jit_model}
    s["jst"] = tg.setup(opt, jit_model)
    ps, ps_jit = tg.params(imp), tg.params(imp_jit)
    st_imp, st_imp_jit = tg.setup(opt, ps), tg.setup(opt, ps_jit)

    @tg.jit
    def step(state, m, x, y):
        _, (g,) = tg.withgradient(lambda m: loss(m, x, y), m)
        return tg.update(state, m, g)

    @tg.jit
    def implicit_step(x, y):
        tg.update_(st_imp_jit, ps_jit, tg.gradient(lambda: loss(imp_jit, x, y), ps_jit))

    def loops():
        (g,) = tg.gradient(lambda m: loss(m, x, y), s["m"])
        s["st"], s["m"] = tg.update(s["st"], s["m"], g)
        tg.update_(st_imp, ps, tg.gradient(lambda: loss(imp, x, y), ps))
        s["jst"], s["jm"] = step(s["jst"], s["jm"], x, y)
        implicit_step(x, y)

    for _ in range(3):
        loops()
    before = CodeGen.compiled
    for _ in range(5):
        loops()
    assert CodeGen.compiled == before
