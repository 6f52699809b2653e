"""The base of treegrad's generated code (guards, write-backs, tree shapes).

Each generator writes one straight-line Python function as text: values it
needs are constants named in the namespace the function runs in, variables
are numbered, and the text is compiled once and kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CodeGen:
    """Names for constants and variables, and compiling the generated source."""

    # How many functions were generated in this process: a cache hit generates
    # none (tests assert it, so a hot path that compiles code shows up).
    compiled = 0

    def __init__(self, ns: dict[str, Any]):
        self.ns = ns
        self.lines: list[str] = []
        self.n = 0

    def _k(self, obj: Any) -> str:
        """A name for a constant in the generated code's namespace."""
        name = f"K{len(self.ns)}"
        self.ns[name] = obj
        return name

    def _v(self) -> str:
        """A new variable name."""
        self.n += 1
        return f"v{self.n}"

    def _define(self, src: str, filename: str, name: str) -> Callable[..., Any]:
        """Compile `src` in the namespace and return the function it defines as `name`."""
        exec(compile(src, filename, "exec"), self.ns)
        CodeGen.compiled += 1
        fn: Callable[..., Any] = self.ns[name]
        return fn
