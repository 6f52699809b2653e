"""Fixes for the defects found in hunt 1202, each checked against an independent reference.

1. A `Params` built from a container follows a leaf whose dtype changes at the same
   tree structure (int -> float makes it a parameter, float -> int drops it).
2. `tg.train` (explicit style) checks only what the optimiser trains: a buffer outside
   `__trainable__` may hold -inf or have a non-finite gradient.
3. The probability losses stay finite in bfloat16 and float16 (eps from the dtype).
4. A Module pickles after it has been flattened.
5. Adding Grads over different parameters names them instead of claiming a replacement.
"""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

L = tg.losses


# --- 1. Params follows dtype changes ---------------------------------------------------


class Scaled(tg.Module):
    def __init__(self):
        self.w = jnp.ones(2)
        self.scale = jnp.array(2)  # an int: not a parameter

    def __call__(self, x):
        return jnp.sum(self.w * x) * self.scale


def test_params_follows_a_leaf_that_becomes_float_at_the_same_structure():
    m, x = Scaled(), jnp.array([1.0, 2.0])
    ps = tg.params(m)
    assert list(ps.named()) == ["w"]
    m.scale = jnp.array(2.0)  # fixed by the user: now a parameter
    assert list(ps.named()) == list(tg.params(m).named()) == ["w", "scale"]
    assert m.scale in ps and len(ps) == 2
    grads = tg.gradient(lambda: m(x), ps)
    ref_w, ref_scale = jax.grad(lambda w, s: jnp.sum(w * x) * s, argnums=(0, 1))(m.w, m.scale)
    np.testing.assert_allclose(grads[m.scale], ref_scale)  # sum(w * x) = 3
    np.testing.assert_allclose(grads[m.w], ref_w)
    assert list(grads.named()) == ["w", "scale"]


def test_params_drops_a_leaf_that_becomes_int_at_the_same_structure():
    d = {"n": jnp.zeros(2), "w": jnp.ones(2)}
    ps = tg.params(d)
    assert list(ps.named()) == ["n", "w"]
    d["n"] = jnp.zeros(2, jnp.int32)  # a dict keeps its structure: the fast path reads it
    assert list(ps.named()) == list(tg.params(d).named()) == ["w"]
    assert d["n"] not in ps
    d["n"] = jnp.zeros(2)  # and back
    assert list(ps.named()) == list(tg.params(d).named()) == ["n", "w"]
    grads = tg.gradient(lambda: jnp.sum(d["w"] * d["n"]), ps)
    ref = jax.grad(lambda t: jnp.sum(t["w"] * t["n"]))(d)
    np.testing.assert_allclose(grads[d["n"]], ref["n"])
    np.testing.assert_allclose(grads[d["w"]], ref["w"])


# --- 2. tg.train checks only the trainable leaves ---------------------------------------


class WithBuffer(tg.Module):
    __trainable__ = ("w",)

    def __init__(self):
        self.w = jnp.ones(2)
        self.buf = jnp.zeros(2)  # sqrt's gradient at 0 is inf, but buf is not trained

    def __call__(self, x):
        return jnp.sum(self.w * x) + jnp.sum(jnp.sqrt(self.buf))


class MaskedTrainable(tg.Module):  # no __trainable__: the mask is trained too
    def __init__(self):
        self.w = jnp.eye(3) * 0.5 + 0.1
        self.mask = jnp.triu(jnp.full((3, 3), -jnp.inf), k=1)  # a causal mask

    def __call__(self, x):
        return jnp.sum(jax.nn.softmax(x @ self.w + self.mask, axis=-1) * x[::-1])


class MaskedBuffer(MaskedTrainable):
    __trainable__ = ("w",)


def _optax_reference(loss, trained, data, rule):
    """Plain optax and jax.grad on the trained arrays alone."""

    @jax.jit
    def step(trained, opt, *batch):
        updates, opt = rule.update(jax.grad(loss)(trained, *batch), opt, trained)
        return optax.apply_updates(trained, updates), opt

    opt = rule.init(trained)
    for batch in data:
        trained, opt = step(trained, opt, *batch)
    return trained


def test_train_ignores_a_nonfinite_gradient_outside_trainable():
    data = [(jnp.array([1.0, 2.0]),)] * 3
    model = WithBuffer()
    _, trained, losses = tg.train(lambda m, x: m(x), model, data, tg.setup(optax.sgd(0.1), model))
    ref = _optax_reference(lambda w, x: jnp.sum(w * x), model.w, data, optax.sgd(0.1))
    np.testing.assert_allclose(trained.w, ref, rtol=1e-6)
    np.testing.assert_array_equal(trained.buf, model.buf)
    assert len(losses) == 3


def test_train_still_stops_on_a_trainable_gradient_and_names_only_it():
    model = WithBuffer()
    data = [(jnp.array([1.0, 2.0]),)]
    loss = lambda m, x: jnp.sum(jnp.sqrt(m.w - 1.0)) + m(x)  # inf at w = 1
    with pytest.raises(tg.NonFiniteLossError) as e:
        tg.train(loss, model, data, tg.setup(optax.sgd(0.1), model))
    msg = str(e.value)
    assert "the gradient of 'w' is not finite (the loss, " in msg
    assert "at epoch 0, step 0; stopped" in msg and "'buf'" not in msg
    assert e.value.model is model


def _masked_reference(model, names, data):
    fixed = {"mask": model.mask}

    def loss(t, x):
        p = {**fixed, **t}
        return jnp.sum(jax.nn.softmax(x @ p["w"] + p["mask"], axis=-1) * x[::-1])

    trained = {n: getattr(model, n) for n in names}
    return {**fixed, **_optax_reference(loss, trained, data, optax.sgd(0.1))}


MASK_DATA = [(jnp.arange(9.0).reshape(3, 3) / 9,), (jnp.arange(9.0).reshape(3, 3) / 4.5,)]


def test_train_accepts_a_minus_inf_buffer_outside_trainable():
    model = MaskedBuffer()
    _, trained, _ = tg.train(lambda m, x: m(x), model, MASK_DATA, tg.setup(optax.sgd(0.1), model))
    ref = _masked_reference(model, ["w"], MASK_DATA)
    np.testing.assert_allclose(trained.w, ref["w"], rtol=1e-6)
    np.testing.assert_array_equal(trained.mask, model.mask)


@pytest.mark.slow  # two tg.train compilations and a reference: ~2 s
def test_train_accepts_a_trainable_minus_inf_mask_the_update_leaves_alone():
    # Inside __trainable__ (there is none), the update does not make the -inf
    # entries non-finite: they already were, and their gradient is 0.
    model = MaskedTrainable()
    _, trained, _ = tg.train(lambda m, x: m(x), model, MASK_DATA, tg.setup(optax.sgd(0.1), model))
    ref = _masked_reference(model, ["w", "mask"], MASK_DATA)
    upper = np.triu(np.ones((3, 3), bool), k=1)
    assert (np.asarray(ref["mask"])[upper] == -np.inf).all()  # still -inf where it was
    assert not np.array_equal(ref["mask"], model.mask)  # the rest of it was trained
    m2 = MaskedTrainable()  # implicit style
    ps = tg.params(m2)
    tg.train(lambda x: m2(x), ps, MASK_DATA, tg.setup(optax.sgd(0.1), ps))
    for got in (trained, m2):
        np.testing.assert_allclose(got.w, ref["w"], rtol=1e-6)
        np.testing.assert_allclose(got.mask, ref["mask"], rtol=1e-6)


# --- 3. Probability losses in low precision ----------------------------------------------

LOW = [jnp.bfloat16, jnp.float16]


def _loss_and_grad(fn, p, y):
    # One compiled call: op by op, each new dtype costs a compile per operation (~1 s).
    return jax.jit(jax.value_and_grad(lambda q, y: fn(q, y).astype(jnp.float32)))(p, y)


@pytest.mark.parametrize("dt", LOW, ids=lambda d: d.__name__)
def test_binarycrossentropy_saturated_is_finite_in_low_precision(dt):
    p, y = jnp.array([1.0, 0.0], dt), jnp.array([0.0, 1.0], dt)
    value, g = _loss_and_grad(L.binarycrossentropy, p, y)
    # Clipped to [eps, 1 - eps] with eps the dtype's machine epsilon (Flux's epseltype).
    eps = float(jnp.finfo(dt).eps)
    np.testing.assert_allclose(float(value), -np.log(eps), rtol=1e-2)
    assert np.isfinite(np.asarray(g, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0)  # flat outside the clip


@pytest.mark.slow  # four losses in three dtypes, each compiled: ~2 s
@pytest.mark.parametrize("dt", LOW, ids=lambda d: d.__name__)
def test_probability_losses_in_low_precision_match_float32(dt):
    p, y = jnp.array([0.3, 0.8, 0.55, 0.1]), jnp.array([0.0, 1.0, 1.0, 0.0])
    for fn, args in [
        (L.binarycrossentropy, (p, y)),
        (L.crossentropy, (jnp.stack([p, 1 - p], -1), jnp.array([1, 0, 0, 1]))),
        (L.logitbinarycrossentropy, (jnp.array([30.0, -30.0, 0.5, -2.0]), y)),
        (L.logitcrossentropy, (jnp.array([[30.0, -30.0], [0.5, -2.0]]), jnp.array([1, 0]))),
    ]:
        a, b = args
        want, want_g = _loss_and_grad(fn, a, b)
        low_b = b.astype(dt) if jnp.issubdtype(b.dtype, jnp.floating) else b
        got, got_g = _loss_and_grad(fn, a.astype(dt), low_b)
        name = fn.__name__
        np.testing.assert_allclose(float(got), float(want), rtol=2e-2, err_msg=name)
        np.testing.assert_allclose(
            np.asarray(got_g, np.float32), want_g, rtol=2e-2, atol=1e-2, err_msg=name
        )


@pytest.mark.parametrize("dt", LOW, ids=lambda d: d.__name__)
def test_crossentropy_zero_probability_uses_the_dtype_eps(dt):
    value, g = _loss_and_grad(L.crossentropy, jnp.array([[1.0, 0.0]], dt), jnp.array([1]))
    np.testing.assert_allclose(float(value), -np.log(float(jnp.finfo(dt).eps)), rtol=1e-2)
    assert np.isfinite(np.asarray(g, np.float32)).all()


def test_probability_losses_keep_eps_1e_7_in_float32():
    p, y = jnp.array([1.0, 0.0, 0.4]), jnp.array([0.0, 1.0, 1.0])
    lo, hi = np.float32(1e-7), np.float32(1 - 1e-7)  # the clip, as float32 rounds it
    pc = np.clip(np.asarray(p, np.float64), lo, hi)
    yy = np.asarray(y, np.float64)
    ref = -np.mean(yy * np.log(pc) + (1 - yy) * np.log1p(-pc))
    got = jax.jit(
        lambda p, y: (
            L.binarycrossentropy(p, y),
            L.crossentropy(jnp.stack([p, 1 - p], -1), jnp.array([1, 0, 1])),
            L.binarycrossentropy(p, y, eps=0.01),  # an eps given is used as given
        )
    )(p, y)
    np.testing.assert_allclose(float(got[0]), ref, rtol=1e-5)
    ce_ref = -np.mean(np.log([np.float32(1e-7), np.float32(1e-7), np.float32(0.6)]))
    np.testing.assert_allclose(float(got[1]), ce_ref, rtol=1e-5)
    pc = np.clip(np.asarray(p, np.float64), np.float32(0.01), np.float32(1 - np.float32(0.01)))
    ref = -np.mean(yy * np.log(pc) + (1 - yy) * np.log1p(-pc))
    np.testing.assert_allclose(float(got[2]), ref, rtol=1e-5)


# --- 4. Pickling a flattened Module -------------------------------------------------------


class One(tg.Module):
    def __init__(self):
        self.w = jnp.arange(2.0)
        self.name = "x"


class NoChildren(tg.Module):
    def __init__(self):
        self.name = "only static"
        self.act = np.tanh


def _round_trip(m):
    jax.tree_util.tree_leaves(m)  # flattened: the split is cached on the instance
    back = pickle.loads(pickle.dumps(m))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(m)
    for a, b in zip(jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    return back


@pytest.mark.parametrize(
    "make",
    [
        One,
        NoChildren,
        lambda: nn.Chain(nn.Dense(2, 2, key=jax.random.key(0))),
        lambda: nn.Dense(2, 2, key=jax.random.key(0)),
    ],
    ids=["one-child", "no-children", "chain", "dense"],
)
def test_module_pickles_after_a_flatten(make):
    m = make()
    back = _round_trip(m)
    assert type(back) is type(m) and vars(back).keys() == vars(m).keys()
    for k, v in vars(m).items():
        if not isinstance(v, (jax.Array, tg.Module, list)):
            assert vars(back)[k] == v


def test_pickled_chain_computes_and_differentiates_like_the_original():
    m = nn.Chain(nn.Dense(3, 2, key=jax.random.key(1)))
    back = _round_trip(m)
    x = jnp.array([1.0, -2.0, 0.5])
    np.testing.assert_array_equal(back(x), m(x))
    (g,) = tg.gradient(lambda mm: jnp.sum(mm(x) ** 2), back)
    w, b = m[0].weight, m[0].bias
    ref = jax.jit(jax.grad(lambda w, b: jnp.sum((w @ x + b) ** 2), argnums=(0, 1)))
    ref_w, ref_b = ref(w, b)
    np.testing.assert_allclose(g[0].weight, ref_w, rtol=1e-6)
    np.testing.assert_allclose(g[0].bias, ref_b, rtol=1e-6)


# --- 5. Grads arithmetic over different parameters -------------------------------------


def test_adding_grads_over_different_parameters_names_them_without_replaced():
    W, b, c = jnp.ones((2, 2)), jnp.zeros(2), jnp.ones(3)
    g1 = tg.gradient(lambda: jnp.sum(W) + jnp.sum(b), tg.Params([W, b]))
    g2 = tg.gradient(lambda: jnp.sum(W) + jnp.sum(c), tg.Params([W, c]))
    with pytest.raises(ValueError) as e:
        g1 + g2
    msg = str(e.value)
    assert msg == (
        "cannot combine Grads over different parameter sets (2 and 2 parameters): '1' is a "
        "float32[2] array in the first and a float32[3] array in the second, not the same "
        "parameter. Take both for the same tg.params."
    )
    assert "replaced" not in msg


def test_adding_grads_across_an_update_still_says_replaced():
    W, b = jnp.ones((2, 2)), jnp.zeros(2)
    g1 = tg.gradient(lambda: jnp.sum(W) + jnp.sum(b), tg.Params([W, b]))
    b2 = b + 1.0  # the same parameter's new value: same shape and dtype
    g2 = tg.gradient(lambda: jnp.sum(W) + jnp.sum(b2), tg.Params([W, b2]))
    with pytest.raises(ValueError, match=r"'1' is a different array in each \(it was replaced"):
        g1 - g2
    b3 = b.astype(jnp.bfloat16)  # another dtype: not a replacement
    g3 = tg.gradient(lambda: jnp.sum(W) + jnp.sum(b3).astype(jnp.float32), tg.Params([W, b3]))
    with pytest.raises(ValueError, match=r"'1' is a float32\[2\] array in the first and a "):
        g1 + g3


@pytest.mark.parametrize("loss", ["logitcrossentropy", "crossentropy"])
@pytest.mark.parametrize("label", [-1, -3, 3])
def test_an_integer_label_out_of_range_is_an_error_or_nan_when_traced(loss, label):
    # Once: -1 silently scored the last class (optax counts from the end), 3 gave NaN.
    fn = getattr(tg.losses, loss)
    x = jnp.array([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    y = jnp.array([0, label])
    with pytest.raises(
        ValueError,
        match=rf"tg\.losses\.{loss}: label {label} is out of range: .* has 3 classes, "
        r"labels go from 0 to 2",
    ):
        fn(x, y)
    # Traced (under jax.jit), it cannot be checked: that row's loss is NaN, so the mean is.
    assert np.isnan(float(jax.jit(fn)(x, y)))
    ok = jnp.array([0, 2])
    np.testing.assert_allclose(jax.jit(fn)(x, ok), fn(x, ok), rtol=1e-6)
    if loss == "logitcrossentropy":
        ref = optax.losses.softmax_cross_entropy_with_integer_labels(x, ok).mean()
    else:
        ref = -jnp.mean(jnp.log(x[jnp.arange(2), ok]))
    np.testing.assert_allclose(fn(x, ok), ref, rtol=1e-6)
