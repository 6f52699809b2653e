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
    "shard",
    "shard_batch",
]


def test_api_names_exist():
    missing = [name for name in API if not hasattr(tg, name)]
    assert not missing
    assert callable(tg.losses.mse)
    assert issubclass(tg.NoGradientWarning, UserWarning)
    assert hasattr(nn, "Dense") and hasattr(nn, "Chain")


def public_callables():
    for module, prefix in ((tg, "tg"), (nn, "nn"), (tg.losses, "tg.losses")):
        for name in dir(module):
            obj = getattr(module, name)
            if (
                not name.startswith("_")
                and callable(obj)
                and getattr(obj, "__module__", "").startswith("treegrad")
            ):
                yield f"{prefix}.{name}", obj


def test_public_surface_has_docstrings_with_runnable_examples():
    names = dict(public_callables())
    assert len(names) > 40
    for name, obj in names.items():
        assert obj.__doc__ and ">>>" in obj.__doc__, (
            f"{name} has no docstring with a runnable example"
        )
