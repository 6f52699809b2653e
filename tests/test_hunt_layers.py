"""Hostile hunt for silent wrong results and unclear errors in `treegrad.nn` and `tg.train`.

Every layer's forward pass is checked against an independent reference (a
`flax.linen` layer or cell with the same weights copied in, an `equinox` layer,
or a closed form in numpy) on edge inputs: batch axes of any rank, a single
example without a batch axis, an empty batch, bf16/f16/f64/integer inputs, NaN.
Every gradient is checked against `jax.grad` of the reference, written as a
function of the treegrad-layout arrays so the chain rule through the weight
mapping is JAX's, not ours. Constructors and calls with bad arguments must fail
with a message naming the argument. State-carrying layers (BatchNorm running
statistics and their momentum convention, Dropout keys, train/test mode),
recurrent cells and `nn.Recurrence`, `Chain`, `__trainable__`, repr counts,
`jax.eval_shape`, `jax.vmap`, and `tg.train` (epochs, data that runs out,
progress bar, a non-finite loss mid-epoch) are hunted too.

Bugs found were kept as strict xfails (`test_bug_*`) asserting the correct
behaviour with a minimal reproduction; fixed, they are plain tests named after
the bug they pinned.
"""

import functools

import equinox as eqx
import flax.linen as fl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import datasets, nn

# The default run stays under 3 minutes; CI runs this file in the slow run.
pytestmark = pytest.mark.slow

K = jax.random.key(0)


def nrnd(seed, *shape, scale=1.0, offset=0.0):
    """Test data as a numpy float32 array (a constant, even while tracing)."""
    v = np.random.default_rng(seed).standard_normal(shape) * scale + offset
    return v.astype(np.float32)


def rnd(seed, *shape, scale=1.0, offset=0.0):
    """Test data from numpy, on the device: no eager XLA op to make it."""
    return jnp.asarray(nrnd(seed, *shape, scale=scale, offset=offset))


def close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol, atol)


def compiled(f, *args):
    """`jax.jit(f)(*args)`, compiled with XLA's backend optimisation off: each test
    program runs once, and compiling dominates the run time of this file."""
    return jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)


def build(make):
    """Run `make` (layer constructors) as one compiled call: no eager per-op compiles."""
    return compiled(make)


def arrays(layer, names):
    return {n: getattr(layer, n) for n in names}


def check(layer, names, ref, xs, rtol=1e-5, atol=1e-5):
    """The layer's output on each input, and tg.gradient of a loss through it, against
    the reference's, with jax.grad of the reference for the gradient.

    One jitted computation (tg.gradient traces as plain JAX inside jax.jit): one
    compile per check. No gradient for an empty input.
    """
    ws = [rnd(99, *jax.eval_shape(layer, x).shape) for x in xs]

    def loss_of(y, w):
        return jnp.sum(jnp.sin(y) * w)

    def run(m, a):
        out = []
        for x, w in zip(xs, ws, strict=True):
            g = want = {}
            if x.size:
                (gm,) = tg.gradient(lambda layer, x=x, w=w: loss_of(layer(x), w), m)
                g = {n: getattr(gm, n) for n in names}
                want = jax.grad(lambda b, x=x, w=w: loss_of(ref(b, x), w))(a)
            out.append((m(x), ref(a, x), g, want))
        return out

    for y, y_ref, g, want in compiled(run, layer, arrays(layer, names)):
        assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
        close(y, y_ref, rtol, atol)
        for n in g:
            close(g[n], want[n], max(rtol, 1e-4), atol)


# --- flax references, as functions of the treegrad-layout arrays --------------------


@jax.jit
def flax_dense(a, x):
    p = {"kernel": a["weight"].T, "bias": a["bias"]}
    return fl.Dense(a["weight"].shape[0]).apply({"params": p}, x)


def flax_conv(layer):
    def ref(a, x):
        mod = fl.Conv(
            layer.out_channels,
            kernel_size=layer.kernel_size,
            strides=layer.stride,
            padding=layer.padding,
            kernel_dilation=layer.dilation,
        )
        return mod.apply({"params": {"kernel": a["weight"], "bias": a["bias"]}}, x)

    return jax.jit(ref)


def flax_layernorm(eps):
    def ref(a, x):
        return fl.LayerNorm(epsilon=eps).apply({"params": a}, x)

    return jax.jit(ref)


@functools.partial(jax.jit, static_argnames=("momentum", "eps", "train"))
def flax_batchnorm(a, stats, x, momentum, eps=1e-5, train=True):
    mod = fl.BatchNorm(use_running_average=not train, momentum=1 - momentum, epsilon=eps)
    variables = {
        "params": {"scale": a["scale"], "bias": a["bias"]},
        "batch_stats": {"mean": stats[0], "var": stats[1]},
    }
    y, new = mod.apply(variables, x, mutable=["batch_stats"])
    return y, (new["batch_stats"]["mean"], new["batch_stats"]["var"])


def _chunks(w, n):
    return jnp.split(w, n, axis=0)


@jax.jit
def flax_lstm_step(a, state, x):
    wi, wh, b = _chunks(a["Wi"], 4), _chunks(a["Wh"], 4), _chunks(a["b"], 4)
    p = {}
    for j, gate in enumerate("ifgo"):
        p["i" + gate] = {"kernel": wi[j].T}
        p["h" + gate] = {"kernel": wh[j].T, "bias": b[j]}
    h, c = state
    (c, h), y = fl.LSTMCell(a["Wh"].shape[1]).apply({"params": p}, (c, h), x)
    return (h, c), y


@jax.jit
def flax_gru_step(a, h, x):
    wi, wh = _chunks(a["Wi"], 3), _chunks(a["Wh"], 3)
    bi, bh = _chunks(a["bi"], 3), _chunks(a["bh"], 3)
    # flax has one bias for the r and z gates (on the input side) and puts the
    # hidden bias of the candidate inside r * (...), as treegrad does.
    p = {
        "ir": {"kernel": wi[0].T, "bias": bi[0] + bh[0]},
        "iz": {"kernel": wi[1].T, "bias": bi[1] + bh[1]},
        "in": {"kernel": wi[2].T, "bias": bi[2]},
        "hr": {"kernel": wh[0].T},
        "hz": {"kernel": wh[1].T},
        "hn": {"kernel": wh[2].T, "bias": bh[2]},
    }
    return fl.GRUCell(a["Wh"].shape[1]).apply({"params": p}, h, x)


@jax.jit
def flax_rnn_step(a, h, x):
    p = {"i": {"kernel": a["Wi"].T, "bias": a["b"]}, "h": {"kernel": a["Wh"].T}}
    return fl.SimpleCell(a["Wh"].shape[1]).apply({"params": p}, h, x)


CELLS = {
    "lstm": (nn.LSTMCell, ("Wi", "Wh", "b"), flax_lstm_step),
    "gru": (nn.GRUCell, ("Wi", "Wh", "bi", "bh"), flax_gru_step),
    "rnn": (nn.RNNCell, ("Wi", "Wh", "b"), flax_rnn_step),
}


def nonzero_state(cell, batch_shape, seed=7):
    """A random state shaped as the cell's, each part different (an LSTM's h != c)."""
    parts, tree = jax.tree.flatten(jax.eval_shape(lambda: cell.initial_state(batch_shape)))
    return tree.unflatten([rnd(seed + i, *p.shape, scale=0.5) for i, p in enumerate(parts)])


def perturbed(layer, names, seed=3):
    """The layer with every named array moved off its initial value (biases not zero)."""
    for i, n in enumerate(names):
        v = getattr(layer, n)
        setattr(layer, n, v + nrnd(seed + i, *v.shape).astype(v.dtype) * 0.3)
    return layer


# --- Dense ----------------------------------------------------------------------------


def test_dense_matches_flax_on_any_batch_rank_unbatched_and_empty():
    layer = build(lambda: perturbed(nn.Dense(3, 4, key=K), ("weight", "bias")))
    xs = [rnd(1, *shape) for shape in [(3,), (0, 3), (2, 5, 3), (2, 1, 4, 3)]]
    check(layer, ("weight", "bias"), flax_dense, xs)
    assert layer(xs[1]).shape == (0, 4)  # eagerly too


def test_dense_promotes_low_precision_and_integer_inputs_as_flax_does():
    layer = build(lambda: perturbed(nn.Dense(3, 2, jnp.tanh, key=K), ("weight", "bias")))
    x = np.arange(12).reshape(4, 3) % 5
    xs = [jnp.asarray(x, dt) for dt in (jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint8)]

    def run(m, a):
        return [(m(v), jnp.tanh(flax_dense(a, v))) for v in xs]

    for y, ref in compiled(run, layer, arrays(layer, ("weight", "bias"))):
        assert y.dtype == ref.dtype == jnp.float32
        close(y, ref)


def test_dense_float64_when_x64_is_enabled_against_numpy():
    with jax.enable_x64(True):
        x = np.random.default_rng(1).standard_normal((5, 3))
        layer, y = build(
            lambda: (lambda m: (m, m(jnp.asarray(x))))(nn.Dense(3, 2, key=K, dtype=jnp.float64))
        )
        assert layer.weight.dtype == layer.bias.dtype == y.dtype == jnp.float64
        np.testing.assert_allclose(y, x @ np.asarray(layer.weight).T, rtol=1e-13, atol=1e-14)


def test_nan_in_one_example_stays_in_that_example():
    x = nrnd(2, 3, 4)
    x[1, 2] = np.nan

    def run():
        # As one sequence of 3 steps, a kernel of 2 spreads the NaN to outputs 0 and 1.
        layers = (nn.Dense(4, 2, key=K), nn.LayerNorm(4), nn.Conv(2, 4, 1, key=K))
        return [layer(jnp.asarray(x)) for layer in layers]

    dense, norm, conv = build(run)
    for y in (dense, norm):
        assert np.isfinite(np.asarray(y)).all(axis=-1).tolist() == [True, False, True]
    assert np.isfinite(np.asarray(conv)).all(axis=-1).tolist() == [False, False]


# --- Conv -----------------------------------------------------------------------------

CONV_CASES = {
    "1d-unbatched-same-stride-dilation": (
        3,
        2,
        4,
        dict(stride=2, dilation=2, padding="SAME"),
        (11, 2),
    ),
    "2d-pairs-stride-dilation": (
        (2, 3),
        2,
        3,
        dict(padding=((1, 0), (2, 1)), stride=(2, 1), dilation=(1, 2)),
        (2, 6, 7, 2),
    ),
    "2d-int-pad-stride-and-empty-batch": ((3, 3), 1, 2, dict(padding=1, stride=2), (1, 6, 7, 1)),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_matches_flax_with_strides_dilation_padding_and_gradient(case):
    ks, cin, cout, kw, shape = CONV_CASES[case]
    layer = build(lambda: perturbed(nn.Conv(ks, cin, cout, key=K, **kw), ("weight", "bias")))
    xs = [rnd(4, *shape)]
    if "empty" in case:
        xs.append(rnd(4, 0, *shape[1:]))
    check(layer, ("weight", "bias"), flax_conv(layer), xs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.uint8], ids=str)
def test_conv_low_precision_or_integer_input_is_not_promoted(dtype):
    layer = build(lambda: nn.Conv(3, 2, 2, key=K))
    x = jnp.asarray(np.arange(12).reshape(6, 2) % 7, dtype)
    ref = flax_conv(layer)(arrays(layer, ("weight", "bias")), x)
    y = layer(x)  # was: lax.conv_general_dilated's raw "requires ... same dtypes"
    assert y.dtype == ref.dtype == jnp.float32
    close(y, ref)


def test_conv_kernel_larger_than_input_is_silently_empty():
    layer, dilated, padded, same = build(
        lambda: (
            nn.Conv(5, 2, 3, key=K),
            nn.Conv((2, 3), 2, 3, key=K, dilation=(1, 2)),
            nn.Conv(5, 2, 3, key=K, padding=1),
            nn.Conv(5, 2, 3, key=K, padding="SAME"),
        )
    )
    x = np.ones((1, 3, 2), np.float32)
    # Was: an output of shape (1, 0, 3), without a word.
    with pytest.raises(ValueError, match=r"kernel size 5 .*axis 0 of size 3 with padding \(0, 0\)"):
        layer(x)
    with pytest.raises(ValueError, match=r"kernel size 3 \(dilated to 5\).*axis 1 of size 4"):
        dilated(np.ones((4, 4, 2), np.float32))
    # Eagerly and when traced alike: the shapes are static.
    with pytest.raises(ValueError, match="kernel size 5"):
        jax.eval_shape(layer, x)
    # Padding that makes room, and "SAME", are fine.
    assert jax.eval_shape(padded, x).shape == (1, 1, 3)
    assert jax.eval_shape(same, x).shape == (1, 3, 3)


def test_conv_numpy_int_sizes_are_refused_with_an_unclear_error():
    i = np.int64
    layer, pairs = build(
        lambda: (
            nn.Conv(i(3), i(2), i(3), key=K, stride=i(2), dilation=i(1), padding=i(1)),
            nn.Conv((i(2), 3), 2, 3, key=K, stride=(i(1), 2), padding=((i(1), 0), (0, i(2)))),
        )
    )
    assert layer.kernel_size == (3,) and layer.stride == (2,) and layer.dilation == (1,)
    assert layer.padding == ((1, 1),) and layer.weight.shape == (3, 2, 3)
    assert pairs.kernel_size == (2, 3) and pairs.padding == ((1, 0), (0, 2))
    assert all(type(v) is int for v in (*layer.kernel_size, *layer.stride, *pairs.padding[1]))
    # Floats are still refused, naming the argument.
    with pytest.raises(TypeError, match="stride"):
        nn.Conv(3, 2, 3, key=K, stride=2.0)
    with pytest.raises(ValueError, match="padding"):
        nn.Conv(3, 2, 3, key=K, padding=((1.5, 0),))
    assert len(datasets.batches(np.zeros((10, 2)), np.arange(10), i(5))) == 2


# --- bad arguments: every error names the argument ----------------------------------

BAD_ARGS = {
    "dense-in-zero": (lambda: nn.Dense(0, 3, key=K), ValueError, "in_features"),
    "dense-out-negative": (lambda: nn.Dense(2, -1, key=K), ValueError, "out_features"),
    "dense-float-size": (lambda: nn.Dense(2.0, 3, key=K), TypeError, "in_features"),
    "dense-int-key": (lambda: nn.Dense(2, 3, key=0), TypeError, "key must be a jax.random key"),
    "dense-batched-key": (
        lambda: nn.Dense(2, 3, key=jax.random.split(K, 2)),
        ValueError,
        "single key",
    ),
    "embedding-zero": (lambda: nn.Embedding(0, 3, key=K), ValueError, "vocab_size"),
    "embedding-bool": (lambda: nn.Embedding(3, True, key=K), TypeError, "features"),
    "layernorm-zero": (lambda: nn.LayerNorm(0), ValueError, "features"),
    "batchnorm-negative": (lambda: nn.BatchNorm(-2), ValueError, "features"),
    "batchnorm-momentum": (lambda: nn.BatchNorm(3, momentum=1.5), ValueError, "momentum"),
    "batchnorm-momentum-str": (lambda: nn.BatchNorm(3, momentum="0.1"), TypeError, "momentum"),
    "conv-kernel-zero": (lambda: nn.Conv(0, 2, 3, key=K), ValueError, "kernel_size"),
    "conv-in-zero": (lambda: nn.Conv(3, 0, 3, key=K), ValueError, "in_channels"),
    "conv-out-zero": (lambda: nn.Conv(3, 2, 0, key=K), ValueError, "out_channels"),
    "conv-stride-zero": (lambda: nn.Conv(3, 2, 3, key=K, stride=0), ValueError, "stride"),
    "conv-dilation-len": (lambda: nn.Conv(3, 2, 3, key=K, dilation=(1, 1)), ValueError, "dilation"),
    "conv-stride-len": (lambda: nn.Conv((3, 3), 2, 3, key=K, stride=(1,)), ValueError, "stride"),
    "conv-3d": (lambda: nn.Conv((3, 3, 3), 2, 3, key=K), ValueError, "1-D and 2-D"),
    "conv-pad-lower": (lambda: nn.Conv(3, 2, 3, key=K, padding="same"), ValueError, "padding"),
    "conv-pad-negative": (lambda: nn.Conv(3, 2, 3, key=K, padding=-1), ValueError, "padding"),
    "conv-pad-pairs-len": (
        lambda: nn.Conv(3, 2, 3, key=K, padding=((1, 1), (1, 1))),
        ValueError,
        "padding",
    ),
    "conv-groups": (lambda: nn.Conv(3, 2, 2, key=K, groups=2), TypeError, "groups"),
    "conv-str-key": (lambda: nn.Conv(3, 2, 3, key="k"), TypeError, "key"),
    "rnn-in-zero": (lambda: nn.RNNCell(0, 3, key=K), ValueError, "in_features"),
    "gru-hidden-zero": (lambda: nn.GRUCell(2, 0, key=K), ValueError, "hidden"),
    "lstm-int-key": (lambda: nn.LSTMCell(2, 3, key=1), TypeError, "key"),
    "dropout-one": (lambda: nn.Dropout(1.0), ValueError, "rate"),
    "dropout-negative": (lambda: nn.Dropout(-0.1), ValueError, "rate"),
    "dropout-bool": (lambda: nn.Dropout(True), TypeError, "rate"),
    "chain-not-callable": (lambda: nn.Chain(nn.Dense(2, 2, key=K), 3), TypeError, "layer 1"),
    "recurrence-not-callable": (lambda: nn.Recurrence(3), TypeError, "cell"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_constructor_arguments_name_the_argument(case):
    make, exc, match = BAD_ARGS[case]
    with pytest.raises(exc, match=match):
        make()


def test_bad_call_arguments_give_clear_errors():
    dense, dense1, conv, lstm, emb, bn = build(
        lambda: (
            nn.Dense(3, 2, key=K),
            nn.Dense(1, 2, key=K),
            nn.Conv(3, 2, 2, key=K),
            nn.LSTMCell(2, 3, key=K),
            nn.Embedding(5, 2, key=K),
            nn.BatchNorm(3),
        )
    )
    z = np.zeros
    cases = [
        (lambda: dense(z((2, 4))), ValueError, r"Dense\(3 => 2\).*3 features.*\(2, 4\)"),
        (lambda: dense1(z(())), ValueError, r"got shape \(\)"),
        (lambda: conv(z((1, 1, 5, 2))), ValueError, r"1 spatial axes.*\(1, 1, 5, 2\)"),
        (lambda: lstm(z(3), z(2)), TypeError, r"pair \(h, c\)"),
        (lambda: lstm((z(4), z(3)), z(2)), ValueError, "initial_state"),
        (lambda: emb(jnp.array([1.0])), TypeError, "integer indices"),
        (lambda: emb(jnp.array([0, 5])), IndexError, "index 5 is out of range"),
        (lambda: emb(jnp.array([-1])), IndexError, "index -1 is out of range"),
        (lambda: nn.Dropout(0.5)(z(3)), ValueError, "needs a PRNG key"),
        (lambda: nn.with_batch_stats(bn, "bn", z((2, 3))), TypeError, "fn must be"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_dense_non_callable_activation_is_accepted_until_the_call():
    # Refused at construction, as every layer that takes an activation does.
    for make in (
        lambda: nn.Dense(2, 3, "relu", key=K),
        lambda: nn.Conv(3, 2, 3, "relu", key=K),
        lambda: nn.RNNCell(2, 3, "relu", key=K),
        lambda: nn.RNNCell(2, 3, None, key=K),
    ):
        with pytest.raises(TypeError, match=r"activation must be a function.*jax\.nn\.relu"):
            make()


def test_layernorm_integer_dtype_gives_untrainable_parameters():
    for make in (
        lambda: nn.LayerNorm(3, dtype=jnp.int32),
        lambda: nn.BatchNorm(3, dtype=jnp.bool_),
        lambda: nn.Dense(2, 3, key=K, dtype=jnp.int8),
        lambda: nn.Embedding(4, 3, key=K, dtype="not a dtype"),
    ):
        with pytest.raises(TypeError, match=r"dtype must be a floating-point (or complex )?dtype"):
            make()
    # Complex parameters stay allowed where they were (Dense, Conv, Embedding, the cells).
    dense = jax.eval_shape(lambda: nn.Dense(2, 3, key=K, dtype=jnp.complex64))
    assert dense.weight.dtype == jnp.complex64


def test_norm_layers_accept_a_negative_eps():
    # Was: nn.LayerNorm(3, eps=-1.0)(jnp.ones(3)) all NaN, without a word.
    for layer in (nn.LayerNorm, nn.BatchNorm):
        for eps in (-1.0, 0.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="eps must be a positive number"):
                layer(3, eps=eps)
        with pytest.raises(TypeError, match="eps must be a positive number"):
            layer(3, eps="1e-5")


# --- LayerNorm / BatchNorm ---------------------------------------------------------


def test_layernorm_matches_flax_any_rank_empty_and_gradient():
    layer = build(lambda: perturbed(nn.LayerNorm(6, eps=1e-3), ("scale", "bias")))
    xs = [rnd(5, *shape, scale=3.0, offset=1.0) for shape in [(6,), (0, 6), (3, 2, 6)]]
    check(layer, ("scale", "bias"), flax_layernorm(1e-3), xs, atol=1e-4)


@pytest.mark.parametrize("which", ["layernorm", "batchnorm"])
def test_norm_statistics_of_bf16_input_are_rounded_to_bf16(which):
    x = np.asarray(jnp.asarray(rnd(6, 4, 64, offset=100.0), jnp.bfloat16))
    xr = x.astype(np.float64)
    if which == "batchnorm":
        x, xr = x.T, xr.T
        y, y16 = build(lambda: (nn.BatchNorm(4)(x), nn.BatchNorm(4, dtype=jnp.bfloat16)(x)))
        ref = (xr - xr.mean(0)) / np.sqrt(xr.var(0) + 1e-5)
    else:
        y, y16 = build(lambda: (nn.LayerNorm(64)(x), nn.LayerNorm(64, dtype=jnp.bfloat16)(x)))
        ref = (xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + 1e-5)
    assert np.abs(np.asarray(y, np.float64) - ref).max() < 1e-2  # flax.linen: 2.5e-4
    # The output dtype is the input's promoted with the parameters', as in flax.linen.
    assert y.dtype == jnp.float32 and y16.dtype == jnp.bfloat16
    assert np.abs(np.asarray(y16, np.float64) - ref).max() < 2e-2  # bf16 rounding of |y| < 3


def test_batchnorm_training_running_stats_and_testmode_match_flax_momentum_convention():
    # treegrad's momentum m moves the running stats by m towards the batch's
    # (PyTorch's convention), which is flax's momentum 1 - m.
    bn = build(lambda: perturbed(nn.BatchNorm(3, momentum=0.25, eps=1e-3), ("scale", "bias")))
    xs = [rnd(seed, 4, 5, 3, scale=2.0, offset=seed) for seed in (1, 2, 3)]  # NWC
    x_test = rnd(9, 7, 3)

    def run(bn):
        a = arrays(bn, ("scale", "bias"))
        stats = (bn.running_mean, bn.running_var)
        out = []
        for x in xs:
            y, bn = nn.with_batch_stats(bn, bn, x)
            y_ref, stats = flax_batchnorm(a, stats, x, 0.25, eps=1e-3)
            out.append(((y, bn.running_mean, bn.running_var), (y_ref, *stats)))
        y_ref = flax_batchnorm(a, stats, x_test, 0.25, eps=1e-3, train=False)[0]
        out.append(((nn.testmode(bn)(x_test),), (y_ref,)))
        # Test mode records nothing; back in train mode it uses the batch again.
        _, same = nn.with_batch_stats(bn, nn.testmode(bn), x_test)
        out.append(((same.running_mean, same.running_var), (bn.running_mean, bn.running_var)))
        y_ref = flax_batchnorm(a, stats, x_test, 0.25, eps=1e-3)[0]
        out.append(((nn.trainmode(nn.testmode(bn))(x_test),), (y_ref,)))
        return out

    for got, want in compiled(run, bn):
        for u, v in zip(got, want, strict=True):
            close(u, v, atol=1e-4)


def test_batchnorm_gradient_in_training_mode_matches_flax():
    bn = build(lambda: perturbed(nn.BatchNorm(3), ("scale", "bias")))
    stats = (bn.running_mean, bn.running_var)

    def ref(a, v):
        return flax_batchnorm(a, stats, v, 0.1)[0]

    check(bn, ("scale", "bias"), ref, [rnd(4, 6, 3, scale=2.0), rnd(5, 2, 3, 3)], atol=1e-4)


def test_batchnorm_running_stats_are_data_not_parameters_in_params_repr_and_train():
    model = build(lambda: nn.Chain(nn.Dense(2, 3, key=K), nn.BatchNorm(3)))
    assert list(tg.params(model).named()) == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.scale",
        "layers.1.bias",
    ]
    assert repr(model).splitlines()[0] == "Chain  # 15 parameters"
    data = [(rnd(i, 8, 2), rnd(10 + i, 8, 3)) for i in range(2)]
    state = tg.setup(optax.sgd(0.1), model)
    _, new, _ = tg.train(lambda m, x, y: tg.losses.mse(m(x), y), model, data, state)
    close(new[1].running_mean, np.zeros(3), 0, 0)
    close(new[1].running_var, np.ones(3), 0, 0)
    assert not np.allclose(new[1].scale, 1.0)


def test_batchnorm_training_on_one_example_silently_returns_the_bias():
    # Was: [0., 0., 0.] (the bias), and the running variance pulled towards 0.
    bn = nn.BatchNorm(3)
    with pytest.raises(ValueError, match=r"one example of shape \(3,\), without a batch axis"):
        bn(np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="without a batch axis"):
        jax.vmap(bn)(np.ones((4, 3), np.float32))
    # A batch of one value per feature too, as PyTorch refuses it.
    with pytest.raises(ValueError, match=r"more than one value per feature.*\(1, 1, 3\)"):
        bn(np.ones((1, 1, 3), np.float32))
    # Test mode (the running statistics) takes one example.
    assert jax.eval_shape(nn.testmode(bn), np.ones(3, np.float32)).shape == (3,)


def test_batchnorm_empty_batch_poisons_the_running_statistics():
    # An empty batch gives an empty output and leaves the running statistics as they
    # were (it has no statistics); it was: [nan, nan, nan].
    bn = build(lambda: perturbed(nn.BatchNorm(3), ("running_mean", "running_var")))
    y, bn2 = nn.with_batch_stats(bn, bn, np.zeros((0, 3), np.float32))
    assert y.shape == (0, 3)
    close(bn2.running_mean, bn.running_mean, 0, 0)
    close(bn2.running_var, bn.running_var, 0, 0)


def test_with_batch_stats_drops_all_but_the_last_call_of_a_shared_batchnorm():
    bn = nn.BatchNorm(2, momentum=0.5)
    x1, x2 = np.array([[1.0, 2.0], [3.0, 6.0]]), np.array([[10.0, 0.0], [20.0, 0.0]])

    def run(bn):
        _, new = nn.with_batch_stats(bn, lambda: (bn(x1), bn(x2)))
        # flax.linen, the same layer called twice in one apply:
        stats = (bn.running_mean, bn.running_var)
        for x in (x1, x2):
            stats = flax_batchnorm(arrays(bn, ("scale", "bias")), stats, x, 0.5)[1]
        return (new.running_mean, new.running_var), stats

    new, stats = compiled(run, bn)
    # As flax and PyTorch do: one momentum step per call, in order (it was: only the last).
    r1 = 0.5 * 0.0 + 0.5 * x1.mean(0)
    v1 = 0.5 * 1.0 + 0.5 * x1.var(0)
    close(new[0], 0.5 * r1 + 0.5 * x2.mean(0))
    close(new[1], 0.5 * v1 + 0.5 * x2.var(0))
    close(new[0], stats[0])
    close(new[1], stats[1])


def test_with_batch_stats_unties_a_shared_batchnorm():
    bn = nn.BatchNorm(2)
    model = nn.Chain(bn, bn)
    switched = nn.testmode(model)
    assert switched[0] is switched[1]
    x = np.array([[1.0, 2.0], [3.0, 6.0]])
    _, new = nn.with_batch_stats(model, model, x)
    assert new[0] is new[1]
    # One layer run twice (on x, then on its own output): two momentum steps.
    h = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5)
    close(new[0].running_mean, 0.9 * (0.1 * x.mean(0)) + 0.1 * h.mean(0), atol=1e-6)


# --- Embedding ----------------------------------------------------------------------


def flax_embed(a, i):
    return fl.Embed(*a["weight"].shape).apply({"params": {"embedding": a["weight"]}}, i)


def test_embedding_matches_flax_for_integer_dtypes_index_ranks_and_gradient():
    emb = build(lambda: nn.Embedding(7, 3, key=K))
    idx = [
        jnp.asarray(i, dt)
        for dt in (jnp.int32, jnp.uint8, jnp.int16)
        for i in ([[0, 6], [3, 3]], 4, np.zeros((0,), int), [1, 1, 5])
    ]
    ws = [rnd(1, *i.shape, 3) for i in idx]

    def run(m, a):
        out = []
        for i, w in zip(idx, ws, strict=True):
            g = want = m.weight  # gradients (repeated indices add up) for int32 indices
            if i.dtype == jnp.int32 and i.size:
                g = tg.gradient(lambda e, i=i, w=w: jnp.sum(e(i) * w), m)[0].weight
                want = jax.grad(lambda b, i=i, w=w: jnp.sum(flax_embed(b, i) * w))(a)["weight"]
            out.append((m(i), flax_embed(a, i), g, want))
        return out

    for i, (y, y_ref, g, want) in zip(idx, compiled(run, emb, {"weight": emb.weight}), strict=True):
        assert y.shape == (*i.shape, 3)
        close(y, y_ref, 0, 0)
        close(g, want, 1e-6, 1e-6)
    close(emb(idx[0]), np.asarray(emb.weight)[np.asarray(idx[0])], 0, 0)  # eagerly too


def test_embedding_traced_negative_index_wraps_to_the_last_row():
    emb = build(lambda: nn.Embedding(5, 2, key=K))
    y = jax.jit(lambda m, i: m(i))(emb, jnp.array([-1, 5, -5, 4, 0]))
    assert np.isnan(np.asarray(y[:3])).all()  # -1 and -5 were rows 4 and 0; 5 a NaN row
    close(y[3:], np.asarray(emb.weight)[[4, 0]], 0, 0)


# --- Dropout ------------------------------------------------------------------------


def test_dropout_matches_equinox_mask_for_the_same_key_and_gradient():
    x = rnd(3, 6, 50) + 2.0
    k, k2 = jax.random.key(11), jax.random.key(12)

    def run():
        out = []
        for rate in (0.3, 0.9):
            d, ref = nn.Dropout(rate), eqx.nn.Dropout(rate)
            (g,) = tg.gradient(lambda v, d=d: jnp.sum(d(v, key=k) ** 2), x)
            g_ref = jax.grad(lambda v, ref=ref: jnp.sum(ref(v, key=k) ** 2))(x)
            out.append((d(x, key=k), ref(x, key=k), g, g_ref))
        return out, nn.Dropout(0.5)(x, key=k2), nn.Dropout(0.5)(x, key=k)

    out, other, again = build(run)
    for y, y_ref, g, g_ref in out:
        close(y, y_ref, 1e-6, 1e-6)
        close(g, g_ref, 1e-5, 1e-5)
    # A different key gives a different mask; the same key the same one (keys are explicit).
    assert not np.array_equal(other == 0, again == 0)
    # Rate 0 and test mode are the identity, and need no key; dtype is kept.
    xb = np.asarray(x, jnp.bfloat16)
    assert nn.Dropout(0.0)(xb) is xb and nn.testmode(nn.Dropout(0.5))(xb) is xb
    assert jax.eval_shape(lambda v: nn.Dropout(0.5)(v, key=k), xb).dtype == jnp.bfloat16


def test_chain_splits_the_key_among_nested_dropouts_in_order():
    chain = nn.Chain(nn.Dropout(0.5), jnp.tanh, nn.Chain(nn.Dropout(0.5)))
    x = np.full((200,), 0.5, np.float32)
    k = jax.random.key(4)

    def run():
        k1, s1 = jax.random.split(k)
        _, s2 = jax.random.split(k1)
        _, s2_inner = jax.random.split(s2)
        masks = jax.random.bernoulli(s1, 0.5, x.shape), jax.random.bernoulli(s2_inner, 0.5, x.shape)
        return chain(x, key=k), masks

    y, (m1, m2) = build(run)
    ref = np.where(m2, np.tanh(np.where(m1, 1.0, 0.0)) / 0.5, 0.0)
    close(y, ref, 1e-6, 1e-6)
    assert not np.array_equal(m1, m2)
    close(build(lambda: nn.testmode(chain)(x)), np.tanh(0.5) * np.ones(200), 1e-6, 1e-6)


# --- Chain, __trainable__, repr, eval_shape, vmap -------------------------------------


def test_chain_indexing_slicing_nesting_repr_and_counts_agree_with_params():
    d1, d2 = build(
        lambda: (nn.Dense(2, 3, key=K), nn.Dense(3, 1, key=jax.random.key(1), use_bias=False))
    )
    inner = nn.Chain(nn.LayerNorm(3), jax.nn.relu)
    chain = nn.Chain(d1, inner, d2)
    assert chain[-1] is d2 and chain[1][0] is inner.layers[0] and len(chain[::2]) == 2
    assert chain[np.int64(0)] is d1
    assert [type(x).__name__ for x in chain] == ["Dense", "Chain", "Dense"]
    with pytest.raises(IndexError):
        chain[3]
    x = rnd(1, 4, 2)
    h = np.asarray(x) @ np.asarray(d1.weight).T + np.asarray(d1.bias)
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    y, y2 = tg.jit(lambda c: (c(x), c[:2](x)))(chain)  # relu: not an array, so tg.jit
    close(y, np.maximum(h, 0) @ np.asarray(d2.weight).T, atol=1e-5)
    close(y2, np.maximum(h, 0), atol=1e-5)
    n = sum(v.size for v in tg.params(chain).named().values())
    assert n == 6 + 3 + 6 + 3
    assert repr(chain).splitlines()[0] == f"Chain  # {n} parameters"
    assert str(chain).startswith("Chain(Dense(2 => 3), Chain(LayerNorm(3), ")


def test_chain_with_a_function_layer_fails_in_jax_eval_shape():
    like = jax.eval_shape(lambda k: nn.Chain(nn.Dense(2, 3, key=k), jax.nn.relu), K)
    assert like[0].weight.shape == (3, 2) and like[1] is jax.nn.relu
    # The function is static data: no leaf, and jax.jit can return the chain.
    chain = build(lambda: nn.Chain(nn.Dense(2, 3, key=K), jnp.tanh, nn.Chain(jax.nn.relu)))
    assert len(jax.tree_util.tree_leaves(chain)) == 2
    assert chain[1] is jnp.tanh and list(chain)[1] is jnp.tanh and chain[2][0] is jax.nn.relu
    assert str(chain) == "Chain(Dense(2 => 3), tanh, Chain(relu))"
    x = nrnd(1, 4, 2)
    ref = np.maximum(np.tanh(x @ np.asarray(chain[0].weight).T), 0)
    close(build(lambda: chain(x)), ref, 1e-6, 1e-6)


def test_trainable_attributes_of_every_layer_are_what_params_collects():
    want = [
        (lambda: nn.Dense(2, 3, key=K), ["weight", "bias"]),
        (lambda: nn.Dense(2, 3, key=K, use_bias=False), ["weight"]),
        (lambda: nn.Conv(3, 2, 2, key=K), ["weight", "bias"]),
        (lambda: nn.Embedding(4, 2, key=K), ["weight"]),
        (lambda: nn.LayerNorm(3), ["scale", "bias"]),
        (lambda: nn.LayerNorm(3, affine=False), []),
        (lambda: nn.BatchNorm(3), ["scale", "bias"]),
        (lambda: nn.RNNCell(2, 3, key=K), ["Wi", "Wh", "b"]),
        (lambda: nn.LSTMCell(2, 3, key=K), ["Wi", "Wh", "b"]),
        (lambda: nn.GRUCell(2, 3, key=K), ["Wi", "Wh", "bi", "bh"]),
        (
            lambda: nn.Recurrence(nn.GRUCell(2, 3, key=K)),
            ["cell.Wi", "cell.Wh", "cell.bi", "cell.bh"],
        ),
    ]
    layers = build(lambda: [make() for make, _ in want])
    for layer, (_, names) in zip(layers, want, strict=True):
        n = 0
        if names:
            assert list(tg.params(layer).named()) == names, layer
            n = sum(v.size for v in tg.params(layer).named().values())
        assert repr(layer).splitlines()[0].endswith(f"# {n} parameters"), layer


def test_eval_shape_builds_and_runs_every_layer_without_computing():
    sds = jax.ShapeDtypeStruct
    cases = [
        (lambda k: nn.Dense(3, 4, key=k), sds((2, 5, 3), jnp.float32), (2, 5, 4)),
        (
            lambda k: nn.Conv((3, 3), 2, 4, key=k, padding="SAME"),
            sds((6, 6, 2), jnp.float32),
            (6, 6, 4),
        ),
        (lambda k: nn.Embedding(9, 4, key=k), sds((2, 3), jnp.int32), (2, 3, 4)),
        (
            lambda k: nn.Chain(nn.Dense(3, 3, key=k), nn.LayerNorm(3), nn.BatchNorm(3)),
            sds((4, 3), jnp.float32),
            (4, 3),
        ),
    ]
    for make, x, out in cases:
        layer = jax.eval_shape(make, K)
        assert jax.eval_shape(lambda m, v: m(v), layer, x).shape == out
    cell = jax.eval_shape(lambda k: nn.LSTMCell(2, 3, key=k), K)
    (h, c), ys = jax.eval_shape(
        lambda m, v: nn.Recurrence(m)(m.initial_state((4,)), v),
        cell,
        sds((5, 4, 2), jnp.float32),
    )
    assert h.shape == c.shape == (4, 3) and ys.shape == (5, 4, 3)


def test_vmap_over_an_ensemble_of_layers_equals_a_loop_over_members():
    x = rnd(2, 3, 5, 2)

    def member(k):
        return nn.Chain(nn.Dense(2, 4, jnp.tanh, key=k), nn.LayerNorm(4))

    def run():
        keys = jax.random.split(K, 3)
        ens = jax.vmap(member)(keys)
        loop = jnp.stack([member(keys[i])(x[i]) for i in range(3)])
        layer = nn.Dense(2, 4, key=K)
        return ens, jax.vmap(lambda m, v: m(v))(ens, x), loop, jax.vmap(layer)(x[0]), layer(x[0])

    ens, y, loop, y1, y1_ref = build(run)
    assert ens[0].weight.shape == (3, 4, 2) and ens[0].in_features == 2
    close(y, loop, atol=1e-5)
    # And over the data only, with one layer: the same as the batched call.
    close(y1, y1_ref, 1e-6, 1e-6)


# --- recurrent cells and Recurrence --------------------------------------------------


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
@pytest.mark.parametrize("name", sorted(CELLS))
def test_cells_match_flax_cells_batched_unbatched_integer_input_and_gradient(name):
    make, names, ref_step = CELLS[name]
    cell = build(lambda: perturbed(make(3, 4, key=K), names))
    cases = [(nonzero_state(cell, b), rnd(8, *b, 3)) for b in ((), (2, 5))]
    # An integer input is promoted, as in flax.
    cases.append((nonzero_state(cell, (1,)), jnp.asarray([[1, 0, 2]], jnp.int32)))
    s0, x0 = cases[1]

    def loss_of(state, y):
        return sum(jnp.sum(jnp.sin(v) * (1 + i)) for i, v in enumerate(jax.tree.leaves((state, y))))

    def run(c, a):
        (g,) = tg.gradient(lambda m: loss_of(*m(s0, x0)), c)
        want = jax.grad(lambda b: loss_of(*ref_step(b, s0, x0)))(a)
        return [(c(s, x), ref_step(a, s, x)) for s, x in cases], arrays(g, names), want

    outs, g, want = compiled(run, cell, arrays(cell, names))
    for got, ref in outs:
        assert jax.tree.structure(got) == jax.tree.structure(ref)
        jax.tree.map(lambda u, v: close(u, v, atol=1e-5), got, ref)
    for n in names:
        close(g[n], want[n], rtol=1e-4, atol=1e-5)


@functools.partial(jax.jit, static_argnames=("ref_step", "hidden"))
def flax_sequence(ref_step, a, state, xs, hidden):
    ys = []
    for t in range(xs.shape[0]):
        state, y = ref_step(a, state, xs[t])
        ys.append(y)
    batch = xs.shape[1:-1]
    return state, (jnp.stack(ys) if ys else jnp.zeros((0, *batch, hidden)))


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_recurrence_of_length_0_1_3_matches_a_loop_of_flax_cells():
    rnns = build(
        lambda: [
            nn.Recurrence(perturbed(make(2, 3, key=K), names)) for make, names, _ in CELLS.values()
        ]
    )
    states = [nonzero_state(rnn.cell, (4,)) for rnn in rnns]
    seqs = [rnd(9 + n, n, 4, 2) for n in (0, 1, 3)]

    def run(rnns):
        out = []
        for rnn, state, (_, names, ref_step) in zip(rnns, states, CELLS.values(), strict=True):
            a = arrays(rnn.cell, names)
            for xs in seqs:
                out.append((rnn(state, xs), flax_sequence(ref_step, a, state, xs, 3)))
        return out

    outs_list = compiled(run, rnns)
    outs = iter(outs_list)
    for state in states:
        for xs in seqs:
            (s, ys), (s_ref, ys_ref) = next(outs)
            assert ys.shape == (xs.shape[0], 4, 3)
            close(ys, ys_ref, atol=1e-5)
            jax.tree.map(lambda u, v: close(u, v, atol=1e-5), s, s_ref)
            if xs.shape[0] == 0:  # the initial state comes back
                jax.tree.map(lambda u, v: close(u, v, 0, 0), s, state)
    # Eagerly too, as users call it (rnns[0] is the LSTM; outs[2] its length-3 run).
    close(rnns[0](states[0], seqs[-1])[1], outs_list[2][0][1], 1e-6, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CELLS))
def test_recurrence_gradient_matches_jax_grad_of_a_loop_of_flax_cells(name):
    make, names, ref_step = CELLS[name]
    rnn = build(lambda: nn.Recurrence(perturbed(make(2, 3, key=K), names)))
    state = nonzero_state(rnn.cell, (4,))
    xs = rnd(9, 5, 4, 2)
    w = rnd(3, 5, 4, 3)

    def loss_of(final, outs):
        return jnp.sum(outs * w) + sum(jnp.sum(jnp.cos(f)) for f in jax.tree.leaves(final))

    def run(m, a):
        (g,) = tg.gradient(lambda r: loss_of(*r(state, xs)), m)
        want = jax.grad(lambda p: loss_of(*flax_sequence(ref_step, p, state, xs, 3)))(a)
        return arrays(g.cell, names), want

    g, want = compiled(run, rnn, arrays(rnn.cell, names))
    for n in names:
        close(g[n], want[n], rtol=1e-4, atol=1e-5)


def test_lstm_cell_forget_bias_and_initial_state_shapes():
    def make():
        cell = nn.LSTMCell(2, 3, key=K)
        return cell, cell.initial_state((2, 5)), nn.GRUCell(2, 3, key=K).initial_state()

    cell, (h, c), h_gru = build(make)
    close(cell.b, [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0], 0, 0)
    assert h.shape == c.shape == (2, 5, 3) and not np.asarray(h).any() and not np.asarray(c).any()
    assert h_gru.shape == (3,) and h_gru.dtype == jnp.float32


def test_recurrence_unbatched_state_with_batched_inputs_gives_a_raw_scan_error():
    rnn = build(lambda: nn.Recurrence(nn.GRUCell(2, 3, key=K)))
    # Was: lax.scan's raw "carry input and carry output must have equal types".
    with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(5, 3\).*initial_state\(\(5,\)\)"):
        rnn(np.zeros(3, np.float32), np.ones((4, 5, 2), np.float32))  # h of shape (3,), x (5, 2)
    with pytest.raises(ValueError, match=r"dtype bfloat16.*dtype float32.*initial_state\(\(\)\)"):
        rnn(np.zeros(3, jnp.bfloat16), np.ones((4, 2), np.float32))


def test_recurrence_with_a_list_state_that_the_cell_accepts_fails():
    rnn = build(lambda: nn.Recurrence(nn.LSTMCell(2, 3, key=K)))
    xs, h0 = rnd(1, 3, 2), np.zeros(3, np.float32)
    assert isinstance(jax.eval_shape(rnn.cell, [h0, h0], xs[0])[0], tuple)  # the cell takes a list
    # Taken as the tuple the cell returns (was: scan's "carry ... differ").
    ((h, c), ys), ((h_ref, c_ref), ys_ref) = build(lambda: (rnn([h0, h0], xs), rnn((h0, h0), xs)))
    close(ys, ys_ref, 0, 0)
    close(h, h_ref, 0, 0)
    close(c, c_ref, 0, 0)


def test_rnncell_low_precision_dtype_cannot_be_built():
    dtypes = (jnp.bfloat16, jnp.float16)
    cells = build(lambda: [nn.RNNCell(2, 3, key=K, dtype=dtype) for dtype in dtypes])
    for cell, dtype, tol in zip(cells, dtypes, (2e-2, 2e-3), strict=True):
        assert cell.Wh.dtype == cell.Wi.dtype == cell.b.dtype == dtype
        wh = np.asarray(cell.Wh, np.float64)
        close(wh @ wh.T, np.eye(3), 0, tol)  # orthogonal, to the dtype's precision


# --- tg.train -------------------------------------------------------------------------


def small_model():
    return build(
        lambda: nn.Chain(nn.Dense(3, 4, jnp.tanh, key=jax.random.key(1)), nn.Dense(4, 1, key=K))
    )


def mse_loss(m, x, y):
    return tg.losses.mse(m(x), y)


def small_data(n=3, seed=0):
    return [(rnd(seed + i, 6, 3), rnd(50 + seed + i, 6, 1)) for i in range(n)]


def flat(model):
    return [model[0].weight, model[0].bias, model[1].weight, model[1].bias]


def optax_run(model, batches, rule):
    """The independent reference: plain optax and jax.grad on a list of the arrays."""

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p[0].T + p[1]) @ p[2].T + p[3] - y) ** 2)

    def step(p, opt, x, y):
        v, g = jax.value_and_grad(loss)(p, x, y)
        u, opt = rule.update(g, opt, p)
        return optax.apply_updates(p, u), opt, v

    p = flat(model)
    opt, losses = rule.init(p), []
    step = jax.jit(step).lower(p, opt, *batches[0]).compile({"xla_backend_optimization_level": 0})
    for x, y in batches:
        p, opt, v = step(p, opt, x, y)
        losses.append(float(v))
    return p, losses


def test_train_epochs_with_a_generator_function_equal_plain_optax_and_no_bar_off_a_terminal(
    capsys,
):
    model, data, rule = small_model(), small_data(), optax.adam(0.05)
    state = tg.setup(rule, model)

    def stream():
        yield from data

    _, m, losses = tg.train(mse_loss, model, stream, state, epochs=3)
    p_ref, losses_ref = optax_run(model, data * 3, rule)
    close(losses, losses_ref, 1e-5, 1e-6)
    for u, v in zip(flat(m), p_ref, strict=True):
        close(u, v, 1e-5, 1e-6)
    assert capsys.readouterr().err == ""  # stderr is not a terminal under pytest: no bar
    tg.train(mse_loss, model, data, state, progress=True)
    assert "step" in capsys.readouterr().err


def test_train_data_that_runs_out_after_one_epoch_is_an_error_naming_the_epoch():
    model, data = small_model(), small_data()
    state = tg.setup(optax.sgd(0.1), model)

    class SharedIterator:  # re-iterable in form, but the same iterator every time
        def __init__(self):
            self.it = iter(data)

        def __iter__(self):
            return self.it

    with pytest.raises(ValueError, match=r"epoch 1 of data gave no batches \(epoch 0 gave 3\)"):
        tg.train(mse_loss, model, SharedIterator(), state, epochs=2)
    with pytest.raises(TypeError, match=r"iterator \(generator\).*epochs=2"):
        tg.train(mse_loss, model, (b for b in data), state, epochs=2)
    assert len(tg.train(mse_loss, model, (b for b in data), state, epochs=1)[2]) == 3
    _, same, losses = tg.train(mse_loss, model, data, state, epochs=0)
    assert losses == [] and all(u is v for u, v in zip(flat(same), flat(model), strict=True))
    for bad, exc in ((-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(exc, match="epochs must be a non-negative int"):
            tg.train(mse_loss, model, data, state, epochs=bad)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_train_nonfinite_loss_mid_epoch_returns_the_last_good_model_and_state():
    model, data, rule = small_model(), small_data(), optax.adam(0.05)
    state = tg.setup(rule, model)
    x_bad = np.array(data[1][0])
    x_bad[2, 0] = np.nan
    calls = []

    def stream():
        calls.append(1)
        yield from (data if len(calls) == 1 else [data[0], (x_bad, data[1][1]), data[2]])

    with pytest.raises(tg.NonFiniteLossError, match=r"loss is nan at epoch 1, step 1") as info:
        tg.train(mse_loss, model, stream, state, epochs=3)
    e = info.value
    assert (e.epoch, e.step, len(calls)) == (1, 1, 2)  # epoch 2 never started
    p_ref, losses_ref = optax_run(model, data + data[:1], rule)
    close(e.losses, losses_ref, 1e-5, 1e-6)
    for u, v in zip(flat(e.model), p_ref, strict=True):
        close(u, v, 1e-5, 1e-6)
    # The state is the last good one too: resuming from it equals the uninterrupted run.
    _, resumed, _ = tg.train(mse_loss, e.model, data[1:2], e.state)
    p_ref, _ = optax_run(model, data + data[:2], rule)
    for u, v in zip(flat(resumed), p_ref, strict=True):
        close(u, v, 1e-5, 1e-6)


def test_datasets_split_fraction_out_of_range_is_silent():
    x, y = np.zeros((10, 2)), np.arange(10)
    # In [0, 1): -0.2 put 8 examples in the test set; 1 would leave no training set.
    for bad in (-0.2, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"test_fraction must be in \[0, 1\)"):
            datasets.split(x, y, test_fraction=bad)
    for bad in ("0.2", True, None):
        with pytest.raises(TypeError, match="test_fraction must be a number"):
            datasets.split(x, y, test_fraction=bad)
    (xtr, ytr), (xte, yte) = datasets.split(x, y, test_fraction=0)  # all for training
    assert len(xtr) == len(ytr) == 10 and len(xte) == len(yte) == 0
    assert sorted(ytr.tolist()) == list(range(10))
    with pytest.raises(ValueError, match="x has 10 examples but y has 9"):
        datasets.split(x, y[:9])
