"""Every example runs (few steps) and its loss falls."""

import importlib.util
import pathlib
import warnings

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_linear_both_styles():
    out = load("linear_both_styles").main(steps=60, verbose=False)
    for curve in out.values():
        assert curve[-1] < 0.1 * curve[0]
    np.testing.assert_allclose(out["explicit"], out["implicit"], rtol=1e-6)


def test_recurrent_named_grads(capsys):
    losses = load("recurrent_named_grads").main(steps=40, verbose=True)
    assert losses[-1] < losses[0]
    out = capsys.readouterr().out
    for name in ("rnn.cell.Wi", "rnn.cell.Wh", "rnn.cell.b", "head.weight", "head.bias"):
        assert name in out


def test_dqn_mistake_and_fix():
    dqn = load("dqn_cartpole")
    import jax

    model = dqn.make_model(jax.random.key(0))
    batch, _ = dqn.rollout(model, jax.random.key(1), 256, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mistake must not raise through, only be recorded
        messages, unchanged = dqn.mistake(model, batch)
    assert unchanged and messages and "outside the function" in messages[0]
    losses = dqn.train_implicit(dqn.make_model(jax.random.key(0)), batch, 30)
    assert losses[-1] < losses[0]
    _, losses = dqn.train_explicit(dqn.make_model(jax.random.key(0)), batch, 30)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_dqn_main_short():
    history = load("dqn_cartpole").main(iterations=2, steps=10, verbose=False)
    assert len(history["explicit"]) == 20


def test_digits_train_checkpoint(tmp_path):
    losses = load("digits_train_checkpoint").main(epochs=2, verbose=False, folder=str(tmp_path))
    assert losses[-1] < losses[0]
    assert (tmp_path / "digits.npz").exists()


def test_implicit_vs_explicit():
    curves = load("implicit_vs_explicit").main(steps=30, verbose=False)
    assert curves["explicit"] == curves["implicit"]
    assert curves["explicit"][-1] < curves["explicit"][0]
