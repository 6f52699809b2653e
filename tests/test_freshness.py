"""Never stale: every value a function reads is fresh, exactly as if it ran uncompiled.

Each case reads values through one route, changes them between calls, and
compares `tg.gradient` with `jax.grad` of the same function (which runs it
eagerly, so it is always fresh). The random test builds a few hundred such
closures from every route at once.
"""

import functools
import random
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg

w = jnp.array([0.5, -1.0, 2.0])


def check(f):
    """tg.gradient of f equals jax.grad of f run eagerly (always fresh); returns the gradient."""
    (g,) = tg.gradient(f, w)
    with jax.disable_jit():  # jax.jit helpers would reuse stale traces otherwise
        ref = jax.grad(f)(w)
    np.testing.assert_allclose(g, ref, rtol=1e-6, atol=1e-6)
    return g


def test_python_number_in_a_dict_and_a_list():
    hp = {"s": 2.0}
    lst = [3.0]
    f = lambda v: jnp.sum(v) * hp["s"] + jnp.sum(v**2) * lst[0]
    check(f)
    hp["s"] = 5.0
    check(f)
    lst[0] = -1.0
    check(f)


def test_helper_swapped_in_a_dict_and_a_list():
    fns = {"act": jnp.sin}
    seq = [jnp.tanh]
    f = lambda v: jnp.sum(fns["act"](v)) + jnp.sum(seq[0](v))
    check(f)
    fns["act"] = jnp.cos
    check(f)
    seq[0] = jax.nn.relu
    check(f)


def test_class_attributes_float_helper_and_numpy():
    class Cfg:
        scale = 2.0
        act = staticmethod(jnp.sin)
        table = np.array([1.0, 2.0, 3.0], np.float32)

    f = lambda v: jnp.sum(Cfg.act(v)) * Cfg.scale + jnp.sum(v * Cfg.table)
    check(f)
    Cfg.scale = 5.0
    check(f)
    Cfg.act = staticmethod(jnp.cos)
    check(f)
    Cfg.table = np.zeros(3, np.float32)
    check(f)
    Cfg.table[1] = 4.0  # in place
    check(f)


def test_instance_reads_a_class_attribute_through_self():
    class Layer:
        scale = 2.0

        def __call__(self, v):
            return jnp.sum(v) * self.scale

    layer = Layer()
    f = lambda v: layer(v)
    check(f)
    Layer.scale = 7.0
    check(f)


def test_module_attributes():
    mod = types.ModuleType("user_config")  # a user module, not a library
    mod.scale = 2.0
    mod.act = jnp.sin
    f = lambda v: jnp.sum(mod.act(v)) * mod.scale
    check(f)
    mod.scale = 3.0
    check(f)
    mod.act = jnp.cos
    check(f)


def test_attribute_many_objects_deep():
    root = types.SimpleNamespace()
    node = root
    for _ in range(8):
        node.next = types.SimpleNamespace()
        node = node.next
    node.value = 2.0
    f = lambda v: jnp.sum(v) * root.next.next.next.next.next.next.next.next.value
    check(f)
    node.value = 9.0
    check(f)
    node.value = jnp.array(3.0)  # a number becomes an array
    check(f)


COUNTER = 0
SCALE = 2.0


def _helper_with_global_statement(v):
    global COUNTER
    COUNTER += 1
    return jnp.sum(v) * SCALE


def test_helper_with_a_global_statement_still_reads_other_globals_fresh():
    global SCALE
    f = lambda v: _helper_with_global_statement(v)
    check(f)
    SCALE = 9.0
    check(f)
    SCALE = 2.0


class _Sized(tg.Module):
    def __init__(self):
        self.w = jnp.ones(3)
        self.sizes = [1, 2]  # static: no arrays

    def __call__(self):
        return jnp.sum(self.w) * len(self.sizes)


def test_static_list_of_a_module_edited_in_place():
    m = _Sized()
    loss = lambda m: m()
    (g,) = tg.gradient(loss, m)
    np.testing.assert_allclose(g.w, jax.grad(lambda w: jnp.sum(w) * 2)(m.w))
    m.sizes.append(3)
    (g,) = tg.gradient(loss, m)
    np.testing.assert_allclose(g.w, [3.0, 3.0, 3.0])


class _Configured(tg.Module):
    def __init__(self):
        self.w = jnp.ones(3)
        self.cfg = {"n": 2}

    def __call__(self):
        extra = jnp.sum(self.cfg["v"] ** 2) if "v" in self.cfg else 0.0
        return jnp.sum(self.w) * self.cfg["n"] + extra


def test_static_dict_of_a_module_that_gains_an_array():
    c = _Configured()
    loss = lambda c: c()
    (g,) = tg.gradient(loss, c)
    assert g.cfg == {"n": 2} and g.w.shape == (3,)  # still static data
    c.cfg["v"] = jnp.array([1.0, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RetraceWarning: it is a child now
        (g,) = tg.gradient(loss, c)
    assert g.cfg["n"] is None
    np.testing.assert_allclose(g.cfg["v"], [2.0, 6.0])
    np.testing.assert_allclose(g.w, [2.0, 2.0, 2.0])


class _Lazy(tg.Module):
    def __init__(self):
        self.w = None  # built on first use

    def __call__(self):
        return 0.0 if self.w is None else jnp.sum(self.w**2)


def test_module_class_whose_first_instance_had_no_arrays():
    (g,) = tg.gradient(lambda m: m(), _Lazy())
    assert type(g) is _Lazy and g.w is None
    m = _Lazy()
    m.w = jnp.array([1.0, 2.0])
    (g,) = tg.gradient(lambda m: m(), m)
    assert type(g) is _Lazy
    np.testing.assert_allclose(g.w, [2.0, 4.0])


def test_self_referencing_dict():
    d = {"w": 2.0}
    d["self"] = d
    f = lambda v: jnp.sum(v) * d["self"]["self"]["w"]
    check(f)
    d["w"] = 4.0
    check(f)
    assert sys.getrecursionlimit() > 100  # the interpreter is fine


def test_function_made_by_exec_without_a_module_name():
    ns = {"jnp": jnp, "K": 2.0}
    exec("def f(v):\n    return jnp.sum(v) * K\n", ns)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # user code: no RetraceWarning
        check(ns["f"])
        ns["K"] = 6.0
        check(ns["f"])
    assert tg._engine.cache_size() == 2


def test_jitted_helper_closure_is_not_stale():
    cell = [jnp.array(2.0)]
    helper = jax.jit(lambda v: jnp.sum(v) * cell[0])
    helper(w)  # jax has cached a trace with the old value
    f = lambda v: helper(v)
    check(f)
    cell[0] = jnp.array(5.0)
    check(f)


def test_partial_and_bound_method():
    class Scaler:
        def __init__(self):
            self.s = 2.0

        def apply(self, v, k):
            return jnp.sum(v) * self.s * k

    sc = Scaler()
    part = functools.partial(sc.apply, k=3.0)
    f = lambda v: part(v)
    check(f)
    sc.s = 4.0
    check(f)
    part = functools.partial(sc.apply, k=0.5)
    check(f)


def test_nothing_changed_means_no_retrace():
    hp = {"s": 2.0}
    traces = []

    def loss(v):
        traces.append(1)
        return jnp.sum(v) * hp["s"]

    for _ in range(5):
        tg.gradient(lambda v: loss(v), w)
    assert len(traces) == 1
    hp["s"] = 3.0
    for _ in range(5):
        tg.gradient(lambda v: loss(v), w)
    assert len(traces) == 2


# --- random closures over every route --------------------------------------------


class _Box:
    pass


class _Holder:
    value = 1.0

    def __init__(self):
        self.value = 1.0

    def method(self):
        return self.value


def _random_case(rng: random.Random, k: int):
    """A closure reading n values through random routes, and how to change each."""
    ns: dict = {"jnp": jnp, "jax": jax, "functools": functools, "__name__": f"fresh_case_{k}"}
    reads: list[str] = []
    setters = []
    prelude: list[str] = []
    cells: list[str] = []
    for i in range(rng.randint(1, 5)):
        route = rng.choice(
            [
                "global",
                "cell",
                "default",
                "dict",
                "list",
                "nested",
                "deep",
                "classattr",
                "module",
                "partial",
                "method",
                "helper",
                "jitted",
            ]
        )
        name = f"x{i}"
        if route == "global":
            ns[name] = 1.0
            reads.append(name)
            setters.append(lambda v, name=name: ns.__setitem__(name, v))
        elif route == "cell":
            box = [1.0]
            ns[f"box{i}"] = box
            cells.append(f"{name} = box{i}[0]")  # bound when the closure is made
            reads.append(name)
            setters.append(("remake", lambda v, box=box: box.__setitem__(0, v)))
        elif route == "default":
            prelude.append(f"def read{i}(d={name}_default): return d")
            ns[f"{name}_default"] = 1.0
            reads.append(f"read{i}()")
            setters.append(lambda v, i=i: setattr(ns[f"read{i}"], "__defaults__", (v,)))
        elif route in ("dict", "list", "nested"):
            container = (
                {"v": 1.0} if route == "dict" else [1.0] if route == "list" else {"a": [{"b": 1.0}]}
            )
            ns[name] = container
            path = {"dict": "['v']", "list": "[0]", "nested": "['a'][0]['b']"}[route]
            reads.append(f"{name}{path}")
            setters.append(lambda v, c=container, p=path: exec(f"c{p} = v", {"c": c, "v": v}))
        elif route == "deep":
            root = _Box()
            node = root
            depth = rng.randint(1, 7)
            for _ in range(depth):
                node.nxt = _Box()
                node = node.nxt
            node.v = 1.0
            ns[name] = root
            reads.append(name + ".nxt" * depth + ".v")
            setters.append(lambda v, node=node: setattr(node, "v", v))
        elif route == "classattr":
            cls = type(f"C{i}", (), {"v": 1.0})
            ns[name] = cls
            reads.append(f"{name}.v")
            setters.append(lambda v, cls=cls: setattr(cls, "v", v))
        elif route == "module":
            mod = types.ModuleType(f"user_mod_{k}_{i}")
            mod.v = 1.0
            ns[name] = mod
            reads.append(f"{name}.v")
            setters.append(lambda v, mod=mod: setattr(mod, "v", v))
        elif route == "partial":
            holder = {"v": 1.0}
            ns[name] = functools.partial(lambda h: h["v"], holder)
            reads.append(f"{name}()")
            setters.append(lambda v, h=holder: h.__setitem__("v", v))
        elif route == "method":
            h = _Holder()
            ns[name] = h.method
            reads.append(f"{name}()")
            setters.append(lambda v, h=h: setattr(h, "value", v))
        elif route == "helper":
            ns[f"{name}_val"] = 1.0
            prelude.append(f"def helper{i}(): return {name}_val")
            reads.append(f"helper{i}()")
            setters.append(lambda v, name=name: ns.__setitem__(f"{name}_val", v))
        else:  # a jax.jit helper whose global changes
            ns[f"{name}_val"] = jnp.asarray(1.0)
            prelude.append(f"helper{i} = jax.jit(lambda: {name}_val * 1.0)")
            reads.append(f"helper{i}()")
            setters.append(
                lambda v, name=name: ns.__setitem__(f"{name}_val", jnp.asarray(v, jnp.float32))
            )
    terms = " + ".join(f"jnp.sum(v ** {j % 3 + 1}) * ({r})" for j, r in enumerate(reads))
    src = "\n".join(prelude) + "\ndef make():\n"
    src += "".join(f"    {c}\n" for c in cells) or "    pass\n"
    src += f"    return lambda v: {terms}\n"
    exec(src, ns)
    return ns, setters


def _run_random_closures(seed: int, n: int) -> None:
    rng = random.Random(seed)
    values = [2.0, -1.5, 0.25, jnp.asarray(3.0), np.float32(0.5), 4]
    for k in range(n):
        ns, setters = _random_case(rng, k)
        f = ns["make"]()
        check(f)
        for _ in range(2):
            setter = rng.choice(setters)
            if isinstance(setter, tuple):  # a closure cell: set, then make a new closure
                setter[1](rng.choice(values))
                f = ns["make"]()
            else:
                setter(rng.choice(values))
            check(f)
        # Nothing changed: the same closure (or a new one of the same code) hits the cache.
        before = tg._engine.cache_size()
        tg.gradient(ns["make"](), w)
        assert tg._engine.cache_size() == before
    tg.clear_cache()


def test_random_closures_are_never_stale():
    _run_random_closures(seed=0, n=25)  # 300 more in the slow job


@pytest.mark.slow
def test_three_hundred_random_closures_are_never_stale():
    _run_random_closures(seed=1, n=300)


def test_a_dict_the_function_writes_into_is_still_read_fresh():
    cfg = {"scale": 2.0, "calls": 0}

    def f(v):
        cfg["calls"] += 1  # a side effect while tracing: that entry is not checked
        return jnp.sum(v) * cfg["scale"]

    check(f)
    cfg["scale"] = 7.0  # but the entry it reads is
    check(f)
    cfg["calls"] = 100  # no re-trace for the entry it writes
    before = cfg["calls"]
    tg.gradient(f, w)
    assert cfg["calls"] == before
