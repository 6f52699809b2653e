"""Every public function given bad input: the exception type and the words that matter.

One row per call. Each regex asserts what the user needs: the argument or path
that is wrong and, where there is one, the fix. Rows whose fix lies in another
owner's module are marked xfail(strict=True): they fail today, and the mark
comes off when the owner fixes the message.
"""

import functools
import operator
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import datasets, nn

from .helpers import MLP, mse


class Ctx:
    """What the rows call with, each built on first use (most rows need one or two)."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.x, self.y = jnp.ones((2, 4)), jnp.zeros((2, 1))
        self.vec = {"w": jnp.ones(3)}
        self.data = [(self.x, self.y)] * 2
        (tmp / "notes.txt").write_text("hello")
        np.save(tmp / "arr.npy", np.ones(3))
        (tmp / "empty").mkdir()
        (tmp / "afile").write_bytes(b"x")

    @functools.cached_property
    def model(self):
        return MLP(jax.random.key(0))

    @functools.cached_property
    def state(self):
        return tg.setup(optax.adam(1e-3), self.model)

    @functools.cached_property
    def hyper(self):
        return tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), self.model)

    @functools.cached_property
    def g(self):
        return tg.gradient(lambda m: mse(m, self.x, self.y), self.model)[0]

    @functools.cached_property
    def vec_state(self):
        return tg.setup(optax.sgd(0.1), self.vec)

    @functools.cached_property
    def ps(self):
        return tg.params(self.model)

    @functools.cached_property
    def grads(self):
        return tg.gradient(lambda: mse(self.model, self.x, self.y), self.ps)

    @functools.cached_property
    def ck(self):
        tg.save(self.tmp / "ck", self.model)
        return self.tmp / "ck"


@pytest.fixture
def c(tmp_path):
    return Ctx(tmp_path)


def _gradient_reading_a_deleted_array(c):
    b = jnp.ones(3)
    tg.gradient(lambda v: jnp.sum(v * b), jnp.ones(3))
    b.delete()
    tg.gradient(lambda v: jnp.sum(v * b), jnp.ones(3))


def _jit_of_a_donated_model(c):
    state = tg.setup(optax.sgd(0.1), c.model)
    tg.update(state, c.model, c.g, donate=True)  # c.model's arrays are donated
    tg.jit(lambda m: mse(m, c.x, c.y))(c.model)


def _gradient_then_replace(c):
    grads = tg.gradient(lambda: mse(c.model, c.x, c.y), c.ps)
    w = c.model.layers[0].weight
    c.model.layers[0].weight = w + 1  # the parameter is replaced after the gradients were taken
    return grads[c.model.layers[0].weight]


def _stale_update_(c):
    grads = tg.gradient(lambda: mse(c.model, c.x, c.y), c.ps)
    state = tg.setup(optax.sgd(0.1), c.ps)
    c.model.layers[0].weight = c.model.layers[0].weight + 0
    tg.update_(state, c.ps, grads)


def _captured_jax_mask(c):
    # (A numpy mask is read as a value and works: tests/test_numpy_values.py.)
    mask = jnp.array([True, False, True])
    return tg.gradient(lambda w: jnp.sum(w[mask]), jnp.ones(3))


def _captured_int(c):
    n = jnp.array(2)
    return tg.gradient(lambda w: jnp.sum(w[: int(n)]), jnp.ones(3))


def _deleted(c):
    x = jnp.ones(3)
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    if not x.is_deleted():
        pytest.skip("this backend does not donate")
    tg.save(c.tmp / "ck2", {"w": x})


def _once_only(c):
    class Loader:
        def __init__(self):
            self.it = iter(c.data)

        def __iter__(self):
            return (b for b in self.it)

    tg.train(mse, c.model, Loader(), c.state, epochs=2)


def _update_in_place_inside_jax_jit(c):
    state = tg.setup(optax.sgd(0.1), c.vec)
    jax.jit(lambda x: tg.update_(state, c.vec, {"w": x}) or x)(jnp.ones(3))


def _edit_leaf_view(c):
    c.hyper.layers[0].weight.state.hyperparams["learning_rate"] = 1.0


def _plain_object_in_a_list_argument(c):
    class Holder:
        w = jnp.ones(3)

    def upd(objs, x):
        objs[0].w = objs[0].w + x

    tg.jit(upd)([Holder()], jnp.ones(3))


def _loss_log_inside_tg_jit(c):
    losses = []

    @tg.jit
    def step(x):
        loss = jnp.sum(x**2)
        losses.append(loss)
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)
        step(c.x)


def _numpy_noise_inside_a_loss(c):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)
        tg.gradient(lambda x: jnp.sum(x * np.random.normal(size=x.shape)), c.x)


def _numpy_array_written_inside_a_loss(c):
    counts = np.zeros(2)

    def loss(x):
        counts[0] += 1.0
        return jnp.sum(x) * counts[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)
        tg.gradient(loss, c.x)


def _numpy_batch_beside_a_numpy_mask(c):
    mask = np.array([True, False, True])
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)
        for i in range(5):
            xb = np.full(3, float(i))
            tg.gradient(lambda w: jnp.sum(w[mask] * xb[mask]), jnp.ones(3))  # noqa: B023


def _next_batch_inside_a_loss(c):
    batches = iter([c.x, c.x * 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)
        tg.gradient(lambda x: jnp.sum(x * next(batches)), c.x)


def _update_params_of_variables(c):
    W, b = c.model.layers[0].weight, c.model.layers[0].bias
    ps = tg.Params([W, b])  # Flux's Params([W, b]): the loss reads the variables
    tg.update_(tg.setup(optax.sgd(0.1), ps), ps, tg.gradient(lambda: jnp.sum(c.x @ W.T + b), ps))
    tg.gradient(lambda: jnp.sum(c.x @ W.T + b), ps)  # W, b: the arrays the update replaced


def _dense_given_a_number(c):
    return nn.Dense(4, 2, key=jax.random.key(0))(1.0)


def row(name, call, exc, words, marks=()):
    return pytest.param(call, exc, words, id=name, marks=marks)


ROWS = [
    # ---- explicit mode
    row(
        "gradient-no-args",
        lambda c: tg.gradient(lambda: jnp.sum(c.x)),
        TypeError,
        r"tg\.params\(model\)",
    ),
    row(
        "gradient-params-among-arguments",
        lambda c: tg.gradient(lambda m, ps: mse(m, c.x, c.y), c.model, c.ps),
        TypeError,
        r"tg\.gradient: a tg\.Params is passed among 2 argument\(s\), so it would be an "
        r"explicit-mode argument, which has no gradient \(None\)",
    ),
    row(
        "gradient-grads-as-argument",
        lambda c: tg.gradient(lambda g: 0.0, tg.gradient(lambda: mse(c.model, c.x, c.y), c.ps)),
        TypeError,
        r"tg\.gradient: a tg\.Grads is passed as \(part of\) argument 0; .* Pass "
        r"grads\.to_tree\(model\) or grads\.named\(\)",
    ),
    row(
        "jit-returns-implicit-back",
        lambda c: tg.jit(lambda x: tg.pullback(lambda: mse(c.model, x, c.y), c.ps))(c.x),
        TypeError,
        r"tg\.jit: the function returns the backward function of an implicit-mode "
        r"tg\.pullback.* Call back\(dy\) inside the function",
    ),
    row(
        "gradient-not-a-function",
        lambda c: tg.gradient("loss", c.model),
        TypeError,
        r"tg\.gradient.*function.*str",
    ),
    row(
        "gradient-vector-loss",
        lambda c: tg.gradient(lambda m: m(c.x), c.model),
        TypeError,
        r"real scalar.*shape \(2, 1\).*tg\.jacobian",
    ),
    row(
        "gradient-complex-loss",
        lambda c: tg.gradient(lambda w: jnp.sum(w) * 1j, jnp.ones(2)),
        TypeError,
        r"real floating-point scalar.*complex64",
    ),
    row(
        "gradient-string-loss",
        lambda c: tg.gradient(lambda w: "low", jnp.ones(2)),
        TypeError,
        r"real scalar.*str",
    ),
    row(
        "withgradient-vector-loss",
        lambda c: tg.withgradient(lambda w: w * 2, jnp.ones(2)),
        TypeError,
        r"tg\.withgradient.*real scalar.*tg\.jacobian",
    ),
    row(
        "pullback-not-a-function",
        lambda c: tg.pullback(3, jnp.ones(2)),
        TypeError,
        r"tg\.pullback.*function.*int",
    ),
    row(
        "pullback-wrong-cotangent",
        lambda c: tg.pullback(lambda w: w * 2, jnp.ones(2))[1](jnp.ones(3)),
        ValueError,
        r"dy.*shape \(3,\).*\(2,\)",
    ),
    row(
        "jacobian-not-a-function",
        lambda c: tg.jacobian(None, jnp.ones(2)),
        TypeError,
        r"tg\.jacobian.*function.*NoneType",
    ),
    row(
        "hessian-vector-output",
        lambda c: tg.hessian(lambda w: w * 2, jnp.ones(2)),
        TypeError,
        r"tg\.hessian.*real scalar",
    ),
    row(
        "captured-jax-bool-mask",
        _captured_jax_mask,
        TypeError,
        r"captured.*traced.*static",
    ),
    row(
        "captured-int-of-array",
        _captured_int,
        TypeError,
        r"captured.*traced.*static",
    ),
    # ---- implicit mode: Params and Grads
    row("params-of-a-float", lambda c: tg.params(3.0), TypeError, r"tg\.params.*float"),
    row(
        "params-of-int-arrays",
        lambda c: tg.params({"n": jnp.arange(3)}),
        ValueError,
        r"no differentiable.*'n'.*int32",
    ),
    row(
        "params-of-empty-dict",
        lambda c: tg.params({}),
        ValueError,
        r"tg\.Params found no floating-point arrays",
    ),
    row(
        "grads-times-string",
        lambda c: c.grads * "a",
        TypeError,
        r"Grads.*number.*str",
    ),
    row(
        "grads-lookup-unregistered",
        lambda c: c.grads[jnp.ones(7)],
        KeyError,
        r"not a registered parameter",
    ),
    row(
        "grads-lookup-after-replace",
        _gradient_then_replace,
        KeyError,
        r"'layers\.0\.weight'.*may have been replaced.*since the gradients were taken",
    ),
    row(
        "grads-add-different-sets",
        lambda c: c.grads + tg.gradient(lambda: jnp.sum(c.vec["w"]), tg.params(c.vec)),
        ValueError,
        r"different",
    ),
    row(
        "grads-is-read-only",
        lambda c: operator.setitem(c.grads, c.model.layers[0].weight, 0),
        TypeError,
        r"read-only.*grads\.map",
    ),
    row(
        "grads-to-tree-other-model",
        lambda c: c.grads.to_tree(MLP(jax.random.key(1))),
        ValueError,
        r"to_tree.*none of.*registered parameters",
    ),
    # ---- compilation
    row("jit-not-a-function", lambda c: tg.jit(3), TypeError, r"tg\.jit expects a function"),
    # ---- optimiser
    row(
        "setup-rule-is-a-string",
        lambda c: tg.setup("adam", c.model),
        TypeError,
        r"tg\.setup expects an optax GradientTransformation.*optax\.adam",
    ),
    row(
        "update-state-and-model-swapped",
        lambda c: tg.update(c.model, c.state, c.g),
        TypeError,
        r"tg\.update: expected the optimiser state from tg\.setup.*tg\.update\(state, model",
    ),
    row(
        "update-gradient-1-tuple",
        lambda c: tg.update(c.state, c.model, (c.g,)),
        TypeError,
        r"1-tuple.*\(g,\) = tg\.gradient",
    ),
    row(
        "update-gradient-wrong-tree",
        lambda c: tg.update(c.state, c.model, {"weight": 1}),
        ValueError,
        r"does not match the model \(first difference at",
    ),
    row(
        "update-state-of-other-model",
        lambda c: tg.update(c.vec_state, c.model, c.g),
        ValueError,
        r"optimiser state.*does not match the model",
    ),
    row(
        "update-gradient-too-long",
        lambda c: tg.update(c.vec_state, c.vec, {"w": jnp.ones(4)}),
        ValueError,
        r"'w'.*\(4,\).*\(3,\)",
    ),
    row(
        "update-gradient-broadcasts",
        lambda c: tg.update(c.vec_state, c.vec, {"w": jnp.ones((3, 1))}),
        ValueError,
        r"'w'.*\(3, 1\).*\(3,\)",
    ),
    row(
        "update-gradient-string-leaf",
        lambda c: tg.update(c.vec_state, c.vec, {"w": "a"}),
        TypeError,
        r"'w'.*str",
    ),
    row(
        "update_-stale-grads",
        _stale_update_,
        ValueError,
        r"'layers\.0\.weight'.*taken before the parameters were replaced.*gradient",
    ),
    row(
        "adjust-unknown-hyperparameter",
        lambda c: tg.adjust(c.hyper, lr=0.1),
        TypeError,
        r"unknown hyperparameter.*'lr'.*learning_rate",
    ),
    row(
        "adjust-rule-without-hyperparameters",
        lambda c: tg.adjust(c.state, learning_rate=0.1),
        TypeError,
        r"no adjustable.*inject_hyperparams",
    ),
    row(
        "adjust-string-value",
        lambda c: tg.adjust(c.hyper, learning_rate="fast"),
        TypeError,
        r"learning_rate='fast' is a str.*number",
    ),
    row(
        "adjust_-not-a-state",
        lambda c: tg.adjust_(3, learning_rate=0.1),
        TypeError,
        r"tg\.adjust_ expects an optimiser state from tg\.setup.*int",
    ),
    row(
        "freeze_-not-a-state",
        lambda c: tg.freeze_(c.model),
        TypeError,
        r"tg\.freeze_ expects an optimiser state.*MLP",
    ),
    row(
        "thaw_-not-a-state",
        lambda c: tg.thaw_("x"),
        TypeError,
        r"tg\.thaw_ expects an optimiser state.*str",
    ),
    row(
        "destructure-rebuild-wrong-length",
        lambda c: tg.destructure(c.vec)[1](jnp.ones(5)),
        ValueError,
        r"rebuild expects a vector of shape \(3,\), got \(5,\)",
    ),
    # ---- training
    row(
        "train-data-none",
        lambda c: tg.train(mse, c.model, None, c.state),
        TypeError,
        r"tg\.train: data is None; pass the batches as a list",
    ),
    row(
        "train-data-one-array",
        lambda c: tg.train(mse, c.model, c.x, c.state),
        TypeError,
        r"data is a single array of shape \(2, 4\).*its rows.*list of tuples",
    ),
    row(
        "train-data-dict",
        lambda c: tg.train(mse, c.model, {"x": c.x}, c.state),
        TypeError,
        r"data is a dict; pass the batches",
    ),
    row(
        "train-data-not-iterable",
        lambda c: tg.train(mse, c.model, 5, c.state),
        TypeError,
        r"data is a int, which is not iterable; pass the batches",
    ),
    row(
        "train-generator-two-epochs",
        lambda c: tg.train(mse, c.model, (b for b in c.data), c.state, epochs=2),
        TypeError,
        r"data is an iterator \(generator\).*epochs=2.*pass a list.*lambda",
    ),
    row(
        "train-data-function-returns-int",
        lambda c: tg.train(mse, c.model, lambda: 3, c.state),
        TypeError,
        r"data\(\) returned a int, not an iterable of batches",
    ),
    row(
        "train-empty-data",
        lambda c: tg.train(mse, c.model, [], c.state),
        ValueError,
        r"epoch 0 of data gave no batches; pass the batches",
    ),
    row(
        "train-second-epoch-empty",
        _once_only,
        ValueError,
        r"epoch 1 of data gave no batches \(epoch 0 gave 2\)",
    ),
    row(
        "train-loss-not-callable",
        lambda c: tg.train("mse", c.model, c.data, c.state),
        TypeError,
        r"loss must be a function loss\(model, \*batch\).*got a str",
    ),
    row(
        "train-model-and-state-swapped",
        lambda c: tg.train(mse, c.state, c.data, c.model),
        TypeError,
        r"model is an optimiser state; the call is tg\.train\(loss, model, data, state\)",
    ),
    row(
        "train-raw-optax-state",
        lambda c: tg.train(mse, c.model, c.data, optax.adam(1e-3).init(c.model)),
        TypeError,
        r"state must be the optimiser state from tg\.setup\(rule, model\), got a tuple",
    ),
    row(
        "train-negative-epochs",
        lambda c: tg.train(mse, c.model, c.data, c.state, epochs=-1),
        ValueError,
        r"epochs must be a non-negative int, got -1",
    ),
    row(
        "train-float-epochs",
        lambda c: tg.train(mse, c.model, c.data, c.state, epochs=1.5),
        TypeError,
        r"epochs must be a non-negative int, got 1\.5",
    ),
    row(
        "train-callback-not-callable",
        lambda c: tg.train(mse, c.model, c.data, c.state, callbacks=[3]),
        TypeError,
        r"callbacks\[0\] is a int, not a function",
    ),
    # ---- checkpoints
    row(
        "save-over-a-file",
        lambda c: tg.save(c.tmp / "afile", c.model),
        FileExistsError,
        r"afile is a file, and a treegrad checkpoint is a folder\. Remove the file",
    ),
    row(
        "save-into-foreign-folder",
        lambda c: tg.save(c.tmp, c.model),
        FileExistsError,
        r"holding files that tg\.save did not write.*Save to a new path",
    ),
    row(
        "save-shape-dtype-structs",
        lambda c: tg.save(c.tmp / "s", jax.eval_shape(lambda: c.vec)),
        TypeError,
        r"'w' is a jax\.ShapeDtypeStruct, which holds no data",
    ),
    row(
        "save-inside-jit",
        lambda c: jax.jit(lambda w: tg.save(c.tmp / "j", {"w": w}))(jnp.ones(2)),
        TypeError,
        r"'w' is a traced array: tg\.save cannot run inside jax\.jit",
    ),
    row("save-deleted-array", _deleted, ValueError, r"'w' has been deleted \(donated"),
    row(
        "save-params",
        lambda c: tg.save(c.tmp / "p", tg.params(c.model)),
        TypeError,
        r"tg\.save: got a tg\.Params, .* Save the model it was built from, tg\.save\(path, model\)",
    ),
    row(
        "load-missing",
        lambda c: tg.load(c.tmp / "nope", c.model),
        FileNotFoundError,
        r"no checkpoint at .*nope",
    ),
    row(
        "load-text-file",
        lambda c: tg.load(c.tmp / "notes.txt", c.model),
        tg.CheckpointError,
        r"notes\.txt is not a valid or complete treegrad checkpoint",
    ),
    row(
        "load-npy-file",
        lambda c: tg.load(c.tmp / "arr.npy", c.model),
        tg.CheckpointError,
        r"arr\.npy is not a valid or complete treegrad checkpoint: it is a numpy \.npy file",
    ),
    row(
        "load-empty-folder",
        lambda c: tg.load(c.tmp / "empty", c.model),
        tg.CheckpointError,
        r"empty is not a valid or complete treegrad checkpoint: it is an empty folder",
    ),
    row(
        "load-other-shape",
        lambda c: tg.load(c.ck, MLP(jax.random.key(0), sizes=(4, 5, 1))),
        ValueError,
        r"'layers\.0\.weight' is float32\[5, 4\] in the model but float32\[8, 4\] in the ch",
    ),
    row(
        "load-other-dtype",
        lambda c: tg.load(c.ck, jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), c.model)),
        ValueError,
        r"'layers\.0\.weight' is float16\[8, 4\] in the model but float32\[8, 4\]",
    ),
    row(
        "load-into-bigger-model",
        lambda c: tg.load(c.ck, MLP(jax.random.key(0), sizes=(4, 8, 1, 1))),
        ValueError,
        r"the model has 'layers\.2\.weight' \(float32\[1, 1\]\) but the checkpoint .* does not",
    ),
    row(
        "load-into-smaller-model",
        lambda c: tg.load(c.ck, MLP(jax.random.key(0), sizes=(4, 8))),
        ValueError,
        r"the checkpoint .* has 'layers\.1\.weight', which the model lacks",
    ),
    # ---- losses
    row(
        "mse-shapes-broadcast-silently",
        lambda c: tg.losses.mse(jnp.ones((4, 1)), jnp.ones(4)),
        ValueError,
        r"tg\.losses\.mse: y of shape \(4,\) broadcasts against yhat of shape \(4, 1\) to \(4, 4\)",
    ),
    row(
        "mse-shapes-do-not-broadcast",
        lambda c: tg.losses.mse(jnp.ones(3), jnp.ones(4)),
        ValueError,
        r"tg\.losses\.mse: y of shape \(4,\) does not broadcast to yhat of shape \(3,\)",
    ),
    row(
        "mae-shapes",
        lambda c: tg.losses.mae(jnp.ones((4, 1)), jnp.ones(4)),
        ValueError,
        r"tg\.losses\.mae: y of shape \(4,\).*\(4, 4\)",
    ),
    row(
        "huber-negative-delta",
        lambda c: tg.losses.huber(jnp.ones(2), jnp.ones(2), delta=-1.0),
        ValueError,
        r"tg\.losses\.huber: delta must be positive \(a scalar\), got -1\.0",
    ),
    row(
        "logitcrossentropy-label-shape",
        lambda c: tg.losses.logitcrossentropy(jnp.ones((4, 3)), jnp.zeros((4, 1), jnp.int32)),
        ValueError,
        r"integer labels y of shape \(4, 1\).*logits of shape \(4, 3\).*\(4,\)",
    ),
    row(
        "logitcrossentropy-label-negative",
        lambda c: tg.losses.logitcrossentropy(jnp.ones((2, 3)), jnp.array([0, -1])),
        ValueError,
        r"tg\.losses\.logitcrossentropy: label -1 is out of range: logits has 3 classes, "
        r"labels go from 0 to 2",
    ),
    row(
        "crossentropy-label-too-large",
        lambda c: tg.losses.crossentropy(jnp.ones((2, 3)) / 3, jnp.array([3, 0])),
        ValueError,
        r"tg\.losses\.crossentropy: label 3 is out of range: probs has 3 classes",
    ),
    row(
        "logitcrossentropy-target-shape",
        lambda c: tg.losses.logitcrossentropy(jnp.ones((4, 3)), jnp.ones((4, 2))),
        ValueError,
        r"targets y of shape \(4, 2\).*logits of shape \(4, 3\).*one-hot",
    ),
    row(
        "crossentropy-label-shape",
        lambda c: tg.losses.crossentropy(jnp.ones((4, 3)) / 3, jnp.zeros(5, jnp.int32)),
        ValueError,
        r"tg\.losses\.crossentropy: integer labels y of shape \(5,\)",
    ),
    row(
        "binarycrossentropy-shapes",
        lambda c: tg.losses.binarycrossentropy(jnp.full((4, 1), 0.5), jnp.ones(4)),
        ValueError,
        r"tg\.losses\.binarycrossentropy: y of shape \(4,\).*\(4, 4\)",
    ),
    row(
        "mse-string-target",
        lambda c: tg.losses.mse(jnp.ones(2), "a"),
        TypeError,
        r"tg\.losses\.mse: y must be an array.*str",
    ),
    # ---- layers
    row(
        "dense-int-key",
        lambda c: nn.Dense(4, 8, key=0),
        TypeError,
        r"Dense: key must be a jax\.random key.*jax\.random\.key\(0\).*int",
    ),
    row(
        "dense-negative-features",
        lambda c: nn.Dense(4, -8, key=jax.random.key(0)),
        ValueError,
        r"Dense: out_features must be a positive int, got -8",
    ),
    row(
        "dense-float-features",
        lambda c: nn.Dense(4.5, 8, key=jax.random.key(0)),
        TypeError,
        r"Dense: in_features must be a positive int, got 4\.5",
    ),
    row(
        "dense-wrong-input-features",
        lambda c: nn.Dense(4, 2, key=jax.random.key(0))(jnp.ones((3, 5))),
        ValueError,
        r"Dense\(4 => 2\): expected input with 4 features on axis -1, got shape \(3, 5\)",
    ),
    row(
        "chain-of-non-callable",
        lambda c: nn.Chain(nn.Dense(2, 2, key=jax.random.key(0)), 3),
        TypeError,
        r"Chain: layer 1 is a int, not callable",
    ),
    row(
        "conv-3d-kernel",
        lambda c: nn.Conv((3, 3, 3), 1, 2, key=jax.random.key(0)),
        ValueError,
        r"Conv supports 1-D and 2-D kernels, got kernel_size=\(3, 3, 3\)",
    ),
    row(
        "conv-bad-padding",
        lambda c: nn.Conv((3, 3), 1, 2, key=jax.random.key(0), padding="FULL"),
        ValueError,
        r"Conv: padding must be \"SAME\", \"VALID\", an int or.*got 'FULL'",
    ),
    row(
        "conv-stride-length",
        lambda c: nn.Conv((3, 3), 1, 2, key=jax.random.key(0), stride=(1, 2, 3)),
        ValueError,
        r"Conv: stride has 3 entries but the kernel has 2 spatial axes",
    ),
    row(
        "conv-wrong-channels",
        lambda c: nn.Conv((3, 3), 1, 2, key=jax.random.key(0))(jnp.ones((1, 8, 8, 3))),
        ValueError,
        r"expected input of shape \(batch, 2 spatial axes, 1\).*got shape \(1, 8, 8, 3\)",
    ),
    row(
        "embedding-float-indices",
        lambda c: nn.Embedding(10, 4, key=jax.random.key(0))(jnp.ones(3)),
        TypeError,
        r"Embedding\(10 => 4\): expected integer indices, got dtype float32",
    ),
    row(
        "dropout-rate-one",
        lambda c: nn.Dropout(1.0),
        ValueError,
        r"Dropout rate must be in \[0, 1\), got 1\.0",
    ),
    row(
        "dropout-rate-string",
        lambda c: nn.Dropout("0.5"),
        TypeError,
        r"Dropout rate must be a number in \[0, 1\), got '0\.5'",
    ),
    row(
        "dropout-training-without-key",
        lambda c: nn.Dropout(0.5)(jnp.ones(3)),
        ValueError,
        r"needs a PRNG key: call it as layer\(x, key=key\).*nn\.testmode",
    ),
    row(
        "layernorm-wrong-features",
        lambda c: nn.LayerNorm(4)(jnp.ones((2, 3))),
        ValueError,
        r"LayerNorm\(4\): expected input with 4 features",
    ),
    row(
        "batchnorm-bad-momentum",
        lambda c: nn.BatchNorm(3, momentum=1.5),
        ValueError,
        r"BatchNorm: momentum must be in \[0, 1\], got 1\.5",
    ),
    row(
        "with-batch-stats-not-callable",
        lambda c: nn.with_batch_stats(nn.BatchNorm(2), "forward", jnp.ones((2, 2))),
        TypeError,
        r"with_batch_stats: fn must be a function.*got a str",
    ),
    row(
        "rnncell-wrong-state",
        lambda c: nn.RNNCell(2, 3, key=jax.random.key(0))(jnp.zeros(4), jnp.ones(2)),
        ValueError,
        r"RNNCell\(2 => 3\): expected a state with 3 features on axis -1, got shape \(4,\)"
        r".*initial_state",
    ),
    row(
        "lstmcell-state-not-a-pair",
        lambda c: nn.LSTMCell(2, 3, key=jax.random.key(0))(jnp.zeros(3), jnp.ones(2)),
        TypeError,
        r"LSTMCell\(2 => 3\): the state is a pair \(h, c\).*initial_state",
    ),
    row(
        "grucell-wrong-input",
        lambda c: nn.GRUCell(2, 3, key=jax.random.key(0))(jnp.zeros(3), jnp.ones(5)),
        ValueError,
        r"GRUCell\(2 => 3\): expected input with 2 features",
    ),
    row(
        "recurrence-of-non-callable",
        lambda c: nn.Recurrence("cell"),
        TypeError,
        r"Recurrence: cell must be a Module mapping \(state, x\) to \(new_state, y\).*got a str",
    ),
    row(
        "update-in-place-inside-users-jax-jit",
        _update_in_place_inside_jax_jit,
        TypeError,
        r"tg\.update_ inside jax\.jit .* does not trace.*left unchanged.*Compile the step with "
        r"tg\.jit.*tg\.update\(state, model, grads\)",
    ),
    row(
        "edit-leaf-state-view",
        _edit_leaf_view,
        TypeError,
        r"view of one parameter's optimiser state.*change nothing.*tg\.adjust_\(state, "
        r"learning_rate=x\)",
    ),
    row(
        "jit-plain-object-in-a-list-argument-stores-tracer",
        _plain_object_in_a_list_argument,
        TypeError,
        r"stores a traced array in attribute 'w' of an argument of type Holder.*capture the "
        r"object",
    ),
    row(
        "loss-log-appended-inside-tg-jit",
        _loss_log_inside_tg_jit,
        tg.RetraceWarning,
        r"tg\.jit: \S+ stores values computed from its traced arrays in your objects \(1 "
        r"item\(s\) appended to a list\).*Return them from the function instead.*put an "
        r"array there before the first call",
    ),
    row(
        "numpy-noise-drawn-inside-a-loss",
        _numpy_noise_inside_a_loss,
        tg.RetraceWarning,
        r"tg\.gradient: \S+ draws from numpy's global random state \(np\.random\.rand\.\.\.\) "
        r"while traced.*traced again on every call.*draw with jax\.random from a key",
    ),
    row(
        "next-batch-taken-inside-a-loss",
        _next_batch_inside_a_loss,
        tg.RetraceWarning,
        r"tg\.gradient: \S+ takes items from a list_iterator it captures while traced.*take "
        r"the items outside the function and pass them in",
    ),
    row(
        "numpy-array-written-in-place-inside-a-loss",
        _numpy_array_written_inside_a_loss,
        tg.RetraceWarning,
        r"tg\.gradient: \S+ changes a numpy array it captures in place while traced \(one of: "
        r"counts\).*traced again on every call that finds one changed.*keep that state in a "
        r"jax array that the function returns",
    ),
    row(
        "numpy-batch-changing-beside-a-numpy-mask",
        _numpy_batch_beside_a_numpy_mask,
        tg.RetraceWarning,
        r"tg\.gradient: \S+ needs the numpy arrays it captures as numpy values \(mask, xb\).*"
        r"traced 4 times.*Pass an array that changes each step as a jax array",
    ),
    # ---- errors added on 2026-12-02 (third stop)
    row(
        "params-nested-in-a-container",
        lambda c: tg.Params({"enc": c.ps}),
        TypeError,
        r"tg\.params: the dict holds a tg\.Params at 'enc'.*tg\.Params\(\[ps, W\]\)",
    ),
    row(
        "params-indexed-by-name",
        lambda c: c.ps["weight"],
        TypeError,
        r"Params are indexed by position \(an int or a slice\), got a str; by name, use "
        r"ps\.named\(\)\['weight'\]",
    ),
    row(
        "params-index-out-of-range",
        lambda c: c.ps[99],
        IndexError,
        r"Params index 99 is out of range: there are \d+\.",
    ),
    row(
        "jit-array-as-static-argument",
        lambda c: tg.jit(lambda a: a, static_argnums=0)(c.x),
        TypeError,
        r"tg\.jit: static argument 0 must be hashable \(it keys the compiled function\), got an "
        r"array \(float32\[2×4\]\); an array is traced, not static",
    ),
    row(
        "jit-of-a-classmethod",
        lambda c: tg.jit(classmethod(lambda cls, x: x)),
        TypeError,
        r"tg\.jit of a classmethod: put @classmethod above @tg\.jit",
    ),
    row(
        "adjust-of-a-place-without-parameters",
        lambda c: tg.adjust_(None, learning_rate=0.1),
        TypeError,
        r"tg\.adjust_ got None: that is the optimiser state at a place with no trainable array",
    ),
    row(
        "save-grads",
        lambda c: tg.save(c.tmp / "g", tg.gradient(lambda: mse(c.model, c.x, c.y), c.ps)),
        TypeError,
        r"tg\.save.*Grads.*grads\.named\(\)",
    ),
    row(
        "train-loss-ignoring-its-model",
        lambda c: tg.train(
            lambda m, x, y: mse(c.model, x, y), c.model, c.data, tg.setup(optax.sgd(0.1), c.model)
        ),
        tg.NoGradientError,
        r"tg\.train: at epoch 0, step 0, the loss does not depend on the model it is given",
    ),
    row(
        "update-in-place-params-of-variables-the-loss-reads",
        _update_params_of_variables,
        TypeError,
        r"tg\.gradient: the loss reads, as W, the old array of the Params' parameter 0 "
        r"\(float32\[\d+×\d+\]\), which tg\.update_ replaced only inside the containers the "
        r"Params holds.*Nothing was changed",
    ),
    row(
        "grads-plus-a-number",
        lambda c: 1 + c.grads,
        TypeError,
        r"unsupported operand type\(s\) for \+: 'int' and 'Grads'",
    ),
    row(
        "dense-given-a-python-number",
        _dense_given_a_number,
        ValueError,
        r"expected input with 4 features on axis -1, got a float, not an array",
    ),
    row(
        "gradient-reading-a-deleted-array",
        _gradient_reading_a_deleted_array,
        RuntimeError,
        r"tg\.gradient: the function reads, as b, an array that was deleted \(float32\[3\]\): "
        r"it was donated to an earlier call",
    ),
    row(
        "jit-of-a-donated-model",
        _jit_of_a_donated_model,
        RuntimeError,
        r"tg\.jit: argument 0\.layers\[0\]\.weight holds an array that was deleted",
    ),
    row(
        "gradient-of-an-abstract-model",
        lambda c: tg.gradient(
            lambda m: mse(m, c.x, c.y), jax.eval_shape(lambda: MLP(jax.random.key(0)))
        ),
        TypeError,
        r"tg\.gradient: the function failed \(.*\); its argument 0 holds a "
        r"jax\.ShapeDtypeStruct at 'layers\.0\.weight'.*\(a model from jax\.eval_shape\?\)",
    ),
    row(
        "setup-of-an-abstract-model",
        lambda c: tg.setup(optax.adam(1e-3), jax.eval_shape(lambda: MLP(jax.random.key(0)))),
        TypeError,
        r"tg\.setup: 'layers\.0\.weight' is a jax\.ShapeDtypeStruct \(float32\[8×4\]\), not an "
        r"array: the model is abstract \(from jax\.eval_shape\?\)",
    ),
    row(
        "params-of-a-random-key",
        lambda c: tg.params(jax.random.key(0)),
        ValueError,
        r"tg\.params: a key<fry> scalar array is not differentiable .*it is a random key, "
        r"which a model holds as state",
    ),
    row(
        "multi-transform-labels-a-module",
        lambda c: tg.setup(
            optax.multi_transform(
                {"a": optax.sgd(0.1)}, jax.tree_util.tree_map(lambda _: "a", c.model)
            ),
            c.model,
        ),
        TypeError,
        r"tg\.setup: the optax rule partition failed to initialise .*a pytree that is callable "
        r".*param_labels=lambda _: labels",
    ),
    row(
        "datasets-batches-size-zero",
        lambda c: datasets.batches(np.ones((4, 2)), np.ones(4), 0),
        ValueError,
        r"batches: size must be a positive int, got 0",
    ),
]


@pytest.mark.parametrize("call, exc, words", ROWS)
def test_bad_input_gives_a_clear_error(c, call, exc, words):
    with pytest.raises(exc, match=words):
        call(c)


def test_the_table_is_big_enough():
    assert len(ROWS) >= 60
