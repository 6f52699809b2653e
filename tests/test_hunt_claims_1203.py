"""Hunt: a CLAIMS AUDIT of the user documentation, 2026-12-03. tests/test_docs.py runs the
docs' code blocks; this file checks the claims made in their prose and tables (docs/
gradients.md, optimiser.md, pitfalls.md, compilation.md, flux.md, coming-from.md,
scaling.md, and /work/shared/API.md), one test per claim, each against an independent
reference: `jax.grad` / `jax.hessian` / `jax.jacfwd` of the explicit function, plain
optax on the same leaves, a closed form, or the exact message (`match=`). The doc and
the claim are named in each test's comment.

Found and fixed:
- compilation.md, "Static arguments are never stale either. A static Module (or other
  pytree) is keyed by what it holds, its static data included, so one edited in place
  traces again": FALSE for a static Module that holds an array. `tg.jit(f,
  static_argnums=0)` keyed such a Module by its identity (`_jit._static_key` fell back to
  `value_key(value)` when an array made the structural key unhashable), so after
  `m.scale = 3.0` the call reused the program traced with `scale = 1.0`: a SILENT stale
  result. (When `f` also read `m.w`, the array, reached through a static value the
  engine does not walk, gave a RetraceWarning saying the array was held "through
  objects it cannot see into ... hold them in a tg.Module", while it was in one.) Fix:
  `_jit.Jitted.__call__` guards a static pytree that holds arrays like a captured object
  (a root of the call, as a plain object named static already was): its arrays are
  traced inputs, its static data checked at each call (`_jit._holds_arrays`). Doc
  sentence extended in docs/compilation.md.
- optimiser.md, "A sub-state view (`state.l1`) ... [is] refused by `tg.save`, naming the
  path": a parameter's `tg.Leaf` (`state.l1.weight`, also a view into the whole state)
  was saved, and `tg.load(path, fresh_state.l1.weight)` returned a bare optax state tuple
  (not a Leaf) and changed no state: a checkpoint that silently restores nothing. Fix:
  `_manifest.check_no_leaf_view` refuses a Leaf in the saved tree (`describe`) and in
  `like` (`_manifestmatch.match`), with the SubState message's advice. Doc and the
  `tg.save` docstring name the Leaf too.

- compilation.md, treegrad sees into "what a builtin method or a dict view the function
  holds reads (`get = cfg.get`, `cfg.values()`: the dict behind it)": holding
  `vals = cfg.values()` raised jax's DeprecationWarning "Python iterable type
  'dict_values' is treated as a leaf in PyTree" (an error under `-W error`, and in a
  later jax; pyproject ignores jax's DeprecationWarnings, so the suite never saw it),
  from `_swap._holds_tracer`, which flattens what the function holds after each trace.
  Fix: `_swap._leaves` takes a values view as a leaf, as it took iterators.
- API.md §1, everything that is not an array/Module/container is static: a Module
  attribute holding a generator, an iterator (a data loader kept on a model) or a
  dict's values view raised the same DeprecationWarning at every flatten, from
  `_module.holds_arrays`. Fix: those are leaves there (`_tree.iterable_leaf`).

Found, not fixed (strict xfail, diagnosis in its reason):
- An array read through a dict values view (`vals = m.values()`, then
  `next(iter(vals))`) is not an input: the result is right only because the function
  is re-traced on every call (RetraceWarning "through objects it cannot see into"), and
  implicit mode refuses such a parameter; `get = m.get` works. `_walk` is being edited
  by another helper at the time of writing, so it is left to the lead.

Checked and true: every other test below, one claim each (doc named in its comment).
"""

from __future__ import annotations

import copy
import os
import pickle
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

# ----------------------------------------------------------------------------- helpers


def _leaves(t):
    # A list of Python numbers is one expected array, not several leaves.
    return jax.tree_util.tree_leaves(
        t, is_leaf=lambda x: isinstance(x, list) and all(isinstance(i, float) for i in x)
    )


def close(a, b, tol=1e-6):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def optax_run(rule, params, grads_list):
    """Plain optax on a dict of leaves: the reference of every optimiser claim."""
    s = rule.init(params)
    for g in grads_list:
        u, s = rule.update(g, s, params)
        params = optax.apply_updates(params, u)
    return params, s


def chain():
    return nn.Chain(nn.Dense(2, 3, key=jax.random.key(0)), nn.Dense(3, 1, key=jax.random.key(1)))


X = jnp.array([3.0, 1, 0, 1, 2])


# ============================================================ gradients.md: explicit mode


def test_an_argument_f_mutates_is_a_copy_yours_is_unchanged():
    # gradients.md: "a dict or Module argument that f changes (d["n"] += 1) is changed
    # in that copy, not in yours".
    d = {"w": jnp.ones(3), "n": 2}

    def f(d):
        d["n"] += 1
        return jnp.sum(d["w"]) * d["n"]

    (g,) = tg.gradient(f, d)
    assert d["n"] == 2
    close(g["w"], jax.grad(lambda w: jnp.sum(w) * 3)(d["w"]))
    assert g["n"] is None


class _Plain:
    def __init__(self, k):
        self.k = k


def test_a_plain_object_argument_is_given_as_it_is():
    # gradients.md: "pass a plain object of yours (not a pytree), which f is given as it is".
    o, seen = _Plain(5.0), []

    def f(w, o):
        seen.append(o)
        return jnp.sum(w) * o.k

    gw, go = tg.gradient(f, jnp.ones(2), o)
    assert seen and all(s is o for s in seen)
    assert go is None
    close(gw, jax.grad(lambda w: jnp.sum(w) * 5.0)(jnp.ones(2)))


def test_tied_array_in_one_argument_total_at_first_place_none_at_others():
    # gradients.md: "One array at several places of one argument is a tied weight: its
    # total gradient at the first place, None at the others."
    w = jnp.array([1.0, 2.0])
    (g,) = tg.gradient(lambda d: jnp.sum(d["a"] ** 2) + jnp.sum(3 * d["b"]), {"a": w, "b": w})
    assert g["b"] is None
    close(g["a"], jax.grad(lambda w: jnp.sum(w**2) + jnp.sum(3 * w))(w))


def test_complex_gradient_is_the_conjugate_of_jax_grad():
    # API.md §1 / gradients.md: "the conjugate of jax.grad's".
    z = jnp.array([1 + 2j, 3 - 1j], dtype=jnp.complex64)
    f = lambda z: jnp.sum(jnp.abs(z) ** 2 + jnp.real(z * (2 + 1j)))
    close(tg.gradient(f, z)[0], jnp.conj(jax.grad(f)(z)))


@pytest.mark.slow  # several compilations (~0.6 s)
def test_real_gradient_for_a_complex_parameter_has_zero_imaginary_part():
    # gradients.md: "a real gradient for a complex parameter is taken as one with a zero
    # imaginary part." Reference: plain optax with the gradient made complex.
    z = {"z": jnp.array([1 + 2j, -1j], dtype=jnp.complex64)}
    g = {"z": jnp.array([1.0, -2.0], dtype=jnp.float32)}
    s = tg.setup(optax.adam(0.1), z)
    s, z2 = tg.update(s, z, g)
    ref, _ = optax_run(optax.adam(0.1), z, [{"z": g["z"].astype(jnp.complex64)}])
    assert z2["z"].dtype == jnp.complex64
    close(z2["z"], ref["z"])


def test_complex_gradient_for_a_real_parameter_is_refused_changing_nothing():
    # gradients.md: "a complex gradient for a real parameter is an error (its imaginary
    # part would be dropped)".
    w = {"w": jnp.array([1.0])}
    s = tg.setup(optax.adam(0.1), w)
    before = jax.tree_util.tree_leaves(s)
    with pytest.raises(ValueError, match=r"'w' is complex but its parameter is real.*jnp\.real"):
        tg.update_(s, w, {"w": jnp.array([1.0 + 1j], dtype=jnp.complex64)})
    assert np.array_equal(w["w"], [1.0])
    close(jax.tree_util.tree_leaves(s), before)


@pytest.mark.slow  # several compilations (~0.6 s)
def test_jacobian_rows_of_a_real_output_follow_the_conjugate_convention():
    # gradients.md: "the rows of tg.jacobian of a real output follow the same convention".
    z = jnp.array([1 + 2j, 3 - 1j], dtype=jnp.complex64)
    f = lambda z: jnp.abs(z) ** 2 * jnp.array([1.0, 2.0]) + jnp.real(z)
    (J,) = tg.jacobian(f, z)
    ref = jnp.conj(jax.jacrev(f)(z))
    close(J, ref)


def test_jacobian_of_a_complex_output_of_real_inputs_is_dy_dx():
    # gradients.md: "tg.jacobian of a complex output of real inputs is dy/dx (complex)".
    x = jnp.array([1.0, 2.0])
    f = lambda x: x * (1 + 2j) + x**2 * 1j
    (J,) = tg.jacobian(f, x)
    assert jnp.iscomplexobj(J)
    close(J, jax.jacfwd(f)(x))


def test_jacobian_and_hessian_with_respect_to_complex_inputs_are_refused():
    # gradients.md: "of complex inputs it is refused, as tg.hessian with respect to a
    # complex argument is ... pass real and imaginary parts as real arguments".
    z = jnp.array([1 + 2j], dtype=jnp.complex64)
    with pytest.raises(TypeError, match=r"tg\.jacobian: .*complex input.*jnp\.real"):
        tg.jacobian(lambda z: z * 2, z)
    with pytest.raises(TypeError, match=r"tg\.hessian: .*complex.*real and imaginary parts"):
        tg.hessian(lambda z: jnp.sum(jnp.abs(z) ** 2), z)


def test_back_is_a_pytree_returned_from_jax_jit():
    # gradients.md: "back is a pytree ... it can be returned from a jax.jit function".
    x = jnp.array([1.0, 2.0])
    y, back = jax.jit(lambda x: tg.pullback(jnp.sin, x))(x)
    close(y, jnp.sin(x))
    close(back(jnp.array([2.0, 3.0]))[0], jnp.array([2.0, 3.0]) * jnp.cos(x))


def test_pullback_casts_a_dy_of_another_float_dtype_refuses_a_complex_one():
    # gradients.md: "A dy of another floating dtype than its output is cast (a complex
    # one for a real output is an error)".
    x = jnp.array([1.0, 2.0])
    _, back = tg.pullback(lambda x: 2 * x, x)
    (r,) = back(jnp.array([1.0, 3.0], jnp.bfloat16))
    assert r.dtype == jnp.float32
    close(r, [2.0, 6.0])
    with pytest.raises(ValueError, match=r"dy has dtype complex64 where the output has dtype"):
        back(jnp.ones(2, jnp.complex64))


@pytest.mark.slow  # several compilations (~0.6 s)
def test_hessian_tied_block_at_first_place_others_and_integers_none():
    # gradients.md: "In tg.hessian, a tied array's block is at its first place (rows and
    # columns of its other places, and of integer leaves, are None)".
    w = jnp.array([1.0, 2.0])
    d = {"a": w, "b": w, "n": jnp.array(3)}
    (H,) = tg.hessian(lambda d: jnp.sum(d["a"] ** 3) + jnp.sum(d["a"] * d["b"]), d)
    close(H["a"]["a"], jax.hessian(lambda w: jnp.sum(w**3) + jnp.sum(w * w))(w))
    assert H["a"]["b"] is None and H["a"]["n"] is None
    assert H["b"] is None and H["n"] is None


def test_stop_gradient_gives_none_a_straight_through_rule_its_cotangent():
    # gradients.md: "an input behind jax.lax.stop_gradient gets None, and one whose value
    # is ignored but whose rule passes a cotangent back gets that cotangent".
    @jax.custom_vjp
    def ste(x):
        return jnp.zeros_like(x)

    ste.defvjp(lambda x: (ste(x), None), lambda _, g: (g,))
    x, y = jnp.array([1.0, 2.0]), jnp.array([3.0])
    f = lambda x, y: jnp.sum(2 * ste(x)) + jnp.sum(jax.lax.stop_gradient(y))
    gx, gy = tg.gradient(f, x, y)
    assert gy is None
    close(gx, jax.grad(f)(x, y))


def test_custom_rule_reading_the_differentiated_array_from_its_closure_is_refused():
    # gradients.md: "a rule that reads the array being differentiated from its closure
    # instead is refused with a TypeError saying to pass the array as an argument".
    W = jnp.array([1.0, 2.0])

    @jax.custom_vjp
    def f(x):
        return jnp.sum(W * x)

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * W,))
    with pytest.raises(TypeError, match=r"pass the array as an argument of the custom function"):
        tg.gradient(lambda: f(jnp.ones(2)), tg.Params([W]))


# ============================================================ gradients.md / API.md: implicit


def _implicit():
    model = {"W": jnp.ones((2, 3)), "b": jnp.zeros(2)}
    ps = tg.params(model)
    loss = lambda s: s * jnp.sum(jnp.tanh(model["W"] @ jnp.arange(3.0) + model["b"]))
    return model, ps, loss


def test_sum_of_a_list_of_grads_accumulates():
    # gradients.md: "sum(list_of_grads) accumulates several batches".
    model, ps, loss = _implicit()
    gs = [tg.gradient(lambda s=s: loss(s), ps) for s in (1.0, 2.0, 3.0)]
    total = sum(gs)
    ref = jax.grad(lambda m: 6.0 * jnp.sum(jnp.tanh(m["W"] @ jnp.arange(3.0) + m["b"])))(model)
    close(total[model["W"]], ref["W"])
    close(total[model["b"]], ref["b"])


def test_grads_scale_by_an_array_of_another_shape_is_refused():
    # gradients.md: "c is a number or a 0-d array: an array of another shape ... is refused".
    _, ps, loss = _implicit()
    g = tg.gradient(lambda: loss(1.0), ps)
    with pytest.raises(TypeError, match=r"multiplied by a scalar.*float32\[2\].*grads\.map"):
        g * jnp.ones(2)


@pytest.mark.parametrize(
    "c",
    [0.5, np.float32(0.5), np.float64(0.5), jnp.float32(0.5)],
    ids=["py", "np32", "np64", "jnp"],
)
def test_grads_scale_never_changes_a_bfloat16_gradient_dtype(c):
    # gradients.md: "grads * lr of a bfloat16 model is bfloat16 whether lr is a Python
    # float, an np.float32 or a float32 0-d array (only a complex c makes ... complex)".
    m = {"w": jnp.array([1.0, 2.0], jnp.bfloat16)}
    g = tg.gradient(lambda: jnp.sum(m["w"] ** 2), tg.params(m))
    for out in (g * c, c * g, g / c):
        assert out[m["w"]].dtype == jnp.bfloat16
    close((g * c)[m["w"]].astype(jnp.float32), [1.0, 2.0])
    assert (g * (1 + 1j))[m["w"]].dtype == jnp.complex64


def test_grads_over_the_same_parameters_combine_in_any_order():
    # gradients.md: "Two Grads combine when they are over the same parameters, in any order".
    model, ps, loss = _implicit()
    g1 = tg.gradient(lambda: loss(1.0), ps)
    g2 = tg.gradient(lambda: loss(2.0), tg.Params([model["b"], model["W"]]))
    s = g1 - g2
    close(s[model["W"]], -g1[model["W"]])
    close(s[model["b"]], -g1[model["b"]])


def test_grads_over_different_parameters_name_the_first_that_differs():
    model, ps, loss = _implicit()
    g1 = tg.gradient(lambda: loss(1.0), ps)
    other = jnp.ones(4)
    g3 = tg.gradient(lambda: jnp.sum(model["W"]) + jnp.sum(other), tg.Params([model["W"], other]))
    with pytest.raises(ValueError, match=r"different parameter sets.*'b' is only in the first"):
        g1 + g3


def test_to_tree_refuses_a_model_with_one_parameter_replaced():
    # gradients.md: "grads.to_tree(model) refuses a model in which a parameter was
    # replaced since the gradients were taken (its gradient would silently be None)".
    m = {"W": jnp.ones(2), "b": jnp.ones(3)}
    g = tg.gradient(lambda: jnp.sum(m["W"] ** 2) + jnp.sum(m["b"]), tg.params(m))
    m["W"] = m["W"] * 2
    with pytest.raises(ValueError, match=r"Grads\.to_tree: the model's 'W' is not the array"):
        g.to_tree(m)


def test_params_set_operations():
    # gradients.md: add/remove/discard, copy.copy is a new set, ps[0], ps[1:] a list;
    # flux.md: union(ps1, ps2) is tg.Params([ps1, ps2]); API.md: equality, empty Params.
    a, c, d = jnp.ones(1), jnp.ones(2), jnp.ones(3)
    p = tg.Params([a, c])
    q = copy.copy(p)
    q.add(d)
    assert len(p) == 2 and len(q) == 3 and d not in p
    assert q[0] is a and isinstance(q[1:], list) and q[1:][0] is c and q[1:][1] is d
    p.remove(a)
    assert a not in p and len(p) == 1
    p.discard(a)  # no error
    with pytest.raises(KeyError, match=r"Params\.remove: .*use discard"):
        p.remove(a)
    u = tg.Params([tg.Params([a]), tg.Params([c]), d])
    assert [x is y for x, y in zip(u, [a, c, d], strict=True)] == [True] * 3
    assert tg.Params([a, c]) == tg.Params([a, c]) and tg.Params([a]) != tg.Params([c])
    assert len(tg.Params([])) == 0


def test_params_remove_of_a_submodel_takes_its_arrays_out():
    m = chain()
    p = tg.params(m)
    p.remove(m[0])
    assert list(p.named()) == ["layers.1.weight", "layers.1.bias"]


@pytest.mark.parametrize("where", ["dict", "nested list"])
def test_a_params_inside_a_dict_or_nested_list_is_refused(where):
    ps = tg.Params([jnp.ones(1)])
    tree = {"p": ps} if where == "dict" else [[ps]]
    with pytest.raises(TypeError, match=r"holds a tg\.Params at .*tg\.Params\(\[ps, W\]\)"):
        tg.Params(tree)


def test_strict_raises_no_gradient_error_and_the_warning_is_a_user_warning():
    # pitfalls.md: "Pass strict=True to raise tg.NoGradientError instead"; API.md:
    # NoGradientWarning is a UserWarning.
    assert issubclass(tg.NoGradientWarning, UserWarning)
    with pytest.raises(tg.NoGradientError, match=r"does not depend on any of the 1 registered"):
        tg.gradient(lambda: jnp.sum(jnp.ones(2)), tg.Params([jnp.ones(2)]), strict=True)


def test_gradient_without_argument_says_to_pass_params():
    # API.md: "tg.gradient(f) with no argument at all is an error that says to pass
    # tg.params(model)".
    with pytest.raises(TypeError, match=r"no argument to differentiate.*tg\.params\(model\)"):
        tg.gradient(lambda: 1.0)


def test_withgradient_of_a_namedtuple_differentiates_its_first_element():
    # API.md: "if f returns a tuple (NamedTuple included) its first element is
    # differentiated and value is the whole output".
    class Out(NamedTuple):
        loss: jax.Array
        aux: jax.Array

    v, (g,) = tg.withgradient(lambda w: Out(jnp.sum(w**2), w * 3), jnp.array([1.0, 2.0]))
    assert isinstance(v, Out)
    close(v.aux, [3.0, 6.0])
    close(g, jax.grad(lambda w: jnp.sum(w**2))(jnp.array([1.0, 2.0])))


@pytest.mark.slow  # several compilations (~0.6 s)
def test_both_styles_agree_to_the_last_bit():
    # gradients.md: "On the same model and data they agree to the last bit".
    m = chain()
    x = jnp.arange(6.0).reshape(3, 2)
    loss = lambda m: jnp.mean(jnp.tanh(m(x)) ** 2)
    (ge,) = tg.gradient(loss, m)
    gi = tg.gradient(lambda: loss(m), tg.params(m)).to_tree(m)
    for a, b in zip(jax.tree_util.tree_leaves(ge), jax.tree_util.tree_leaves(gi), strict=True):
        assert np.array_equal(a, b)
    close(ge, jax.grad(loss)(m), tol=1e-6)


# ============================================================ optimiser.md


@pytest.mark.slow  # several compilations (~0.6 s)
def test_setup_from_params_with_one_removed_rule_sees_the_params_arrays_only():
    # optimiser.md: "arrays removed from a tg.Params given to tg.setup ... the rule sees
    # the Params' arrays, as a plain optax user given them would". A global-norm clip
    # would see the removed array's gradient otherwise.
    m = {"emb": jnp.full(3, 10.0), "w": jnp.array([1.0, -2.0])}
    p = tg.params(m)
    p.remove(m["emb"])
    rule = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    s = tg.setup(rule, p)
    f = lambda emb, w: jnp.sum(emb * w[0]) + jnp.sum(w**2)
    w0 = m["w"]
    tg.update_(s, p, tg.gradient(lambda: f(m["emb"], m["w"]), p))
    ref, _ = optax_run(rule, {"w": w0}, [{"w": jax.grad(f, 1)(m["emb"], w0)}])
    close(m["w"], ref["w"])
    assert np.array_equal(m["emb"], jnp.full(3, 10.0))


@pytest.mark.slow  # several compilations (~0.6 s)
def test_none_gradient_under_optax_flatten_keeps_its_slice_others_step_as_optax():
    # optimiser.md: "optax.flatten keeps every parameter's state in one vector ...: a
    # skipped parameter's slice of it is kept, and the rest steps as plain optax's would
    # with a zero gradient there."
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    rule = optax.flatten(optax.adam(0.1))
    g1 = {"a": jnp.array([0.5, -1.0]), "b": jnp.array([2.0])}
    s = tg.setup(rule, m)
    s, m1 = tg.update(s, m, g1)
    s, m2 = tg.update(s, m1, {"a": None, "b": jnp.array([1.0])})
    r1, os1 = optax_run(rule, m, [g1])
    u, os2 = rule.update({"a": jnp.zeros(2), "b": jnp.array([1.0])}, os1, r1)
    r2 = optax.apply_updates(r1, u)
    assert np.array_equal(m2["a"], m1["a"])
    close(m2["b"], r2["b"])
    # a's slice of the flat moments is the one before the skipped step; b's stepped
    mu_ref = np.asarray(os2[0].mu).copy()
    mu_ref[:2] = np.asarray(os1[0].mu)[:2]
    # (one vector for all: each Leaf's view shows the whole of it)
    close(s["a"].state[0].mu, mu_ref)
    close(
        s["b"].state[0].nu, np.concatenate([np.asarray(os1[0].nu)[:2], np.asarray(os2[0].nu)[2:]])
    )
    assert int(s["a"].state[0].count) == 2


@pytest.mark.slow  # several compilations (~0.6 s)
def test_frozen_is_skipped_like_a_none_gradient():
    # optimiser.md: "A frozen parameter is skipped like a None gradient: value and own
    # state entries kept, shared counters advancing."
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    g = {"a": jnp.array([0.5, -1.0]), "b": jnp.array([2.0])}
    s = tg.setup(optax.adam(0.1), m)
    s, m1 = tg.update(s, m, g)
    tg.freeze_(s["a"])
    sf, mf = tg.update(s, m1, g)
    tg.thaw_(s["a"])
    sn, mn = tg.update(s, m1, {"a": None, "b": g["b"]})
    assert np.array_equal(mf["a"], m1["a"])
    close(mf, mn)
    close(jax.tree_util.tree_leaves(sf), jax.tree_util.tree_leaves(sn))
    ref, _ = optax_run(optax.adam(0.1), m, [g, {"a": jnp.zeros(2), "b": g["b"]}])
    close(mf["b"], ref["b"])


def test_a_tie_broken_or_made_after_setup_names_both_places():
    # optimiser.md: "one made or broken after tg.setup ... is an error that names both
    # places".
    w = jnp.ones(2)
    broken = {"enc": w, "dec": w}
    s = tg.setup(optax.sgd(0.1), broken)
    broken["dec"] = broken["enc"] * 1
    with pytest.raises(ValueError, match=r"'dec' and 'enc' were one array .* now two"):
        tg.update(s, broken, {"enc": jnp.ones(2), "dec": jnp.ones(2)})
    made = {"enc": jnp.ones(2), "dec": jnp.ones(2)}
    s = tg.setup(optax.sgd(0.1), made)
    made["dec"] = made["enc"]
    with pytest.raises(ValueError, match=r"'dec' and 'enc' are now one array .* were two"):
        tg.update(s, made, {"enc": jnp.ones(2), "dec": None})


class _Act(tg.Module):
    def __call__(self, x):
        return jax.nn.relu(x)


@pytest.mark.slow  # several compilations (~0.6 s)
def test_a_shared_submodel_without_arrays_stays_one_object_after_update_and_rebuild():
    # optimiser.md: "A sub-model held at two places stays one object too, whether or not
    # it holds arrays (an activation layer used twice), after tg.update and rebuild."
    a = _Act()
    m = nn.Chain(nn.Dense(2, 2, key=jax.random.key(0)), a, nn.Dense(2, 2, key=jax.random.key(1)), a)
    s = tg.setup(optax.sgd(0.1), m)
    (g,) = tg.gradient(lambda m: jnp.sum(m(jnp.ones(2))), m)
    _, m2 = tg.update(s, m, g)
    flat, rebuild = tg.destructure(m)
    m3 = rebuild(flat)
    assert m2[1] is m2[3] and m3[1] is m3[3]


def test_freeze_of_a_place_without_arrays_does_nothing_adjust_is_an_error():
    # optimiser.md: "freezing or thawing it does nothing ...; tg.adjust_ of it is an
    # error that says so."
    m = {"w": jnp.ones(2), "n": jnp.array(3)}
    s = tg.setup(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), m)
    assert s["n"] is None
    tg.freeze_(s["n"])
    tg.thaw_(s["n"])
    with pytest.raises(TypeError, match=r"tg\.adjust_ got None: .*no trainable array"):
        tg.adjust_(s["n"], learning_rate=0.2)


@pytest.mark.slow  # several compilations (~0.7 s)
def test_a_substate_rule_equals_multi_transform():
    # optimiser.md: "the same result as optax.multi_transform with one label per rule (a
    # cross-parameter rule ... sees only its own parameters)".
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, -1.0])}
    ra = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1))
    rb = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.3))
    s = tg.setup(ra, m)
    s["b"] = tg.setup(rb, m["b"])
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([1.0, 2.0])}
    mm = m
    for _ in range(3):
        s, m = tg.update(s, m, g)
    ref, _ = optax_run(optax.multi_transform({"A": ra, "B": rb}, {"a": "A", "b": "B"}), mm, [g] * 3)
    close(m, ref)


def test_adjust_without_inject_hyperparams_says_how_to_build_one():
    s = tg.setup(optax.adam(0.1), {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"no adjustable hyperparameters.*inject_hyperparams"):
        tg.adjust(s, learning_rate=0.2)


def test_adjust_to_the_value_already_there_splits_nothing():
    # optimiser.md: "Adjusting to the values already there changes nothing, and splits
    # nothing." Checked by the global-norm clip, which would see two parts after a split.
    mk = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(learning_rate))
    )
    m = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([2.0])}
    s = tg.setup(mk(learning_rate=0.5), m)
    n = len(jax.tree_util.tree_leaves(s))
    tg.adjust_(s["enc"], learning_rate=0.5)
    assert len(jax.tree_util.tree_leaves(s)) == n
    _, m2 = tg.update(s, m, m)
    ref, _ = optax_run(mk(learning_rate=0.5), m, [m])
    close(m2, ref)


def test_adjust_of_a_substate_splits_so_the_clip_sees_each_part_apart():
    # optimiser.md: "after tg.adjust_(state.enc, learning_rate=...),
    # optax.clip_by_global_norm clips the encoder's norm and the rest's separately."
    mk = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(learning_rate))
    )
    m = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([1.0])}
    s = tg.setup(mk(learning_rate=1.0), m)
    tg.adjust_(s["enc"], learning_rate=0.5)
    g = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([2.0])}
    _, m2 = tg.update(s, m, g)
    ra, _ = optax_run(mk(learning_rate=0.5), {"enc": m["enc"]}, [{"enc": g["enc"]}])
    rb, _ = optax_run(mk(learning_rate=1.0), {"dec": m["dec"]}, [{"dec": g["dec"]}])
    close(m2, {**ra, **rb})


def test_pickling_a_state_says_to_use_save():
    s = tg.setup(optax.adam(0.1), {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"cannot pickle a treegrad optimiser state.*tg\.save"):
        pickle.dumps(s)


def test_lookahead_refused_by_setup_inside_a_chain_reduce_on_plateau_by_update():
    # optimiser.md, "Rules treegrad refuses".
    with (
        pytest.raises(TypeError, match=r"tg\.setup: optax\.lookahead updates a pair"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # optax's own absl notice
        tg.setup(
            optax.chain(optax.sgd(0.1), optax.lookahead(optax.sgd(0.1), 2, 0.5)),
            {"w": jnp.ones(2)},
        )
    m = {"w": jnp.ones(2)}
    s = tg.setup(optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau()), m)
    with pytest.raises(TypeError, match=r"reduce_on_plateau in it\) needs extra arguments"):
        tg.update_(s, m, {"w": jnp.ones(2)})
    assert np.array_equal(m["w"], jnp.ones(2))


def test_destructure_keeps_dtypes_rebuild_is_a_partial_jit_takes_it():
    # optimiser.md: "Each array comes back in its own dtype whatever the vector's ... and
    # rebuild is a jax.tree_util.Partial ... jax.jit can take it as an argument."
    m = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(3), "i": jnp.array([1, 2])}
    flat, rebuild = tg.destructure(m)
    assert flat.shape == (5,)
    m2 = rebuild(jnp.arange(5))  # an integer vector
    assert (m2["a"].dtype, m2["b"].dtype, m2["i"].dtype) == (jnp.bfloat16, jnp.float32, jnp.int32)
    close(m2["b"], [2.0, 3.0, 4.0])
    assert np.array_equal(m2["i"], [1, 2])
    assert isinstance(rebuild, jax.tree_util.Partial)
    close(jax.jit(lambda r, f: r(f)["b"])(rebuild, flat * 2), [2.0, 2.0, 2.0])


# ============================================================ checkpoints (optimiser/pitfalls)


@pytest.mark.slow  # orbax writes and reads a folder (~0.5 s)
def test_frozen_flags_are_saved_whatever_likes_flags(tmp_path):
    m = {"a": jnp.ones(2), "b": jnp.ones(3)}
    s = tg.setup(optax.adam(0.1), m)
    tg.freeze_(s["a"])
    tg.save(tmp_path / "c", s)
    like = tg.setup(optax.adam(0.1), m)
    tg.freeze_(like["b"])
    s2 = tg.load(tmp_path / "c", like)
    assert s2["a"].frozen and not s2["b"].frozen


@pytest.mark.slow  # orbax writes and reads a folder (~0.5 s)
def test_loading_into_a_state_of_another_rule_says_the_rule_differs(tmp_path):
    m = {"a": jnp.ones(2)}
    tg.save(tmp_path / "c", tg.setup(optax.adam(0.1), m))
    with pytest.raises(ValueError, match=r"the optimiser rule differs from the one the state"):
        tg.load(tmp_path / "c", tg.setup(optax.sgd(0.1, momentum=0.9), m))


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        ({"s": np.array(["a"])}, r"'s' is an array of dtype <U1"),
        ({"s": {1, 2}}, r"'s' is a set"),
        ({"s": bytearray(b"x")}, r"'s' is a bytearray"),
        ({"s": np.ma.masked_array([1.0], mask=[True])}, r"'s' is a numpy masked array"),
    ],
    ids=["strings", "set", "bytearray", "masked"],
)
def test_save_refuses_what_a_checkpoint_cannot_hold_before_writing(tmp_path, tree, match):
    with pytest.raises(TypeError, match=match):
        tg.save(tmp_path / "c", {"w": jnp.ones(2), **tree})
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


def test_save_refuses_params_grads_and_a_substate(tmp_path):
    m = chain()
    s = tg.setup(optax.adam(0.1), m)
    g = tg.gradient(lambda: jnp.sum(m(jnp.ones(2))), tg.params(m))
    with pytest.raises(TypeError, match=r"got a tg\.Params, .*tg\.save\(path, model\)"):
        tg.save(tmp_path / "p", tg.params(m))
    with pytest.raises(TypeError, match=r"got a tg\.Grads, .*grads\.named\(\)"):
        tg.save(tmp_path / "g", g)
    with pytest.raises(TypeError, match=r"got a part of an optimiser state"):
        tg.save(tmp_path / "s", s[0])
    assert not os.listdir(tmp_path)


def test_save_refuses_a_leaf_view(tmp_path):
    # FIXED. optimiser.md: "A sub-state view (state.l1, or a parameter's tg.Leaf) ... [is]
    # refused by tg.save". A Leaf was saved, and loading into a fresh state's Leaf gave a
    # bare optax tuple, restoring nothing into the state.
    m = chain()
    s = tg.setup(optax.adam(0.1), m)
    with pytest.raises(
        TypeError,
        match=r"tg\.save: got the optimiser state of one parameter " + _LEAF_FIX,
    ):
        tg.save(tmp_path / "leaf", s[0].weight)
    with pytest.raises(TypeError, match=r"at 'x'.*Save the whole state"):
        tg.save(tmp_path / "leaf", {"x": s[0].weight})
    assert not os.listdir(tmp_path)


_LEAF_FIX = (
    r"\(a tg\.Leaf such as state\.l1\.weight, a view into the whole state\), which a "
    r"checkpoint does not store\. Save the whole state, tg\.save\(path, state\), and load "
    r"it with tg\.load\(path, tg\.setup\(rule, model\)\)\."
)


@pytest.mark.slow  # orbax writes and reads a folder (~0.5 s)
def test_load_refuses_a_leaf_view_as_like(tmp_path):
    m = chain()
    tg.save(tmp_path / "c", tg.setup(optax.adam(0.1), m))
    with pytest.raises(
        TypeError, match=r"tg\.load: got the optimiser state of one parameter " + _LEAF_FIX
    ):
        tg.load(tmp_path / "c", tg.setup(optax.adam(0.1), m)[0].weight)


@pytest.mark.slow  # orbax writes and reads a folder (~0.5 s)
def test_weak_types_static_data_and_ties_round_trip(tmp_path):
    # optimiser.md: "Weakly typed arrays come back weakly typed"; "A Module's static data
    # ... tg.load takes them from like"; API.md: "tied weights come back tied".
    class M(tg.Module):
        def __init__(self, eps):
            self.w = jnp.ones(2)
            self.v = self.w
            self.half = jnp.asarray(0.5)
            self.eps = eps

    tg.save(tmp_path / "c", M(1.0))
    like = M(2.0)
    like.v = jnp.zeros(2)  # untied in like
    m2 = tg.load(tmp_path / "c", like)
    assert m2.half.weak_type and not m2.w.weak_type
    assert m2.eps == 2.0
    assert m2.w is m2.v


# ============================================================ pitfalls.md


@pytest.mark.slow  # several compilations (~0.6 s)
def test_train_stops_on_a_non_finite_loss_with_the_last_good_model():
    # pitfalls.md: "tg.train stops at once, naming the epoch and step; the error's .model
    # and .state are those of the last good step". Reference: one plain optax step.
    m = nn.Dense(3, 1, key=jax.random.key(0))
    rule = optax.sgd(1e30)
    s = tg.setup(rule, m)
    x, y = jnp.ones((2, 3)), jnp.zeros((2, 1))
    loss = lambda m, x, y: tg.losses.mse(m(x), y)
    with pytest.raises(tg.NonFiniteLossError, match=r"the loss is (nan|inf) at epoch 0, step 1"):
        tg.train(loss, m, [(x, y)] * 4, s, progress=False)
    try:
        tg.train(loss, m, [(x, y)] * 4, s, progress=False)
    except tg.NonFiniteLossError as e:
        good = e.model
    ref = {"w": m.weight, "b": m.bias}
    ref, _ = optax_run(
        rule, ref, [jax.grad(lambda p: tg.losses.mse(x @ p["w"].T + p["b"], y))(ref)]
    )
    got = np.asarray(good.weight, np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(ref["w"], np.float64), rtol=1e-5)


def test_dense_wrong_input_size_message():
    with pytest.raises(ValueError) as e:
        nn.Dense(4, 2, key=jax.random.key(0))(jnp.ones((3, 5)))
    assert (
        str(e.value)
        == "Dense(4 => 2): expected input with 4 features on axis -1, got shape (3, 5)."
    )


def test_an_array_in_a_deque_is_fresh_with_one_retrace_warning():
    # pitfalls.md: "tg.RetraceWarning, once per function, when a closure reaches an array
    # through an object treegrad cannot see into ...; it then re-traces on every call".
    import collections

    dq = collections.deque([jnp.array([1.0, 2.0])])
    f = lambda v: jnp.sum(v * dq[0])
    with pytest.warns(tg.RetraceWarning, match=r"through objects it cannot see into") as rec:
        a = tg.gradient(f, jnp.ones(2))[0]
        dq[0] = jnp.array([5.0, 6.0])
        b = tg.gradient(f, jnp.ones(2))[0]
    assert sum(issubclass(w.category, tg.RetraceWarning) for w in rec) == 1
    close(a, [1.0, 2.0])
    close(b, [5.0, 6.0])


def test_update_inside_a_users_jax_jit_on_a_captured_model_is_refused():
    # pitfalls.md: "tg.update_ inside your own jax.jit, on a model it captured, is refused
    # with a TypeError that says so".
    m = {"w": jnp.ones(2)}
    ps = tg.params(m)
    s = tg.setup(optax.sgd(0.1), ps)

    @jax.jit
    def step():
        tg.update_(s, ps, tg.gradient(lambda: jnp.sum(m["w"] ** 2), ps))

    with pytest.raises(TypeError, match=r"tg\.update_"):
        step()
    assert np.array_equal(m["w"], jnp.ones(2)) and not isinstance(m["w"], jax.core.Tracer)


def test_a_numpy_mask_captured_works_and_stays_fresh():
    # pitfalls.md: "So a numpy mask works and stays fresh".
    mask = np.array([True, False, True])
    w = jnp.array([1.0, 2.0, 3.0])
    f = lambda w: jnp.sum(w[mask] ** 2)
    close(tg.gradient(f, w)[0], [2.0, 0.0, 6.0])
    mask[:] = [False, True, True]
    close(tg.gradient(f, w)[0], jax.grad(lambda w: jnp.sum(w[np.array([1, 2])] ** 2))(w))


# ============================================================ compilation.md


def test_static_module_holding_an_array_edited_in_place_is_read_fresh():
    # FIXED. compilation.md: "A static Module ... is keyed by what it holds, its static
    # data included, so one edited in place traces again". A Module holding an array was
    # keyed by identity: the old trace was reused, a stale result.
    class M(tg.Module):
        def __init__(self):
            self.w = jnp.ones(2)
            self.s = 1.0

    g = tg.jit(lambda m, x: x * m.s, static_argnums=0)
    m, x = M(), jnp.array([1.0, 2.0])
    close(g(m, x), x * 1.0)
    m.s = 3.0
    close(g(m, x), x * 3.0)
    h = tg.jit(lambda x, m: x * m.s, static_argnames="m")
    close(h(x, m=m), x * 3.0)
    m.s = 4.0
    close(h(x, m=m), x * 4.0)


def test_static_module_holding_an_array_it_reads_compiles_once_and_is_fresh():
    # FIXED with the above: reading the static Module's array gave a RetraceWarning
    # ("through objects it cannot see into ... hold them in a tg.Module") on every call.
    class M(tg.Module):
        def __init__(self):
            self.w = jnp.ones(2)
            self.s = 1.0

    traces = []

    def f(m, x):
        traces.append(1)
        return x * m.s + jnp.sum(m.w)

    g = tg.jit(f, static_argnums=0)
    m, x = M(), jnp.array([1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(g(m, x), [3.0])
        close(g(m, x), [3.0])
        assert len(traces) == 1
        m.w = jnp.zeros(2)  # an array: a traced input, no new trace
        close(g(m, x), [1.0])
        assert len(traces) == 1
        m.s = 3.0
        close(g(m, x), [3.0])
        assert len(traces) == 2


def test_update_returns_a_dict_model_with_sorted_keys():
    # compilation.md: "tg.update returns a dict model with sorted keys".
    m = {"b": jnp.ones(2), "a": jnp.ones(1)}
    s = tg.setup(optax.sgd(0.1), m)
    _, m2 = tg.update(s, m, {"b": jnp.ones(2), "a": jnp.ones(1)})
    assert list(m2) == ["a", "b"]
    close(m2, {"a": [0.9], "b": [0.9, 0.9]})


def test_jit_with_other_options_never_reuses_a_program():
    # compilation.md: "tg.jit(step) never reuses a program that tg.jit(step,
    # donate_argnums=0) made (it would delete its callers' arrays)".
    traces = []

    def step(m):
        traces.append(1)
        return jax.tree_util.tree_map(lambda a: a + 1, m)

    keep = {"w": jnp.ones(2)}
    tg.jit(step)(keep)
    assert not keep["w"].is_deleted()
    donated = {"w": jnp.ones(2)}
    close(tg.jit(step, donate_argnums=0)(donated), {"w": [2.0, 2.0]})
    assert len(traces) == 2


def test_a_donated_tied_weight_is_donated_once_and_a_later_read_is_named():
    # compilation.md: "a tied weight is donated once ... A later call given a donated
    # array ... names it".
    w = jnp.ones(3)
    m = {"a": w, "b": w}
    s = tg.setup(optax.sgd(0.1), m)
    _, m2 = tg.update(s, m, {"a": jnp.ones(3), "b": None}, donate=True)
    assert w.is_deleted() and m2["a"] is m2["b"]
    close(m2["a"], [0.9, 0.9, 0.9])
    with pytest.raises(RuntimeError, match=r"reads, as w, an array that was deleted"):
        tg.withgradient(lambda v: jnp.sum(v * w), jnp.ones(3))


def test_returning_grads_from_tg_jit_says_what_to_return():
    m = {"w": jnp.ones(2)}
    ps = tg.params(m)
    step = tg.jit(lambda: tg.gradient(lambda: jnp.sum(m["w"] ** 2), ps))
    with pytest.raises(TypeError, match=r"returns a tg\.Grads.*grads\.to_tree\(model\)"):
        step()


def test_an_entry_popped_from_a_captured_list_is_the_next_each_call():
    # compilation.md: "An entry it takes out of a list ... each call takes the next entry
    # as it would uncompiled ... (a tg.RetraceWarning says so once)".
    batches = [jnp.full(2, 1.0), jnp.full(2, 2.0), jnp.full(2, 3.0)]
    f = lambda v: jnp.sum(v * batches.pop())
    with pytest.warns(tg.RetraceWarning, match=r"takes items from a list"):
        outs = [float(tg.gradient(f, jnp.ones(2))[0][0]) for _ in range(3)]
    assert outs == [3.0, 2.0, 1.0] and batches == []


def test_a_schedule_inside_the_rule_reading_a_dict_is_read_fresh():
    # compilation.md: "A schedule reading a dict entry that changed traces the step
    # again, so it reads the new value at every step, as plain optax run eagerly does."
    cfg = {"lr": 0.1}
    sched = lambda count: cfg["lr"]
    m = {"w": jnp.ones(1)}
    s = tg.setup(optax.inject_hyperparams(optax.sgd)(learning_rate=sched), m)
    s, m = tg.update(s, m, {"w": jnp.ones(1)})
    cfg["lr"] = 1.0
    s, m = tg.update(s, m, {"w": jnp.ones(1)})
    close(m["w"], [1.0 - 0.1 - 1.0])


@pytest.mark.slow  # several compilations (~0.7 s)
def test_hessian_changes_a_python_value_once():
    # compilation.md: "tg.hessian runs the function more than once while it traces ...
    # the Python values it changes start each run from the values the call found, and
    # are changed once."
    calls = {"n": 0}

    def f(w):
        calls["n"] += 1
        return jnp.sum(w**3)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        (H,) = tg.hessian(f, jnp.array([1.0, 2.0]))
    assert calls["n"] == 1
    close(H, jax.hessian(lambda w: jnp.sum(w**3))(jnp.array([1.0, 2.0])))


def test_the_cache_keeps_at_most_128_programs_and_no_user_arrays():
    # compilation.md: "The cache holds no user arrays (deleting a model frees it) and
    # keeps at most 128 compiled programs".
    import gc
    import weakref

    from treegrad import _cache

    assert _cache.MAX_ENTRIES == 128

    def use():
        big = jnp.ones(7)
        m = {"w": big}
        tg.gradient(lambda: jnp.sum(m["w"] ** 2), tg.params(m))
        tg.gradient(lambda v: jnp.sum(v * big), jnp.ones(7))
        return weakref.ref(big)

    r = use()
    gc.collect()
    assert r() is None


@pytest.mark.slow  # 140 compilations (~3 s)
def test_the_cache_is_bounded_at_128_entries():
    from treegrad import _cache

    for i in range(140):
        f = eval(f"lambda v: jnp.sum(v) * {i}.0", {"jnp": jnp})  # 140 distinct codes
        close(tg.gradient(f, jnp.ones(1))[0], [float(i)])
    assert len(_cache._LRU) <= 128


# ============================================================ API.md / flux.md / coming-from.md


def test_dense_shapes_and_map():
    # API.md §5: weight (out, in), bias (out,), maps (..., in) to (..., out).
    d = nn.Dense(3, 5, key=jax.random.key(0))
    x = jnp.arange(42.0).reshape(2, 7, 3)
    assert d.weight.shape == (5, 3) and d.bias.shape == (5,)
    close(d(x), x @ d.weight.T + d.bias, tol=1e-4)


def test_losses_against_closed_form_and_optax():
    a, b = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.0, 2.0, 5.0])
    close(tg.losses.mse(a, b), 5.0 / 3.0)
    logits = jax.random.normal(jax.random.key(0), (4, 3))
    y = jax.nn.one_hot(jnp.array([0, 2, 1, 1]), 3)
    close(tg.losses.logitcrossentropy(logits, y), optax.softmax_cross_entropy(logits, y).mean())


def test_documented_defaults():
    import inspect

    from jax.sharding import PartitionSpec as P

    sig = inspect.signature
    assert sig(tg.train).parameters["epochs"].default == 1
    assert sig(tg.update).parameters["donate"].default is False
    assert sig(tg.gradient).parameters["strict"].default is False
    assert sig(tg.shard_batch).parameters["spec"].default == P("data")
    assert sig(tg.shard).parameters["mesh"].default is None
    jit = sig(tg.jit).parameters
    for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
        assert jit[name].default == ()
    assert sig(nn.Dense).parameters["activation"].default is None


def test_shard_leaves_non_array_leaves_alone():
    # API.md §6: "non-array leaves are left alone".
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    m = {"w": jnp.ones(2), "s": "hi", "f": 1.5, "n": None}
    m2 = tg.shard(m, P(), mesh=mesh)
    assert m2["s"] == "hi" and m2["f"] == 1.5 and m2["n"] is None
    close(m2["w"], [1.0, 1.0])


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ({"layers.5.weight": "P()"}, r"the rule 'layers\.5\.weight' matches no array"),
        ({"layers.*.weight": "P()", "layers.0.weight": "P()"}, r"'layers\.0\.weight' is shadowed"),
        ({"layers.0.weight": "P('model')"}, r"names the axis 'model', which the mesh lacks"),
        (
            {"layers.0.weight": "P('data', 'data')"},
            r"for 'layers\.0\.weight' names the axis 'data' twice",
        ),
    ],
    ids=["nothing", "shadowed", "no-axis", "twice"],
)
def test_shard_rule_errors_name_the_path(rules, match):
    # scaling.md: "A rule that places nothing ..., or an axis the mesh lacks or names
    # twice is an error naming the path."
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rules = {k: eval(v, {"P": P}) for k, v in rules.items()}
    with pytest.raises(ValueError, match=match):
        tg.shard(chain(), rules, mesh=mesh)


# ============================================================ more claims: freshness routes


@pytest.mark.slow  # several compilations (~0.7 s)
def test_inject_hyperparams_state_dtypes_are_optaxs_after_a_step_from_the_start():
    # optimiser.md: "optax.inject_hyperparams keeps its hyperparameters in the parameters'
    # common dtype (complex, for a model mixing real and complex arrays), and a real
    # parameter's moments take it at the first step, as in plain optax; tg.setup makes
    # the state in those dtypes from the start."
    m = {"r": jnp.array([1.0, -1.0]), "c": jnp.array([1 + 1j, 2j], jnp.complex64)}
    g = {"r": jnp.array([0.5, 1.0]), "c": jnp.array([1 - 1j, 0.5], jnp.complex64)}
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    s = tg.setup(rule, m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # optax casts complex to real
        ref, os1 = optax_run(rule, m, [g])
    dtypes = lambda t: [x.dtype for x in jax.tree_util.tree_leaves(t)]
    assert dtypes(s) == dtypes(os1)
    s, m1 = tg.update(s, m, g)
    assert dtypes(s) == dtypes(os1)
    close(m1, ref)


def test_weight_decay_over_a_captured_params_and_a_scalar_parameter():
    # API.md §3: "Iterating over a captured Params inside f works, as in Flux's
    # weight-decay idiom"; "0-d arrays (scalars) can be parameters".
    m = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5)}
    ps = tg.params(m)
    g = tg.gradient(
        lambda: jnp.sum(m["w"] ** 3) + m["b"] + 0.1 * sum(jnp.sum(p**2) for p in ps), ps
    )
    ref = jax.grad(
        lambda d: jnp.sum(d["w"] ** 3) + d["b"] + 0.1 * (jnp.sum(d["w"] ** 2) + d["b"] ** 2)
    )(m)
    close(g[m["w"]], ref["w"])
    close(g[m["b"]], ref["b"])


def test_a_parameter_read_through_a_plain_object_in_a_list_is_found():
    # API.md §3: "A parameter held by a plain object inside a list or dict is found too."
    h = _Plain(0.0)
    h.w = jnp.array([1.0, 2.0])
    held = {"objs": [h]}
    g = tg.gradient(lambda: jnp.sum(held["objs"][0].w ** 2), tg.Params([h.w]))
    close(g[h.w], jax.grad(lambda w: jnp.sum(w**2))(h.w))


_W_BODY = jnp.array([1.0, 2.0])


def _body(x):
    return x * _W_BODY


def test_a_long_lived_cond_body_reading_a_global_is_fresh():
    # compilation.md: "A long-lived function given to lax.cond ... that reads the model
    # from a global ... treegrad empties that memo of jax's ... so a gradient reads the
    # arrays of this call".
    global _W_BODY
    f = lambda v: jnp.sum(jax.lax.cond(True, _body, lambda x: x, v))
    close(tg.gradient(f, jnp.ones(2))[0], [1.0, 2.0])
    _W_BODY = jnp.array([5.0, 7.0])
    close(tg.gradient(f, jnp.ones(2))[0], [5.0, 7.0])


def test_contextvar_enum_and_singledispatch_are_read_fresh():
    # compilation.md: "what ... a ContextVar holds in the calling context", "the value of
    # an Enum member (a list there, edited in place, is seen)", "how
    # functools.singledispatch registers".
    import contextvars
    import enum
    import functools

    cv = contextvars.ContextVar("cv")

    class E(enum.Enum):
        A = [1.0]  # noqa: RUF012 (a list member, edited in place below)

    @functools.singledispatch
    def k(x):
        return 1.0

    mode = {"m": 1}
    f = lambda v: jnp.sum(v * cv.get()) * E.A.value[0] * k(mode["m"])
    cv.set(jnp.array([2.0]))
    close(tg.gradient(f, jnp.ones(1))[0], [2.0])
    cv.set(jnp.array([3.0]))
    close(tg.gradient(f, jnp.ones(1))[0], [3.0])
    E.A.value[0] = 4.0
    close(tg.gradient(f, jnp.ones(1))[0], [12.0])

    @k.register(int)
    def _(x):
        return 0.5

    close(tg.gradient(f, jnp.ones(1))[0], [6.0])
    close(jax.grad(lambda v: jnp.sum(f(v)))(jnp.ones(1)), [6.0])  # uncompiled: the same


def test_a_generator_seeded_inside_draws_the_same_and_compiles_once():
    # pitfalls.md: "A generator made and seeded inside the function
    # (np.random.default_rng(0)) draws the same values on every call, so it is compiled
    # once" (no RetraceWarning: warnings are errors here).
    traces = []

    def f(v):
        traces.append(1)
        return jnp.sum(v * np.random.default_rng(0).normal(size=2))

    for _ in range(3):
        close(tg.gradient(f, jnp.ones(2))[0], np.random.default_rng(0).normal(size=2))
    assert len(traces) == 1


def test_a_value_set_once_costs_one_trace_then_an_edit_is_seen():
    # compilation.md / pitfalls.md: "A value set once (cfg.setdefault("scale", 2.0) ...)
    # costs one trace more and no warning: from the second call on it is read and
    # checked like any other value".
    cfg, traces = {}, []

    def f(v):
        traces.append(1)
        cfg.setdefault("scale", 2.0)
        return jnp.sum(v) * cfg["scale"]

    outs = [float(tg.gradient(f, jnp.ones(1))[0][0]) for _ in range(4)]
    assert outs == [2.0] * 4 and len(traces) == 2
    cfg["scale"] = 5.0
    assert float(tg.gradient(f, jnp.ones(1))[0][0]) == 5.0


def test_a_log_entry_holding_an_array_is_written_back_and_compiles_once():
    # pitfalls.md: "last = {"loss": jnp.zeros(())} before the first call, then
    # last["loss"] = loss in the step ... written back after each one, and the step
    # compiles once."
    last, traces = {"loss": jnp.zeros(())}, []
    m = {"w": jnp.array([1.0, 2.0])}

    @tg.jit
    def step(x):
        traces.append(1)
        loss = jnp.sum(m["w"] * x)
        last["loss"] = loss
        return loss

    for i in range(3):
        step(jnp.full(2, float(i)))
        assert float(last["loss"]) == 3.0 * i
    assert len(traces) == 1


def test_a_captured_array_stored_as_it_is_stays_the_users_array():
    # compilation.md: "One of the arrays the function captures, stored elsewhere as it is
    # (history.append(model.w) ...) is not a computed value: your own array stays there".
    m, history = {"w": jnp.ones(2)}, []

    def f(v):
        history.append(m["w"])
        return jnp.sum(v * m["w"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.RetraceWarning)
        for _ in range(2):
            close(tg.gradient(f, jnp.ones(2))[0], [1.0, 1.0])
    assert history and all(h is m["w"] for h in history)


def test_a_dict_values_view_the_function_holds_is_read_fresh_without_a_jax_warning():
    # FIXED. compilation.md: treegrad sees into "what a builtin method or a dict view the
    # function holds reads (get = cfg.get, cfg.values(): the dict behind it)". Holding
    # `cfg.values()` raised jax's DeprecationWarning "Python iterable type 'dict_values'
    # is treated as a leaf in PyTree" (an error under -W error, and in a later jax) from
    # `_swap._holds_tracer`, which flattened the held view after each trace.
    # (pyproject ignores jax's DeprecationWarnings; a user's `-W error` does not)
    cfg = {"s": 2.0, "t": 1.0}
    vals = cfg.values()
    f = lambda v: jnp.sum(v) * sum(vals)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(tg.gradient(f, jnp.ones(()))[0]) == 3.0
        cfg["s"] = 3.0
        assert float(tg.gradient(f, jnp.ones(()))[0]) == 4.0 == float(jax.grad(f)(jnp.ones(())))


@pytest.mark.xfail(
    strict=True,
    reason="_walk.Walk.node: a dict view held by the function (`vals = m.values()`) is "
    "walked as Same(view) with its dict held as a root by identity (`_held`); the dict's "
    "arrays, read by iterating the view (no key named in the code), are not made inputs "
    "of the trace (unlike `get = m.get`, whose read names the key). They stay constants: "
    "the result is right only because the function is re-traced on every call, with a "
    "RetraceWarning 'through objects it cannot see into', and implicit mode refuses such "
    "a parameter, while compilation.md lists 'cfg.values(): the dict behind it' among "
    "what treegrad sees into",
)
def test_an_array_read_through_a_dict_values_view_is_an_input():
    m = {"w": jnp.ones(2)}
    vals = m.values()
    traces = []

    def f(v):
        traces.append(1)
        return jnp.sum(v * next(iter(vals)))

    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.RetraceWarning)
        close(tg.gradient(f, jnp.ones(2))[0], [1.0, 1.0])
        m["w"] = jnp.full(2, 3.0)
        close(tg.gradient(f, jnp.ones(2))[0], [3.0, 3.0])
    assert len(traces) == 1


@pytest.mark.parametrize("kind", ["values view", "generator", "list iterator"])
def test_a_module_holding_an_iterator_or_a_values_view_is_static_without_a_jax_warning(kind):
    # FIXED. API.md §1: "everything else (functions, strings, Python numbers, None) is
    # static". A Module attribute holding a generator, an iterator (a data loader kept on
    # the model) or a dict's values view raised jax's DeprecationWarning "Python iterable
    # type ... is treated as a leaf" (an error in a later jax) at every flatten, from
    # `_module.holds_arrays`.
    class M(tg.Module):
        def __init__(self, it):
            self.w = jnp.array([1.0, 2.0])
            self.it = it

    it = {
        "values view": {"a": 1.0}.values(),
        "generator": (i for i in range(3)),
        "list iterator": iter([1, 2]),
    }[kind]
    m = M(it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (g,) = tg.gradient(lambda m: jnp.sum(m.w**2), m)
        _, m2 = tg.update(tg.setup(optax.sgd(0.5), m), m, g)
    close(g.w, jax.grad(lambda w: jnp.sum(w**2))(m.w))
    assert g.it is it and m2.it is it
    close(m2.w, [0.0, 0.0])


# ============================================================ more claims: the optimiser


@pytest.mark.slow  # several compilations (~0.7 s)
def test_none_gradients_do_not_recompile_the_update():
    # optimiser.md: "Which gradients are None is an input of the compiled step, not part
    # of its cache key: a step with None gradients does not re-trace." Counted with jax's
    # own compile events, independent of treegrad.
    compiles = []

    def listen(ev, d, **kw):
        if "backend_compile" in ev:
            compiles.append(ev)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        _count_update_compiles(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _count_update_compiles(compiles):
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    rule = optax.adam(0.1)
    s = tg.setup(rule, m)
    gs = [
        {"a": jnp.array([0.5, 1.0]), "b": jnp.array([2.0])},
        {"a": None, "b": jnp.array([1.0])},
        {"a": jnp.array([1.0, -1.0]), "b": None},
    ]
    s, m1 = tg.update(s, m, gs[0])  # the first call compiles
    n = len(compiles)
    s, m2 = tg.update(s, m1, gs[1])
    s, _ = tg.update(s, m2, gs[2])
    assert len(compiles) == n
    # the values: plain optax with a zero gradient for a, whose value is put back
    ref, os_ = optax_run(rule, m, [gs[0]])
    u, _ = rule.update({"a": jnp.zeros(2), "b": gs[1]["b"]}, os_, ref)
    assert np.array_equal(m2["a"], m1["a"])
    close(m2["b"], optax.apply_updates(ref, u)["b"])


def test_update_with_grads_taken_before_an_update_is_refused_changing_nothing():
    # optimiser.md: "Everything is checked before anything changes (... that a tg.Grads
    # was taken for the model's current arrays)".
    m = {"w": jnp.ones(2)}
    ps = tg.params(m)
    s = tg.setup(optax.adam(0.1), ps)
    g = tg.gradient(lambda: jnp.sum(m["w"] ** 2), ps)
    tg.update_(s, ps, g)
    w1, leaves = m["w"], jax.tree_util.tree_leaves(s)
    with pytest.raises(ValueError, match=r"taken before the parameters were replaced"):
        tg.update_(s, ps, g)
    assert m["w"] is w1
    for a, b in zip(jax.tree_util.tree_leaves(s), leaves, strict=True):
        assert np.array_equal(a, b)


def test_key_error_for_an_array_of_another_shape_does_not_suggest_a_replacement():
    # API.md §3: "when the array has the shape and dtype of a registered parameter, that
    # the parameter may have been replaced" (and only then).
    a = jnp.ones(2)
    g = tg.gradient(lambda: jnp.sum(a * 2), tg.Params([a]))
    with pytest.raises(KeyError, match=r"float32\[5\] array is not a registered") as e:
        g[jnp.ones(5)]
    assert "replaced" not in str(e.value)
    with pytest.raises(KeyError, match=r"may have been replaced"):
        g[a + 0]


@pytest.mark.slow  # a compiled training run and its optax reference (~1 s)
def test_train_with_params_updates_in_place_like_optax_for_epochs():
    # API.md §5 / flux.md: "Given a Params ... loss(*batch) is a closure over the model
    # ... and the model is updated in place"; epochs repeat the data.
    m = nn.Dense(3, 1, key=jax.random.key(0))
    data = [(jnp.ones((4, 3)) * i, jnp.full((4, 1), float(i))) for i in range(3)]
    rule = optax.adam(0.05)
    ps = tg.params(m)
    ref = {"w": m.weight, "b": m.bias}
    _, _, losses = tg.train(
        lambda x, y: tg.losses.mse(m(x), y), ps, data, tg.setup(rule, ps), epochs=2, progress=False
    )
    os_, ref_losses = rule.init(ref), []
    for _ in range(2):
        for x, y in data:
            lf = lambda p, x=x, y=y: jnp.mean((x @ p["w"].T + p["b"] - y) ** 2)
            loss, g = jax.value_and_grad(lf)(ref)
            ref_losses.append(float(loss))
            u, os_ = rule.update(g, os_, ref)
            ref = optax.apply_updates(ref, u)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(m.weight, ref["w"], tol=1e-5)
    close(m.bias, ref["b"], tol=1e-5)


def test_adjust_is_pure_and_keeps_the_moments():
    # API.md §4: "tg.adjust(state, **hyper) (pure) ... change hyperparameters such as
    # learning_rate without resetting the optimiser's moments". Reference: optax's own
    # inject_hyperparams state edited between two steps.
    rule = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    m = {"w": jnp.array([1.0, -2.0])}
    g = {"w": jnp.array([0.3, 0.5])}
    s = tg.setup(rule, m)
    s, m = tg.update(s, m, g)
    s2 = tg.adjust(s, learning_rate=0.01)
    assert float(s["w"].state.hyperparams["learning_rate"]) == np.float32(0.1)
    _, m2 = tg.update(s2, m, g)
    ref = {"w": jnp.array([1.0, -2.0])}
    ref, os_ = optax_run(rule, ref, [g])
    os_.hyperparams["learning_rate"] = jnp.asarray(0.01)
    u, _ = rule.update(g, os_, ref)
    close(m2, optax.apply_updates(ref, u))


@pytest.mark.slow  # four steps and two optax references (~0.6 s)
def test_adjust_of_a_shared_substate_gives_it_a_copy_with_moments_and_counters():
    # optimiser.md: "Adjusting a sub-state whose parameters share an optax state with
    # others first gives them their own copy of it (moments and counters included)".
    # For adam (per-parameter moments, one count), equal to two separate optax runs.
    mk = optax.inject_hyperparams(optax.adam)
    m = {"enc": jnp.array([1.0, -2.0]), "dec": jnp.array([0.5])}
    gs = [{"enc": jnp.array([0.3, 0.5]), "dec": jnp.array([1.0])}] * 4
    s = tg.setup(mk(learning_rate=0.1), m)
    for i, g in enumerate(gs):
        if i == 2:
            tg.adjust_(s["enc"], learning_rate=0.02)
        s, m = tg.update(s, m, g)
    for k, p0, lr2 in (("enc", [1.0, -2.0], 0.02), ("dec", [0.5], 0.1)):
        r, p = mk(learning_rate=0.1), {k: jnp.array(p0)}
        os_ = r.init(p)
        for i, g in enumerate(gs):
            if i == 2:
                os_.hyperparams["learning_rate"] = jnp.asarray(lr2)
            u, os_ = r.update({k: g[k]}, os_, p)
            p = optax.apply_updates(p, u)
        close(m[k], p[k])


def test_adjust_of_a_shared_substate_inside_a_compiled_step_is_refused():
    # optimiser.md: "adjusting a sub-state that still shares its optax state with others
    # is an error there, which says what to do."
    m = {"enc": jnp.array([1.0, -2.0]), "dec": jnp.array([0.5])}
    s = tg.setup(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), m)

    @tg.jit
    def step(s, lr):
        tg.adjust_(s["enc"], learning_rate=lr)
        return s

    with pytest.raises(TypeError, match=r"inside a compiled step .*Give it a part of its own"):
        step(s, 0.5)


class _Twice(tg.Module):
    def __init__(self, a):
        self.a = a
        self.b = a


@pytest.mark.slow  # several compilations (~0.7 s)
def test_a_shared_submodel_is_one_object_after_update_and_update_():
    # API.md §4: "A sub-model shared by two places (the same Module object twice) is
    # still one object after update/update_." Values against jax.grad + sgd.
    a = nn.Dense(2, 2, key=jax.random.key(0))
    w0, b0 = a.weight, a.bias
    f = lambda w, b: jnp.sum(jnp.ones(2) @ w.T + b) + jnp.sum((jnp.ones(2) @ w.T + b) ** 2)
    gw, gb = jax.grad(f, (0, 1))(w0, b0)
    t = _Twice(a)
    loss = lambda t: jnp.sum(t.a(jnp.ones(2))) + jnp.sum(t.b(jnp.ones(2)) ** 2)
    _, t2 = tg.update(tg.setup(optax.sgd(0.1), t), t, tg.gradient(loss, t)[0])
    assert t2.a is t2.b
    close((t2.a.weight, t2.a.bias), (w0 - 0.1 * gw, b0 - 0.1 * gb))
    ps = tg.params(t)
    tg.update_(tg.setup(optax.sgd(0.1), ps), ps, tg.gradient(lambda: loss(t), ps))
    assert t.a is t.b is a
    close((a.weight, a.bias), (w0 - 0.1 * gw, b0 - 0.1 * gb))


def test_grads_arithmetic_treats_none_as_zero():
    # API.md §3: "Arithmetic: g1 + g2, g1 - g2, g * c, c * g, g / c, -g; None acts as
    # zero"; "g.map(fn) returns a new Grads"; "a read-only Mapping".
    import collections.abc

    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0])
    ps = tg.Params([a, b])
    g1 = tg.gradient(lambda: jnp.sum(a**2) + jnp.sum(b), ps)
    g2 = tg.gradient(lambda: jnp.sum(a**3), ps)
    assert g2[b] is None
    close((g1 + g2)[a], 2 * a + 3 * a**2)
    close((g1 + g2)[b], [1.0])
    close((g2 - g1)[b], [-1.0])
    close((-g2)[a], -3 * a**2)
    assert (g2 * 2)[b] is None and (g2 / 2)[b] is None and (-g2)[b] is None
    mapped = g1.map(lambda x: x * 10)
    assert isinstance(mapped, tg.Grads) and mapped is not g1
    close(mapped[a], 20 * a)
    assert isinstance(g1, collections.abc.Mapping)
    with pytest.raises(TypeError, match=r"Grads is read-only"):
        g1[a] = jnp.zeros(2)


@pytest.mark.slow  # several compilations (~0.8 s)
def test_trainable_attributes_only_the_rule_sees_the_trainable_tree():
    # API.md §1/§4: "__trainable__ ... only those attributes are collected by tg.params
    # and updated by the optimiser"; "The rule sees the whole trainable tree": a global
    # norm clip over the trainable attribute alone.
    class T(tg.Module):
        __trainable__ = ("w",)

        def __init__(self):
            self.w = jnp.array([1.0, 2.0])
            self.v = jnp.array([3.0])

    t = T()
    rule = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    s = tg.setup(rule, t)
    (g,) = tg.gradient(lambda t: jnp.sum(t.w**2) + jnp.sum(t.v**2) * 10, t)
    close(g.v, [60.0])  # explicit mode differentiates every floating leaf
    _, t2 = tg.update(s, t, g)
    ref, _ = optax_run(rule, {"w": t.w}, [{"w": 2 * t.w}])
    assert list(tg.params(t).named()) == ["w"]
    assert np.array_equal(t2.v, t.v)
    close(t2.w, ref["w"])


@pytest.mark.slow  # several compilations (~0.8 s)
def test_train_stops_on_a_non_finite_gradient_naming_the_parameters():
    # API.md §5: "stops with a clear error on a non-finite loss or gradient, naming the
    # step, with the last good model and state" (here: the ones given, step 0).
    m = nn.Dense(2, 1, key=jax.random.key(0))
    s = tg.setup(optax.sgd(0.1), m)
    data = [(jnp.zeros((1, 2)), jnp.zeros((1, 1)))] * 3
    loss = lambda m, x, y: jnp.sqrt(jnp.sum((m(x) - y - m.bias) ** 2))  # sqrt at 0
    with pytest.raises(
        tg.NonFiniteLossError, match=r"gradient of 'weight', 'bias' is not finite .* step 0"
    ) as e:
        tg.train(loss, m, data, s, progress=False)
    assert np.array_equal(e.value.model.weight, m.weight)
    assert np.array_equal(e.value.model.bias, m.bias)


# ============================================================ pitfalls.md: numpy and counters


def test_plain_jax_reads_an_array_a_live_trace_read_as_its_old_contents():
    # pitfalls.md (a claim about jax itself, on which treegrad's copies rest): "while a
    # trace that read an array is alive, jax converts that array object to its old
    # contents (plain jax too: after jax.make_jaxpr(f)(w) and buf += 1, jnp.asarray(buf)
    # gives the old values; jax 0.10.2 and 0.12)".
    buf = np.zeros(2)
    alive = jax.make_jaxpr(lambda w: w * buf)(jnp.ones(2))
    buf += 1
    assert np.array_equal(jnp.asarray(buf), [0.0, 0.0]) and np.array_equal(buf, [1.0, 1.0])
    del alive


def test_a_list_appended_to_and_read_is_a_counter_traced_every_call():
    # pitfalls.md: "A list it appends to and also reads (if len(self.history) > 3:, in the
    # function or a helper) is a counter: its length decides the result, so it is traced
    # on every call". Reference: the same function uncompiled.
    class Trainer:
        def __init__(self):
            self.history = []

    def make(tr):
        def f(x):
            tr.history.append(1)
            return x * (2.0 if len(tr.history) > 3 else 1.0)

        return f

    tr, ref_tr = Trainer(), Trainer()
    g, ref = tg.jit(make(tr)), make(ref_tr)
    with pytest.warns(tg.RetraceWarning, match=r"attribute 'history' of a Trainer"):
        outs = [float(g(jnp.ones(()))) for _ in range(6)]
    assert outs == [float(ref(jnp.ones(()))) for _ in range(6)] == [1.0] * 3 + [2.0] * 3
    assert len(tr.history) == 6


def test_numpy_arrays_changed_in_place_while_traced_follow_numpy():
    # pitfalls.md: "the function sorts, fills or shuffles one in place (order.sort() ...)
    # treegrad reads that function's captured numpy arrays as values"; "Arithmetic in
    # place through another name counts too: b = buf; b += 1".
    order = np.array([3.0, 1.0, 2.0])

    def f(w):
        order.sort()
        return jnp.sum(w * order)

    buf = np.zeros(2)

    def h(w):
        b = buf
        b += 1
        return jnp.sum(w * buf)

    with pytest.warns(tg.RetraceWarning, match=r"changes a numpy array it captures in place"):
        close(tg.gradient(f, jnp.ones(3))[0], [1.0, 2.0, 3.0])
        order[:] = [5.0, 4.0, 6.0]
        close(tg.gradient(f, jnp.ones(3))[0], [4.0, 5.0, 6.0])
        outs = [tg.gradient(h, jnp.ones(2))[0] for _ in range(3)]
    close(outs, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    close(buf, [3.0, 3.0])


# ============================================================ compilation.md: tg.jit forms


def test_jit_above_staticmethod_and_classmethods_cls_read_fresh():
    # compilation.md: "(cls of a @classmethod above @tg.jit is such an argument [read
    # fresh].) @tg.jit above @staticmethod compiles the function and binds no instance."
    class K:
        scale = 2.0

        @tg.jit
        @staticmethod
        def f(x):
            return x * 3

        @classmethod
        @tg.jit
        def g(cls, x):
            return x * cls.scale

    close(K().f(jnp.ones(1)), [3.0])
    close(K.g(jnp.ones(1)), [2.0])
    K.scale = 5.0
    close(K.g(jnp.ones(1)), [5.0])


@pytest.mark.slow  # several compilations (~0.8 s)
def test_multi_transform_label_function_on_a_callable_model_is_optaxs():
    # optimiser.md: "optax.masked and optax.multi_transform take mask and label trees
    # shaped like the model (give a function instead of a tree when the model is itself
    # callable, as optax calls callable label trees)".
    m = chain()

    def labels(tree):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "a" if "weight" in jax.tree_util.keystr(p) else "b", tree
        )

    rules = {"a": optax.adam(0.1), "b": optax.sgd(0.5)}
    s = tg.setup(optax.multi_transform(rules, labels), m)
    (g,) = tg.gradient(lambda m: jnp.sum(m(jnp.ones((2, 2))) ** 2), m)
    _, m2 = tg.update(s, m, g)
    d = {"w0": m[0].weight, "b0": m[0].bias, "w1": m[1].weight, "b1": m[1].bias}
    gd = {"w0": g[0].weight, "b0": g[0].bias, "w1": g[1].weight, "b1": g[1].bias}
    lab = {"w0": "a", "w1": "a", "b0": "b", "b1": "b"}
    ref, _ = optax_run(optax.multi_transform(rules, lab), d, [gd])
    close(
        (m2[0].weight, m2[0].bias, m2[1].weight, m2[1].bias),
        (ref["w0"], ref["b0"], ref["w1"], ref["b1"]),
    )


@pytest.mark.slow  # two compiled steps (~1 s)
def test_compiled_implicit_step_is_bit_identical_to_the_compiled_explicit_step():
    # compilation.md: "The whole step is one XLA computation, traced once, and
    # bit-for-bit the same as the explicit step above written from the same weights."
    x, y = jnp.arange(8.0).reshape(4, 2), jnp.ones((4, 1))
    loss = lambda m: jnp.mean((m(x) - y) ** 2)
    me = chain()
    se = tg.setup(optax.adam(1e-2), me)

    @tg.jit
    def explicit(state, model):
        (g,) = tg.gradient(loss, model)
        return tg.update(state, model, g)

    mi = chain()
    ps = tg.params(mi)
    si = tg.setup(optax.adam(1e-2), ps)

    @tg.jit
    def implicit():
        tg.update_(si, ps, tg.gradient(lambda: loss(mi), ps))

    for _ in range(3):
        se, me = explicit(se, me)
        implicit()
    for a, b in zip(jax.tree_util.tree_leaves(me), jax.tree_util.tree_leaves(mi), strict=True):
        assert np.array_equal(a, b)
