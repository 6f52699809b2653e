"""Every public name that shared/API.md promises exists, and nothing private leaks."""

import treegrad as tg
from treegrad import nn

API = [
    "Module",
    "gradient",
    "withgradient",
    "pullback",
    "jacobian",
    "hessian",
    "Params",
    "params",
    "Grads",
    "NoGradientWarning",
    "setup",
    "update",
    "update_",
    "adjust",
    "adjust_",
    "freeze_",
    "thaw_",
    "destructure",
    "jit",
    "train",
    "losses",
    "save",
    "load",
]


def test_api_names_exist():
    missing = [name for name in API if not hasattr(tg, name)]
    assert not missing
    assert callable(tg.losses.mse)
    assert issubclass(tg.NoGradientWarning, UserWarning)
    assert hasattr(nn, "Dense") and hasattr(nn, "Chain")


def test_public_surface_has_docstrings_with_examples():
    for name in dir(tg):
        if name.startswith("_"):
            continue
        obj = getattr(tg, name)
        if callable(obj) and getattr(obj, "__module__", "").startswith("treegrad"):
            assert obj.__doc__, f"tg.{name} has no docstring"
    for name in (
        "gradient",
        "withgradient",
        "pullback",
        "jacobian",
        "hessian",
        "Params",
        "Grads",
        "setup",
        "update",
        "update_",
        "jit",
        "train",
        "save",
        "destructure",
        "Module",
    ):
        assert ">>>" in getattr(tg, name).__doc__, f"tg.{name} has no runnable example"
