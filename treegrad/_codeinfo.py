"""What code reads: the global and attribute names of a code object, and which
attributes of an object count as read.

The walk (`_walk.py`) checks a class's or a module's attributes by the names the
walked code reads, and an object's instance attributes by the names that code
may read, so that a value nothing reads (bookkeeping of the user's) changes
without tracing the function again.
"""

from __future__ import annotations

import abc
import dis
import re
import types
import typing
from typing import Any

from ._kinds import is_library


class _CodeInfo:
    """The global names and attribute names a code object (and its nested code) reads.

    `attrs`: every attribute name it loads or stores (a class's or a module's
    attributes of those names are walked). `reads`: the instance attributes it
    may read: those it loads or deletes, those it stores outside a constructor (a
    step that writes `self.x` must see it settled), and the names it spells as
    string constants (`getattr(o, "x")`, `hasattr`, `attrgetter("a.b")`,
    `"{0.x}".format(o)`; not in `attrs`: each would add a check to every library
    module with a `__getattr__` the function reaches, jax.numpy's included).
    `dynamic`: it may read an attribute by a name computed at run time
    (`getattr(o, name)`, `vars(o)`, `o.__dict__`, `dataclasses.asdict`...), so
    every instance attribute of the objects it reaches counts as read.
    `all_globals`: it reads its globals by name (`globals()`, `eval`, `exec`, a
    frame's `f_globals`), so any of them may be read.
    `imports`: the module names its strings spell when it calls `import_module` or
    `__import__` (`importlib.import_module("cfg").s`: that module is read).
    `in_place`: it calls one of numpy's in-place methods and drops the result
    (`order.sort()`, `np.random.shuffle(order)`, `buf.fill(0)`), or applies an
    in-place operator to a local name bound to a value it read from elsewhere
    (`b = buf; b += 1`, `for p in params: p -= g`): on a captured numpy array, which
    a jax tracer cannot stand in for (`_walk.Walk.as_values`).
    `read_names`: the global and closure variable names it loads other than to call
    `.append`, `.extend`, `.add` or `.update` on them: a list (set, deque) only added
    to is a log, its output; one also read (`len(log)`) a counter, whose length the
    next call reads (`_settle`).
    `read_attrs`: the same for attribute names (`self.log`), with the names its string
    constants spell (`getattr(self, "log")`).
    `read_locals`: the same for local names (a parameter whose default is a list:
    `def step(x, traces=traces): traces.append(1)` only appends to it).
    """

    __slots__ = (
        "all_globals",
        "attrs",
        "dynamic",
        "globals",
        "imports",
        "in_place",
        "read_attrs",
        "read_locals",
        "read_names",
        "reads",
    )

    def __init__(self, code: types.CodeType):
        names: dict[str, None] = {}
        attrs: set[str] = set()
        reads: set[str] = set()
        dynamic = in_place = by_global_name = imports = False
        read_names: set[str] = set()
        read_attrs: set[str] = set()
        read_locals: set[str] = set()
        words: set[str] = set()  # the identifiers its string constants spell
        modules: set[str] = set()  # its string constants that could name a module
        stack = [code]
        while stack:
            c = stack.pop()
            ins = list(dis.get_instructions(c))
            aliases: set[str] = set()  # locals bound to a value read from elsewhere
            for i, op in enumerate(ins):
                name = op.opname
                if name in _VARIABLE_LOADS and not _appends(ins, i + 1):
                    read_names.add(op.argval)
                elif name in _LOCAL_LOADS and not _appends(ins, i + 1):
                    # (3.13's LOAD_FAST_LOAD_FAST loads two: both count as read.)
                    both = op.argval if isinstance(op.argval, tuple) else (op.argval,)
                    read_locals.update(both)
                if name in _STORE_LOCAL and i and ins[i - 1].opname in _ALIAS_SOURCES:
                    aliases.add(_stored(op))
                elif (
                    name == "BINARY_OP"
                    and op.argrepr.endswith("=")
                    and i + 1 < len(ins)
                    and ins[i + 1].opname in _STORE_LOCAL
                    and _stored(ins[i + 1]) in aliases
                ):
                    # `b += 1` on such a name: numpy adds into the array `b` is (a
                    # captured one, maybe); on a tracer it rebinds `b` only.
                    in_place = True
                if op.argval in _IMPORTS and name in _LOADS:
                    imports = True
                if name == "IMPORT_NAME" and isinstance(op.argval, str):
                    # `import cfg` / `from cfg import s` in the function: `cfg` is read.
                    imports = True
                    modules.add(op.argval)
                    reads.update(op.argval.split("."))
                elif name == "IMPORT_FROM":
                    attrs.add(op.argval)
                    reads.add(op.argval)
                if name in _GLOBAL_NAMES:
                    names[op.argval] = None
                    by_global_name = by_global_name or op.argval in _READS_GLOBALS_BY_NAME
                    if op.argval in _EVALUATES:
                        source = _source(ins, i + 1)
                        if source is None:
                            dynamic = True  # `eval(EXPR)`, `exec(code)`: reads unknown
                        else:
                            stack.extend(source)
                    if op.argval in _BY_NAME and not _constant_name(ins, i + 1, op.argval):
                        dynamic = True
                    dynamic = dynamic or op.argval in _READS_EVERY_ATTRIBUTE
                elif name in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR", "DELETE_ATTR"):
                    attrs.add(op.argval)
                    reads.add(op.argval)
                    if name != "LOAD_METHOD" and not _appends(ins, i + 1):
                        read_attrs.add(op.argval)
                    by_global_name = by_global_name or op.argval in _READS_GLOBALS_BY_NAME
                    if op.argval in _EVALUATES and _on_builtins(ins, i):  # builtins.eval
                        source = _source(ins, i + 1)
                        if source is None:
                            dynamic = True  # `eval(EXPR)`, `exec(code)`: reads unknown
                        else:
                            stack.extend(source)
                    if op.argval in _BY_NAME and not _constant_name(ins, i + 1, op.argval):
                        dynamic = True
                    dynamic = dynamic or op.argval in _READS_EVERY_ATTRIBUTE
                    if op.argval in _IN_PLACE and not in_place:
                        in_place = _dropped_call(ins, i + 1)
                    if op.argval in _FORMATS and not _constant_before(ins, i):
                        # `FMT.format(cfg)`, `str.format(FMT, cfg)`: the format string
                        # is a value, not a constant of this code, so the attributes
                        # it names (`"{0.scale}"`) are not known here.
                        dynamic = True
                elif name == "MATCH_CLASS":
                    # `case Cfg(scale=s)` reads `scale` from the subject: its keyword
                    # names are the tuple constant loaded just before; `case P(x, y)`
                    # (op.arg positional sub-patterns) reads the names of the class's
                    # `__match_args__`, which no code spells: any attribute may be read.
                    j = _before(ins, i)
                    kw = ins[j].argval if j >= 0 and ins[j].opname == "LOAD_CONST" else None
                    if isinstance(kw, tuple) and all(isinstance(k, str) for k in kw):
                        reads.update(kw)
                    else:
                        dynamic = True
                    k = _before(ins, j)
                    # (`case float(x)`: a builtin class matches the subject itself.)
                    self_matching = (
                        op.arg == 1 and k >= 0 and ins[k].opname in _GLOBAL_NAMES
                    ) and ins[k].argval in _SELF_MATCHING
                    dynamic = dynamic or (bool(op.arg) and not self_matching)
                elif name == "STORE_ATTR":
                    attrs.add(op.argval)
                    if c.co_name not in _CONSTRUCTORS:
                        reads.add(op.argval)
            for k in c.co_consts:
                if isinstance(k, types.CodeType):
                    stack.append(k)
                elif isinstance(k, str):
                    words.update(_IDENTIFIER.findall(k))
                    if all(part.isidentifier() for part in k.split(".")):
                        reads.update(k.split("."))
                        read_attrs.update(k.split("."))
                        modules.add(k)
                    elif "{" in k:  # a format string: "{0.scale}".format(cfg)
                        reads.update(_FORMAT_ATTRIBUTE.findall(k))
        if by_global_name:
            # `globals()["s"]`, `eval("s * 2")`, `fn.__globals__["s"]`: the global
            # names its strings spell are read too, and any other by a name computed
            # at run time (`all_globals`, `_walk`).
            names.update(dict.fromkeys(sorted(words - names.keys())))
        self.all_globals = by_global_name
        self.imports = frozenset(modules) if imports else frozenset()
        self.globals = tuple(names)
        self.attrs = frozenset(attrs)
        self.reads = frozenset(reads)
        self.dynamic = dynamic
        self.in_place = in_place
        self.read_names = frozenset(read_names)
        self.read_attrs = frozenset(read_attrs)
        self.read_locals = frozenset(read_locals)


def _appends(ins: list[dis.Instruction], i: int) -> bool:
    """Whether instruction `i` takes a method that only adds to the value loaded just
    before (`log.append(x)`, `seen.add(k)`: 3.11's LOAD_METHOD, 3.12's LOAD_ATTR)."""
    return (
        i < len(ins)
        and ins[i].opname in ("LOAD_METHOD", "LOAD_ATTR")
        and ins[i].argval in ("append", "extend", "add", "update")
    )


# Instructions that load a local variable (3.12's LOAD_FAST_CHECK and
# LOAD_FAST_AND_CLEAR, 3.13's LOAD_FAST_LOAD_FAST of two).
_LOCAL_LOADS = frozenset(
    {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST"}
)

# Instructions that load a global or a closure variable by name.
_VARIABLE_LOADS = frozenset(
    {
        "LOAD_GLOBAL",
        "LOAD_NAME",
        "LOAD_DEREF",
        "LOAD_CLASSDEREF",
        "LOAD_FROM_DICT_OR_DEREF",
        "LOAD_FROM_DICT_OR_GLOBALS",
    }
)


# Instructions that read a global by name (3.12's LOAD_FROM_DICT_OR_GLOBALS: a
# generic class's bases, a `type` alias, in an annotation scope of a class body).
_GLOBAL_NAMES = frozenset(
    {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"}
)
# Builtin classes whose one positional class pattern (`case float(x)`) matches the
# subject itself, reading no attribute.
_SELF_MATCHING = frozenset(
    {"bool", "bytearray", "bytes", "dict", "float", "frozenset", "int", "list", "set"}
    | {"str", "tuple"}
)
# str methods that read the attributes a format string names (`"{0.scale}"`).
_FORMATS = frozenset({"format", "format_map"})
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_IMPORTS = frozenset({"import_module", "__import__"})
_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD"})
# Names whose use reads the function's globals by a name its code spells as a string.
_READS_GLOBALS_BY_NAME = frozenset({"globals", "eval", "exec", "f_globals", "__globals__"})
_FORMAT_ATTRIBUTE = re.compile(r"\.([A-Za-z_]\w*)(?=[^{}]*\})")
# Functions that run Python source or a code object: what it reads is in no instruction
# here (`eval("cfg.scale")` reads `scale`): a constant source is compiled and read as
# nested code is; any other (`eval(EXPR)`, `exec(code)`) may read any attribute.
_EVALUATES = frozenset({"eval", "exec"})
# Functions that read an attribute by name: by a constant name they read that name
# (a string constant, in `reads`); by any other, every attribute may be read.
_BY_NAME = frozenset({"getattr", "hasattr", "setattr", "delattr", "attrgetter", "methodcaller"})
# Names whose use reads (or writes) an object's attributes by names not in the code.
_READS_EVERY_ATTRIBUTE = frozenset(
    {
        "vars",
        "dir",
        "__dict__",
        "__getattribute__",
        "__setattr__",
        "__delattr__",
        "__getstate__",
        "__reduce__",
        "__reduce_ex__",
        "asdict",
        "astuple",
        "deepcopy",
    }
)
# An attribute only a constructor stores, and no code reads, is bookkeeping of the
# user's (a step counter set in __init__ and incremented by the training loop).
_CONSTRUCTORS = frozenset({"__init__", "__new__", "__post_init__", "__setstate__"})


# numpy's methods and functions that change an array in place and return None. A
# jax array has none of them but `sort`, which returns a sorted copy: dropped, the
# array stays unsorted, silently.
_IN_PLACE = frozenset(
    {
        "sort",
        "partition",
        "fill",
        "resize",
        "put",
        "itemset",
        "setflags",
        "shuffle",
        "copyto",
        "place",
        "putmask",
        "fill_diagonal",
    }
)


# Instructions that leave a value read from elsewhere (a global, a closure cell, an
# attribute, an item, the next item of a loop) for the next instruction to store.
_ALIAS_SOURCES = frozenset(
    {
        "LOAD_GLOBAL",
        "LOAD_DEREF",
        "LOAD_CLASSDEREF",
        "LOAD_FROM_DICT_OR_DEREF",
        "LOAD_NAME",
        "LOAD_ATTR",
        "BINARY_SUBSCR",
        "FOR_ITER",
    }
)
# A store to a local name (3.13's superinstruction stores its first name, then loads).
_STORE_LOCAL = frozenset({"STORE_FAST", "STORE_FAST_LOAD_FAST"})


def _stored(op: dis.Instruction) -> str:
    """The local name a `_STORE_LOCAL` instruction stores."""
    return str(op.argval[0] if isinstance(op.argval, tuple) else op.argval)


def _dropped_call(ins: list[dis.Instruction], i: int) -> bool:
    """Whether the method loaded before instruction `i` is called with simple
    arguments (names, constants, their attributes) and its result dropped: a
    statement `x.sort()`, `np.random.shuffle(order)`, `buf.fill(0.0)`."""
    end = min(len(ins), i + 12)
    while i < end and (
        ins[i].opname in _VALUE_LOADS
        or ins[i].opname in _CONTINUES
        or ins[i].opname in ("LOAD_CONST", "CACHE", "PRECALL", "KW_NAMES")
    ):
        i += 1
    if i >= end or ins[i].opname not in ("CALL", "CALL_KW"):
        return False
    i += 1
    while i < len(ins) and ins[i].opname == "CACHE":
        i += 1
    return i < len(ins) and ins[i].opname == "POP_TOP"


def _source(ins: list[dis.Instruction], i: int) -> list[types.CodeType] | None:
    """The code of the source that `eval`/`exec`, loaded before instruction `i`, is
    called with, when it is a string constant: `[code]` (`[]` when it does not
    compile, so cannot run); None when the argument is not a constant."""
    while i < len(ins) and ins[i].opname in ("PUSH_NULL", "EXTENDED_ARG", "NOP"):
        i += 1
    if i >= len(ins) or not _is_name_constant(ins, i):
        return None
    text = ins[i].argval
    for mode in ("eval", "exec"):
        try:
            return [compile(text, "<string>", mode, dont_inherit=True)]
        except (SyntaxError, ValueError):
            continue
    return []


def _on_builtins(ins: list[dis.Instruction], i: int) -> bool:
    """Whether the attribute loaded at `i` is read from `builtins` (`builtins.eval`),
    not from any object (`model.eval()` is a method of the user's)."""
    j = _before(ins, i)
    return j >= 0 and ins[j].argval in ("builtins", "__builtins__")


def _before(ins: list[dis.Instruction], i: int) -> int:
    """The index of the instruction before `i` that is not an EXTENDED_ARG, or -1."""
    j = i - 1
    while j >= 0 and ins[j].opname == "EXTENDED_ARG":
        j -= 1
    return j


def _constant_before(ins: list[dis.Instruction], i: int) -> bool:
    """Whether the attribute loaded at `i` is looked up on a string constant
    (`"{0.scale}".format`): the constant's names are in `reads` already."""
    j = _before(ins, i)
    return j >= 0 and ins[j].opname == "LOAD_CONST" and isinstance(ins[j].argval, str)


def _constant_name(ins: list[dis.Instruction], i: int, fn: str) -> bool:
    """Whether the call starting at instruction `i` (of getattr and the like) passes a
    string constant as the name: `getattr(obj.a, "name")`, `attrgetter("a", "b")`.

    The object is one expression (a name and its attributes; none for attrgetter
    and methodcaller); the name is the constant right after it, followed by the call
    or by one plain default value and the call. Anything else (`getattr(obj,
    cfg["n"])`: a second name loaded, the constant a subscript's key) is not a
    constant name, and every attribute may be read.
    """
    objects = 0 if fn in ("attrgetter", "methodcaller") else 1
    starts = 0
    while i < len(ins) and (ins[i].opname in _VALUE_LOADS or ins[i].opname in _CONTINUES):
        starts += ins[i].opname in _VALUE_LOADS
        i += 1
    if starts != objects or not _is_name_constant(ins, i):
        return False
    while _is_name_constant(ins, i):  # attrgetter("a", "b")
        i += 1
    if i < len(ins) and ins[i].opname in _CALLS:
        return True
    # getattr(obj, "name", default), the default a constant or a plain name
    plain = i < len(ins) and (ins[i].opname == "LOAD_CONST" or ins[i].opname in _VALUE_LOADS)
    return plain and i + 1 < len(ins) and ins[i + 1].opname in _CALLS


def _is_name_constant(ins: list[dis.Instruction], i: int) -> bool:
    return i < len(ins) and ins[i].opname == "LOAD_CONST" and isinstance(ins[i].argval, str)


# Instructions that load a value (the start of an argument), and those that go on
# with the value loaded (an attribute of it) or load nothing.
_VALUE_LOADS = frozenset(
    {
        "LOAD_FAST",
        "LOAD_FAST_CHECK",
        "LOAD_FAST_BORROW",
        "LOAD_DEREF",
        "LOAD_CLOSURE",
        "LOAD_CLASSDEREF",
        "LOAD_GLOBAL",
        "LOAD_NAME",
    }
)
_CONTINUES = frozenset({"LOAD_ATTR", "PUSH_NULL", "EXTENDED_ARG", "COPY_FREE_VARS", "NOP"})
_CALLS = frozenset({"CALL", "PRECALL", "KW_NAMES", "CALL_KW"})


_CODE_INFO: dict[types.CodeType, _CodeInfo] = {}


def code_info(code: types.CodeType) -> _CodeInfo:
    info = _CODE_INFO.get(code)
    if info is None:
        info = _CODE_INFO[code] = _CodeInfo(code)
    return info


# Instance attributes libraries read by name from the objects they are given (array
# protocols, wrapped callables): checked whatever the walked code reads.
PROTOCOL_NAMES = frozenset(
    {
        "shape",
        "dtype",
        "ndim",
        "size",
        "sharding",
        "weak_type",
        "__array__",
        "__array_interface__",
        "__array_struct__",
        "__array_priority__",
        "__jax_array__",
        "__dlpack__",
        "__cuda_array_interface__",
        "__wrapped__",
        "__name__",
        "__qualname__",
        "__module__",
        "__doc__",
    }
)
# Libraries whose code reads no attribute of the objects it is given but the array
# protocols (PROTOCOL_NAMES) and their classes' special methods (`_thread` is
# `threading`'s, `_operator` `operator`'s: C modules named with an underscore).
_READS_PROTOCOLS_ONLY = frozenset(
    {
        "jax",
        "jaxlib",
        "numpy",
        "optax",
        "treegrad",
        "ml_dtypes",
        "opt_einsum",
        "einops",
        "jaxtyping",
        "builtins",
        "math",
        "cmath",
        "operator",
        "functools",
        "itertools",
        "collections",
        "typing",
        "typing_extensions",
        "types",
        "enum",
        "abc",
        "numbers",
        "weakref",
        "thread",
        "threading",
        "contextvars",
        "random",
        "time",
        "warnings",
        "sys",
        "os",
        "posixpath",
    }
)
_C_CALLABLES = (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType)


def reads_any_attribute(obj: Any) -> bool:
    """Whether library code (a module, function, class, or an object of a library
    class) may read any attribute of the objects it is given: not one of
    `_READS_PROTOCOLS_ONLY` (a C function counts as its module's)."""
    name: Any
    if type(obj) is types.ModuleType:
        name = obj.__name__
    elif isinstance(obj, (type, types.FunctionType, *_C_CALLABLES)):
        name = getattr(obj, "__module__", None)
        if name is None:  # a C method (`{}.get`): its object's class's
            name = type(getattr(obj, "__self__", None)).__module__
    else:
        name = type(obj).__module__
    if not isinstance(name, str):
        return True
    return name.partition(".")[0].lstrip("_") not in _READS_PROTOCOLS_ONLY


# Bases whose code reads no instance attribute.
_PLAIN_BASES = frozenset({object, abc.ABC, typing.Generic, typing.Protocol})


def every_attribute(t: type) -> bool:
    """Whether every attribute of a `t` counts as read: a library class's (a
    `SimpleNamespace`, a `threading.local`) or one deriving from one, whose code
    (not walked) may read any of them."""
    return any(is_library(k) for k in t.__mro__ if k not in _PLAIN_BASES)


def clear() -> None:
    _CODE_INFO.clear()
