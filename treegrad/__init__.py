"""treegrad: Flux/Zygote-style gradients on JAX pytrees, in explicit and implicit style."""

from . import losses as losses
from . import nn as nn
from ._adjust import adjust as adjust
from ._adjust import adjust_ as adjust_
from ._adjust import freeze_ as freeze_
from ._adjust import thaw_ as thaw_
from ._cache import RetraceWarning as RetraceWarning
from ._cache import clear_cache as clear_cache
from ._destructure import destructure as destructure
from ._gradient import gradient as gradient
from ._gradient import hessian as hessian
from ._gradient import jacobian as jacobian
from ._gradient import pullback as pullback
from ._gradient import withgradient as withgradient
from ._grads import Grads as Grads
from ._io import CheckpointError as CheckpointError
from ._io import load as load
from ._io import save as save
from ._jit import jit as jit
from ._module import Module as Module
from ._optim import Leaf as Leaf
from ._optim import OptState as OptState
from ._optim import setup as setup
from ._optim import update as update
from ._optim import update_ as update_
from ._paramerrors import NoGradientError as NoGradientError
from ._paramerrors import NoGradientWarning as NoGradientWarning
from ._params import Params as Params
from ._params import params as params
from ._shard import shard as shard
from ._shard import shard_batch as shard_batch
from ._train import NonFiniteLossError as NonFiniteLossError
from ._train import StepInfo as StepInfo
from ._train import train as train
from ._tree import is_differentiable as is_differentiable

__version__ = "0.1.0"
