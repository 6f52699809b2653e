"""Training on a mesh of 8 CPU devices: data, 2x4 model and fully sharded parallel.

Not collected by the main run (jax fixes the device count at start-up):
`tests/test_scaling.py` runs this file with pytest in a subprocess that sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.

Every layout is trained in each style (explicit, implicit, both inside
`tg.jit`, `tg.train`) and compared with plain `jax.grad` + optax on one
device; the sharding of every gradient, optimiser state array and updated
parameter is checked against the parameter's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treegrad as tg
from treegrad import nn

# A string: evaluated at collection, so importing this module starts no backend
# (tests/scaling_procs.py imports it before jax.distributed.initialize).
pytestmark = pytest.mark.skipif(
    "jax.device_count() != 8", reason="needs 8 devices; run by tests/test_scaling.py"
)

STEPS = 3
RULE = optax.adam(1e-2)


class MLP(tg.Module):
    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.layers = [
            nn.Dense(8, 16, key=k[0]),
            nn.Dense(16, 16, key=k[1]),
            nn.Dense(16, 8, key=k[2]),
        ]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def layout(kind):
    """The mesh, and the rules placing the model on it."""
    devices = np.array(jax.devices())
    if kind == "data":  # data parallel: the model replicated, batches split
        return Mesh(devices, ("data",)), {"layers": P()}
    if kind == "model":  # 2x4: weights split by output over "model", batches over "data"
        mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
        return mesh, {"layers.*.weight": P("model", None), "layers.*.bias": P("model")}
    if kind == "fsdp":  # fully sharded: every parameter split over the data axis too
        mesh = Mesh(devices, ("data",))
        return mesh, {"layers.*.weight": P("data", None), "layers.*.bias": P("data")}
    # 2x4, model parallel and fully sharded at once
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
    return mesh, {"layers.*.weight": P("model", "data"), "layers.*.bias": P("model")}


def host_batches(n=STEPS):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32))
        for _ in range(n)
    ]


def reference(n=STEPS):
    """Plain jax.grad and optax on one device: the model after `n` steps, and the losses."""
    model = MLP(jax.random.key(0))
    opt = RULE.init(model)
    losses = []
    for x, y in host_batches(n):
        loss, g = jax.value_and_grad(loss_fn)(model, jnp.asarray(x), jnp.asarray(y))
        updates, opt = RULE.update(g, opt, model)
        model = optax.apply_updates(model, updates)
        losses.append(float(loss))
    return model, losses


def walk(tree, path):
    for part in path.split("."):
        tree = tree[int(part)] if part.isdigit() else getattr(tree, part)
    return tree


def same_layout(a, b):
    """Whether array `a` is laid out like `b` (an array or a sharding)."""
    return a.sharding.is_equivalent_to(getattr(b, "sharding", b), a.ndim)


def check_state(mesh, model, state):
    """Adam's moments on their parameter's layout, the step count replicated on the mesh."""
    replicated = NamedSharding(mesh, P())
    for path, p in tg.params(model).named().items():
        adam = walk(state, path).state[0]
        for moment in (adam.mu, adam.nu):
            assert same_layout(moment, p), (path, moment.sharding)
        assert adam.count.sharding.is_equivalent_to(replicated, 0), adam.count.sharding


def check(mesh, expected, model, state, grads):
    """Values and layouts after training (`grads`: (param, gradient) pairs of the last step)."""
    ref = tg.params(reference()[0]).named()
    placed = tg.params(model).named()
    assert placed.keys() == ref.keys()
    for path, p in placed.items():
        np.testing.assert_allclose(np.asarray(p), np.asarray(ref[path]), rtol=1e-6, atol=1e-6)
        assert same_layout(p, expected[path]), (path, p.sharding)
    check_state(mesh, model, state)
    for p, g in grads:
        assert g is not None and same_layout(g, p), (g.sharding, p.sharding)


def start(kind):
    mesh, rules = layout(kind)
    model = tg.shard(MLP(jax.random.key(0)), rules, mesh=mesh)
    expected = {k: v for k, v in tg.params(model).named().items()}
    state = tg.setup(RULE, model)
    check_state(mesh, model, state)
    batches = [tg.shard_batch(b, mesh) for b in host_batches()]
    return mesh, model, expected, state, batches


def pairs(model, g):
    return list(zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(g), strict=True))


def explicit_gradient(model, x, y):
    _, (g,) = tg.withgradient(lambda m: loss_fn(m, x, y), model)
    return g


def implicit_gradient(model, ps, x, y):
    return tg.gradient(lambda: loss_fn(model, x, y), ps)


KINDS = ["data", "model", "fsdp", "model+fsdp"]


@pytest.mark.parametrize("kind", KINDS)
def test_explicit(kind):
    mesh, model, expected, state, batches = start(kind)
    for x, y in batches:
        g = explicit_gradient(model, x, y)
        grads = pairs(model, g)
        state, model = tg.update(state, model, g)
    check(mesh, expected, model, state, grads)


@pytest.mark.parametrize("kind", KINDS)
def test_implicit(kind):
    mesh, model, expected, state, batches = start(kind)
    ps = tg.params(model)
    state = tg.setup(RULE, ps)
    for x, y in batches:
        g = implicit_gradient(model, ps, x, y)
        grads = list(g.items())
        tg.update_(state, ps, g)
    check(mesh, expected, model, state, grads)


@pytest.mark.parametrize("kind", KINDS)
def test_jit_explicit(kind):
    mesh, model, expected, state, batches = start(kind)

    @tg.jit
    def step(state, model, x, y):
        (g,) = tg.gradient(lambda m: loss_fn(m, x, y), model)
        state, new = tg.update(state, model, g)
        return state, new, g

    for x, y in batches:
        before = model
        state, model, g = step(state, model, x, y)
    check(mesh, expected, model, state, pairs(before, g))


@pytest.mark.parametrize("kind", KINDS)
def test_jit_gradients_alone(kind):
    """Gradients as outputs of a compiled step, the update left outside."""
    _, model, _, _, batches = start(kind)
    x, y = batches[0]
    explicit = tg.jit(lambda m, x, y: tg.gradient(lambda m: loss_fn(m, x, y), m)[0])
    ps = tg.params(model)
    implicit = tg.jit(lambda x, y: tg.gradient(lambda: loss_fn(model, x, y), ps).to_tree(model))
    ref = jax.grad(loss_fn)(MLP(jax.random.key(0)), jnp.asarray(x), jnp.asarray(y))
    for g in (explicit(model, x, y), implicit(x, y)):
        for p, gp, r in zip(*map(jax.tree_util.tree_leaves, (model, g, ref)), strict=True):
            assert same_layout(gp, p), (gp.sharding, p.sharding)
            np.testing.assert_allclose(np.asarray(gp), np.asarray(r), atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_jit_implicit(kind):
    mesh, model, expected, state, batches = start(kind)
    ps = tg.params(model)
    state = tg.setup(RULE, ps)

    @tg.jit
    def step(x, y):
        g = tg.gradient(lambda: loss_fn(model, x, y), ps)
        tree = g.to_tree(model)
        tg.update_(state, ps, g)
        return tree

    for x, y in batches:
        before = tg.params(model).arrays()
        g = step(x, y)
    check(
        mesh, expected, model, state, list(zip(before, jax.tree_util.tree_leaves(g), strict=True))
    )


@pytest.mark.parametrize("kind", KINDS)
def test_train(kind):
    mesh, model, expected, state, _ = start(kind)
    state, model, losses = tg.train(loss_fn, model, host_batches(), state, mesh=mesh)
    assert len(losses) == STEPS
    check(mesh, expected, model, state, [])


def test_data_parallel_on_explicit_axes():
    """jax.make_mesh's default axes carry shardings in the types; the same code trains."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    model = tg.shard(MLP(jax.random.key(0)), P(), mesh=mesh)
    expected = tg.params(model).named()
    state = tg.setup(RULE, model)
    check_state(mesh, model, state)
    for x, y in (tg.shard_batch(b, mesh) for b in host_batches()):
        g = explicit_gradient(model, x, y)
        grads = pairs(model, g)
        state, model = tg.update(state, model, g)
    check(mesh, expected, model, state, grads)
    model = tg.shard(MLP(jax.random.key(0)), P(), mesh=mesh)
    state, model, _ = tg.train(loss_fn, model, host_batches(), tg.setup(RULE, model), mesh=mesh)
    check(mesh, expected, model, state, [])


def test_gradient_follows_each_calls_placement():
    """One function, two layouts: each call's gradients take that call's layout."""
    mesh, _ = layout("fsdp")
    model = MLP(jax.random.key(0))
    x, y = map(jnp.asarray, host_batches(1)[0])
    ref = jax.grad(loss_fn)(model, x, y)
    for spec in (P("data", None), P(None, "data"), P()):
        placed = tg.shard(model, {"layers.*.weight": spec}, mesh=mesh)
        (g,) = tg.gradient(lambda m: loss_fn(m, x, y), placed)
        for layer, g_layer, r in zip(placed.layers, g.layers, ref.layers, strict=True):
            assert same_layout(g_layer.weight, layer.weight), (spec, g_layer.weight.sharding)
            np.testing.assert_allclose(np.asarray(g_layer.weight), r.weight, atol=1e-6)


def test_pullback_keeps_fsdp_layout():
    mesh, rules = layout("fsdp")
    model = tg.shard(MLP(jax.random.key(0)), rules, mesh=mesh)
    x, y = tg.shard_batch(host_batches(1)[0], mesh)
    value, back = tg.pullback(lambda m: loss_fn(m, x, y), model)
    (g,) = back(jnp.ones_like(value))
    ref = jax.grad(loss_fn)(MLP(jax.random.key(0)), jnp.asarray(x), jnp.asarray(y))
    for p, gp, r in zip(*(jax.tree_util.tree_leaves(t) for t in (model, g, ref)), strict=True):
        assert same_layout(gp, p), gp.sharding
        np.testing.assert_allclose(np.asarray(gp), np.asarray(r), atol=1e-6)


def test_model_built_directly_sharded():
    """tg.shard inside tg.jit: the parameters are made in place on the mesh."""
    mesh, rules = layout("model")
    make = tg.jit(lambda key: tg.shard(MLP(key), rules, mesh=mesh))
    model = make(jax.random.key(0))
    plain = MLP(jax.random.key(0))
    for path, p in tg.params(model).named().items():
        spec = rules["layers.*.weight" if path.endswith("weight") else "layers.*.bias"]
        assert same_layout(p, NamedSharding(mesh, spec)), (path, p.sharding)
        np.testing.assert_array_equal(np.asarray(p), np.asarray(walk(plain, path)))
    # Through tg.jit's out_shardings (a pytree prefix of the output), for a dict model.
    rep = NamedSharding(mesh, P())
    make_dict = tg.jit(
        lambda key: {"w": jax.random.normal(key, (16, 8)), "b": jnp.zeros(16)},
        out_shardings={"w": NamedSharding(mesh, P("model", None)), "b": rep},
    )
    d = make_dict(jax.random.key(1))
    assert same_layout(d["w"], NamedSharding(mesh, P("model", None))), d["w"].sharding
    assert same_layout(d["b"], rep), d["b"].sharding


def test_destructure_rebuild_keeps_layout():
    mesh, rules = layout("model+fsdp")
    model = tg.shard(MLP(jax.random.key(0)), rules, mesh=mesh)
    flat, rebuild = tg.destructure(model)
    again = rebuild(flat * 2)
    for p, q in zip(
        jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(again), strict=True
    ):
        assert same_layout(q, p), q.sharding
        np.testing.assert_allclose(np.asarray(q), 2 * np.asarray(p))
    # Differentiable through the placement, inside jax.jit too.
    x, y = tg.shard_batch(host_batches(1)[0], mesh)
    g = jax.jit(jax.grad(lambda v: loss_fn(rebuild(v), x, y)))(flat)
    ref_flat, _ = tg.destructure(
        jax.grad(loss_fn)(MLP(jax.random.key(0)), jnp.asarray(x), jnp.asarray(y))
    )
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref_flat), atol=1e-6)


def test_train_refuses_host_batches_for_a_sharded_model():
    mesh, model, _, state, _ = start("fsdp")
    with pytest.raises(
        ValueError,
        match=r"placed on 8 devices .*'layers\.0\.weight'.*batch 0 of epoch 0 holds a numpy "
        r"array at '0'.*mesh=mesh",
    ):
        tg.train(loss_fn, model, host_batches(), state)
    # Placed batches, or an explicit mesh, are accepted.
    placed = [tg.shard_batch(b, mesh) for b in host_batches(1)]
    _, _, losses = tg.train(loss_fn, model, placed, state)
    assert len(losses) == 1


def test_setup_places_state_of_a_restored_model(tmp_path):
    """A checkpoint loaded onto another mesh trains on (the count is on the new mesh)."""
    _, model, _, state, _ = start("fsdp")
    tg.save(tmp_path / "ck", (model, state))
    mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rules2 = {"layers.*.weight": P("data", "model"), "layers.*.bias": P("data")}
    abstract = tg.shard(jax.eval_shape(lambda: MLP(jax.random.key(0))), rules2, mesh=mesh2)
    like_state = tg.shard(state, rules2, mesh=mesh2)
    model2, state2 = tg.load(tmp_path / "ck", (abstract, like_state))
    assert state2.layers[0].weight.state[0].count.sharding.mesh == mesh2
    for x, y in (tg.shard_batch(b, mesh2) for b in host_batches()):
        g = explicit_gradient(model2, x, y)
        state2, model2 = tg.update(state2, model2, g)
    ref = tg.params(reference()[0]).named()
    for path, p in tg.params(model2).named().items():
        assert same_layout(
            p, NamedSharding(mesh2, P("data", "model") if "weight" in path else P("data"))
        )
        np.testing.assert_allclose(np.asarray(p), np.asarray(ref[path]), rtol=1e-6, atol=1e-6)


def test_specs_that_do_not_divide_are_named():
    mesh, _ = layout("model")
    with pytest.raises(
        ValueError,
        match=r"cannot place 'b' \(float32\[6\]\).*splits dimension 0 \(size 6\) into 4 parts "
        r"over model, which does not divide it",
    ):
        tg.shard({"b": jnp.ones(6)}, P("model"), mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"'0' has 6 rows in dimension 0 in this process, which do not split evenly over "
        r"its 4 devices along data; use a local batch size divisible by 4",
    ):
        tg.shard_batch(
            (np.ones((6, 2)),), Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "m"))
        )


def test_jit_in_shardings_are_the_gradients_layout():
    """Inputs on one device, placed by tg.jit's in_shardings: gradients follow in_shardings."""
    mesh, rules = layout("fsdp")
    shardings = jax.tree.map(
        lambda a: a.sharding, tg.shard(MLP(jax.random.key(0)), rules, mesh=mesh)
    )
    rows = NamedSharding(mesh, P("data"))
    grad = tg.jit(
        lambda m, x, y: tg.gradient(lambda m: loss_fn(m, x, y), m)[0],
        in_shardings=(shardings, rows, rows),
    )
    model = MLP(jax.random.key(0))
    x, y = map(jnp.asarray, host_batches(1)[0])
    g = grad(model, x, y)
    ref = jax.grad(loss_fn)(model, x, y)
    for s, gp, r in zip(*map(jax.tree_util.tree_leaves, (shardings, g, ref)), strict=True):
        assert gp.sharding.is_equivalent_to(s, gp.ndim), (gp.sharding, s)
        np.testing.assert_allclose(np.asarray(gp), np.asarray(r), atol=1e-6)
