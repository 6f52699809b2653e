"""Small datasets that ship inside treegrad, so examples run offline.

Example:
    >>> from treegrad import datasets
    >>> x, y = datasets.digits()
    >>> x.shape, y.shape, int(y.max())
    ((1797, 64), (1797,), 9)
"""

from __future__ import annotations

import gzip
import numbers
import operator
from importlib import resources

import numpy as np


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 handwritten digits (UCI Optdigits test set, 8x8 pixels).

    Returns:
        `(x, y)`: `x` float32 of shape `(1797, 64)` scaled to [0, 1], `y` int32
        labels 0-9. See `treegrad/data/README.md` for the source and licence.
    """
    raw = resources.files("treegrad").joinpath("data/digits.csv.gz").read_bytes()
    table = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.float32)
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int32)


def split(
    x: np.ndarray, y: np.ndarray, test_fraction: float = 0.2, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Shuffle and split into `(train, test)` pairs.

    Arguments:
        x: inputs, one row per example.
        y: labels, as many as `x` has rows.
        test_fraction: the share of examples in the test set (rounded down), in
            [0, 1): 0 puts every example in the training set; 1 would leave it
            empty and is refused.
        seed: seed of the shuffle.

    Examples:
        >>> import numpy as np
        >>> from treegrad import datasets
        >>> (xtr, ytr), (xte, yte) = datasets.split(np.zeros((10, 2)), np.arange(10), 0.3)
        >>> len(xtr), len(xte)
        (7, 3)
    """
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real):
        raise TypeError(
            f"split: test_fraction must be a number in [0, 1), e.g. 0.2, got {test_fraction!r}"
        )
    if not 0.0 <= float(test_fraction) < 1.0:
        raise ValueError(
            f"split: test_fraction must be in [0, 1) (the share of examples in the test set; "
            f"1 would leave no training examples), got {test_fraction}"
        )
    if len(x) != len(y):
        raise ValueError(f"split: x has {len(x)} examples but y has {len(y)}")
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def batches(
    x: np.ndarray, y: np.ndarray, size: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Shuffled minibatches of exactly `size` examples (the remainder is dropped)."""
    try:
        n_size = operator.index(size) if not isinstance(size, bool) else 0
    except TypeError:
        n_size = 0
    if n_size <= 0:
        raise ValueError(f"batches: size must be a positive int, got {size!r}")
    size = n_size
    if len(x) != len(y):
        raise ValueError(f"batches: x has {len(x)} examples but y has {len(y)}")
    order = np.random.default_rng(seed).permutation(len(x))
    n = len(x) // size
    return [
        (x[order[i * size : (i + 1) * size]], y[order[i * size : (i + 1) * size]]) for i in range(n)
    ]
