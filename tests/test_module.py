import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treegrad as tg
from treegrad import nn

from .helpers import MLP


class Affine(tg.Module):
    def __init__(self):
        self.w = jnp.ones((2, 3))
        self.b = jnp.zeros(2)
        self.name = "affine"
        self.scale = 2.0
        self.act = jax.nn.relu
        self.tags = ["a", "b"]

    def __call__(self, x):
        return self.act(self.w @ x + self.b) * self.scale


def test_children_and_static():
    m = Affine()
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert [leaf.shape for leaf in leaves] == [(2, 3), (2,)]
    rebuilt = jax.tree_util.tree_unflatten(treedef, [leaf + 1 for leaf in leaves])
    assert type(rebuilt) is Affine
    assert rebuilt.name == "affine" and rebuilt.scale == 2.0 and rebuilt.act is jax.nn.relu
    assert rebuilt.tags == ["a", "b"]
    np.testing.assert_array_equal(rebuilt.w, 2 * np.ones((2, 3)))


def test_unflatten_does_not_call_init():
    calls = []

    class Counted(tg.Module):
        def __init__(self):
            calls.append(1)
            self.w = jnp.ones(2)

    m = Counted()
    jax.tree_util.tree_map(lambda x: x * 2, m)
    assert len(calls) == 1


def test_key_paths():
    m = MLP(jax.random.key(0))
    paths = [
        jax.tree_util.keystr(p, simple=True, separator=".")
        for p, _ in jax.tree_util.tree_flatten_with_path(m)[0]
    ]
    assert paths == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]


def test_mutable():
    m = Affine()
    m.w = jnp.zeros((2, 3))
    np.testing.assert_array_equal(m(jnp.ones(3)), np.zeros(2))


def test_jit_sees_module():
    m = Affine()
    out = jax.jit(lambda m, x: m(x))(m, jnp.ones(3))
    np.testing.assert_allclose(out, [6.0, 6.0])


def test_repr_has_paths_shapes_counts():
    m = MLP(jax.random.key(0))
    text = repr(m)
    assert "MLP  # 49 parameters" in text
    assert "weight: float32[8×4]" in text
    assert "layers: list[2]" in text


def test_static_equality_shares_treedef():
    a, b = Affine(), Affine()
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    b.scale = 3.0
    assert jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b)


def test_chain_indexing():
    k1, k2 = jax.random.split(jax.random.key(0))
    c = nn.Chain(nn.Dense(2, 3, key=k1), nn.Dense(3, 1, key=k2))
    assert c[0].out_features == 3 and len(c[1:]) == 1
    with pytest.raises(
        ValueError, match=r"Dense\(2 => 3\).*expected input with 2 features.*\(4, 5\)"
    ):
        c(jnp.ones((4, 5)))


def test_module_from_unflatten_keeps_its_structure_when_edited():
    # tree_map puts whatever the function returns at the array places: shardings
    # (a prefix tree for in_shardings), booleans (a filter spec), tracers.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: one, Affine())
    spec = jax.tree_util.tree_map(lambda _: True, Affine())
    before = jax.tree_util.tree_structure(Affine())
    for tree in (shardings, spec):
        tree.name = "affine"  # the same static value
        tree.act = jax.nn.relu
        assert jax.tree_util.tree_structure(tree) == before
    shardings.w = one  # a sharding takes the place of the sharding it replaces
    assert jax.tree_util.tree_structure(shardings) == before
    spec.b = 2.0  # a Python number is static, wherever it is assigned
    assert jax.tree_util.tree_leaves(spec) == [True]

    @jax.jit
    def edit(m):
        m.name = "affine"
        m.b = m.b + 1
        return m

    out = edit(Affine())
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(Affine())
    np.testing.assert_array_equal(out.b, np.ones(2))
