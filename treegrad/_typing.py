"""The type names in treegrad's signatures: models, gradients and optimiser states.

A JAX pytree has no static type (any nesting of lists, tuples, dicts and registered
classes is one), so for a type checker `PyTree` is `Any`, as `jaxtyping.PyTree` is.
The names below say which pytree a function expects, and the API reference links
each to its meaning here.

Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import treegrad as tg
    >>> from treegrad._typing import GradientTree, Model
    >>> def sgd(model: Model, grads: GradientTree, lr: float = 0.1) -> Model:
    ...     return jax.tree_util.tree_map(lambda p, g: p - lr * g, model, grads)
    >>> model = {"w": jnp.array([1.0, 2.0])}
    >>> (g,) = tg.gradient(lambda m: jnp.sum(m["w"] ** 2), model)
    >>> sgd(model, g)["w"]
    Array([0.8, 1.6], dtype=float32)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias, Union

if TYPE_CHECKING:
    from ._grads import Grads
    from ._module import Module
    from ._optview import Leaf, OptState, SubState
    from ._params import Params

PyTree: TypeAlias = Any
"""Any JAX pytree: arrays, and lists, tuples, dicts, NamedTuples and registered classes
of them (nested), with any other values as leaves."""

# Unions with `Any` are `Any` to a type checker; the names are for the reader. `Union`, not
# `|`: a string forward reference cannot take `|` at run time.
Model: TypeAlias = Union["Module", PyTree]
"""A model: a `tg.Module`, a plain pytree (dict, list, tuple, NamedTuple) of arrays, or
another library's pytree model (an `equinox.Module`). Its differentiable leaves are
its floating and complex `jax.Array`s."""

GradientTree: TypeAlias = PyTree
"""An explicit-mode gradient: the structure of the argument it was taken for (same
containers, Module types and static data), each differentiable leaf replaced by its
gradient and every other leaf by `None`; `None` also where the output does not
depend on the leaf."""

Gradients: TypeAlias = Union[GradientTree, "Grads"]
"""Either style's gradient, as the optimiser accepts it: a `GradientTree` for the
model, or the implicit-mode `tg.Grads`."""

ModelOrParams: TypeAlias = Union[Model, "Params"]
"""What the optimiser trains: a `Model`, or a `tg.Params` collected from one."""

StatePart: TypeAlias = Union["OptState", "SubState", "Leaf"]
"""An optimiser state from `tg.setup`, the part of it for a sub-model (`state.l1`,
`state["w"]`), or one parameter's `tg.Leaf`."""
