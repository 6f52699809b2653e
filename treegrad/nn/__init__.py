"""Layers for treegrad models: every layer is a `tg.Module`.

Initialisers and activations come from `jax.nn`. Layers that behave
differently in training and in evaluation (Dropout, BatchNorm) have a
`training` flag; `nn.testmode(model)` and `nn.trainmode(model)` return copies
with every layer switched.
"""

from ._basic import Chain as Chain
from ._basic import Dense as Dense
from ._basic import Dropout as Dropout
from ._basic import Embedding as Embedding
from ._basic import testmode as testmode
from ._basic import trainmode as trainmode
from ._conv import Conv as Conv
from ._norm import BatchNorm as BatchNorm
from ._norm import LayerNorm as LayerNorm
from ._norm import with_batch_stats as with_batch_stats
from ._recurrent import GRUCell as GRUCell
from ._recurrent import LSTMCell as LSTMCell
from ._recurrent import Recurrence as Recurrence
from ._recurrent import RNNCell as RNNCell

__all__ = [
    "BatchNorm",
    "Chain",
    "Conv",
    "Dense",
    "Dropout",
    "Embedding",
    "GRUCell",
    "LSTMCell",
    "LayerNorm",
    "RNNCell",
    "Recurrence",
    "testmode",
    "trainmode",
    "with_batch_stats",
]
