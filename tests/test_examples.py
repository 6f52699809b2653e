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


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_recurrent_named_grads(capsys):
    losses = load("recurrent_named_grads").main(steps=40, verbose=True)
    assert losses[-1] < losses[0]
    out = capsys.readouterr().out
    for name in ("rnn.cell.Wi", "rnn.cell.Wh", "rnn.cell.b", "head.weight", "head.bias"):
        assert name in out


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
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


def test_dqn_default_run_is_the_short_one():
    dqn = load("dqn_cartpole")
    defaults = dqn.main.__defaults__[:2]
    assert defaults == (dqn.QUICK["iterations"], dqn.QUICK["steps"])
    # The default run must stay well under a minute: 12 s measured for 4 x 100 steps.
    assert dqn.QUICK["iterations"] * dqn.QUICK["steps"] <= 400
    assert dqn.FULL["iterations"] * dqn.FULL["steps"] > 2 * 400


@pytest.mark.slow  # 6.6 s on a quiet 2-core machine, mostly compiling the rollout
def test_dqn_main_short_prints_progress_and_the_whole_warning(capsys):
    history = load("dqn_cartpole").main(iterations=2, steps=10, verbose=True)
    assert len(history["explicit"]) == 20
    assert history["explicit"] == history["implicit"]
    out = capsys.readouterr().out
    assert "iteration  1/2" in out and "iteration  2/2" in out
    # The whole warning, wrapped but not cut: its last words are the fix.
    flat = " ".join(out.split())
    assert "use explicit mode: tg.gradient(lambda m: loss(m(x), y), model)." in flat
    assert "identical step for step" in out


@pytest.mark.slow  # over ~2 s: the default run stays under 3 minutes
def test_digits_train_checkpoint(tmp_path):
    losses = load("digits_train_checkpoint").main(epochs=2, verbose=False, folder=str(tmp_path))
    assert losses[-1] < losses[0]
    assert (tmp_path / "digits.npz").exists()


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
def test_implicit_vs_explicit():
    curves = load("implicit_vs_explicit").main(steps=30, verbose=False)
    assert curves["explicit"] == curves["implicit"]
    assert curves["explicit"][-1] < curves["explicit"][0]


@pytest.mark.slow  # 8 s: two processes start jax; tests/test_scaling.py covers the same path
@pytest.mark.devices
def test_data_parallel_in_two_processes_equals_plain_optax():
    dp = load("data_parallel")
    report, losses = dp.main(steps=10, processes=2)
    assert report.startswith("2 process(es), 8 devices: 10 steps")
    import jax
    import optax

    model = dp.make_model(jax.random.key(0))
    rule = optax.adam(3e-3)
    opt = rule.init(model)
    expected = []
    for x, y in dp.local_batches(10):  # the whole batches, on one device
        value, g = jax.value_and_grad(dp.loss)(model, x, y)
        updates, opt = rule.update(g, opt, model)
        model = optax.apply_updates(model, updates)
        expected.append(float(value))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]
