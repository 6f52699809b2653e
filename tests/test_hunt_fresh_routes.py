"""Routes to a value `f` reads that were stale (found 2026-12-02): a builtin method
or a dict view the closure holds (`get = cfg.get`, `cfg.values()`), an attribute
set on a function (`helper.scale`), and a plain object passed as an argument
(jax takes it for one leaf, keyed by identity) changed in place. Each changes the
value between calls and compares with the function run uncompiled (`jax.grad`
under `jax.disable_jit`); trace counters check that nothing unchanged re-traces."""

import builtins
import enum
import functools
import importlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg

w = jnp.array([0.5, -1.0, 2.0])


def reference(f, *args):
    with jax.disable_jit():
        return jax.grad(f)(*args)


def _builtin_method():
    cfg = {"s": 2.0}
    get = cfg.get
    return (lambda v: jnp.sum(v**2) * get("s")), lambda s: cfg.__setitem__("s", s)


def _list_getitem():
    box = [2.0]
    item = box.__getitem__
    return (lambda v: jnp.sum(v**2) * item(0)), lambda s: box.__setitem__(0, s)


def _dict_values_view():
    cfg = {"s": 2.0}
    vals = cfg.values()
    return (lambda v: jnp.sum(v**2) * sum(vals)), lambda s: cfg.__setitem__("s", s)


def _dict_items_view():
    cfg = {"s": 2.0}
    items = cfg.items()
    return (lambda v: jnp.sum(v**2) * dict(items)["s"]), lambda s: cfg.__setitem__("s", s)


def _helper_reads_its_attribute():
    def helper(v):
        return v * helper.scale

    helper.scale = 2.0
    return (lambda v: jnp.sum(helper(v) ** 2)), lambda s: setattr(helper, "scale", s)


def _loss_reads_a_helper_attribute():
    def helper(v):
        return v

    helper.scale = 2.0
    return (lambda v: jnp.sum(helper(v) ** 2) * helper.scale), lambda s: setattr(helper, "scale", s)


def _loss_reads_its_own_attribute():
    def loss(v):
        return jnp.sum(v**2) * loss.scale

    loss.scale = 2.0
    return loss, lambda s: setattr(loss, "scale", s)


class _Mode(enum.Enum):
    TRAIN = 1


def _enum_member_attribute():
    _Mode.TRAIN.scale = 2.0
    return (lambda v: jnp.sum(v**2) * _Mode.TRAIN.scale), lambda s: setattr(_Mode.TRAIN, "scale", s)


def _name_put_in_builtins():
    builtins.TG_TEST_SCALE = 2.0
    f = eval("lambda v: jnp.sum(v**2) * TG_TEST_SCALE", {"jnp": jnp})
    return f, lambda s: setattr(builtins, "TG_TEST_SCALE", s)


def _singledispatch_registered_later():
    @functools.singledispatch
    def factor(a):
        return 2.0

    def set_scale(s):
        if s != 2.0:
            factor.register(float, lambda a: s)  # a new implementation for floats

    return (lambda v: jnp.sum(v**2) * factor(0.5)), set_scale


ROUTES = [
    _builtin_method,
    _list_getitem,
    _dict_values_view,
    _dict_items_view,
    _helper_reads_its_attribute,
    _loss_reads_a_helper_attribute,
    _loss_reads_its_own_attribute,
    _enum_member_attribute,
    _name_put_in_builtins,
    _singledispatch_registered_later,
]


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__.strip("_"))
def test_values_read_through_the_route_are_fresh(route):
    f, set_scale = route()
    for s in (2.0, 3.0, -0.5):
        set_scale(s)
        (g,) = tg.gradient(f, w)
        np.testing.assert_allclose(g, reference(f, w), rtol=1e-6)
        np.testing.assert_allclose(
            g, 2 * w * s**2 if route is _helper_reads_its_attribute else 2 * w * s
        )


class Config:
    def __init__(self, scale):
        self.scale = scale
        self.calls = 0


@pytest.mark.filterwarnings("ignore:.*changes values it can read")  # (traced each call)
def test_a_plain_object_argument_changed_in_place_is_read_fresh():
    cfg = Config(2.0)

    def loss(v, c):
        c.calls += 1  # a number it changes, it can read: advanced on each call
        return jnp.sum(v**2) * c.scale

    for s in (2.0, 3.0):
        cfg.scale = s
        g, none = tg.gradient(loss, w, cfg)
        assert none is None
        np.testing.assert_allclose(g, reference(loss, w, cfg))
        value, (_g2, _) = tg.withgradient(loss, w, cfg)
        np.testing.assert_allclose(value, s * jnp.sum(w**2), rtol=1e-6)
        _y, back = tg.pullback(loss, w, cfg)
        np.testing.assert_allclose(back(1.0)[0], 2 * w * s, rtol=1e-6)
        np.testing.assert_allclose(tg.jit(loss)(w, cfg), s * jnp.sum(w**2), rtol=1e-6)
    calls = cfg.calls
    for _ in range(3):
        tg.gradient(loss, w, cfg)
    assert cfg.calls == calls + 3  # as uncompiled


def test_a_plain_object_inside_a_container_argument_is_read_fresh():
    cfg = Config(2.0)
    in_dict = lambda d: jnp.sum(d["w"] ** 2) * d["cfg"].scale
    in_list = tg.jit(lambda xs: jnp.sum(xs[0] ** 2) * xs[1].scale)
    for s in (2.0, 3.0):
        cfg.scale = s
        (g,) = tg.gradient(in_dict, {"w": w, "cfg": cfg})
        np.testing.assert_allclose(g["w"], 2 * w * s, rtol=1e-6)
        assert g["cfg"] is None
        np.testing.assert_allclose(in_list([w, cfg]), s * jnp.sum(w**2), rtol=1e-6)


def test_unchanged_routes_do_not_retrace():
    cfg = {"s": 2.0}
    get = cfg.get
    traces = []

    def loss(v):
        traces.append(1)
        return jnp.sum(v) * get("s") * loss.scale

    loss.scale = 3.0
    for _ in range(4):
        tg.gradient(loss, w)
    assert len(traces) == 1
    cfg["s"] = 4.0
    np.testing.assert_allclose(tg.gradient(loss, w)[0], jnp.full(3, 12.0))
    assert len(traces) == 2


class _LazyProxy:
    """What lazy loaders hand out: the first attribute read imports a module."""

    def __getattribute__(self, name):
        sys.modules.setdefault("tg_test_loaded_lazily", types.ModuleType("tg_test_loaded_lazily"))
        return object.__getattribute__(self, name)


@pytest.mark.slow  # over ~1 s: every user module in sys.modules is walked
@pytest.mark.usefixtures("few_user_modules")
def test_a_module_imported_while_sys_modules_is_walked(monkeypatch):
    # Once: the size of sys.modules was taken before the walk, which imported one
    # (a user module holding a lazy loader's object): "a new guard rejected its own
    # function" (AssertionError), on the first call.
    monkeypatch.delitem(sys.modules, "tg_test_loaded_lazily", raising=False)
    user = types.ModuleType("tg_test_user_with_lazy")
    user.proxy = _LazyProxy()
    user.s = 2.0
    monkeypatch.setitem(sys.modules, user.__name__, user)
    name = "tg_test_user_with_lazy"
    f = lambda v: jnp.sum(v**2) * getattr(sys.modules[name], "s")  # noqa: B009
    np.testing.assert_allclose(tg.gradient(f, w)[0], 4 * w)
    user.s = 3.0
    np.testing.assert_allclose(tg.gradient(f, w)[0], 6 * w)


def test_an_installed_namespace_package_is_library_code():
    # mpl_toolkits (matplotlib's) has no __file__: it was taken for the user's, and a
    # function reading sys.modules by a computed name walked all of matplotlib's
    # 3-d axes through it (20 s of the default test run).
    import mpl_toolkits

    from treegrad._kinds import is_library_module

    assert getattr(mpl_toolkits, "__file__", None) is None
    assert is_library_module("mpl_toolkits")


@pytest.mark.parametrize("how", ["import_module", "__import__"])
def test_a_module_found_by_import_module_is_read_fresh(how, monkeypatch):
    # Once: importlib.import_module("cfg").s was read by the first trace only.
    cfg = types.ModuleType("tg_test_cfg_by_import")
    cfg.s = 2.0
    monkeypatch.setitem(sys.modules, cfg.__name__, cfg)
    ns = {"jnp": jnp, "importlib": importlib}
    call = {"import_module": "importlib.import_module", "__import__": "__import__"}[how]
    f = eval(f"lambda v: jnp.sum(v**2) * {call}('tg_test_cfg_by_import').s", ns)
    for s in (2.0, 3.0, -1.0):
        cfg.s = s
        np.testing.assert_allclose(tg.gradient(f, w)[0], reference(f, w), rtol=1e-6)
        np.testing.assert_allclose(tg.gradient(f, w)[0], 2 * w * s, rtol=1e-6)
