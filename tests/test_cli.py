"""The command line: the main job and the benchmark smoke run."""

import subprocess
import sys

from treegrad import _bench, _cli


def test_demo_quick_agrees_and_writes_plot(tmp_path, capsys):
    png = tmp_path / "curve.png"
    assert _cli.main(["demo", "--quick", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "OK: explicit and implicit training agree" in out
    assert "test accuracy" in out and "ms/step" in out
    accuracy = [
        float(line.split()[2])
        for line in out.splitlines()
        if line.startswith(("explicit", "implicit"))
    ]
    assert len(accuracy) == 2 and min(accuracy) > 0.8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_smoke_prints_every_column(capsys):
    assert _bench.main(steps=2, repeats=1, sizes=["tiny"]) == 0
    out = capsys.readouterr().out
    for name in (
        "jax.jit fused (hand-written)",
        "jax two-call (hand-written)",
        "tg.jit step",
        "tg naive loop",
        "tg implicit loop",
    ):
        assert name in out
    assert "vs fused" in out and "vs two-call" in out
    assert "traces of the loss: naive loop 1, implicit loop 1" in out
    assert "first call" in out


def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "treegrad._cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "demo" in out.stdout and "bench" in out.stdout
