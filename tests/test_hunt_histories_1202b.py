"""Found by a randomised differential hunt of 2026-12-02 over optimiser histories.

Random models (nested dicts, lists, tuples, Modules and `nn` layers; tied arrays and
shared sub-models; float32, bfloat16, complex, 0-d and numpy leaves beside integer,
bool and Python-number leaves), random optax rules (chains of adam, sgd, momentum,
lion and adamw with masks, global-norm clips, inject_hyperparams, multi_transform,
MultiSteps, apply_every, flatten, schedules) and random sequences of operations
(`tg.update`/`tg.update_` explicit and implicit, eager and under `tg.jit`, `None`
gradients, freeze/thaw, whole and sub-state adjusts, save/load, replaced arrays, a
new setup) were run against plain optax on the equivalent dict of arrays, where a
skipped or frozen parameter keeps its value and its own state entries.

- A gradient Module whose attribute was set to a container of `None`s
  (`g.extra = {"scale": None, "table": [None]}`, `g.layers = [None, None]`: a whole
  sub-tree skipped, which docs/optimiser.md allows) was refused as "the gradient tree
  does not match the model", naming an unrelated path (found with a random gradient
  whose all-None sub-trees were rebuilt). A Module decides child or static by value,
  and a container holding no array is static data, so the gradient's treedef lacked
  the child. `tg.update`/`tg.update_` now find each parameter's gradient by its key
  path and skip those sub-trees, as they do for `{"enc": None}` in a dict.
- A float numpy array tied at two places (one object) became two parameters in
  `tg.params(model)`, which converts numpy leaves to jax.Arrays in place, one place at
  a time: the user's model lost its tie. With the optimiser state set up on those
  Params, the two places then trained apart, silently; with a state set up before,
  `tg.update_` refused it. Now one jax.Array is made per numpy object
  (`_paramsource.convert_numpy`).
- A gradient with an extra or a missing key, or a list one too long, was refused
  naming the model's first integer leaf ("first difference at 'i'"), where the gradient
  holds `None` as it should: the message now names the key that differs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn


class Net(tg.Module):
    def __init__(self):
        k = jax.random.split(jax.random.key(0), 2)
        self.enc = nn.Dense(3, 2, key=k[0])
        self.dec = nn.Dense(2, 1, key=k[1])
        self.extra = {"scale": jnp.float32(2.0), "table": [jnp.ones(2)]}

    def __call__(self, x):
        return self.dec(self.enc(x)) * self.extra["scale"] + jnp.sum(self.extra["table"][0])


X = jnp.array([[1.0, -2.0, 0.5], [0.3, 0.2, -1.0]])


def loss(m):
    return jnp.sum(m(X) ** 2)


def _plain(m):
    return {k: np.asarray(v) for k, v in tg.params(m).named().items()}


def _optax_reference(rule, m, g, skip):
    """Plain optax on the dict of arrays, one step: the skipped parameters see a zero
    gradient, then get their value back."""
    params = {k: jnp.asarray(v) for k, v in tg.params(m).named().items()}
    grads = tg.params(g).named()
    grads = {k: (jnp.zeros_like(params[k]) if k.startswith(skip) else grads[k]) for k in params}
    # compiled, as treegrad's step is: eager optax costs ~1 s here
    updates, _ = jax.jit(rule.update)(grads, rule.init(params), params)
    new = optax.apply_updates(params, updates)
    return {k: (params[k] if k.startswith(skip) else v) for k, v in new.items()}


RULE = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1))


@functools.cache
def _want_without_enc_and_extra():
    m = Net()
    (g,) = tg.gradient(loss, m)
    return _optax_reference(RULE, m, g, ("enc", "extra"))


@pytest.mark.parametrize("style", ["update", "update_", "tg.jit"])
def test_a_container_of_nones_at_a_gradient_modules_attribute_skips_that_sub_tree(style):
    rule = RULE
    m = Net()
    state = tg.setup(rule, m)
    (g,) = tg.gradient(loss, m)
    want = _want_without_enc_and_extra()
    g.enc = None  # skip the encoder this step, as {"enc": None, ...} does for a dict
    g.extra = {"scale": None, "table": [None]}  # a container of Nones is a Module's static data
    if style == "update":
        state, m2 = tg.update(state, m, g)
    elif style == "update_":
        m2 = m
        tg.update_(state, m2, g)
    else:
        state, m2 = tg.jit(lambda s, m, g: tg.update(s, m, g))(state, m, g)
    got = _plain(m2)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # the skipped parameters' moments are untouched, the shared count advanced
    adam = state.enc.weight.state[1][0]
    assert int(adam.count) == 1
    assert float(jnp.max(jnp.abs(adam.mu))) == 0.0
    assert float(jnp.max(jnp.abs(state.dec.weight.state[1][0].mu))) > 0.0


def test_a_container_of_nones_in_a_gradient_module_under_tg_jit_update_():
    # under tg.jit, with update_ on the model: the gradient is an input of the compiled step
    m = Net()
    state = tg.setup(optax.sgd(0.5), m)
    (g,) = tg.gradient(loss, m)
    want = _optax_reference(optax.sgd(0.5), m, g, ("extra",))
    g.extra = {"scale": None, "table": [None]}
    tg.jit(lambda g: tg.update_(state, m, g))(g)
    got = _plain(m)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_a_module_attribute_gradient_that_is_wrong_is_still_refused():
    m = Net()
    state = tg.setup(optax.sgd(0.1), m)
    before = _plain(m)
    (g,) = tg.gradient(loss, m)
    g.enc = {"weight": None, "bias": None}  # Nones, but in a dict where the model has a Dense
    g.extra = {"scale": None, "table": [None]}
    with pytest.raises(ValueError, match=r"tg\.update: the gradient tree does not match the model"):
        tg.update(state, m, g)
    (g,) = tg.gradient(loss, m)
    g.extra = {"scale": None, "table": [None], "more": jnp.ones(2)}  # a gradient the model lacks
    with pytest.raises(ValueError, match=r"tg\.update: the gradient tree does not match the model"):
        tg.update(state, m, g)
    (g,) = tg.gradient(loss, m)
    g.enc = {"weight": g.enc.weight, "bias": g.enc.bias}  # a dict where the model has a Dense
    g.dec = None
    with pytest.raises(
        ValueError, match=r"tg\.update_: the gradient tree does not match the model"
    ):
        tg.update_(state, m, g)
    assert all(np.array_equal(v, before[k]) for k, v in _plain(m).items())


# --- the gradient-mismatch message names the place that differs ----------------------


def _model_with_an_int_leaf():
    # "count" sorts before "tied": its None gradient was taken as the first difference
    w = jnp.ones(2)
    return {"count": jnp.arange(3), "tied": {"a": w, "b": [w]}, "v": jnp.ones(3)}


def _grads_with(edit):
    g = {"count": None, "tied": {"a": jnp.ones(2), "b": [jnp.ones(2)]}, "v": jnp.ones(3)}
    edit(g)
    return g


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda g: g["tied"].__setitem__("z", jnp.ones(2)), r"tied\.z"),
        (lambda g: g["tied"].pop("b"), r"tied\.b\.0"),
        (lambda g: g["tied"]["b"].append(jnp.ones(2)), r"tied\.b\.1"),
        (lambda g: g.pop("v"), r"v"),
    ],
    ids=["extra-key", "missing-key", "list-too-long", "missing-leaf"],
)
@pytest.mark.parametrize("api", ["update", "update_"])
def test_a_gradient_with_a_wrong_key_names_that_key_and_changes_nothing(edit, where, api):
    model = _model_with_an_int_leaf()
    state = tg.setup(optax.adam(0.1), model)
    before_model = dict(model)
    before_state = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    msg = (
        rf"tg\.{api}: the gradient tree does not match the model \(first difference at '{where}'\)"
    )
    with pytest.raises(ValueError, match=msg):
        getattr(tg, api)(state, model, _grads_with(edit))
    assert all(model[k] is v for k, v in before_model.items())
    assert model["tied"]["a"] is model["tied"]["b"][0]
    after = jax.tree_util.tree_leaves(state)
    assert all(np.array_equal(a, b) for a, b in zip(after, before_state, strict=True))


# --- a tied numpy weight stays one parameter in tg.params -----------------------------


def _numpy_tied():
    w = np.array([1.0, 2.0, 3.0], np.float32)
    return {"a": [w], "b": {"t": w}, "c": jnp.ones(2)}


def _tied_loss(model):
    return jnp.sum(model["a"][0]) + jnp.sum(model["b"]["t"] * 2.0) + jnp.sum(model["c"])


@pytest.mark.parametrize("setup_on", ["model", "params"])
def test_a_tied_numpy_weight_stays_tied_through_params_and_trains_as_one(setup_on):
    model = _numpy_tied()
    rule = optax.sgd(0.1, momentum=0.9)
    state = tg.setup(rule, model) if setup_on == "model" else None
    ps = tg.params(model)
    assert len(ps) == 2
    assert model["a"][0] is model["b"]["t"]
    if state is None:
        state = tg.setup(rule, ps)
    # plain optax on the one array, its gradient summed over its two places (1 + 2)
    ref = {"w": jnp.array([1.0, 2.0, 3.0]), "c": jnp.ones(2)}
    ref_state = rule.init(ref)
    g_ref = {"w": jnp.full(3, 3.0), "c": jnp.ones(2)}
    for _ in range(2):
        tg.update_(state, ps, tg.gradient(lambda: _tied_loss(model), ps))
        u, ref_state = rule.update(g_ref, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    assert model["a"][0] is model["b"]["t"]
    np.testing.assert_allclose(model["a"][0], ref["w"], rtol=1e-6)
    np.testing.assert_allclose(model["c"], ref["c"], rtol=1e-6)
