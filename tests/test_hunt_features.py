"""Python-language features inside a loss function (after Zygote.jl's test/features.jl
and the implicit-parameter tests of test/interface.jl).

Every feature is differentiated in both styles, explicit `tg.gradient(lambda m: ...,
model)` and implicit `tg.gradient(lambda: ..., tg.params(model))` (looked up as
`grads[W]`), against `jax.grad` of the same explicit function, and called again after
something the function reads has changed (API.md section 2, "Never stale").
"""

import dataclasses
import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg

W3 = jnp.array([1.0, 2.0, 3.0])


def _close(got, ref):
    """`got` (None meaning a structural zero) against `ref`, leaf by leaf."""
    ref = jnp.asarray(ref)
    got = jnp.zeros_like(ref) if got is None else got
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got, ref)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64), 1e-5, 1e-6)


def _close_tree(got, ref):
    lg = jax.tree_util.tree_leaves(got, is_leaf=lambda v: v is None)
    lr = jax.tree_util.tree_leaves(ref)
    assert jax.tree_util.tree_structure(ref) == jax.tree_util.tree_structure(
        jax.tree_util.tree_map(lambda r: 0, ref)
    )
    assert len(lg) == len(lr), (got, ref)
    for g, r in zip(lg, lr, strict=True):
        _close(g, r)


def check(loss, model):
    """Explicit and implicit gradients of `loss(model)` against `jax.grad`."""
    ref = jax.grad(loss)(model)
    (ge,) = tg.gradient(lambda m: loss(m), model)
    assert type(ge) is type(model)
    _close_tree(ge, ref)
    gi = tg.gradient(lambda: loss(model), tg.params(model))
    for p, r in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(ref), strict=True):
        _close(gi[p], r)
    return ref


def check_fn(f, w):
    """A function of one array: explicit gradient, and implicit through a dict."""
    ref = jax.grad(f)(w)
    _close(tg.gradient(f, w)[0], ref)
    box = {"w": w}
    _close(tg.gradient(lambda: f(box["w"]), tg.params(box))[w], ref)
    return ref


# -- closures ---------------------------------------------------------------------------


def test_closure_rebinding_a_captured_variable_with_nonlocal():
    def make():
        s, a = 1.0, jnp.ones(3)

        def loss(m):
            return jnp.sum(m["w"] * a) * s + jnp.sum(m["w"] ** 2)

        def rebind(new_s, new_a):
            nonlocal s, a
            s, a = new_s, new_a

        return loss, rebind

    loss, rebind = make()
    model = {"w": W3}
    r1 = check(loss, model)
    rebind(3.0, jnp.array([1.0, -1.0, 2.0]))
    r2 = check(loss, model)
    assert not np.allclose(r1["w"], r2["w"])
    rebind(3.0, jnp.ones((3,), jnp.float32) * 5)  # only the array changes
    _close(check(loss, model)["w"], 2 * W3 + 15.0)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_closures_created_in_a_loop_bind_late():
    xs = [jnp.ones(3), jnp.full(3, 2.0), jnp.full(3, 3.0)]
    fs = []
    for i in range(3):
        fs.append(lambda m: jnp.sum(m["w"] * xs[i]))  # noqa: B023
    model = {"w": W3}
    for f in fs:  # late binding: every closure reads the last i, as Python does
        _close(check(f, model)["w"], xs[2])
    i = 0
    for f in fs:
        _close(check(f, model)["w"], xs[0])
    xs[0] = jnp.full(3, -4.0)  # the list entry replaced
    _close(check(fs[1], model)["w"], xs[0])
    bound = [lambda m, i=i: jnp.sum(m["w"] * xs[i]) for i in range(3)]  # bound early
    for k, f in enumerate(bound):
        _close(check(f, model)["w"], xs[k])


def test_implicit_lambda_reading_a_loop_variable():
    W = jnp.array([0.5, -1.0, 2.0])
    xs = [jnp.ones(3), jnp.full(3, 2.0), jnp.full(3, 3.0)]
    ps = tg.Params([W])
    for i in (0, 2, 1):
        g = tg.gradient(lambda: jnp.sum(jnp.sin(W) * xs[i]), ps)  # noqa: B023
        _close(g[W], jnp.cos(W) * xs[i])


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_default_arguments():
    def loss(m, c=jnp.ones(3), k=1.0, *, p=2.0):  # noqa: B008
        return jnp.sum(m["w"] * c) * k + jnp.sum(m["w"] ** 2) * p

    model = {"w": W3}
    _close(check(loss, model)["w"], 1.0 + 4.0 * W3)
    loss.__defaults__ = (jnp.full(3, 2.0), 3.0)
    _close(check(loss, model)["w"], 6.0 + 4.0 * W3)
    loss.__kwdefaults__["p"] = 0.5
    _close(check(loss, model)["w"], 6.0 + W3)


# -- recursion, generators, control flow -----------------------------------------------


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_recursive_python_helper():
    cfg = {"depth": 2}

    def nest(w, n):
        return w if n == 0 else jnp.sin(nest(w, n - 1)) * 1.5

    def loss(m):
        return jnp.sum(nest(m["w"], cfg["depth"]))

    model = {"w": W3}
    seen = set()
    for depth in (2, 4, 0, 2):
        cfg["depth"] = depth
        seen.add(tuple(np.asarray(check(loss, model)["w"]).round(5)))
    assert len(seen) == 3


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_generators_and_comprehensions_over_model_parts():
    model = {"a": W3, "b": 2 * W3, "c": jnp.array([0.5, 0.0, -1.0])}
    chosen = ["a", "b"]

    def gen_loss(m):
        return sum(jnp.sum(m[k] ** 2) for k in chosen)

    def comp_loss(m):
        parts = {k: jnp.sum(jnp.tanh(v)) for k, v in m.items() if k in chosen}
        return sum([parts[k] * (j + 1) for j, k in enumerate(sorted(parts))])

    for loss in (gen_loss, comp_loss):
        chosen[:] = ["a", "b"]
        r = check(loss, model)
        assert not np.any(r["c"])
        chosen.append("c")
        assert np.any(check(loss, model)["c"])
        chosen[:] = ["b"]
        r = check(loss, model)
        assert not np.any(r["a"]) and np.any(r["b"])
        (ge,) = tg.gradient(loss, model)
        assert ge["a"] is None and ge["c"] is None


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_try_except_and_early_return():
    cfg = {"key": "a", "early": False}

    def loss(m):
        if cfg["early"]:
            return jnp.sum(m["b"] ** 3)
        try:
            v = m[cfg["key"]]
        except KeyError:
            return jnp.sum(jnp.cos(m["b"]))
        try:
            return jnp.sum(v.reshape(2, 2))  # shape error for a 3-vector: handled
        except TypeError:
            return jnp.sum(v**2)

    model = {"a": W3, "b": -W3}
    _close(check(loss, model)["a"], 2 * W3)
    cfg["key"] = "missing"
    r = check(loss, model)
    _close(r["b"], -jnp.sin(-W3))
    cfg["early"] = True
    _close(check(loss, model)["b"], 3 * W3**2)
    cfg.update(early=False, key="b")
    _close(check(loss, model)["b"], -2 * W3)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_python_control_flow_on_static_values():
    flags = {"square": True}
    extras = [jnp.array([1.0, 0.0, 0.0])]

    class Cfg:
        on = True

    def loss(m):
        out = jnp.sum(m["w"] ** 2) if flags["square"] else jnp.sum(m["w"] ** 3)
        for k in range(len(extras)):
            out = out + jnp.sum(m["w"] * extras[k])
        if Cfg.on:
            out = out * 2.0
        return out

    model = {"w": W3}
    results = []
    for square, n, on in ((True, 1, True), (False, 1, True), (False, 3, True), (True, 0, False)):
        flags["square"] = square
        extras[:] = [jnp.array([1.0, 0.0, float(j)]) for j in range(n)]
        Cfg.on = on
        results.append(check(loss, model)["w"])
    _close(results[3], 2 * W3)


# -- callables --------------------------------------------------------------------------


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_functools_partial():
    def scaled(c, m, a=None):
        return jnp.sum(m["w"] ** 2) * c + jnp.sum(m["w"] * a)

    model = {"w": W3}
    for c in (1.0, 3.0):
        p = functools.partial(scaled, c, a=jnp.ones(3))
        _close(check(p, model)["w"], 2 * c * W3 + 1.0)
    p.keywords["a"] = jnp.full(3, 5.0)  # the partial's own dict, edited in place
    _close(check(p, model)["w"], 6 * W3 + 5.0)
    q = functools.partial(jnp.dot, W3)  # a partial of a library function: explicit only
    _close(tg.gradient(q, jnp.ones(3))[0], W3)
    _close(tg.gradient(q, 2 * jnp.ones(3))[0], W3)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_bound_methods_classmethods_staticmethods():
    class Net:
        k = 2.0

        def __init__(self, s):
            self.s = s

        def loss(self, m):
            return jnp.sum(m["w"] ** 2) * self.s * self.k

        @classmethod
        def cls_loss(cls, m):
            return jnp.sum(m["w"] ** 3) * cls.k

        @staticmethod
        def static_loss(m):
            return jnp.sum(jnp.sin(m["w"])) * Net.k

    model = {"w": W3}
    net = Net(1.0)
    for s, k in ((1.0, 2.0), (4.0, 2.0), (4.0, 5.0)):
        net.s, Net.k = s, k
        _close(check(net.loss, model)["w"], 2 * W3 * s * k)
        _close(check(Net.cls_loss, model)["w"], 3 * W3**2 * k)
        _close(check(net.static_loss, model)["w"], jnp.cos(W3) * k)
    Net.loss = lambda self, m: jnp.sum(m["w"]) * 10.0  # the method swapped on the class
    _close(check(net.loss, model)["w"], jnp.full(3, 10.0))


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_operator_module_functions():
    ops = {"f": operator.mul}
    model = {"a": W3, "b": 2 * W3}

    def loss(m):
        return jnp.sum(ops["f"](m["a"], m["b"]))

    _close(check(loss, model)["a"], 2 * W3)
    ops["f"] = operator.add
    _close(check(loss, model)["a"], jnp.ones(3))
    ops["f"] = operator.truediv
    _close(check(loss, model)["b"], -W3 / (2 * W3) ** 2)
    pick = operator.itemgetter("a")  # created here: its key is a constant of this code
    _close(check(lambda m: jnp.sum(pick(m) ** 2), model)["a"], 2 * W3)


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_getattr_with_a_name_chosen_at_call_time():
    class Holder:
        pass

    h = Holder()
    h.x, h.y, h.k = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), 2.0
    names = ["x"]

    def loss(w):
        return jnp.sum(w * getattr(h, names[0])) * h.k

    w = jnp.array([0.5, -0.5])
    _close(check_fn(loss, w), 2 * h.x)
    names[0] = "y"
    _close(check_fn(loss, w), 2 * h.y)
    h.y = jnp.array([7.0, 8.0])
    _close(check_fn(loss, w), 2 * h.y)
    ps = tg.Params([h.x, h.y])
    for n in ("x", "y", "x"):
        names[0] = n
        g = tg.gradient(lambda: jnp.sum(getattr(h, names[0]) ** 2), ps)
        _close(g[h.x], 2 * h.x if n == "x" else jnp.zeros(2))
        _close(g[h.y], 2 * h.y if n == "y" else jnp.zeros(2))


def test_getattr_name_from_a_dict_entry_is_fresh():
    class Holder:
        pass

    h = Holder()
    h.s = 2.0
    cfg = {"n": "s"}
    w = jnp.ones(2)

    def loss(w):
        return jnp.sum(w) * getattr(h, cfg["n"])

    _close(tg.gradient(loss, w)[0], jnp.full(2, 2.0))
    h.s = 5.0  # the attribute named by the (unchanged) dict entry changes
    _close(tg.gradient(loss, w)[0], jnp.full(2, 5.0))  # was still 2.0


def test_getattr_name_from_a_dict_entry_implicit():
    class Holder:
        pass

    h = Holder()
    h.x = jnp.array([1.0, 2.0])
    cfg = {"n": "x"}
    g = tg.gradient(lambda: jnp.sum(getattr(h, cfg["n"]) ** 2), tg.Params([h.x]))
    _close(g[h.x], 2 * h.x)  # was a TypeError "cannot see into"


_H, _CFG, _K = object(), {"n": "s"}, "s"


@pytest.mark.parametrize(
    "fn, dynamic",
    [
        (lambda: getattr(_H, "s"), False),  # noqa: B009 -- the form under test
        (lambda: getattr(_H.a.b, "s"), False),  # noqa: B009
        (lambda: getattr(_H, "s", None), False),
        (lambda: getattr(_H, "s", _K), False),
        (lambda: hasattr(_H, "s") and setattr(_H, "s", 1.0), False),
        (lambda: operator.attrgetter("a.b", "c")(_H), False),
        (lambda: operator.methodcaller("f")(_H), False),
        (lambda: getattr(_H, _CFG["n"]), True),  # the constant is the dict's key
        (lambda: getattr(_H, _K), True),
        (lambda: getattr(_H, "s" + _K), True),
        (lambda: getattr(_H, f"{_K}"), True),
        (lambda: operator.attrgetter(_K)(_H), True),
        (lambda: setattr(_H, _CFG["n"], 1.0), True),
    ],
)
def test_which_code_reads_attributes_by_a_name_not_in_it(fn, dynamic):
    # A constant name is read as that name; any other may be every attribute
    # (`_codeinfo._constant_name`), so what it reads is checked whatever it names.
    from treegrad._codeinfo import code_info

    assert code_info(fn.__code__).dynamic is dynamic


class _Obj:
    pass


_OB = _Obj()
_ATTR_S = operator.attrgetter("s")
_PARTIAL_S = functools.partial(getattr, _OB, "s")


def _via_attrgetter(w):
    return jnp.sum(w) * _ATTR_S(_OB)


def _via_partial_getattr(w):
    return jnp.sum(w) * _PARTIAL_S()


def _via_sorted_key(w):
    items = sorted([_OB, _SECOND], key=_ATTR_S)
    return jnp.sum(w * items[0].a)


_SECOND = _Obj()


@pytest.mark.parametrize("loss", [_via_attrgetter, _via_partial_getattr, _via_sorted_key])
def test_attribute_read_through_a_captured_attrgetter_is_fresh(loss):
    _OB.s, _OB.a = 2.0, jnp.full(2, 1.0)
    _SECOND.s, _SECOND.a = 3.0, jnp.full(2, 10.0)
    w = jnp.ones(2)
    _close(tg.gradient(loss, w)[0], jax.grad(loss)(w))
    _OB.s = 5.0  # read by the attrgetter: changes both the scale and the sort order
    _close(tg.gradient(loss, w)[0], jax.grad(loss)(w))  # was the old result


def test_parameter_read_through_a_captured_attrgetter_implicit():
    _OB.x = jnp.array([1.0, 2.0])
    get_x = _GET_X
    g = tg.gradient(lambda: jnp.sum(get_x(_OB) ** 2), tg.Params([_OB.x]))
    _close(g[_OB.x], 2 * _OB.x)  # was a TypeError naming a Module's static data


_GET_X = operator.attrgetter("x")


# -- classes ----------------------------------------------------------------------------


class Scaled(tg.Module):
    scale = 2.0
    mode = "sum"

    def __init__(self):
        self.w = jnp.array([1.0, 2.0, 3.0])
        self.b = jnp.array([0.5, 0.5, -0.5])

    @property
    def effective(self):
        return self.w * self.scale + self.b

    def __call__(self, x):
        y = self.effective * x
        return jnp.sum(y) if self.mode == "sum" else jnp.sum(y**2)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_module_call_reads_a_class_attribute_changed_between_calls():
    m = Scaled()
    x = jnp.array([1.0, 2.0, 3.0])
    old = (Scaled.scale, Scaled.mode, Scaled.effective)
    try:
        for scale, mode in ((2.0, "sum"), (3.0, "sum"), (3.0, "square")):
            Scaled.scale, Scaled.mode = scale, mode
            check(lambda m: m(x), m)
        m.scale = 10.0  # an instance attribute shadows the class's
        _close(check(lambda m: m(x), m).w, 2 * (10 * m.w + m.b) * 10 * x**2)
        del m.scale
        _close(check(lambda m: m(x), m).w, 2 * (3 * m.w + m.b) * 3 * x**2)
        Scaled.effective = property(lambda self: self.w**2)  # the property swapped
        _close(check(lambda m: m(x), m).w, 2 * m.w**4 * x**2 * 2 / m.w)
    finally:
        Scaled.scale, Scaled.mode, Scaled.effective = old


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_getattr_and_getitem_user_class():
    class Bag:
        def __init__(self, d):
            self._d = d

        def __getattr__(self, k):
            try:
                return self.__dict__["_d"][k]
            except KeyError:
                raise AttributeError(k) from None

        def __getitem__(self, k):
            return self._d[k]

    bag = Bag({"a": jnp.ones(3), "b": jnp.full(3, 2.0), "k": 1.0})

    def loss(w):
        return jnp.sum(w * bag.a) * bag["k"] + jnp.sum(w**2 * bag["b"])

    _close(check_fn(loss, W3), 1.0 + 4 * W3)
    bag._d["a"], bag._d["k"] = jnp.full(3, 4.0), 3.0
    _close(check_fn(loss, W3), 12.0 + 4 * W3)
    a, b = bag._d["a"], bag._d["b"]
    g = tg.gradient(lambda: jnp.sum(bag.a**2 * bag["b"]), tg.Params([a, b]))
    _close(g[a], 2 * a * b)
    _close(g[b], a**2)


@dataclasses.dataclass
class _DC:
    w: jax.Array
    c: float = 1.0


@dataclasses.dataclass(frozen=True)
class _FrozenDC:
    w: jax.Array
    c: float = 1.0


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_dataclasses_holding_arrays():
    d, fd = _DC(jnp.full(3, 2.0)), _FrozenDC(jnp.full(3, 3.0))

    def loss(w):
        return jnp.sum(w * d.w) * d.c + jnp.sum(w**2 * fd.w) * fd.c

    _close(check_fn(loss, W3), d.w + 2 * W3 * fd.w)
    d.c, d.w = 5.0, jnp.full(3, 7.0)
    _close(check_fn(loss, W3), 35.0 + 2 * W3 * fd.w)
    object.__setattr__(fd, "c", 9.0)  # a frozen dataclass edited behind its back
    _close(check_fn(loss, W3), 35.0 + 18 * W3 * fd.w)
    fd = dataclasses.replace(fd, c=2.0)
    _close(check_fn(loss, W3), 35.0 + 4 * W3 * fd.w)
    for obj in (d, fd):  # implicit, the dataclass's array registered
        g = tg.gradient(lambda o=obj: jnp.sum(o.w**2) * o.c, tg.Params([obj.w]))
        _close(g[obj.w], 2 * obj.w * obj.c)


def test_plain_dataclass_argument_is_a_non_differentiable_leaf():
    # Not a pytree: a leaf that is not an array, so its gradient is None (API.md section 1).
    d = _DC(jnp.full(3, 2.0))
    # The warning says why the gradient is None and how to differentiate the arrays
    # (it blamed captured arrays and said to pass them as arguments: they were one).
    words = (
        r"tg\.gradient: an argument of .*<lambda> is a _DC, which is not a pytree: it is one "
        r"leaf, not differentiated \(its gradient is None\).*float32\[3\].*Make _DC a "
        r"tg\.Module, or register it as a pytree \(jax\.tree_util\.register_dataclass"
    )
    with pytest.warns(tg.RetraceWarning, match=words):
        (g,) = tg.gradient(lambda d: jnp.sum(d.w**2) * d.c, d)
    assert g is None
    with pytest.raises(TypeError, match=r"tg\.params got a _DC"):
        tg.params(d)


class _NT(NamedTuple):
    w: jax.Array
    b: jax.Array
    k: float = 1.0


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_namedtuple_model():
    def loss(n):
        return jnp.sum(n.w**2 * n.k + jnp.sin(n.b))

    for nt in (_NT(jnp.full(3, 2.0), W3), _NT(jnp.full(3, 2.0), W3, 3.0)):
        ref = jax.grad(lambda w, b, k=nt.k: loss(_NT(w, b, k)), argnums=(0, 1))(nt.w, nt.b)
        (g,) = tg.gradient(loss, nt)
        assert type(g) is _NT and g.k is None
        _close(g.w, ref[0])
        _close(g.b, ref[1])
        gi = tg.gradient(lambda n=nt: loss(n), tg.params(nt))
        _close(gi[nt.w], ref[0])
        _close(gi[nt.b], ref[1])


# -- nested gradients -------------------------------------------------------------------


def _inner(w):
    return jnp.sum(jnp.sin(w) * w**2)


_SECOND_ORDER = jax.grad(lambda w: jnp.sum(jax.grad(_inner)(w) ** 2))


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_nested_gradients_in_every_combination():
    def explicit_in_explicit(m):
        return jnp.sum(tg.gradient(_inner, m["w"])[0] ** 2)

    def implicit_in_explicit(m):
        g = tg.gradient(lambda: _inner(m["w"]), tg.Params([m["w"]]))
        return jnp.sum(g[m["w"]] ** 2)

    for outer in (explicit_in_explicit, implicit_in_explicit):
        for w in (W3, 1.5 * W3):
            _close(tg.gradient(outer, {"w": w})[0]["w"], _SECOND_ORDER(w))

    box = {"w": W3}
    ps = tg.params(box)

    def explicit_in_implicit():
        return jnp.sum(tg.gradient(_inner, box["w"])[0] ** 2)

    def implicit_in_implicit():
        return jnp.sum(tg.gradient(lambda: _inner(box["w"]), ps)[box["w"]] ** 2)

    for outer in (explicit_in_implicit, implicit_in_implicit):
        for w in (W3, 1.5 * W3):
            box["w"] = w
            _close(tg.gradient(outer, ps)[w], _SECOND_ORDER(w))


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_nested_gradient_across_different_parameters_and_with_jax():
    a, b = jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0])

    def outer():
        g = tg.gradient(lambda: jnp.sum(jnp.sin(a * b)), tg.Params([a]))
        return jnp.sum(g[a] ** 2)

    ref = jax.grad(lambda b: jnp.sum(jax.grad(lambda a: jnp.sum(jnp.sin(a * b)))(a) ** 2))
    _close(tg.gradient(outer, tg.Params([b]))[b], ref(b))
    b = jnp.array([2.0, 0.25])  # the captured variable rebound
    _close(tg.gradient(outer, tg.Params([b]))[b], ref(b))
    for w in (W3, -W3):
        _close(jax.grad(lambda w: jnp.sum(tg.gradient(_inner, w)[0] ** 2))(w), _SECOND_ORDER(w))
        _close(tg.gradient(lambda w: jnp.sum(jax.grad(_inner)(w) ** 2), w)[0], _SECOND_ORDER(w))
    v = None

    def hvp(w):
        return jnp.vdot(tg.gradient(_inner, w)[0], v)

    for v in (jnp.array([1.0, 0.0, 2.0]), jnp.array([0.0, 3.0, 0.0])):
        _close(tg.gradient(hvp, W3)[0], jax.hessian(_inner)(W3) @ v)


# -- mutation inside f ------------------------------------------------------------------


def test_side_effects_happen_at_trace_time_as_documented():
    # docs/compilation.md: a log the function appends to and a counter it increments are
    # its outputs; side effects happen when it is traced, as with jax.jit.
    log = []

    def loss(w):
        log.append("traced")
        return jnp.sum(w**2)

    for _ in range(3):
        _close(tg.gradient(loss, W3)[0], 2 * W3)
    assert log == ["traced"]


def test_setting_an_attribute_of_a_captured_model_matches_uncompiled():
    class Lin(tg.Module):
        def __init__(self):
            self.w = jnp.array([1.0, 2.0, 3.0])

    m, ref = Lin(), Lin()
    ps = tg.params(m)

    def step(model):
        model.w = model.w * 2
        return jnp.sum(model.w**2)

    for _ in range(2):
        w0 = m.w
        g = tg.gradient(lambda: step(m), ps)
        expected = jax.grad(lambda w: jnp.sum((2 * w) ** 2))(ref.w)
        step(ref)  # uncompiled: the model now holds the doubled array
        _close(g[w0], expected)
        assert isinstance(m.w, jax.Array) and not isinstance(m.w, jax.core.Tracer)
        _close(m.w, ref.w)


def test_setting_an_attribute_of_the_argument_leaves_the_caller_model_alone():
    class Lin(tg.Module):
        def __init__(self):
            self.w = jnp.array([1.0, 2.0, 3.0])

    def loss(model):
        model.w = model.w * 2
        return jnp.sum(model.w**2)

    m = Lin()
    w0 = m.w
    for _ in range(2):
        (g,) = tg.gradient(loss, m)
        _close(g.w, jax.grad(loss)(Lin()).w)
        assert m.w is w0  # like jax.grad: the argument is a value


def _lost(*places):
    """pytest.warns for the RetraceWarning of values stored from a trace, at `places`."""
    where = ", ".join(places).replace("[", r"\[").replace("]", r"\]")
    return pytest.warns(
        tg.RetraceWarning,
        match=r"^tg\.(gradient|jit): \S+ stores values computed from its traced arrays in "
        rf"your objects \({where}\)\. A traced value cannot stay there after the call, so "
        r"each was taken out again .* traced again on every call\. Return them .* or put an "
        r"array there before the first call: an array the function replaces is written back "
        r"after every call\.$",
    )


def test_cache_filled_into_a_new_dict_key():
    # docs/compilation.md: "A value it computes from the traced arrays and stores in your
    # object (a cache filled on first use) is not left there as a tracer: it is removed".
    cache = {}

    def loss(w):
        if "v" not in cache:
            cache["v"] = jnp.sum(w**2)
        return cache["v"]

    with _lost("dict entry ['v']") as caught:
        for w in (W3, 2 * W3):  # was a KeyError from _swap.py; fresh on the second call
            _close(tg.gradient(loss, w)[0], 2 * w)
            assert "v" not in cache
    assert len(caught) == 1  # once per function


def test_traced_values_in_a_dict_of_unsortable_keys_are_removed():
    # jax cannot flatten {1: y, "a": y} (it sorts keys): whether it holds a tracer is
    # unknown, so it goes as a traced value does (was a ValueError from inside treegrad).
    cache = {}

    def loss(w):
        y = jnp.sum(w**2)
        cache["v"] = {1: y, "a": y}
        return y

    with _lost("dict entry ['v']"):
        for w in (W3, 2 * W3):
            _close(tg.gradient(loss, w)[0], 2 * w)
            assert cache == {}


_GLOBAL_LAST = None


def _stores_a_global(w):
    global _GLOBAL_LAST
    _GLOBAL_LAST = jnp.sum(w**2)
    return _GLOBAL_LAST


def _stores_a_new_global(w):
    global _GLOBAL_NEW
    _GLOBAL_NEW = jnp.sum(w**3)
    return jnp.sum(w**3)


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_traced_value_written_to_a_global():
    with _lost("global '_GLOBAL_LAST'"), _lost("global '_GLOBAL_NEW'"):
        for w in (W3, 2 * W3, 2 * W3):  # the second call raised UnexpectedTracerError
            _close(tg.gradient(_stores_a_global, w)[0], 2 * w)
            assert _GLOBAL_LAST is None  # put back, as an object's attribute is
            _close(tg.gradient(_stores_a_new_global, w)[0], 3 * w**2)
            assert "_GLOBAL_NEW" not in globals()  # new: removed again
            g = tg.gradient(lambda w=w: _stores_a_global(w), tg.Params([w]))
            _close(g[w], 2 * w)
            assert _GLOBAL_LAST is None


def test_traced_value_assigned_to_a_nonlocal():
    last = 1.0
    fresh = None

    def loss(w):
        nonlocal last, fresh
        last = jnp.sum(w**2)
        if fresh is None:
            fresh = last
        return last * 1.0

    with _lost("closure variable 'fresh', closure variable 'last'"):
        for w in (W3, 2 * W3):
            _close(tg.gradient(loss, w)[0], 2 * w)
            assert last == 1.0 and fresh is None  # put back: no tracer left in the cells


def test_traced_value_appended_to_a_captured_list():
    seen = ["kept"]

    def loss(w):
        y = jnp.sum(w**2)
        seen.append(y)
        return y

    with _lost(r"1 item\(s\) appended to a list"):
        for w in (W3, 2 * W3):
            _close(tg.gradient(loss, w)[0], 2 * w)
            assert seen == ["kept"]  # removed, as a value added to a dict is


# -- arguments, shapes, ties ------------------------------------------------------------


@pytest.mark.slow  # over ~0.3 s: the default run stays under 3 minutes
def test_keyword_only_arguments_and_kwargs():
    def loss(m, *, scale=2.0, **extra):
        return jnp.sum(m["w"] ** 2) * scale + sum(jnp.sum(v * m["w"]) for v in extra.values())

    model = {"w": W3}
    _close(check(loss, model)["w"], 4 * W3)
    _close(check(lambda m: loss(m, scale=3.0, e=jnp.ones(3)), model)["w"], 6 * W3 + 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        tg.gradient(loss, model, scale=3.0)


@pytest.mark.slow  # the default run stays under 3 minutes; CI runs it
def test_same_function_object_with_different_shapes_and_dtypes():
    def f(w):
        return jnp.sum(jnp.tanh(w) ** 2)

    for x in (
        jnp.ones(3),
        jnp.ones((2, 2)),
        jnp.ones((), jnp.float32),
        jnp.ones(3, jnp.float16),
        jnp.ones(3, jnp.bfloat16),
        jnp.ones(3),
    ):
        g = check_fn(f, x)
        assert g.dtype == x.dtype and g.shape == x.shape
    box = {"w": jnp.ones(3)}
    ps = tg.params(box)
    for v in (jnp.ones(3), 2 * jnp.ones(4), jnp.ones((2, 2), jnp.float16)):
        box["w"] = v
        g = tg.gradient(lambda: jnp.sum(box["w"] ** 3), ps)[v]
        _close(g, 3 * v**2)


class _Lin(tg.Module):
    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return self.w @ x


@pytest.mark.slow  # over ~0.5 s: the default run stays under 3 minutes
def test_two_models_sharing_one_array_implicit_total():
    W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    x = jnp.array([1.0, -1.0])
    a, b = _Lin(W), _Lin(W)
    ps = tg.Params([a, b])
    assert len(ps) == 1
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(w @ (w @ x))))
    _close(tg.gradient(lambda: jnp.sum(jnp.tanh(b(a(x)))), ps)[W], ref(W))
    (ge,) = tg.gradient(lambda ms: jnp.sum(jnp.tanh(ms[1](ms[0](x)))), [a, b])
    _close(ge[0].w, ref(W))
    assert ge[1].w is None
    W2 = 0.5 * W
    a.w = b.w = W2  # re-tied to a new array
    _close(tg.gradient(lambda: jnp.sum(jnp.tanh(b(a(x)))), ps)[W2], ref(W2))


def test_untying_a_shared_weight_in_sub_models():
    W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    x = jnp.array([1.0, -1.0])

    class Two(tg.Module):
        def __init__(self):
            self.a, self.b = _Lin(W), _Lin(W)

    m = Two()
    ps = tg.params(m)
    assert len(ps) == 1
    m.b.w = 3 * W  # untie: two parameters now, as tg.params(m) freshly built says
    assert len(tg.params(m)) == 2
    g = tg.gradient(lambda: jnp.sum(jnp.tanh(m.b(m.a(x)))), ps)
    ga, gb = jax.grad(lambda u, v: jnp.sum(jnp.tanh(v @ (u @ x))), argnums=(0, 1))(m.a.w, m.b.w)
    _close(g[m.a.w], ga)
    _close(g[m.b.w], gb)  # treegrad: KeyError, and len(ps) stays 1


def test_untying_a_shared_weight_in_a_dict():
    W = jnp.array([1.0, 2.0])
    d = {"a": W, "b": W}
    ps = tg.params(d)
    assert len(ps) == 1  # the first read caches the de-duplicated positions
    d["b"] = 3 * W
    g = tg.gradient(lambda: jnp.sum(d["a"] * d["b"]), ps)
    assert len(ps) == 2  # was 1: the first read's de-duplicated positions were kept
    _close(g[d["b"]], d["a"])
    _close(g[d["a"]], d["b"])


def test_untying_a_shared_weight_then_training_says_to_set_up_again():
    # A state set up while tied has one parameter; after the untie the Params has two,
    # and the update says so (nothing changed), naming both places and the fix.
    W = jnp.array([1.0, 2.0])
    d = {"a": W, "b": W}
    ps = tg.params(d)
    state = tg.setup(optax.sgd(0.1), ps)
    d["b"] = b = 3 * W
    loss = lambda: jnp.sum(d["a"] * d["b"] ** 2)
    with pytest.raises(ValueError, match=r"'a' and 'b' were one array.*tg\.setup\(rule, model\)"):
        tg.update_(state, ps, tg.gradient(loss, ps))
    assert d["a"] is W and d["b"] is b
    state = tg.setup(optax.sgd(0.1), ps)  # set up again: both trained, as plain optax
    g = jax.grad(lambda r: jnp.sum(r["a"] * r["b"] ** 2))(dict(d))
    tg.update_(state, ps, tg.gradient(loss, ps))
    _close(d["a"], W - 0.1 * g["a"])
    _close(d["b"], b - 0.1 * g["b"])
