"""treegrad: Flux/Zygote-style gradients on JAX pytrees, in explicit and implicit style."""

from . import nn as nn
from ._engine import RetraceWarning as RetraceWarning
from ._engine import clear_cache as clear_cache
from ._gradient import gradient as gradient
from ._gradient import hessian as hessian
from ._gradient import jacobian as jacobian
from ._gradient import pullback as pullback
from ._gradient import withgradient as withgradient
from ._jit import jit as jit
from ._module import Module as Module
from ._params import Grads as Grads
from ._params import NoGradientError as NoGradientError
from ._params import NoGradientWarning as NoGradientWarning
from ._params import Params as Params
from ._params import params as params
from ._tree import is_differentiable as is_differentiable

__version__ = "0.1.0"
