"""Hostile hunt on tg.save / tg.load (1202c): what earlier hunts left.

Found and fixed here: weakly typed arrays came back strongly typed (a bfloat16
model with a `jnp.asarray(0.5)` buffer computed in float32 after a load); a
sub-state view (`state[0]`), a `tg.Grads` and a numpy masked array were saved
as nothing (or without their mask) and loaded as `like`'s; two threads saving
one path failed with orbax's errors and a load beside them raised
AttributeError; a failed rename left the new data and a temporary manifest.
"""

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import _io

from .test_io import assert_same, bits


def _flags(tree):
    return [getattr(x, "weak_type", None) for x in jax.tree_util.tree_leaves(tree)]


# ---------------------------------------------------------------- weak types


class Scaled(tg.Module):
    """bfloat16 weights and a Python-number buffer, as one writes `self.scale = jnp.asarray(.5)`."""

    __trainable__ = ("weight",)

    def __init__(self, seed):
        self.weight = jax.random.normal(jax.random.key(seed), (3, 2)).astype(jnp.bfloat16)
        self.scale = jnp.asarray(0.5)  # weakly typed: bfloat16 * scale stays bfloat16
        self.fill = jnp.full((2,), 0.25)  # weakly typed too

    def __call__(self, x):
        return (x @ self.weight) * self.scale + self.fill


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_weakly_typed_arrays_come_back_weak_and_compute_as_saved(tmp_path):
    m = Scaled(0)
    tg.save(tmp_path / "ck", m)
    x = jnp.ones((4, 3), jnp.bfloat16)
    for like in (Scaled(1), jax.eval_shape(lambda: Scaled(1))):
        out = tg.load(tmp_path / "ck", like)
        assert _flags(out) == _flags(m)
        assert (out.weight.weak_type, out.scale.weak_type, out.fill.weak_type) == (0, 1, 1)
        # the reference: the saved model itself; once the loaded one gave float32
        assert out(x).dtype == m(x).dtype == jnp.bfloat16
        assert bits(out(x)) == bits(m(x))
    # the saved value decides, not `like`: a strong array saved loads strong
    tg.save(tmp_path / "strong", {"s": jnp.float32(0.5)})
    assert _flags(tg.load(tmp_path / "strong", {"s": jnp.asarray(0.0)})) == [False]


@pytest.mark.slow  # ~2 s: compiled steps, two checkpoints
def test_implicit_resume_with_frozen_adjusted_multi_transform_is_bit_exact(tmp_path):
    # Params-based state, multi_transform of inject_hyperparams rules, adjust_ then
    # freeze_, loaded into jax.eval_shape likes: equals the uninterrupted run. Once
    # the buffer's weak type was lost, and the resumed steps computed in float32.
    def rule():
        inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
        return optax.multi_transform({"a": inner, "b": optax.sgd(0.1)}, lambda t: "a")

    def make(seed):
        m = {"net": Scaled(seed), "head": jax.random.normal(jax.random.key(seed + 9), (2,))}
        return m, tg.setup(rule(), tg.params(m))

    def steps(m, s, n, start):
        ps = tg.params(m)
        for i in range(start, start + n):
            x = jnp.cos(jnp.arange(12.0).reshape(4, 3) * (i + 1)).astype(jnp.bfloat16)
            loss = lambda: jnp.sum((m["net"](x) @ m["head"].astype(jnp.bfloat16)) ** 2)  # noqa: B023
            tg.update_(s, ps, tg.gradient(loss, ps))

    m, s = make(0)
    steps(m, s, 2, 0)
    tg.adjust_(s, learning_rate=0.03)
    tg.freeze_(s["head"])
    steps(m, s, 1, 2)
    tg.save(tmp_path / "ck", (m, s))
    steps(m, s, 3, 3)
    m2, s2 = tg.load(tmp_path / "ck", jax.eval_shape(lambda: make(5)))
    assert s2["head"].frozen and not s2["net"].weight.frozen
    steps(m2, s2, 3, 3)
    assert_same((m2, s2), (m, s))
    assert _flags(m2) == _flags(m)


# ---------------------------------------------------------------- saved as nothing


def _model_and_state():
    m = {"a": jnp.arange(3.0), "b": {"c": jnp.ones(2)}}
    s = tg.setup(optax.adam(0.1), m)
    s, m = tg.update(s, m, jax.tree_util.tree_map(jnp.ones_like, m))
    return m, s


def test_sub_state_views_and_grads_are_refused_not_saved_as_nothing(tmp_path):
    m, s = _model_and_state()
    grads = tg.gradient(lambda: jnp.sum(m["a"] ** 2), tg.params(m))
    tg.save(tmp_path / "ck", {"w": jnp.ones(2)})
    listing = sorted(os.listdir(tmp_path / "ck"))
    cases = [
        (s["b"], r"got a part of an optimiser state \(state\.l1 or state\[0\]"),
        ({"opt": s["b"]}, r"got a part of an optimiser state at 'opt' .*Save the whole state"),
        (grads, r"got a tg\.Grads, .*Save grads\.named\(\)"),
        ({"g": grads}, r"got a tg\.Grads at 'g'"),
    ]
    for tree, words in cases:
        with pytest.raises(TypeError, match=r"tg\.save: " + words):
            tg.save(tmp_path / "ck", tree)
        with pytest.raises(TypeError, match=words):
            tg.save(tmp_path / "new", tree)
    assert sorted(os.listdir(tmp_path / "ck")) == listing and not (tmp_path / "new").exists()
    # what the message says works: the whole state, and grads.named()
    tg.save(tmp_path / "s", s)
    back = tg.load(tmp_path / "s", tg.setup(optax.adam(0.1), m))
    assert_same(back, s)
    tg.save(tmp_path / "g", grads.named())
    np.testing.assert_array_equal(tg.load(tmp_path / "g", grads.named())["a"], 2 * m["a"])
    # a view in `like` is refused too: it would come back as `like`'s own view
    with pytest.raises(TypeError, match=r"tg\.load: got a part of an optimiser state at"):
        tg.load(tmp_path / "s", {"opt": s["b"]})


def test_masked_array_is_refused_not_saved_without_its_mask(tmp_path):
    tg.save(tmp_path / "ck", {"w": np.arange(2.0)})
    listing = sorted(os.listdir(tmp_path / "ck"))
    masked = np.ma.array([1.0, -1e9], mask=[False, True])
    with pytest.raises(TypeError, match=r"'w' is a numpy masked array, whose mask .*\.filled"):
        tg.save(tmp_path / "ck", {"w": masked})
    assert sorted(os.listdir(tmp_path / "ck")) == listing
    out = tg.load(tmp_path / "ck", {"w": np.zeros(2)})["w"]
    np.testing.assert_array_equal(out, [0.0, 1.0])  # the previous checkpoint
    assert masked.mask.tolist() == [False, True]


# ---------------------------------------------------------------- concurrency and failures


@pytest.mark.slow  # ~3 s: twelve orbax saves
def test_threads_saving_and_loading_one_path_all_succeed_and_never_mix(tmp_path):
    # Once: most saves died inside orbax (each thread removed the others' unfinished
    # data), and a load beside them raised AttributeError on orbax's metadata.
    path = tmp_path / "ck"
    tg.save(path, {"w": jnp.zeros(64), "step": 0})
    errors, loaded = [], []

    def saver(t):
        for j in range(3):
            try:
                step = 10 * t + j
                tg.save(path, {"w": jnp.full(64, float(step)), "step": step})
            except Exception as e:  # collected and reported below
                errors.append(e)

    threads = [threading.Thread(target=saver, args=(t,)) for t in range(1, 4)]
    for t in threads:
        t.start()
    for _ in range(6):
        out = tg.load(str(path) + "/", {"w": jnp.zeros(64), "step": 0})  # another spelling
        loaded.append((np.asarray(out["w"]), out["step"]))
    for t in threads:
        t.join()
    assert errors == []
    for w, step in loaded:  # each load is one whole save, never a mix of two
        np.testing.assert_array_equal(w, np.full(64, float(step)))
    assert len(os.listdir(path)) == 2


def test_failed_rename_keeps_previous_and_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    tg.save(path, {"w": jnp.arange(3.0)})
    listing = sorted(os.listdir(path))
    real = os.replace

    def refuse(*args):
        raise OSError("rename refused")

    monkeypatch.setattr(_io.os, "replace", refuse)
    with pytest.raises(OSError, match="rename refused"):
        tg.save(path, {"w": jnp.ones(3)})
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == listing  # once: data-1 and a temporary manifest stayed
    np.testing.assert_array_equal(tg.load(path, {"w": jnp.zeros(3)})["w"], [0.0, 1.0, 2.0])

    def interrupted_after(*args):
        real(*args)
        raise KeyboardInterrupt  # lands just after the commit

    monkeypatch.setattr(_io.os, "replace", interrupted_after)
    with pytest.raises(KeyboardInterrupt):
        tg.save(path, {"w": jnp.full(3, 7.0)})
    monkeypatch.undo()
    # committed: the new checkpoint loads whole (its data was not cleaned up as unfinished)
    np.testing.assert_array_equal(tg.load(path, {"w": jnp.zeros(3)})["w"], [7.0, 7.0, 7.0])
    tg.save(path, {"w": jnp.ones(3)})  # and the next save removes what is left
    assert len(os.listdir(path)) == 2
