"""Hostile hunt on `tg.jit`'s options and on `tg.train` (1202c).

`tg.jit`'s options mean what they mean for `jax.jit`, and what a compiled function
reads is never stale (API.md sections 2 and 5): two `tg.jit`s of one function with
other options, static arguments that are functions, classes or Modules edited in
place, `in_shardings` next to static arguments. `tg.train` never silently trains
nothing. References: the function run uncompiled, `jax.jit`, plain optax by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

from .helpers import run_on_cpu_devices

ONE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


# --- the options key the compiled program ---------------------------------------------


def test_a_plain_tg_jit_never_reuses_a_donating_one_of_the_same_function():
    # Both orders: a program made with donate_argnums deleted the arrays of the
    # plain tg.jit's callers, and one made without it never donated.
    def f(m, x):
        return {"w": m["w"] * x}

    donating, plain = tg.jit(f, donate_argnums=0), tg.jit(f)
    m = {"w": jnp.ones(3)}
    np.testing.assert_array_equal(donating(m, 2.0)["w"], 2.0 * np.ones(3))
    assert m["w"].is_deleted()
    m = {"w": jnp.ones(3)}
    np.testing.assert_array_equal(plain(m, 3.0)["w"], 3.0 * np.ones(3))
    assert not m["w"].is_deleted()
    np.testing.assert_array_equal(m["w"], np.ones(3))

    def g(m, x):
        return {"w": m["w"] * x}

    tg.jit(g)({"w": jnp.ones(3)}, 2.0)
    m = {"w": jnp.ones(3)}
    tg.jit(g, donate_argnames="m")(m, 2.0)
    assert m["w"].is_deleted()


def test_options_given_the_same_way_share_one_trace():
    traces = []

    def f(m, x):
        traces.append(1)
        return m * x

    for _ in range(3):
        tg.jit(f, out_shardings=ONE, donate_argnums=(0,))(jnp.ones(2), 2.0)
    assert len(traces) == 1


# --- static arguments are never stale --------------------------------------------------


@pytest.mark.parametrize("spec", [{}, {"static_argnums": 0}, {"static_argnames": "fn"}])
def test_static_function_argument_reads_its_closure_fresh(spec):
    cfg = {"s": 1.0}
    W = [jnp.ones(2)]

    def scaled(x):
        return x * cfg["s"]

    def weighted(x):
        return x * W[0]

    def f(fn, x):
        return fn(x)

    g = tg.jit(f, **spec)
    x = jnp.arange(2.0)
    for s, w in [(1.0, 1.0), (3.0, 7.0), (-2.0, 0.5)]:
        cfg["s"], W[0] = s, jnp.full(2, w)
        np.testing.assert_array_equal(g(scaled, x), f(scaled, x))
        np.testing.assert_array_equal(g(fn=weighted, x=x), f(weighted, x))


class _Config:
    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k


def test_static_plain_object_edited_in_place_is_read_fresh():
    g = tg.jit(lambda cfg, x: cfg(x), static_argnums=0)
    cfg, x = _Config(2.0), jnp.arange(2.0)
    np.testing.assert_array_equal(g(cfg, x), 2.0 * x)
    cfg.k = 5.0  # keyed by its hash (identity), the old trace was reused
    np.testing.assert_array_equal(g(cfg, x), 5.0 * x)


class Scale(tg.Module):
    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k


def test_static_module_edited_in_place_traces_again_and_an_equal_one_does_not():
    traces = []

    def f(m, x):
        traces.append(m.k)
        return m(x)

    g = tg.jit(f, static_argnums=0)
    m, x = Scale(2.0), jnp.ones(2)
    np.testing.assert_array_equal(g(m, x), [2.0, 2.0])
    m.k = 5.0  # jax.jit keys a static argument by hash: tg.jit by what it holds
    np.testing.assert_array_equal(g(m, x), [5.0, 5.0])
    np.testing.assert_array_equal(g(Scale(2.0), x), [2.0, 2.0])  # equal: the first trace
    assert traces == [2.0, 5.0]
    # A new shape traces the k=2.0 program again: with its value, not the edited object's.
    m.k = 9.0
    np.testing.assert_array_equal(g(Scale(2.0), jnp.ones(3)), 2.0 * np.ones(3))
    assert traces == [2.0, 5.0, 2.0]


def test_class_and_module_passed_as_arguments_are_read_fresh():
    import types

    class C:
        k = 3.0

        @classmethod
        @tg.jit
        def f(cls, x):
            return x * cls.k

    class D(C):
        pass

    x = jnp.ones(2)
    np.testing.assert_array_equal(C.f(x), 3.0 * np.ones(2))
    C.k = 4.0
    np.testing.assert_array_equal(C.f(x), 4.0 * np.ones(2))
    D.k = 7.0
    np.testing.assert_array_equal(D.f(x), 7.0 * np.ones(2))
    np.testing.assert_array_equal(C().f(x), 4.0 * np.ones(2))
    mod = types.ModuleType("cfg_1202c")
    mod.s = 2.0
    g = tg.jit(lambda m, x: x * m.s)
    np.testing.assert_array_equal(g(mod, x), 2.0 * np.ones(2))
    mod.s = 9.0
    np.testing.assert_array_equal(g(mod, x), 9.0 * np.ones(2))


def test_dtype_classes_as_arguments_trace_once_each():
    traces = []

    def f(x, dt):
        traces.append(dt)
        return x.astype(dt) * 2

    g = tg.jit(f)
    for _ in range(3):
        for dt in (jnp.float16, jnp.float32, jnp.bfloat16, np.int32):
            out = g(jnp.ones(2), dt)
            assert out.dtype == dt
    assert len(traces) == 4


def test_staticmethod_binds_no_instance_and_classmethod_says_where_to_put_it():
    class C:
        @tg.jit
        @staticmethod
        def f(x):
            return x + 1

    x = jnp.ones(2)
    np.testing.assert_array_equal(C.f(x), 2.0 * np.ones(2))
    np.testing.assert_array_equal(C().f(x), 2.0 * np.ones(2))
    with pytest.raises(TypeError, match=r"classmethod: put @classmethod above @tg\.jit"):
        tg.jit(classmethod(lambda cls, x: x))


def test_negative_positions_of_a_varargs_function_count_from_the_end_as_jax_jit():
    traces = []

    def f(*args):
        traces.append(args[-1])
        return args[0] * args[-1]

    g, x = tg.jit(f, static_argnums=-1), jnp.arange(2.0)
    np.testing.assert_array_equal(g(x, 3), jax.jit(f, static_argnums=-1)(x, 3))
    np.testing.assert_array_equal(g(x, 3), 3 * x)
    np.testing.assert_array_equal(g(x, x, 4), 4 * x)
    assert traces[-2:] == [3, 4] and traces.count(3) == 2  # one tg.jit trace, one jax's
    with pytest.raises(TypeError, match=r"static argument 1 must be hashable.*got a list"):
        g(x, [3])
    with pytest.raises(TypeError, match=r"got an array \(float32\[2\]\); an array is traced"):
        g(x, x)
    a, b = jnp.ones(2), jnp.ones(2)
    tg.jit(lambda *a: (a[0] * 2, a[1] * 2), donate_argnums=-1)(a, b)
    assert b.is_deleted() and not a.is_deleted()


# --- in_shardings and out_shardings ------------------------------------------------------


def test_in_shardings_leave_out_static_arguments_as_for_jax_jit():
    def f(x, n, y):
        return x * n + y

    x, y = jnp.ones(2), jnp.arange(2.0)
    want = jax.jit(f, static_argnums=1, in_shardings=(ONE, ONE))(x, 3, y)
    for shardings in [(ONE, ONE), (ONE, None, ONE)]:  # jax's way, and one per argument
        g = tg.jit(f, static_argnums=1, in_shardings=shardings)
        np.testing.assert_array_equal(g(x, 3, y), want)
    g = tg.jit(f, in_shardings=(ONE, None, ONE))
    with pytest.raises(ValueError, match=r"3 entries for 2 positional arguments, and 1 passed by"):
        g(x, 3, y=y)


@pytest.mark.slow  # over ~0.5 s (compiles)
def test_out_shardings_none_leaves_that_part_to_xla_as_jax_jit_does():
    # jax.jit reads a None in out_shardings as "let XLA choose"; tg.jit refused it.
    f = lambda x: (x * 2, x + 1)
    ours = tg.jit(f, out_shardings=(None, ONE))(jnp.ones(2))
    jaxs = jax.jit(f, out_shardings=(None, ONE))(jnp.ones(2))
    for a, b in zip(ours, jaxs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert ours[1].sharding == ONE
    # None where the output holds no array (a Module's unset activation): fine.
    m = tg.nn.Dense(2, 2, key=jax.random.key(0))
    like = jax.tree.map(lambda a: ONE, m)
    out = tg.jit(lambda m: m, out_shardings=like)(m)
    np.testing.assert_array_equal(out.weight, m.weight)
    assert out.weight.sharding == ONE


MESH_SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import treegrad as tg
from treegrad import nn
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
NS = lambda *s: NamedSharding(mesh, P(*s))
def spec(a):  # trailing Nones dropped: P("model") == P("model", None)
    s = list(a.sharding.spec)
    while s and s[-1] is None:
        s.pop()
    return s
k0, k1 = jax.random.key(0), jax.random.key(1)
model = nn.Chain(nn.Dense(8, 16, jnp.tanh, key=k0), nn.Dense(16, 8, key=k1))
x = jax.random.normal(jax.random.key(2), (16, 8)); y = jnp.zeros((16, 8))
msh = jax.tree.map(lambda a: NS("model", None) if a.ndim == 2 else NS("model"), model)
def step(state, model, x, y):
    l, (g,) = tg.withgradient(lambda m: jnp.mean((m(x) - y) ** 2), model)
    return (*tg.update(state, model, g), l)
state = tg.setup(optax.adam(0.1), model)
out = {}
ref = jax.jit(step)(state, model, x, y)
tg.jit(step)(state, model, x, y)  # a program without shardings, first
for name, kw in {
    "in": dict(in_shardings=(None, msh, NS("data"), NS("data"))),
    "out": dict(out_shardings=(NS(), msh, NS())),
}.items():
    s, m, l = tg.jit(step, **kw)(state, model, x, y)
    out[name] = [
        float(max(jnp.max(jnp.abs(a - b))
                  for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(ref[1])))),
        spec(m[0].weight), spec(m[1].bias), type(m).__name__,
    ]
# jax's convention: in_shardings for the arguments that are not static.
f = lambda x, n, y: (x * n, y + 0)
g = tg.jit(f, static_argnums=1, in_shardings=(NS("data"), NS("model")))
a, b = g(jnp.ones(8), 3, jnp.ones(8))
out["static"] = [spec(a), spec(b), float(a[0])]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.devices
def test_shardings_on_eight_devices_module_prefixes_and_their_own_programs():
    proc = run_on_cpu_devices(MESH_SCRIPT, 8)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    import json

    got = json.loads(line[0][len("RESULT ") :])
    for name in ("in", "out"):
        err, w_spec, b_spec, kind = got[name]
        assert err < 1e-5 and kind == "Chain"
        # The layout asked for (the program made first had none: not reused).
        assert w_spec == ["model"] and b_spec == ["model"]
    assert got["static"] == [["data"], ["model"], 3.0]


# --- tg.train: a step that trains nothing is an error --------------------------------


def test_train_loss_ignoring_its_model_argument_is_an_error_and_changes_nothing():
    model = {"w": jnp.ones(3)}
    state = tg.setup(optax.sgd(0.1), model)
    before = jax.tree.leaves(state)
    loss = lambda m, x: jnp.sum((model["w"] * x) ** 2)  # reads the captured model
    with pytest.raises(tg.NoGradientError, match=r"epoch 0, step 0, the loss does not depend on"):
        tg.train(loss, model, [(jnp.ones(3),)] * 3, state)
    np.testing.assert_array_equal(model["w"], np.ones(3))
    assert all(a is b for a, b in zip(jax.tree.leaves(state), before, strict=True))
    ints = {"n": jnp.arange(3)}
    with pytest.raises(tg.NoGradientError, match=r"no trainable floating-point arrays"):
        tg.train(lambda m, x: jnp.sum(x), ints, [(jnp.ones(3),)], tg.setup(optax.sgd(0.1), ints))


@pytest.mark.slow  # over ~0.5 s (compiles)
def test_train_params_of_arrays_the_loss_reads_as_globals_is_refused_at_the_first_update():
    # Flux's train!(loss, Params([W, b]), ...) mutates W and b; in jax an update gives the
    # Params new arrays, which the loss (reading the old W, b) would never see: the first
    # update is refused, before any change, naming the step and what the loss reads.
    W, b = jnp.ones((2, 3)), jnp.zeros(2)
    x, y = jnp.arange(3.0), jnp.ones(2)
    ps = tg.Params([W, b])
    state = tg.setup(optax.sgd(0.1), ps)
    before = jax.tree.leaves(state)
    loss = lambda x, y: jnp.sum((W @ x + b - y) ** 2)
    with pytest.raises(
        TypeError,
        match=r"tg\.train, at epoch 0, step 0: tg\.update_: the loss reads the Params' "
        r"parameter 0 \(float32\[2×3\]\) as W, not from the containers",
    ):
        tg.train(loss, ps, [(x, y)] * 3, state)
    assert ps[0] is W and ps[1] is b
    assert all(a is c for a, c in zip(jax.tree.leaves(state), before, strict=True))


@pytest.mark.slow  # over ~0.5 s (compiles)
def test_train_with_params_the_container_the_loss_reads_trains_like_optax():
    # The way out the error names: the loss reads the arrays from the container.
    params = {"W": jnp.ones((2, 3)), "b": jnp.zeros(2)}
    x, y = jnp.arange(3.0), jnp.ones(2)
    ps = tg.params(params)
    state = tg.setup(optax.adam(0.05), ps)
    loss = lambda x, y: jnp.sum((params["W"] @ x + params["b"] - y) ** 2)
    seen = []
    _, model, losses = tg.train(loss, ps, [(x, y)] * 4, state, callbacks=[seen.append])
    assert model is params and all(info.model is params for info in seen)
    rule, p = optax.adam(0.05), {"W": jnp.ones((2, 3)), "b": jnp.zeros(2)}
    opt, ref = rule.init(p), []
    for _ in range(4):
        v, g = jax.value_and_grad(lambda p: jnp.sum((p["W"] @ x + p["b"] - y) ** 2))(p)
        u, opt = rule.update(g, opt, p)
        p = optax.apply_updates(p, u)
        ref.append(float(v))
    np.testing.assert_allclose(losses, ref, rtol=1e-6)
    for k in p:
        np.testing.assert_allclose(params[k], p[k], rtol=1e-6)


def test_no_gradient_inside_a_users_jax_jit_says_to_build_the_params_inside():
    model = {"w": jnp.ones(3)}
    ps = tg.params(model)

    @jax.jit
    def step(m):  # m: traced copies; ps holds the arrays from outside
        return tg.gradient(lambda: jnp.sum(m["w"] ** 2), ps)[model["w"]]

    with pytest.warns(
        tg.NoGradientWarning,
        match=r"runs inside a jax transformation .*"
        r"Build the Params inside the transformed function",
    ):
        assert step(model) is None


def test_no_gradient_inside_tg_jit_names_params_of_standalone_arrays():
    # Not "a jax transformation": inside tg.jit the Params of standalone arrays holds
    # arrays the function does not read (an update replaced them in the Params only).
    W = jnp.ones(3)
    ps = tg.Params([W + 0.0])  # another array than the global the loss reads

    @tg.jit
    def step():
        return tg.gradient(lambda: jnp.sum(W**2), ps, strict=True)

    with pytest.raises(
        tg.NoGradientError,
        match=r"reads none of the arrays the Params hold "
        r"now\. Inside a compiled step .*tg\.Params\(\[W, b\]\) with W and b globals",
    ):
        step()
