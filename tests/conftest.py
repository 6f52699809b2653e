import pytest

import treegrad as tg


def pytest_collection_modifyitems(config, items):
    # The slow tests first (the order is otherwise kept): under pytest-xdist's worksteal
    # scheduling, a long test started last (the slowest take 30-130 s) leaves the other
    # workers idle until it ends.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _fresh_cache():
    tg.clear_cache()
    yield
