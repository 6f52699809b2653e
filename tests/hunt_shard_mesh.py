"""Hostile-user hunt on a mesh of 8 CPU devices: the checks of tests/test_hunt_shard.py.

Not collected as tests (jax fixes the device count when it starts):
`tests/test_hunt_shard.py` runs this file once per session in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`; it runs every check in
`CHECKS` named on its command line (all if none) and prints one JSON line,
`RESULTS {name: "ok" | "<error>"}`. A check
named `bug_*` asserts what would be right where treegrad cannot do it (a strict
xfail there, with the reason).

Every numerical check compares against an independent reference: plain
`jax.grad` and optax on one device (unplaced arrays), or `jax.device_put`.
"""

import functools
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treegrad as tg
from treegrad import nn

CHECKS: dict[str, Callable[[], None]] = {}
SLOW: set[str] = set()  # over ~1.5 s each on a 2-core machine, or sweeps: the slow tests only


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def slow_check(fn: Callable[[], None]) -> Callable[[], None]:
    SLOW.add(fn.__name__)
    return check(fn)


# --- models, layouts and references ----------------------------------------------------


class Net(tg.Module):
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = nn.Dense(8, 16, key=k1)
        self.l2 = nn.Dense(16, 8, key=k2)
        self.act = jnp.tanh  # static data
        self.tag = "net"
        self.scale = 0.5

    def __call__(self, x):
        return self.l2(self.act(self.l1(x))) * self.scale


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def mesh1():
    return Mesh(np.array(jax.devices()), ("data",))


def mesh2x4():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


FSDP = {"l1.weight": P("data", None), "l2.weight": P(None, "data"), "*.bias": P("data")}
MODEL = {
    "l1.weight": P("model", "data"),
    "l1.bias": P("model"),
    "l2.weight": P(None, "model"),
    "l2.bias": P(),
}


def batches(n=2):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32))
        for _ in range(n)
    ]


def net():
    """A fresh Net of the same initial arrays (built once: eager initialisers are slow)."""
    if not _NET:
        _NET.append(Net(jax.random.key(0)))
    return jax.tree_util.tree_map(lambda a: a, _NET[0])


_NET: list[Net] = []


_grad = jax.jit(jax.grad(loss_fn))


def ref_grad(model, x, y):
    """Plain jax.grad, on one device (the batch copied to the host first)."""
    return _grad(model, np.asarray(x), np.asarray(y))


@functools.partial(jax.jit, static_argnums=0)
def ref_step(rule, model, opt, g):
    """Plain optax, on one device."""
    updates, opt = rule.update(g, opt, model)
    return optax.apply_updates(model, updates), opt


@functools.cache
def reference(rule, n=2):
    """Plain jax.grad + optax on one device: the model after `n` steps, and the losses."""
    model = net()
    opt = jax.jit(rule.init)(model)
    losses = []
    for x, y in batches(n):
        losses.append(float(jax.jit(loss_fn)(model, x, y)))
        model, opt = ref_step(rule, model, opt, ref_grad(model, x, y))
    return model, opt, losses


def close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def same_layout(a, b):
    """Whether array `a` is laid out like `b` (an array or a sharding)."""
    return a.sharding.is_equivalent_to(getattr(b, "sharding", b), a.ndim)


def assert_layouts(tree, like):
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(like), strict=True):
        assert same_layout(a, b), (a.shape, a.sharding, getattr(b, "sharding", b))


def placed(rules=FSDP, mesh=None):
    # Copies: a replicated placement may share the one-device buffer of its input, and
    # donating it would delete net()'s arrays (see donating_a_placed_copy_keeps_the_input).
    return tg.shard(jax.tree_util.tree_map(jnp.copy, net()), rules, mesh=mesh or mesh1())


def state_layout_ok(state, model, mesh):
    """Per-parameter entries of the parameter's shape on its layout, the rest replicated."""
    params = tg.params(model).named()
    for path, p in params.items():
        sub = state
        for part in path.split("."):
            sub = getattr(sub, part)
        for x in jax.tree_util.tree_leaves(sub.state):
            if x.shape == p.shape:
                assert same_layout(x, p), (path, x.shape, x.sharding, p.sharding)
            else:  # shared scalars (count, hyperparameters) and factored moments
                assert x.sharding.mesh == mesh and same_layout(x, NamedSharding(mesh, P())), (
                    path,
                    x.shape,
                    x.sharding,
                )


# --- gradients -------------------------------------------------------------------------


@slow_check
def grads_every_style_on_2x4_with_int_and_bool_leaves():
    mesh = mesh2x4()
    model = {
        "net": placed(MODEL, mesh),
        "ids": jnp.arange(8),
        "on": jnp.ones(8, bool),
    }
    model = tg.shard(model, {"ids": P("data"), "on": P("model")}, mesh=mesh)
    x, y = tg.shard_batch(batches(1)[0], mesh)

    def loss(m, x, y):
        return loss_fn(m["net"], x, y) + jnp.sum(m["ids"] * m["on"]) * 0.0

    ref = ref_grad(net(), x, y)
    ps = tg.params(model)
    results = {
        "explicit": tg.gradient(lambda m: loss(m, x, y), model)[0],
        "implicit": tg.gradient(lambda: loss(model, x, y), ps).to_tree(model),
        "tg.jit explicit": tg.jit(lambda m, x, y: tg.gradient(lambda m: loss(m, x, y), m)[0])(
            model, x, y
        ),
        "tg.jit implicit": tg.jit(
            lambda x, y: tg.gradient(lambda: loss(model, x, y), ps).to_tree(model)
        )(x, y),
        "pullback": tg.pullback(lambda m: loss(m, x, y), model)[1](jnp.ones(()))[0],
    }
    for style, g in results.items():
        assert g["ids"] is None and g["on"] is None, style
        assert g["net"].act is jnp.tanh and g["net"].tag == "net", style
        close(g["net"], ref)
        assert_layouts(g["net"], model["net"])


@slow_check
def pullback_and_jacobian_on_explicit_axes_and_in_shard_map():
    # The backward pass read for which inputs get None is traced with the outputs'
    # own types (explicit placement, shard_map's varying axes), and the Jacobian's
    # unit cotangents are placed as jax.jacrev places them.
    f = lambda w: jnp.sin(w) * w
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.arange(16.0) / 7, NamedSharding(mesh, P("data")))
        y, back = tg.pullback(f, w)
        dy = jnp.ones_like(y) * 0.5
        close(back(dy)[0], jax.vjp(f, w)[1](dy)[0])
        assert back(dy)[0].sharding.spec == P("data")
        close(tg.jacobian(f, w)[0], jax.jacrev(f)(w))
        close(jax.jit(lambda v: tg.jacobian(f, v)[0])(w), jax.jacrev(f)(w))

    auto = mesh1()

    def ours(w):
        y, back = tg.pullback(f, w)
        return back(jnp.ones_like(y))[0], tg.jacobian(f, w)[0].sum(0)

    def theirs(w):
        y, back = jax.vjp(f, w)
        return back(jnp.ones_like(y))[0], jax.jacrev(f)(w).sum(0)

    spec = {"mesh": auto, "in_specs": P("data"), "out_specs": (P("data"), P("data"))}
    w = jnp.arange(16.0) / 7
    close(jax.shard_map(ours, **spec)(w), jax.shard_map(theirs, **spec)(w))


# --- the optimiser -----------------------------------------------------------------------


def _by_ndim(tree):
    return jax.tree_util.tree_map(lambda a: "matrix" if a.ndim == 2 else "vector", tree)


RULES = {
    "inject_hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "chain_clip_adam": optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "multi_transform": optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(1e-2, momentum=0.9)}, _by_ndim
    ),
    "masked": optax.masked(
        optax.adam(1e-2), lambda t: jax.tree_util.tree_map(lambda a: a.ndim == 2, t)
    ),
    "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=4),
}


@slow_check
def setup_and_update_place_every_optax_state_on_the_parameters_layout():
    mesh = mesh1()
    for name, rule in RULES.items():
        model = placed(FSDP, mesh)
        before = tg.params(model).named()
        state = tg.setup(rule, model)
        state_layout_ok(state, model, mesh)
        for x, y in (tg.shard_batch(b, mesh) for b in batches()):
            (g,) = tg.gradient(lambda m, x=x, y=y: loss_fn(m, x, y), model)
            state, model = tg.update(state, model, g)
        state_layout_ok(state, model, mesh)
        for path, p in tg.params(model).named().items():
            assert same_layout(p, before[path]), (name, path, p.sharding)
        ref, _, _ = reference(rule)
        try:
            close(model, ref)
        except AssertionError as e:
            raise AssertionError(name) from e


@slow_check
def none_subtree_gradient_keeps_layout_identity_and_moments():
    mesh = mesh1()
    model = placed(FSDP, mesh)
    rule = optax.adam(1e-2)
    state = tg.setup(rule, model)
    x, y = tg.shard_batch(batches(1)[0], mesh)
    (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
    state, model = tg.update(state, model, g)
    mu_before = state.l1.weight.state[0].mu
    (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
    g.l1 = None
    state2, model2 = tg.update(state, model, g)
    assert model2.l1.weight is model.l1.weight and model2.l1.bias is model.l1.bias
    np.testing.assert_array_equal(state2.l1.weight.state[0].mu, mu_before)
    assert int(state2.l1.weight.state[0].count) == 2  # the shared count advances
    assert_layouts(model2, model)
    state_layout_ok(state2, model2, mesh)
    # Reference: plain optax, the second step with zeros for l1 (adam is per parameter
    # but for the shared count): l2 as optax has it, l1 as after the first step.
    rule_ref = net()
    o = rule.init(rule_ref)
    rule_ref, o = ref_step(rule, rule_ref, o, ref_grad(rule_ref, x, y))
    close(model.l1, rule_ref.l1)
    g2 = ref_grad(rule_ref, x, y)
    g2.l1 = jax.tree_util.tree_map(jnp.zeros_like, g2.l1)
    close(model2.l2, ref_step(rule, rule_ref, o, g2)[0].l2)
    close(model2.l1, rule_ref.l1)


@check
def frozen_substate_keeps_layout_and_identity():
    mesh = mesh1()
    model = placed(FSDP, mesh)
    rule = optax.adam(1e-2)
    state = tg.setup(rule, model)
    tg.freeze_(state.l2)
    x, y = tg.shard_batch(batches(1)[0], mesh)
    (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
    state2, model2 = tg.update(state, model, g)
    assert model2.l2.weight is model.l2.weight and model2.l2.bias is model.l2.bias
    assert_layouts(model2, model)
    state_layout_ok(state2, model2, mesh)
    plain = net()
    ref_g = ref_grad(plain, x, y)
    close(model2.l1, ref_step(rule, plain.l1, rule.init(plain.l1), ref_g.l1)[0])


@check
def donated_update_and_replicated_gradients_keep_layouts():
    mesh = mesh1()
    rule = optax.adam(1e-2)
    x, y = tg.shard_batch(batches(1)[0], mesh)
    ref, _, _ = reference(rule, 1)
    # Donated: the new arrays keep the layout of the donated ones.
    model = placed(FSDP, mesh)
    layout = jax.tree_util.tree_map(lambda a: a.sharding, model)
    state = tg.setup(rule, model)
    (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
    state, new = tg.update(state, model, g, donate=True)
    assert_layouts(new, layout)
    state_layout_ok(state, new, mesh)
    close(new, ref)
    # Gradients from plain jax.grad, replicated: the parameters stay fully sharded.
    model = placed(FSDP, mesh)
    state = tg.setup(rule, model)
    g = jax.device_put(
        ref_grad(net(), x, y),
        NamedSharding(mesh, P()),
    )
    state, new = tg.update(state, model, g)
    assert_layouts(new, model)
    state_layout_ok(state, new, mesh)
    close(new, ref)


@check
def tg_jit_step_with_donated_sharded_arguments():
    mesh = mesh2x4()
    rule = optax.adam(1e-2)
    model = placed(MODEL, mesh)
    layout = jax.tree_util.tree_map(lambda a: a.sharding, model)
    state = tg.setup(rule, model)

    def step(state, model, x, y):
        (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
        return tg.update(state, model, g)

    step = tg.jit(step, donate_argnums=(0, 1))
    for x, y in (tg.shard_batch(b, mesh) for b in batches()):
        state, model = step(state, model, x, y)
    assert_layouts(model, layout)
    state_layout_ok(state, model, mesh)
    close(model, reference(rule)[0])


def _tied():
    """A dict model with one array at two places, placed once (not through tg.shard)."""
    w = jax.device_put(
        jax.random.normal(jax.random.key(3), (8, 8)), NamedSharding(mesh1(), P("data", None))
    )
    return {"enc": w, "dec": w, "b": jax.device_put(jnp.zeros(8), NamedSharding(mesh1(), P()))}


def _tied_loss(m, x):
    return jnp.mean(jnp.tanh(x @ m["enc"] + m["b"]) @ m["dec"].T)


def _tied_reference(rule, x, steps):
    p = {"w": jax.random.normal(jax.random.key(3), (8, 8)), "b": jnp.zeros(8)}
    o = rule.init(p)
    f = lambda p: _tied_loss({"enc": p["w"], "dec": p["w"], "b": p["b"]}, x)
    for _ in range(steps):
        u, o = rule.update(jax.grad(f)(p), o, p)
        p = optax.apply_updates(p, u)
    return p


@slow_check
def tied_weight_on_a_mesh_explicit_and_implicit():
    rule = optax.adam(1e-2)
    x = jnp.asarray(batches(1)[0][0])
    ref = _tied_reference(rule, x, 2)
    # explicit
    model = _tied()
    state = tg.setup(rule, model)
    for _ in range(2):
        (g,) = tg.gradient(lambda m: _tied_loss(m, x), model)
        state, model = tg.update(state, model, g)
    assert model["enc"] is model["dec"]
    assert same_layout(model["enc"], NamedSharding(mesh1(), P("data", None)))
    close((model["enc"], model["b"]), (ref["w"], ref["b"]))
    # implicit, in place, inside tg.jit
    model = _tied()
    ps = tg.params(model)
    assert len(ps) == 2
    state = tg.setup(rule, ps)

    @tg.jit
    def step():
        tg.update_(state, ps, tg.gradient(lambda: _tied_loss(model, x), ps))

    for _ in range(2):
        step()
    assert model["enc"] is model["dec"]
    assert same_layout(model["enc"], NamedSharding(mesh1(), P("data", None)))
    close((model["enc"], model["b"]), (ref["w"], ref["b"]))


# --- tg.train(mesh=) ----------------------------------------------------------------------


@slow_check
def train_batch_spec_variants_equal_one_device():
    mesh = mesh2x4()
    rule = optax.sgd(0.1, momentum=0.9)
    ref, _, ref_losses = reference(rule)
    for spec in (P(), (P(("model", "data")), P("data"))):
        model = placed(MODEL, mesh)
        layout = jax.tree_util.tree_map(lambda a: a.sharding, model)
        state = tg.setup(rule, model)
        state, model, losses = tg.train(
            loss_fn, model, batches(), state, mesh=mesh, batch_spec=spec
        )
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=str(spec))
        close(model, ref)
        assert_layouts(model, layout)
        state_layout_ok(state, model, mesh)


@slow_check
def train_mesh_with_an_unplaced_model_and_in_implicit_style():
    mesh = mesh1()
    rule = optax.adam(1e-2)
    ref, _, ref_losses = reference(rule)
    model = net()
    _, trained, losses = tg.train(loss_fn, model, batches(), tg.setup(rule, model), mesh=mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(trained, ref)
    model = placed(FSDP, mesh)
    layout = jax.tree_util.tree_map(lambda a: a.sharding, model)
    ps = tg.params(model)
    state = tg.setup(rule, ps)
    _, _, losses = tg.train(lambda x, y: loss_fn(model, x, y), ps, batches(), state, mesh=mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(model, ref)
    assert_layouts(model, layout)
    state_layout_ok(state, model, mesh)


# --- tg.shard and tg.shard_batch ----------------------------------------------------------


@check
def shard_batch_values_for_every_spec():
    mesh = mesh2x4()
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    for spec in (P(None, "data"), P(("data", "model")), P("model", "data"), P()):
        out = tg.shard_batch(a, mesh, spec)
        assert out.sharding == NamedSharding(mesh, spec), spec
        ref = jax.device_put(a, NamedSharding(mesh, spec))
        for s, r in zip(out.addressable_shards, ref.addressable_shards, strict=True):
            assert s.index == r.index and s.device == r.device, spec
            np.testing.assert_array_equal(s.data, r.data)
    out = tg.shard_batch({"ids": np.arange(8), "on": np.ones(8, bool), "t": 2.0}, mesh)
    assert out["ids"].dtype == jnp.int32 and out["on"].dtype == jnp.bool_ and out["t"] == 2.0
    np.testing.assert_array_equal(out["ids"], np.arange(8))
    # A jax array on another mesh is re-placed on this one.
    other = jax.device_put(a, NamedSharding(mesh1(), P(None, "data")))
    out = tg.shard_batch(other, mesh)
    assert out.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(out, a)


@check
def shard_and_shard_batch_name_specs_that_do_not_divide():
    mesh = mesh2x4()
    msg = "splits dimension 0 (size 4) into 8 parts over data×model, which does not divide it"
    for place in (
        lambda: tg.shard({"b": jnp.ones(4)}, {"b": P(("data", "model"))}, mesh=mesh),
        lambda: jax.jit(lambda b: tg.shard(b, P(("data", "model")), mesh=mesh))(jnp.ones(4)),
    ):
        try:
            place()
        except ValueError as e:
            assert "tg.shard: cannot place" in str(e) and msg in str(e), str(e)
        else:
            raise AssertionError("no error")
    try:
        tg.shard_batch(np.ones((6, 2)), mesh, P("model"))
    except ValueError as e:
        assert "6 rows in dimension 0" in str(e) and "divisible by 4" in str(e), str(e)
    else:
        raise AssertionError("no error")


@check
def shard_inside_jax_jit_constrains_each_rule():
    mesh = mesh2x4()
    out = jax.jit(lambda m: tg.shard(m, MODEL, mesh=mesh))(net())
    close(out, net())
    assert out.act is jnp.tanh and out.tag == "net"
    for path, rule in (("l1", "l1.weight"), ("l2", "l2.weight")):
        w = getattr(out, path).weight
        assert same_layout(w, NamedSharding(mesh, MODEL[rule])), (path, w.sharding)
    assert same_layout(out.l1.bias, NamedSharding(mesh, P("model")))


# --- files ---------------------------------------------------------------------------------


@slow_check
def save_and_load_onto_another_mesh_with_eval_shape_likes():
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    model = placed(FSDP, mesh1())
    state = tg.setup(rule, model)
    (x, y), (x2, y2) = (tg.shard_batch(b, mesh1()) for b in batches())
    (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
    state, model = tg.update(state, model, g)
    with tempfile.TemporaryDirectory() as d:
        tg.save(f"{d}/ck", (model, state))
        mesh = mesh2x4()
        like = jax.eval_shape(
            lambda: (Net(jax.random.key(1)), tg.setup(rule, Net(jax.random.key(1))))
        )
        like_model = tg.shard(like[0], MODEL, mesh=mesh)
        like_state = tg.shard(like[1], MODEL, mesh=mesh)
        model2, state2 = tg.load(f"{d}/ck", (like_model, like_state))
    for a, b in zip(
        jax.tree_util.tree_leaves((model2, state2)),
        jax.tree_util.tree_leaves((model, state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(
        jax.tree_util.tree_leaves((model2, state2)),
        jax.tree_util.tree_leaves((like_model, like_state)),
        strict=True,
    ):
        if b.sharding is not None:
            assert same_layout(a, b.sharding), (a.shape, a.sharding, b.sharding)
    count = state2.l1.weight.state.count
    assert same_layout(count, NamedSharding(mesh, P())), count.sharding
    # The next step on the new mesh equals the one-device run.
    x2, y2 = tg.shard_batch(batches()[1], mesh)
    (g,) = tg.gradient(lambda m: loss_fn(m, x2, y2), model2)
    state2, model2 = tg.update(state2, model2, g)
    close(model2, reference(rule)[0])


@check
def save_and_load_tied_int_and_bool_sharded_leaves():
    mesh = mesh1()
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data")))
    tree = {
        "enc": w,
        "dec": w,
        "ids": jax.device_put(jnp.arange(8), NamedSharding(mesh, P("data"))),
        "on": jax.device_put(jnp.arange(8) % 2 == 0, NamedSharding(mesh, P("data"))),
    }
    specs = {"enc": P(None, "data"), "dec": P(None, "data"), "ids": P(), "on": P("data")}
    with tempfile.TemporaryDirectory() as d:
        tg.save(f"{d}/ck", tree)
        out = tg.load(f"{d}/ck", tg.shard(jax.eval_shape(lambda: tree), specs, mesh=mesh))
    assert out["enc"] is out["dec"]
    for k, spec in specs.items():
        assert out[k].sharding == NamedSharding(mesh, spec), (k, out[k].sharding)
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))
        assert out[k].dtype == tree[k].dtype


# --- placements made inside a trace, and arrays on different devices ---------------------


@check
def gradient_of_a_model_placed_inside_a_trace_keeps_that_placement():
    mesh = mesh1()
    x, y = tg.shard_batch(batches(1)[0], mesh)
    replicated = tg.shard(net(), P(), mesh=mesh)
    ref = ref_grad(net(), x, y)
    fsdp = placed(FSDP, mesh)

    def grad_of_placed(m, x, y):
        return tg.gradient(lambda m: loss_fn(m, x, y), tg.shard(m, FSDP, mesh=mesh))[0]

    # tg.jit, and the user's own jax.jit (the documented way there).
    for jit in (tg.jit, jax.jit):
        g = jit(grad_of_placed)(replicated, x, y)
        close(g, ref)
        assert_layouts(g, fsdp)
    # A PartitionSpec taking the mesh from jax.set_mesh (its abstract mesh in the trace).
    with jax.set_mesh(mesh):
        g = tg.jit(lambda m: tg.gradient(lambda m: loss_fn(m, x, y), tg.shard(m, FSDP))[0])(
            replicated
        )
    close(g, ref)
    assert_layouts(g, fsdp)


@check
def update_with_a_state_on_other_devices_names_the_fix():
    mesh = mesh1()
    model = placed(FSDP, mesh)
    # The state was set up for the model before it was placed (committed to device 0).
    state = tg.setup(optax.adam(1e-2), jax.device_put(net(), jax.devices()[0]))
    x, y = tg.shard_batch(batches(1)[0], mesh)
    (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
    want = (
        "tg.update: the optimiser state of 'l1.weight' (0.mu.l1.weight) is on device 0 but "
        "the parameter on 8 devices (ids 0-7): the state was set up (or loaded) for the model "
        "placed elsewhere. Set it up again for the placed model, tg.setup(rule, model), or "
        "place it as the model is: tg.shard(state, rules, mesh=mesh) with the model's rules."
    )
    for donate in (False, True):
        try:
            tg.update(state, model, g, donate=donate)
        except ValueError as e:
            assert str(e) == want, str(e)
        else:
            raise AssertionError("no error")
    # Nothing was changed or donated before the error.
    assert not any(a.is_deleted() for a in jax.tree_util.tree_leaves((state, model, g)))
    # The fix the message names: the state placed as the model (the numbers of such a
    # step are checked against optax in setup_and_update_place_every_optax_state_...).
    state2, new = tg.update(tg.shard(state, FSDP, mesh=mesh), model, g)
    assert_layouts(new, model)
    state_layout_ok(state2, new, mesh)
    # A gradient on other devices than its parameter.
    state = tg.setup(optax.adam(1e-2), model)
    try:
        tg.update(state, model, jax.device_put(g, jax.devices()[0]))
    except ValueError as e:
        assert str(e).startswith(
            "tg.update: the gradient of 'l1.weight' is on device 0 but the parameter on 8 "
            "devices (ids 0-7). Take the gradient of the placed model"
        ), str(e)
    else:
        raise AssertionError("no error")


@check
def gradient_of_leaves_on_different_devices_names_them():
    mesh = mesh1()
    m = {
        "a": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data"))),
        "b": jax.device_put(jnp.ones(8), jax.devices()[0]),
    }
    want = (
        "tg.gradient: 'a' is on 8 devices (ids 0-7) but 'b' on device 0; one computation "
        "needs all its arrays on the same devices. Place them together"
    )
    calls = (
        lambda: tg.gradient(lambda m: jnp.sum(m["a"] * m["b"]), m),
        lambda: tg.gradient(lambda: jnp.sum(m["a"] * m["b"]), tg.params(m)),
    )
    for call in calls:
        try:
            call()
        except ValueError as e:
            assert str(e).startswith(want), str(e)
        else:
            raise AssertionError("no error")
    try:
        tg.gradient(lambda a, b: jnp.sum(a * b), m["a"], m["b"])
    except ValueError as e:
        assert str(e).startswith("tg.gradient: argument 0 is on 8 devices (ids 0-7) but "), str(e)
    else:
        raise AssertionError("no error")


@check
def shard_a_tied_weight_with_two_specs_is_an_error():
    w = jnp.ones((8, 8))
    tied = {"enc": w, "dec": w}
    try:
        tg.shard(tied, {"dec": P("data"), "enc": P()}, mesh=mesh1())
    except ValueError as e:
        assert str(e).startswith(
            "tg.shard: 'dec' and 'enc' are one (tied) array, but the spec places them "
            "differently (NamedSharding("
        ), str(e)
        assert "one array has one placement. Give both paths the same spec" in str(e), str(e)
    else:
        raise AssertionError("no error")
    # Equivalent specs are one placement.
    out = tg.shard(tied, {"dec": P("data"), "enc": P("data", None)}, mesh=mesh1())
    assert out["enc"] is out["dec"] and same_layout(out["enc"], NamedSharding(mesh1(), P("data")))


# --- files and donation ---------------------------------------------------------------------


@check
def load_tied_weight_with_two_shardings_in_like_is_an_error():
    mesh = mesh1()
    w = jnp.arange(64.0).reshape(8, 8)
    sds = lambda spec: jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, spec))
    with tempfile.TemporaryDirectory() as d:
        tg.save(f"{d}/ck", {"enc": w, "dec": w})
        try:
            tg.load(f"{d}/ck", {"dec": sds(P()), "enc": sds(P("data"))})
        except ValueError as e:
            assert str(e).startswith(
                "tg.load: 'dec' and 'enc' are one (tied) array in the checkpoint, but `like` "
                "places them differently ("
            ), str(e)
            assert "Give both paths the same sharding in `like`." in str(e), str(e)
        else:
            raise AssertionError("no error")
        # Equivalent shardings are one placement.
        out = tg.load(f"{d}/ck", {"dec": sds(P("data")), "enc": sds(P("data", None))})
    assert out["enc"] is out["dec"] and same_layout(out["enc"], NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(out["enc"], w)


@check
def donating_a_placed_copy_keeps_the_input():
    # As with jax.device_put, tg.shard's result may share the input's buffer (a
    # replicated placement keeps it on its device; documented): placing a copy is
    # what keeps the input usable after donating the placed model.
    mesh = mesh1()
    model = {"w": jnp.arange(8.0)}
    placed_model = tg.shard(jax.tree_util.tree_map(jnp.copy, model), P(), mesh=mesh)
    state = tg.setup(optax.sgd(0.1), placed_model)
    _, new = tg.update(state, placed_model, {"w": jnp.ones(8)}, donate=True)
    assert not model["w"].is_deleted()
    np.testing.assert_array_equal(model["w"], np.arange(8.0))
    np.testing.assert_allclose(new["w"], np.arange(8.0) - 0.1, rtol=1e-6)
    assert same_layout(new["w"], NamedSharding(mesh, P()))


# --- a known limitation: asserts what would be right --------------------------------------


@check
def bug_jax_jit_explicit_fsdp_gradient_is_replicated():
    mesh = mesh1()
    model = placed(FSDP, mesh)
    x, y = tg.shard_batch(batches(1)[0], mesh)
    g = jax.jit(lambda m, x, y: tg.gradient(lambda m: loss_fn(m, x, y), m)[0])(model, x, y)
    close(g, ref_grad(net(), x, y))
    assert_layouts(g, model)


def main() -> None:
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    only = set(sys.argv[1:])
    results = {}
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            fn()
            results[name] = "ok"
        except Exception as e:
            tb = traceback.format_exc(limit=-4)
            results[name] = f"{type(e).__name__}: {str(e)[:1500]}\n{tb[-2500:]}"
        print(f"{name}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
