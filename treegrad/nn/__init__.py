"""Layers for treegrad models: every layer is a `tg.Module`."""

from ._basic import Chain as Chain
from ._basic import Dense as Dense

__all__ = ["Chain", "Dense"]
