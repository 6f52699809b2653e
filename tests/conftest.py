import pytest

import treegrad as tg


@pytest.fixture(autouse=True)
def _fresh_cache():
    tg.clear_cache()
    yield
