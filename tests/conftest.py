import jax
import pytest

import treegrad as tg

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _fresh_cache():
    tg.clear_cache()
    yield
