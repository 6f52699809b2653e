"""What kind of value the engine sees: an array, library code, or the user's values.

The walk (`_walk.py`) and the guards (`_guard.py`) ask these of every value a
function can read. An array is an input of the compiled program; a value of
library code (jax, numpy, optax, the standard library, anything installed in
site-packages) is checked by identity and never walked into, since its code
never reads the user's arrays through its own globals; everything else is the
user's and is walked. Each answer is memoised by type or module name, and
`clear` (run by `tg.clear_cache`) forgets them all.
"""

from __future__ import annotations

import sys
import types
import warnings
import weakref
from typing import Any

import jax
import numpy as np

from ._module import Module

# Packages whose code never reads user arrays through its own globals: values
# from them are checked by identity and never walked into. Everything else,
# including code made by `exec` without a module name, is user code.
_LIBRARY_ROOTS = frozenset(
    {
        "jax",
        "jaxlib",
        "numpy",
        "optax",
        "equinox",
        "flax",
        "chex",
        "scipy",
        "torch",
        "tqdm",
        "matplotlib",
        "orbax",
        "ml_dtypes",
        "opt_einsum",
        "einops",
        "jaxtyping",
        "typing_extensions",
        "treegrad",
        *sys.stdlib_module_names,
    }
)
# treegrad's own applications are user code: they show what a user's script does.
_APPLICATIONS = frozenset({"treegrad._bench", "treegrad._demo"})

CONST_TYPES = frozenset(
    {int, float, complex, bool, str, bytes, type(None), type(Ellipsis), range, slice}
)
ARRAY_TYPES: set[type] = set()
_NOT_ARRAY_TYPES: set[type] = set()
PROXY_TYPES = (weakref.ProxyType, weakref.CallableProxyType)


def is_array(x: Any) -> bool:
    """A dynamic input: a `jax.Array` (tracers included) or a numeric numpy array."""
    t = type(x)
    if t in ARRAY_TYPES:
        return True
    if t in _NOT_ARRAY_TYPES:
        return False
    if t in PROXY_TYPES:  # isinstance sees the referent's class through a weak proxy
        return False
    try:
        if isinstance(x, np.ndarray):
            # Not cached by type: a numpy array of strings, objects or dates is no input
            # of a compiled function (jax cannot take it); the walk snapshots it instead.
            return x.dtype.kind not in _NOT_NUMERIC
        r = isinstance(x, jax.Array)
    except Exception:  # an object whose __getattribute__ refuses even __class__
        return False
    (ARRAY_TYPES if r else _NOT_ARRAY_TYPES).add(t)
    return r


_NOT_NUMERIC = frozenset("OUSMm")  # object, str, bytes, datetime64, timedelta64


_LIBRARY_MODULES: dict[Any, bool] = {}


def is_library_module(name: Any) -> bool:
    r = _LIBRARY_MODULES.get(name)
    if r is None:
        r = _LIBRARY_MODULES[name] = (
            isinstance(name, str)
            and name not in _APPLICATIONS
            and (name.partition(".")[0] in _LIBRARY_ROOTS or _installed(name))
        )
    return r


def _installed(name: str) -> bool:
    """A module of an installed package (site-packages): library code, not the user's."""
    module = sys.modules.get(name.partition(".")[0])
    # A namespace package (`mpl_toolkits`, which matplotlib installs) has no __file__,
    # only its folders.
    paths = [getattr(module, "__file__", None) or "", *getattr(module, "__path__", ())]
    return any(isinstance(p, str) and ("site-packages" in p or "dist-packages" in p) for p in paths)


def is_library(obj: Any) -> bool:
    """Library code: defined in a file of a library package (not a doctest or `exec`)."""
    if not is_library_module(getattr(obj, "__module__", None)):
        return False
    # Doctests run in a copy of the library module's namespace: their code is user code.
    if type(obj) is types.FunctionType:
        return not obj.__code__.co_filename.startswith("<doctest")
    if isinstance(obj, type):
        r = _LIBRARY_CLASSES.get(obj)
        if r is None:
            r = _LIBRARY_CLASSES[obj] = not _made_in_types(obj) and not any(
                (fn := code_of(v)) is not None and fn.__code__.co_filename.startswith("<doctest")
                for v in vars(obj).values()
            )
        return r
    return True


def _made_in_types(cls: type) -> bool:
    """A class made by `types.new_class` (`dataclasses.make_dataclass` on Python 3.11):
    its `__module__` says "types", but it is the user's, not one of that module's."""
    return cls.__module__ == "types" and getattr(types, cls.__name__, None) is not cls


# Standard-library classes whose instances exist to hold the user's values (parsed
# command-line options, a list or dict wrapper, a queue): walked as a user object,
# every attribute, not checked by identity as other library objects are (a logger or
# a lock, whose changing internals the function does not read). By name, so that
# none of their modules need be imported.
_VALUE_HOLDERS = frozenset(
    {
        "types.SimpleNamespace",
        "argparse.Namespace",
        "collections.UserDict",
        "collections.UserList",
        "collections.UserString",
        "weakref.WeakValueDictionary",
        "weakref.WeakKeyDictionary",
        "_weakrefset.WeakSet",
        "queue.Queue",
        "queue.LifoQueue",
        "queue.PriorityQueue",
        # A config read from a file: its sections are the user's values.
        "configparser.ConfigParser",
        "configparser.RawConfigParser",
        "configparser.SectionProxy",
    }
)


def has_instance_dict(value: Any) -> bool:
    """Whether `value` has a `__dict__`, asked of its type where that can tell: a
    `__getattr__` of the user's, asked for a missing `__dict__` (a class with
    `__slots__` only), may raise anything, not AttributeError."""
    t = type(value)
    if t.__dictoffset__ != 0:
        return True
    # A __getattribute__ of its own (threading.local's) may answer `__dict__` itself.
    return t.__getattribute__ is not object.__getattribute__ and hasattr(value, "__dict__")


def holds_user_values(t: type) -> bool:
    """Whether a library class `t` is one of the standard library's value holders."""
    return f"{t.__module__}.{t.__qualname__}" in _VALUE_HOLDERS


_LIBRARY_CLASSES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


JITTED_TYPE = type(jax.jit(lambda: None))
# Wrappers whose `__wrapped__` function is inlined while tracing (`tg.jit` adds its own).
JITTED_TYPES: set[type] = {JITTED_TYPE}
_PYTREE_NODE: dict[type, bool] = {}


def is_pytree_node(x: Any) -> bool:
    """Whether `x` is a registered pytree node (a Module, an equinox module, a state...)."""
    t = type(x)
    r = _PYTREE_NODE.get(t)
    if r is None:
        try:
            # Whether the type is a registered node, not whether this value has leaves:
            # cached by type, an empty one (the state of optax.sgd) must not make
            # every later one of its type a leaf.
            with warnings.catch_warnings():
                # jax 0.10 deprecates taking an iterable (an iterator, a generator the
                # function captures) as a leaf; it is not a node either way.
                warnings.simplefilter("ignore", DeprecationWarning)
                treedef: Any = jax.tree_util.tree_structure(x)  # jaxlib's stub lacks node_data
            r = isinstance(x, Module) or treedef.node_data() is not None
        except Exception:  # jax refuses it as a leaf (an iterator, later jax) or can't flatten it
            return False
        _PYTREE_NODE[t] = r
    return r


def clear() -> None:
    """Forget every memo (`tg.clear_cache`)."""
    from . import _codeinfo  # imports this module

    _codeinfo.clear()
    _PYTREE_NODE.clear()
    _LIBRARY_MODULES.clear()
    _LIBRARY_CLASSES.clear()
    ARRAY_TYPES.clear()
    _NOT_ARRAY_TYPES.clear()


def code_of(value: Any) -> Any:
    """The function behind a class attribute (a method, static/class method, property)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    return value if type(value) is types.FunctionType else None
