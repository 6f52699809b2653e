import sys

import pytest

import treegrad as tg

# The engine's tests: the engine reads the interpreter's bytecode, frames, closure
# cells and random states, so CI runs the default selection of these on each Python
# with the newest jax (`.ci/run`, `-m engine`), the other tests on one.
ENGINE_TESTS = frozenset(
    {
        "test_engine.py",
        "test_freshness.py",
        "test_numpy_values.py",
        "test_draws.py",
        "test_gradient.py",
        "test_implicit.py",
        "test_implicit_jit.py",
        "test_bad_inputs.py",
        "test_module.py",
        "test_fasttree.py",
        "test_jaxpr.py",
        "test_hunt_bodies.py",
        "test_hunt_fresh.py",
        "test_hunt_fresh_routes.py",
        "test_hunt_jit.py",
        "test_hunt_jit_adversary.py",
        "test_hunt_implicit.py",
        "test_hunt_explicit.py",
        "test_hunt_fastpath.py",
        "test_hunt_hotpath.py",
        "test_hunt_features.py",
        "test_hunt_module.py",
    }
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in ENGINE_TESTS:
            item.add_marker(pytest.mark.engine)


@pytest.fixture
def few_user_modules(request, monkeypatch):
    """`sys.modules` read by a computed name walks every user module in it: in a test run,
    every test module imported, every example and every module a test made (19-54 s
    each for three tests in a whole run on a busy 2-core host, 1 s alone). They are
    taken out of it for the test, as a script has few: all but the test's own module."""
    from treegrad._kinds import is_library_module

    keep = {"__main__", request.module.__name__}
    for name in [n for n in sys.modules if n not in keep and not is_library_module(n)]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture(autouse=True)
def _fresh_cache():
    tg.clear_cache()
    yield
