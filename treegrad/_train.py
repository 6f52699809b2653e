"""`tg.train`: the compiled training loop with a progress bar.

One small compiled step (`_step`: gradient, update, and a finiteness check of
the loss and every gradient) and a host loop around it that checks its inputs
up front, re-iterates the data each epoch, and stops at the first non-finite
loss or gradient with the last good model and state.
"""

from __future__ import annotations

import math
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from ._gradient import withgradient
from ._grads import Grads
from ._jit import jit
from ._optim import OptState, UnreadParameterError, update, update_
from ._paramerrors import NoGradientError
from ._params import Params
from ._paramsource import trainable_leaves_with_path
from ._paths import rebind
from ._shard import DATA, shard_batch
from ._tree import describe_leaf, path_str
from ._typing import Model, ModelOrParams


class NonFiniteLossError(FloatingPointError):
    """Raised by `tg.train` when the loss or a gradient becomes NaN or infinite.

    Attributes `.model` and `.state` are those of the last good step,
    `.losses` the losses up to it, and `.epoch`, `.step` where it stopped.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.ones(())}
        >>> data = [(jnp.ones(2),), (jnp.array([jnp.nan, 1.0]),)]
        >>> loss = lambda m, x: jnp.sum(m["w"] * x)
        >>> try:
        ...     tg.train(loss, model, data, tg.setup(optax.sgd(0.1), model))
        ... except tg.NonFiniteLossError as e:
        ...     print(len(e.losses), round(float(e.model["w"]), 4))
        1 0.8
    """

    def __init__(
        self,
        message: str,
        state: Any,
        model: Any,
        losses: list[float],
        epoch: int | None = None,
        step: int | None = None,
    ):
        super().__init__(message)
        self.state = state
        self.model = model
        self.losses = losses
        self.epoch = epoch
        self.step = step


class StepInfo(NamedTuple):
    """What a `tg.train` callback receives after each step.

    `model` and `state` are those after the step; with a `tg.Params`, `model` is
    the model the Params read (as `tg.train` returns it), updated in place.

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.ones(())}
        >>> seen = []
        >>> loss = lambda m, x: jnp.sum(m["w"] * x)
        >>> state = tg.setup(optax.sgd(0.1), model)
        >>> _ = tg.train(loss, model, [(jnp.ones(2),)] * 3, state, callbacks=[seen.append])
        >>> [(s.epoch, s.step) for s in seen]
        [(0, 0), (0, 1), (0, 2)]
    """

    epoch: int
    step: int
    loss: float
    model: Any
    state: Any


@jit
def _step(loss: Callable[..., Any], state: Any, model: Any, batch: tuple[Any, ...]) -> Any:
    value, (g,) = withgradient(lambda m: loss(m, *batch), model)
    _check_scalar(value)
    trained = _trainable(g)  # (read once: also checked for finite values below)
    if not any(map(_is_inexact_array, trained)):
        # Every gradient None: nothing would be trained, silently (read by `train`).
        raise NoGradientError("tg.train: no gradient")
    new_state, new_model = update(state, model, g)
    # The new model too: an update can overflow finite gradients (a learning rate
    # too large), and that model must not be kept as the last good one. Only what
    # the optimiser trains is checked: a buffer outside `__trainable__` may hold
    # -inf (an attention mask) or have a NaN gradient that nothing uses.
    ok = _finite(trained) & _stayed_finite(_trainable(model), _trainable(new_model))
    return new_state, new_model, value, ok


def _check_scalar(value: Any) -> None:
    if isinstance(value, tuple):
        # withgradient takes a tuple's first element as the loss; tg.train records it.
        raise TypeError(
            f"tg.train: the loss returned a tuple of {len(value)} (a loss and auxiliary "
            "values?); tg.train needs a real scalar loss. Return the loss alone, or write "
            "the loop with tg.withgradient, which returns the whole tuple."
        )


def _is_inexact_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)


def _finite(tree: Any) -> Any:
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.array(checks)) if checks else jnp.array(True)


def _trainable(tree: Any) -> list[Any]:
    """The leaves of `tree` at the places the optimiser trains (`__trainable__`)."""
    return [x for _, x in trainable_leaves_with_path(tree)]


def _stayed_finite(before: list[Any], after: list[Any]) -> Any:
    """Whether no element of the parameters went from finite to NaN or infinite.

    A parameter that was already infinite where the update leaves it (a -inf mask
    among the trainable arrays, with a zero gradient there) is not the update's doing.
    """
    checks = [
        jnp.all(jnp.isfinite(new) | ~jnp.isfinite(old))
        for old, new in zip(before, after, strict=True)
        if isinstance(new, jax.Array) and jnp.issubdtype(new.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.array(checks)) if checks else jnp.array(True)


def _implicit_step(loss: Callable[..., Any], ps: Params, state: Any) -> Callable[..., Any]:
    """Flux's `train!(loss, ps, data, opt)` step: the model is updated in place.

    Compiled by tg.jit like any implicit-style step: the model's arrays and the
    optimiser state are read from where they live and written back after the call.
    """

    def step(batch: tuple[Any, ...]) -> Any:
        # strict: a step where no gradient flows is an error `train` explains.
        value, grads = withgradient(lambda: loss(*batch), ps, strict=True)
        _check_scalar(value)
        before = list(ps)
        update_(state, ps, grads)
        ok = _finite([g for g in cast(Grads, grads).values() if g is not None])
        after = list(ps)  # the updated parameters too
        return value, jnp.stack([ok, _stayed_finite(before, after)])

    return jit(step)


def _nonfinite_gradients(loss: Callable[..., Any], model: Any, batch: tuple[Any, ...]) -> list[str]:
    # Only after a failed step: the gradient again, outside `_step`, to name its paths.
    _, (g,) = withgradient(lambda m: loss(m, *batch), model)
    return [
        path_str(p) or "<root>"
        for p, x in trainable_leaves_with_path(g)
        if not bool(jnp.all(jnp.isfinite(x)))
    ]


_DATA_HELP = (
    "pass the batches as a list of tuples, e.g. [(x1, y1), (x2, y2)], a re-iterable loader, "
    "or a function returning a fresh iterable each epoch (data=lambda: make_batches())"
)


def _epochs(data: Any, epochs: int) -> Callable[[], Iterable[Any]]:
    """Check `data` and return a function giving each epoch's batches."""
    what = type(data).__name__
    if data is None or isinstance(data, (str, bytes, Mapping)):
        raise TypeError(
            f"tg.train: data is {'None' if data is None else 'a ' + what}; {_DATA_HELP}."
        )
    if isinstance(data, (jax.Array, np.ndarray)):
        raise TypeError(
            f"tg.train: data is a single array of shape {data.shape}, and iterating it would "
            f"give its rows as batches; {_DATA_HELP}."
        )
    if isinstance(data, Iterable):
        if isinstance(data, Iterator) and epochs > 1:
            raise TypeError(
                f"tg.train: data is an iterator ({what}), which runs out after one pass, but "
                f"epochs={epochs}; pass a list, a re-iterable loader, or a function returning "
                "a fresh iterator each epoch (data=lambda: make_batches())."
            )
        return lambda: data
    if callable(data):

        def fresh() -> Iterable[Any]:
            out = data()
            if not isinstance(out, Iterable) or isinstance(out, (str, bytes, Mapping)):
                raise TypeError(
                    f"tg.train: data() returned a {type(out).__name__}, not an iterable of "
                    f"batches; {_DATA_HELP}."
                )
            return out

        return fresh
    raise TypeError(f"tg.train: data is a {what}, which is not iterable; {_DATA_HELP}.")


def _check_args(loss: Any, model: Any, state: Any, epochs: Any, callbacks: list[Any]) -> int:
    if not callable(loss):
        raise TypeError(
            f"tg.train: loss must be a function loss(model, *batch) returning a scalar, got a "
            f"{type(loss).__name__}. The call is tg.train(loss, model, data, state), or "
            "tg.train(loss, tg.params(model), data, state) with loss(*batch)."
        )
    if isinstance(model, Params) and len(model) == 0:
        raise ValueError("tg.train: the tg.Params is empty; build it with tg.params(model).")
    if isinstance(model, OptState):
        raise TypeError(
            "tg.train: model is an optimiser state; the call is "
            "tg.train(loss, model, data, state) with state = tg.setup(rule, model)."
        )
    if not isinstance(state, OptState):
        raise TypeError(
            f"tg.train: state must be the optimiser state from tg.setup(rule, model), got a "
            f"{type(state).__name__}. The call is tg.train(loss, model, data, state)."
        )
    if isinstance(epochs, bool):
        raise TypeError(f"tg.train: epochs must be a non-negative int, got {epochs!r}.")
    try:
        n = operator.index(epochs)
    except TypeError:
        raise TypeError(f"tg.train: epochs must be a non-negative int, got {epochs!r}.") from None
    if n < 0:
        raise ValueError(f"tg.train: epochs must be a non-negative int, got {n}.")
    for i, cb in enumerate(callbacks):
        if not callable(cb):
            raise TypeError(
                f"tg.train: callbacks[{i}] is a {type(cb).__name__}, not a function; pass "
                "functions taking a tg.StepInfo, e.g. callbacks=[print]."
            )
    return n


def _batch_hint(batch: Any) -> str:
    """What a batch the loss cannot take probably meant."""
    if isinstance(batch, list):
        return (
            " The batch is a list; only a tuple is unpacked into the loss's arguments: "
            "give batches as tuples, (x, y)."
        )
    if not isinstance(batch, tuple):
        return (
            " Each batch is a single array (data=(X, Y) is the batches X, then Y): for one "
            "batch of (X, Y), pass data=[(X, Y)]."
        )
    return ""


def _check_arity(loss: Any, n_batch: int, implicit: bool, batch: Any = ()) -> None:
    """The loss must take what tg.train passes: (model, *batch), or (*batch) with a Params."""
    code = getattr(loss, "__code__", None)
    if code is None or code.co_flags & 0x04 or not isinstance(loss, types.FunctionType):
        return  # *args, or not a plain function: nothing to check
    n = code.co_argcount
    want = n_batch if implicit else n_batch + 1
    n_defaults = len(loss.__defaults__ or ())
    if want <= n and want >= n - n_defaults:
        return
    if implicit:
        raise TypeError(
            f"tg.train: with a tg.Params (implicit style), tg.train calls loss(*batch) with "
            f"{n_batch} argument(s), but the loss takes {n}.{_batch_hint(batch)} The loss "
            "reads the model from its closure: loss = lambda x, y: mse(model(x), y). For a "
            "loss(model, *batch), pass the model itself: tg.train(loss, model, data, state)."
        )
    hint = (
        " It looks like an implicit-style loss(*batch): pass tg.params(model) instead of the model."
        if n == n_batch
        else ""
    )
    raise TypeError(
        f"tg.train: tg.train calls loss(model, *batch) with {want} argument(s) (the model and "
        f"{n_batch} from the batch), but the loss takes {n}.{_batch_hint(batch) or hint}"
    )


def train(
    loss: Callable[..., Any],
    model: ModelOrParams,
    data: Iterable[Any] | Callable[[], Iterable[Any]],
    state: OptState,
    *,
    epochs: int = 1,
    callbacks: Iterable[Callable[[StepInfo], Any]] = (),
    progress: bool | None = None,
    mesh: Mesh | None = None,
    batch_spec: Any = DATA,
) -> tuple[OptState, Model, list[float]]:
    """Train `model` on `data`: one compiled step (gradient + update) per batch.

    Given a `tg.Params` instead of a model (Flux's `train!(loss, ps, data,
    opt)`), `loss(*batch)` closes over the model, each step is the compiled
    implicit step (`tg.gradient(lambda: loss(*batch), ps)` and `tg.update_`),
    and the model and `state` are updated in place.

    Arguments:
        loss: `loss(model, *batch)` returning a scalar; `loss(*batch)` with a
            `tg.Params`.
        model: the model, or a `tg.Params` of it.
        data: the batches: a list (or any re-iterable) of tuples, each splatted
            into `loss` (a batch that is not a tuple is passed as one argument);
            or a function with no arguments returning a fresh iterable, called
            at the start of each epoch. An iterator (a generator) runs out
            after one pass, so with `epochs > 1` it is an error, and so is an
            epoch that gives no batches.
        state: from `tg.setup`.
        epochs: passes over `data`.
        callbacks: functions called with a `tg.StepInfo` after every step.
        progress: show a progress bar (default: only on a terminal).
        mesh: a `jax.sharding.Mesh`: each batch is this process's part of the
            global batch, placed with `tg.shard_batch(batch, mesh, batch_spec)`
            (data parallel, in one process or many). Without a mesh, a batch
            of host (numpy) or one-device arrays for a model placed on
            several devices is an error: inside the step it would be copied
            whole to every device.
        batch_spec: how each batch is split over `mesh` (default `P("data")`:
            rows over the `"data"` axis; `P()` replicates it on purpose), or
            a pytree prefix of specs for the batch as `data` gives it (a
            tuple, a dict, ...).

    Returns:
        `(state, model, losses)` with one loss per step. The inputs are not
        modified, except in implicit style, where `model` is the Params' model
        and `state` the given state, both updated in place.

    Raises:
        NonFiniteLossError: the loss or a gradient became NaN or infinite; the
            error names the epoch, step (and gradient path), and carries the
            last good `state` and `model`.
        NoGradientError: at some step the loss depends on none of the
            trainable parameters (an explicit loss ignoring its model argument, a
            Params of arrays the loss reads as globals): nothing would be trained.
        TypeError: `loss`, `data`, `state`, `epochs`, `callbacks` or `mesh` is
            not what is described here; the message names the argument and
            the fix.
        ValueError: a batch not placed on the mesh of a model that is (see `mesh`).

    Examples:
        >>> import jax.numpy as jnp, optax, treegrad as tg
        >>> model = {"w": jnp.zeros(())}
        >>> data = [(jnp.array([1.0, 2.0]), jnp.array([2.0, 4.0]))] * 20
        >>> loss = lambda m, x, y: tg.losses.mse(m["w"] * x, y)
        >>> state, model, losses = tg.train(loss, model, data, tg.setup(optax.adam(0.1), model))
        >>> losses[-1] < losses[0]
        True
        >>> def stream():   # a generator function: called afresh each epoch
        ...     yield from data[:5]
        >>> _, _, losses = tg.train(loss, model, stream, state, epochs=3)
        >>> len(losses)
        15

        Implicit style, as Flux's `train!(loss, ps, data, opt)`:

        >>> ps = tg.params(model)
        >>> state = tg.setup(optax.adam(0.1), ps)
        >>> _, _, losses = tg.train(lambda x, y: loss(model, x, y), ps, data, state)
        >>> losses[-1] < losses[0]
        True
    """
    callbacks = list(callbacks)
    n_epochs = _check_args(loss, model, state, epochs, callbacks)
    batches_of = _epochs(data, n_epochs)
    ps = model if isinstance(model, Params) else None
    implicit = ps is not None
    step_fn = None if ps is None else _implicit_step(loss, ps, state)
    checked = False
    place = _batch_placement(model, mesh, batch_spec)
    losses: list[float] = []
    total = len(data) * n_epochs if isinstance(data, (list, tuple)) else None
    bar = tqdm(
        total=total, disable=None if progress is None else not progress, unit="step", leave=False
    )
    first_epoch_steps = 0
    try:
        for epoch in range(n_epochs):
            step = -1
            for step, batch in enumerate(batches_of()):
                placed = place(batch, epoch, step)
                args = placed if isinstance(placed, tuple) else (placed,)
                if not checked:
                    _check_arity(loss, len(args), implicit, batch)
                    checked = True
                if step_fn is not None and ps is not None:
                    v, ok = _implicit_train_step(step_fn, ps, state, args, epoch, step, losses)
                else:
                    try:
                        new_state, new_model, value, grads_ok = _step(loss, state, model, args)
                    except NoGradientError:
                        raise _no_gradient(epoch, step, model, implicit=False) from None
                    v, ok = jax.device_get((value, grads_ok))
                    v = float(v)
                    if not (math.isfinite(v) and ok):
                        raise _nonfinite(v, epoch, step, loss, state, model, args, losses)
                    state, model = new_state, new_model
                losses.append(v)
                bar.update(1)
                if bar.n % 10 == 0:
                    bar.set_postfix(loss=f"{v:.4g}")
                for cb in callbacks:
                    # The model as `train` returns it: with a Params, the model it reads.
                    cb(StepInfo(epoch, step, v, model if ps is None else ps.source, state))
            if step < 0:
                raise ValueError(
                    f"tg.train: epoch {epoch} of data gave no batches"
                    + (f" (epoch 0 gave {first_epoch_steps})" if epoch else "")
                    + f"; {_DATA_HELP}."
                )
            if epoch == 0:
                first_epoch_steps = step + 1
    finally:
        bar.close()
    return state, (model if ps is None else ps.source), losses


def _implicit_train_step(
    step_fn: Any,
    ps: Params,
    state: Any,
    batch: tuple[Any, ...],
    epoch: int,
    step: int,
    losses: list[float],
) -> tuple[float, bool]:
    # The step rebinds the model's arrays and the state in place; the previous
    # arrays are kept (no copy: arrays are immutable) to put back after a bad step.
    before = (ps.arrays(), jax.tree_util.tree_leaves(state))
    try:
        value, flags = step_fn(batch)
    except NoGradientError:
        raise _no_gradient(epoch, step, ps, implicit=True) from None
    except UnreadParameterError as e:
        # Refused before any change (`tg.update_`): the model and state are as they were.
        raise UnreadParameterError(f"tg.train, at epoch {epoch}, step {step}: {e}") from None
    v, (grads_ok, params_ok) = jax.device_get((value, flags))
    v = float(v)
    ok = bool(grads_ok and params_ok)
    if not (math.isfinite(v) and ok):
        for old, tree in zip(before, (ps.source, state), strict=True):
            now = ps.arrays() if tree is ps.source else jax.tree_util.tree_leaves(state)
            rebind(tree, {id(n): o for n, o in zip(now, old, strict=True) if n is not o})
        if not math.isfinite(v):
            what = f"the loss is {v}"
        elif not grads_ok:
            what = "a gradient is not finite"
        else:
            what = "the update made a parameter not finite (lower the learning rate)"
        raise NonFiniteLossError(
            f"tg.train: {what} at epoch {epoch}, step {step}; stopped. The model and state "
            "were put back to the last good step (the error's .model and .state).",
            state,
            ps.source,
            losses,
            epoch=epoch,
            step=step,
        )
    return v, True


def _no_gradient(epoch: int, step: int, model: Any, implicit: bool) -> NoGradientError:
    """A step where the loss depends on none of the trainable parameters: every gradient
    is None, so the step would change nothing and the losses would stay as they are."""
    n = len(model) if implicit else sum(map(_is_inexact_array, _trainable(model)))
    where = f"tg.train: at epoch {epoch}, step {step}, "
    if n == 0:
        return NoGradientError(
            where + "the model has no trainable floating-point arrays: nothing to train."
        )
    if implicit:
        return NoGradientError(
            where + f"the loss depends on none of the {n} parameters of the tg.Params (every "
            "gradient is None), so nothing would be trained. The loss reads other arrays "
            "than the ones the Params hold now: after an update they hold new arrays, and a "
            "loss reading arrays captured on their own (tg.Params([W, b]) with W and b "
            "globals) never sees them. Keep the parameters in a model, dict or list the loss "
            "reads them from (params = {'W': W, 'b': b}; ps = tg.params(params)), and build "
            "the Params from it. The model and state are as before this step."
        )
    return NoGradientError(
        where + f"the loss does not depend on the model it is given (every gradient of its "
        f"{n} trainable arrays is None), so nothing would be trained. tg.train calls "
        "loss(model, *batch): compute with that first argument, not with a model the loss "
        "captures (lambda m, x, y: mse(m(x), y), not mse(model(x), y)); or, for a loss "
        "reading a captured model, pass tg.params(model) and loss(*batch)."
    )


def _batch_placement(model: Any, mesh: Any, spec: Any) -> Callable[..., Any]:
    """How each batch is placed: sharded over `mesh`, or checked against the model's layout."""
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"tg.train: mesh must be a jax.sharding.Mesh, got {mesh!r:.60}; e.g. "
                "mesh=jax.make_mesh((8,), ('data',))."
            )
        return lambda batch, epoch, step: shard_batch(batch, mesh, spec)
    placed = _placed_leaf(model)
    if placed is None:
        return lambda batch, epoch, step: batch

    def check(batch: Any, epoch: int, step: int) -> Any:
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            # Rows are what data parallelism splits: a 0-d value may be copied.
            on_one = getattr(x, "ndim", 0) > 0 and (
                isinstance(x, np.ndarray)
                or (isinstance(x, jax.Array) and len(x.sharding.device_set) == 1)
            )
            if on_one:
                where, s = placed
                raise ValueError(
                    f"tg.train: the model is placed on {s.num_devices} devices ({where!r} on "
                    f"{s.mesh}), but batch {step} of epoch {epoch} holds "
                    f"{'a numpy' if isinstance(x, np.ndarray) else 'a one-device'} array at "
                    f"{path_str(path) or '<root>'!r} ({describe_leaf(x)}), which the step "
                    "would copy whole to every device: no data parallelism. Pass mesh=mesh to "
                    "split each batch over it (batch_spec=P('data') by default; P() to "
                    "replicate it on purpose), or place the batches with tg.shard_batch."
                )
        return batch

    return check


def _placed_leaf(model: Any) -> tuple[str, Any] | None:
    """The path and sharding of the model's first array placed on several devices."""
    arrays = (
        list(model.named().items())
        if isinstance(model, Params)
        else [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(model)[0]]
    )
    for path, x in arrays:
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.num_devices > 1:
            return path, s
    return None


def _nonfinite(
    v: float,
    epoch: int,
    step: int,
    loss: Callable[..., Any],
    state: Any,
    model: Any,
    batch: tuple[Any, ...],
    losses: list[float],
) -> NonFiniteLossError:
    keep = "The error's .model and .state are those of the last good step"
    if not math.isfinite(v):
        what = f"the loss is {v}"
        fix = "lower the learning rate, or check that batch for NaNs"
    else:
        paths = _nonfinite_gradients(loss, model, batch)
        if paths:
            where = ", ".join(repr(p) for p in paths[:3])
            what = f"the gradient of {where} is not finite (the loss, {v:.4g}, is)"
            fix = "look for a log, sqrt or division at 0 in the loss, or clip the gradients"
        else:
            what = (
                f"the update made a parameter not finite (the loss, {v:.4g}, and the "
                "gradients are finite)"
            )
            fix = "lower the learning rate, or clip the gradients"
    return NonFiniteLossError(
        f"tg.train: {what} at epoch {epoch}, step {step}; stopped. {keep} ({fix}).",
        state,
        model,
        losses,
        epoch=epoch,
        step=step,
    )
