"""Hunt: models from other JAX libraries and pytree registrations (flax.linen params,
flax.nnx Modules, flax.struct / register_dataclass / register_pytree_with_keys nodes,
NamedTuple, OrderedDict, defaultdict, int keys, None leaves) as treegrad models. Every
result is compared with jax.grad / plain optax on the same leaves / nnx.Optimizer."""

import collections
import dataclasses
import typing

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad._tree import same_structure

fl = pytest.importorskip("flax.linen")
flax_struct = pytest.importorskip("flax.struct")
nnx = pytest.importorskip("flax.nnx")

X = jax.random.normal(jax.random.key(1), (5, 3))
Y = jnp.ones((5, 2))
OPT = optax.adam(0.05)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def is_float(a):
    return isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.inexact)


def floats(tree):
    return [a for a in jtu.tree_leaves(tree) if is_float(a)]


def all_close(la, lb, tol=1e-5):
    la, lb = list(la), list(lb)
    assert len(la) == len(lb)
    for a, b in zip(la, lb, strict=True):
        close(a, b, tol)


def optax_ref(model, loss, n=3, opt=OPT):
    """Plain jax.value_and_grad + optax on the float leaves, the rest held fixed."""
    leaves, tdef = jtu.tree_flatten(model)
    idx = [i for i, a in enumerate(leaves) if is_float(a)]

    def f(ds):
        ls = list(leaves)
        for i, d in zip(idx, ds, strict=True):
            ls[i] = d
        return loss(jtu.tree_unflatten(tdef, ls))

    ds = [leaves[i] for i in idx]
    g0 = jax.grad(f)(ds)
    st, losses = opt.init(ds), []
    for _ in range(n):
        v, g = jax.value_and_grad(f)(ds)
        u, st = opt.update(g, st, ds)
        ds = optax.apply_updates(ds, u)
        losses.append(float(v))
    return g0, ds, losses


def check_model(make, loss, *, mutable, tmp_path):
    """gradient == jax.grad; tg.update, tg.jit step and tg.train == 3 optax steps;
    tg.update_ and implicit update_ rebind so the next gradient sees the new values;
    save/load round-trips the model and a state."""
    m0 = make()
    g0, ref, ref_losses = optax_ref(m0, loss)
    (g,) = tg.gradient(loss, m0)
    assert type(g) is type(m0)
    all_close([a for a in jtu.tree_leaves(g) if a is not None], g0)

    m, st = make(), tg.setup(OPT, m0)
    for _ in range(3):
        (g,) = tg.gradient(loss, m)
        st, m = tg.update(st, m, g)
    assert type(m) is type(m0)
    all_close(floats(m), ref)

    @tg.jit
    def step(st, m):
        v, (g,) = tg.withgradient(loss, m)
        st, m = tg.update(st, m, g)
        return st, m, v

    m, st, losses = make(), tg.setup(OPT, m0), []
    for _ in range(3):
        st, m, v = step(st, m)
        losses.append(float(v))
    all_close(floats(m), ref)
    close(losses, ref_losses)

    _, m, losses = tg.train(loss, make(), [()] * 3, tg.setup(OPT, m0))
    all_close(floats(m), ref)
    close(losses, ref_losses)

    if mutable:
        m = make()
        st = tg.setup(OPT, m)
        for _ in range(3):
            tg.update_(st, m, tg.gradient(loss, m)[0])
        all_close(floats(m), ref)
        m = make()
        ps = tg.params(m)
        st = tg.setup(OPT, ps)
        for _ in range(3):  # a model that never trains would give the first step 3 times
            tg.update_(st, ps, tg.gradient(lambda: loss(m), ps))
        all_close(floats(m), ref)

    m2 = jtu.tree_map(lambda a: a * 2 if is_float(a) else a, m0)
    tg.save(tmp_path / "m.tg", m2)
    back = tg.load(tmp_path / "m.tg", make())
    assert type(back) is type(m0) and jtu.tree_structure(back) == jtu.tree_structure(m2)
    all_close(floats(back), floats(m2), 0)
    st = tg.setup(OPT, m0)
    st, _ = tg.update(st, m0, tg.gradient(loss, m0)[0])
    tg.save(tmp_path / "s.tg", st)
    sb = tg.load(tmp_path / "s.tg", tg.setup(OPT, m0))
    all_close(jtu.tree_leaves(sb), jtu.tree_leaves(st), 0)


# --- flax.linen --------------------------------------------------------------------------


class _Linen(fl.Module):
    @fl.compact
    def __call__(self, x, train=True):
        # BatchNorm after tanh: every parameter matters (a bias right before a
        # BatchNorm has a gradient of rounding noise, which Adam amplifies).
        x = jnp.tanh(fl.Dense(8)(x))
        x = fl.BatchNorm(use_running_average=not train)(x)
        return fl.Dense(2)(x)


_LINEN = _Linen()
_VARS = _LINEN.init(jax.random.key(0), X)


def _linen_loss(p, bs=_VARS["batch_stats"]):
    out, _ = _LINEN.apply({"params": p, "batch_stats": bs}, X, mutable=["batch_stats"])
    return jnp.mean((out - Y) ** 2)


@pytest.mark.slow  # about 4 s: first compiles of a flax model
def test_linen_params_dict_trains_as_optax_and_batch_stats_stay_apart():
    variables = jtu.tree_map(lambda a: a, _VARS)  # a fresh dict, same arrays
    params, bs = variables["params"], variables["batch_stats"]
    bs_before = jtu.tree_leaves(bs)
    g0, ref, _ = optax_ref(params, _linen_loss)
    (g,) = tg.gradient(_linen_loss, params)
    all_close(jtu.tree_leaves(g), g0)
    assert set(tg.params(params).named()) == {
        "BatchNorm_0.bias",
        "BatchNorm_0.scale",
        "Dense_0.bias",
        "Dense_0.kernel",
        "Dense_1.bias",
        "Dense_1.kernel",
    }
    # implicit: the loss reads the whole variables dict; only "params" is registered
    ps = tg.params(variables["params"])
    st = tg.setup(OPT, ps)
    for _ in range(3):
        grads = tg.gradient(lambda: _linen_loss(variables["params"], variables["batch_stats"]), ps)
        assert len(grads) == 6
        tg.update_(st, ps, grads)
    all_close(jtu.tree_leaves(variables["params"]), ref)
    assert all(a is b for a, b in zip(jtu.tree_leaves(bs), bs_before, strict=True))


@pytest.mark.slow  # over ~1 s
def test_linen_params_full_route(tmp_path):
    p = _VARS["params"]
    check_model(lambda: jtu.tree_map(lambda a: a, p), _linen_loss, mutable=True, tmp_path=tmp_path)


@pytest.mark.slow  # over ~1 s
def test_linen_frozen_dict_full_route(tmp_path):
    from flax.core import freeze

    p = _VARS["params"]
    check_model(
        lambda: freeze(jtu.tree_map(lambda a: a, p)), _linen_loss, mutable=False, tmp_path=tmp_path
    )


# --- pytree registrations ----------------------------------------------------------------


@flax_struct.dataclass
class _Struct:
    w: jax.Array
    b: jax.Array
    act: typing.Callable = flax_struct.field(pytree_node=False, default=jnp.tanh)
    n: int = flax_struct.field(pytree_node=False, default=2)


@dataclasses.dataclass
class _RegDC:
    w: jax.Array
    b: jax.Array
    steps: jax.Array  # an int data field: not trained, gradient None
    n: int


jtu.register_dataclass(_RegDC, data_fields=["w", "b", "steps"], meta_fields=["n"])


class _Keyed:
    """register_pytree_with_keys whose flatten reorders its children and drops one."""

    def __init__(self, w, b, scratch=None):
        self.w, self.b, self.scratch = w, b, scratch


jtu.register_pytree_with_keys(
    _Keyed,
    lambda m: (((jtu.GetAttrKey("b"), m.b), (jtu.GetAttrKey("w"), m.w)), None),
    lambda aux, c: _Keyed(c[1], c[0]),
)


class _NT(typing.NamedTuple):
    w: jax.Array
    b: jax.Array


def _w0():
    return jnp.linspace(-0.5, 0.5, 6).reshape(3, 2)


def _wb_loss(m):
    w, b = (m["w"], m["b"]) if isinstance(m, dict) else (m.w, m.b)
    return jnp.mean((jnp.tanh(X @ w + b) - Y) ** 2)


KINDS = {
    "flax.struct": (
        lambda: _Struct(_w0(), jnp.zeros(2)),
        lambda m: jnp.mean((m.act(X @ m.w + m.b) - Y) ** 2) * m.n,
        True,
    ),
    "register_dataclass": (
        lambda: _RegDC(_w0(), jnp.zeros(2), jnp.arange(2), 3),
        lambda m: _wb_loss(m) * m.n + jnp.sum(m.steps),
        True,
    ),
    "register_pytree_with_keys": (lambda: _Keyed(_w0(), jnp.zeros(2)), _wb_loss, True),
    "NamedTuple": (lambda: _NT(_w0(), jnp.zeros(2)), _wb_loss, False),
    "OrderedDict": (
        lambda: collections.OrderedDict([("w", _w0()), ("b", jnp.zeros(2))]),
        _wb_loss,
        True,
    ),
    "defaultdict": (
        lambda: collections.defaultdict(list, [("w", _w0()), ("b", jnp.zeros(2))]),
        _wb_loss,
        True,
    ),
    "int keys": (
        lambda: {1: _w0(), 0: jnp.zeros(2), 10: jnp.ones(2)},
        lambda m: jnp.mean((jnp.tanh(X @ m[1] + m[0]) * m[10] - Y) ** 2),
        True,
    ),
    "None leaves": (
        lambda: {"w": _w0(), "b": None, "c": [None, jnp.ones(2)]},
        lambda m: jnp.mean((jnp.tanh(X @ m["w"]) * m["c"][1] - Y) ** 2),
        True,
    ),
}


@pytest.mark.slow  # over ~1 s each
@pytest.mark.parametrize("kind", list(KINDS))
def test_registered_model_kind_full_route(kind, tmp_path):
    make, loss, mutable = KINDS[kind]
    check_model(make, loss, mutable=mutable, tmp_path=tmp_path)


def test_namedtuple_root_refuses_update_in_place_and_changes_nothing():
    # (a frozen flax.struct dataclass is rebound in place, like an equinox Module:
    # covered by the full route above)
    m = KINDS["NamedTuple"][0]()
    st = tg.setup(OPT, m)
    (g,) = tg.gradient(_wb_loss, m)
    before, sbefore = jtu.tree_leaves(m), jtu.tree_leaves(st)
    with pytest.raises(TypeError, match=r"cannot update 'w' in place: only tuples hold it"):
        tg.update_(st, m, g)
    assert all(a is b for a, b in zip(jtu.tree_leaves(m), before, strict=True))
    assert all(a is b for a, b in zip(jtu.tree_leaves(st), sbefore, strict=True))
    _, new = tg.update(st, m, g)  # the failed call did not advance the state
    _, ref, _ = optax_ref(m, _wb_loss, n=1)
    all_close(floats(new), ref)


def test_register_dataclass_int_field_gets_none_and_is_kept():
    m = _RegDC(_w0(), jnp.zeros(2), jnp.arange(2), 3)
    (g,) = tg.gradient(lambda mm: _wb_loss(mm) * mm.n + jnp.sum(mm.steps), m)
    assert type(g) is _RegDC and g.steps is None and g.n == 3
    ref = jax.grad(lambda w, b: _wb_loss({"w": w, "b": b}) * 3, argnums=(0, 1))(m.w, m.b)
    close(g.w, ref[0])
    close(g.b, ref[1])
    assert list(tg.params(m).named()) == ["w", "b"]
    _, new = tg.update(tg.setup(optax.sgd(0.1), m), m, g)
    assert new.steps is m.steps and new.n == 3
    close(new.w, m.w - 0.1 * ref[0])


# Two register_dataclass types (flax.struct.dataclass is one) with the same fields
# have treedefs that jax compares EQUAL (jaxlib 0.10.2: `==` on a dataclass node
# ignores the type; the hashes differ). The fast path's structure check relies on `==`.
@flax_struct.dataclass
class _Lin:
    w: jax.Array

    def __call__(self, x):
        return jnp.sum(self.w * x)


@flax_struct.dataclass
class _Sin:
    w: jax.Array

    def __call__(self, x):
        return jnp.sum(jnp.sin(self.w * x))


def _call_loss(m):
    return m(X[0])


def test_jax_treedef_equality_of_same_layout_dataclasses_is_the_trap():
    # Why treegrad compares treedefs with `_tree.same_structure`: jax's == takes these
    # two types for one node (jaxlib 0.10 to 0.12); their hashes differ.
    a, b = jtu.tree_structure(_Lin(1.0)), jtu.tree_structure(_Sin(1.0))
    if a != b:
        pytest.skip("jax's == now tells same-layout dataclass types apart")
    assert hash(a) != hash(b)
    assert not same_structure(a, b) and same_structure(a, jtu.tree_structure(_Lin(2.0)))


def test_same_layout_dataclass_of_another_type_is_not_served_from_the_cache():
    # Was silent: the second class's gradient (and tg.jit value) was the first's, of
    # the first's type, from the cached program.
    w = jnp.array([0.1, 0.2, 0.3])
    tg.gradient(_call_loss, _Lin(w))
    (g,) = tg.gradient(_call_loss, _Sin(w))
    ref = jax.grad(_call_loss)(_Sin(w))
    assert type(g) is _Sin
    close(g.w, ref.w)
    f = tg.jit(_call_loss)
    f(_Lin(w))
    close(f(_Sin(w)), _call_loss(_Sin(w)))
    # Captured (the guard's check of a model it reads), implicit mode.
    holder = {"m": _Lin(w)}
    loss = lambda: _call_loss(holder["m"])
    tg.gradient(loss, tg.params(holder))
    holder["m"] = _Sin(w)
    gi = tg.gradient(loss, tg.params(holder))
    close(gi[holder["m"].w], ref.w)


def test_an_optimiser_state_of_one_dataclass_type_refuses_another():
    w = jnp.array([0.1, 0.2, 0.3])
    state = tg.setup(optax.adam(0.1), _Lin(w))
    with pytest.raises(
        ValueError,
        match=r"tg\.update: the optimiser state does not match the model \(same paths, "
        r"different static data or types\)",
    ):
        tg.update(state, _Sin(w), _Sin(w))


# --- flax.nnx ----------------------------------------------------------------------------

# treegrad reads and writes an nnx Variable's leaf with get_raw_value/set_raw_value, not
# through the `.value` property flax 0.12.10 deprecates: pytest's filter makes any use of
# it an error here (`_paths.raw_value`).


class _Nnx(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _nnx_loss(m):
    return jnp.mean((m(X) - Y) ** 2)


def _nnx_ref(n=3):
    m = _Nnx(nnx.Rngs(0))
    o = nnx.Optimizer(m, OPT, wrt=nnx.Param)
    g0 = nnx.grad(_nnx_loss)(m)
    for _ in range(n):
        o.update(m, nnx.grad(_nnx_loss)(m))
    return g0, jtu.tree_leaves(nnx.state(m, nnx.Param))


def _nnx_arrays(m):
    return jtu.tree_leaves(nnx.state(m, nnx.Param))


@pytest.mark.slow  # over ~1 s
def test_nnx_module_explicit_update_and_update_in_place_match_nnx_optimizer():
    g0, ref = _nnx_ref()
    m = _Nnx(nnx.Rngs(0))
    (g,) = tg.gradient(_nnx_loss, m)
    assert type(g) is _Nnx
    all_close(_nnx_arrays(g), jtu.tree_leaves(g0))
    st, m2 = tg.setup(OPT, m), m
    for _ in range(3):
        st, m2 = tg.update(st, m2, tg.gradient(_nnx_loss, m2)[0])
    all_close(_nnx_arrays(m2), ref)
    assert m2 is not m  # pure: the user's module is untouched
    all_close(_nnx_arrays(m), _nnx_arrays(_Nnx(nnx.Rngs(0))), 0)
    st = tg.setup(OPT, m)
    for _ in range(3):
        tg.update_(st, m, tg.gradient(_nnx_loss, m)[0])
    all_close(_nnx_arrays(m), ref)
    # split / merge: graphdef static, state the model
    gd, state = nnx.split(_Nnx(nnx.Rngs(0)))
    st = tg.setup(OPT, state)
    for _ in range(3):
        (gs,) = tg.gradient(lambda s: _nnx_loss(nnx.merge(gd, s)), state)
        st, state = tg.update(st, state, gs)
    all_close(jtu.tree_leaves(state), ref)


@pytest.mark.slow  # over ~1 s
def test_nnx_module_implicit_mode_trains_as_nnx_optimizer():
    # Was: flax's bare TraceContextError ("Cannot mutate Param from a different trace
    # level") from tg.gradient(lambda: loss(m), tg.params(m)) and from tg.update_ inside
    # tg.jit. Fixed in _swap.Swap._tree: a refusing Variable is treated as immutable.
    _, ref = _nnx_ref()
    m = _Nnx(nnx.Rngs(0))
    before = jtu.tree_leaves(m)
    ps = tg.params(m)
    assert len(ps) == 4
    st = tg.setup(OPT, ps)
    for _ in range(3):
        tg.update_(st, ps, tg.gradient(lambda: _nnx_loss(m), ps))
    all_close(_nnx_arrays(m), ref)
    assert not any(a is b for a, b in zip(jtu.tree_leaves(m), before, strict=True))

    m = _Nnx(nnx.Rngs(0))
    st = tg.setup(OPT, m)

    @tg.jit
    def step():
        tg.update_(st, m, tg.gradient(_nnx_loss, m)[0])

    for _ in range(3):
        step()
    all_close(_nnx_arrays(m), ref)


@pytest.mark.slow  # about 2 s
def test_nnx_implicit_gradient_in_a_dict_restores_every_leaf():
    box = {"a": jnp.array(2.0), "m": _Nnx(nnx.Rngs(0))}
    before = jtu.tree_leaves(box)
    ps = tg.params(box)
    g = tg.gradient(lambda: jnp.sum(box["m"](X) * box["a"]) ** 2, ps)
    assert all(a is b for a, b in zip(jtu.tree_leaves(box), before, strict=True))
    ra, rm = jax.grad(lambda a, m: jnp.sum(m(X) * a) ** 2, argnums=(0, 1))(box["a"], box["m"])
    close(g[box["a"]], ra)
    close(g[box["m"].l1.kernel[...]], rm.l1.kernel[...])


# An implicit step on an nnx.Module compiled by tg.jit (tg.train with a Params too) was a
# strict xfail: the Swap rebuilt the module (nnx Variables refuse tracers) into the loss's
# cell only, while the Params read the old module ("the loss depends on none of the
# parameters"). Fixed in _swap.Swap (stand_ins given to every Alias route); see
# tests/test_fix_xfails_1202f.py.


@pytest.mark.slow  # over ~1 s
def test_nnx_implicit_tg_jit_step_matches_nnx_optimizer():
    _, ref = _nnx_ref()
    m = _Nnx(nnx.Rngs(0))
    ps = tg.params(m)
    st = tg.setup(OPT, ps)

    @tg.jit
    def step():
        tg.update_(st, ps, tg.gradient(lambda: _nnx_loss(m), ps))

    for _ in range(3):
        step()
    all_close(_nnx_arrays(m), ref)


@pytest.mark.slow  # over ~1 s
def test_nnx_train_with_params_matches_nnx_optimizer():
    _, ref = _nnx_ref()
    m = _Nnx(nnx.Rngs(0))
    ps = tg.params(m)
    tg.train(lambda: _nnx_loss(m), ps, [()] * 3, tg.setup(OPT, ps))
    all_close(_nnx_arrays(m), ref)
