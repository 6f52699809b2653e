"""The command line: the main job, argument checks, the benchmark run and its plot."""

import json
import re
import subprocess
import sys

import matplotlib.figure
import pytest

from treegrad import _bench, _cli


@pytest.mark.slow  # over ~1 s: the default run stays under 3 minutes
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


def test_cli_size_names_are_the_benchmark_sizes():
    assert tuple(_bench.SIZES) == _cli.BENCH_SIZES


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["bench", "--sizes", "huge"], r"--sizes: unknown size 'huge': choose one or more of "),
        (["bench", "--sizes", "tiny,huge"], r"unknown size 'huge'.*tiny, deep, wide"),
        (["bench", "--sizes", ","], r"--sizes: unknown size ','"),
        (["bench", "--steps", "0"], r"--steps: must be at least 1, got 0"),
        (["bench", "--repeats", "two"], r"--repeats: expected a whole number, got 'two'"),
        (["demo", "--epochs", "-1"], r"--epochs: must be at least 1, got -1"),
        (["bench", "--first-call", "10,x"], r"--first-call: expected comma-separated whole"),
        (
            ["bench", "--first-call", "0"],
            r"--first-call: every number of arrays must be at least 1",
        ),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_choices(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(argv)
    assert exit_.value.code == 2  # argparse's usage error, not a traceback from the run
    err = capsys.readouterr().err
    assert "usage: treegrad" in err
    assert re.search(words, err), err


def test_bench_main_rejects_an_unknown_size_before_running():
    with pytest.raises(ValueError, match=r"unknown benchmark size 'huge': choose from tiny, deep"):
        _bench.main(sizes=["tiny", "huge"])


def test_help_shows_defaults_and_that_plot_takes_minutes(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 200)" in out and "(default: 5)" in out and "(default: tiny,deep)" in out
    assert "from: tiny, deep, wide" in out
    assert "takes several minutes" in out and "prints progress" in out
    assert "(default: no sweep)" in out and "(default: )" not in out
    with pytest.raises(SystemExit):
        _cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "(default: 20)" in out and "(default: treegrad-demo.png)" in out
    assert "(default: False)" not in out


@pytest.mark.slow  # over ~2 s: the default run stays under 3 minutes
def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "treegrad._cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "demo" in out.stdout and "bench" in out.stdout


@pytest.mark.slow  # over ~2 s: the default run stays under 3 minutes
def test_missing_anchor_notes_name_the_extra(monkeypatch):
    for name in ("equinox", "flax", "torch"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    systems, notes, _ = _bench._systems([2, 3, 1], 4)
    assert not any(name.startswith(("equinox", "flax", "PyTorch")) for name in systems)
    assert len(notes) == 3, notes
    assert notes[0].startswith("equinox skipped (ModuleNotFoundError")
    assert notes[1].startswith("flax nnx skipped (ModuleNotFoundError")
    for note in notes[:2]:
        assert note.endswith('to include it: pip install -e ".[bench]"'), note
    assert notes[2].endswith("to include it: pip install torch"), notes[2]


def _fake_measure(sizes, batch, steps, repeats, anchors=True, seed=0):
    # Per-repetition seconds per step; each treegrad loop is a known multiple of its baseline.
    depth = len(sizes) - 1
    base = [1.0, 2.0, 4.0]
    times = {
        "jax.jit fused (hand-written)": base,
        "jax two-call (hand-written)": [2 * b for b in base],
        "tg.jit step": [1.5 * b for b in base],
        "tg.jit implicit step": [1.25 * b for b in base],
        "tg naive loop (new lambda/step)": [
            2 * b * r for b, r in zip(base, (1.0, 1.2, 3.0), strict=True)
        ],
        "tg implicit loop": [2 * b * (1 + depth / 10) for b in base],
    }
    return _bench.Measured(times, times, [], {})


def test_leaf_sweep_ratios_per_repetition_and_progress(monkeypatch, capsys):
    monkeypatch.setattr(_bench, "measure", _fake_measure)
    sweep = _bench.leaf_sweep([5, 20], steps=1, repeats=3, progress=True)
    assert set(sweep) == set(_bench.BASELINES)
    assert sweep["tg.jit step"] == [(10, 1.5, 1.5, 1.5), (40, 1.5, 1.5, 1.5)]
    assert sweep["tg naive loop (new lambda/step)"][0] == (10, 1.2, 1.0, 3.0)
    assert [p.median for p in sweep["tg implicit loop"]] == pytest.approx([1.5, 3.0])
    out = capsys.readouterr().out
    assert "sweep 1/2: MLP of 5 layers (10 leaves)" in out
    assert "sweep 2/2: MLP of 20 layers (40 leaves)" in out and "sweep done" in out


def test_overhead_plot_has_title_reference_line_and_error_bars(monkeypatch, tmp_path):
    monkeypatch.setattr(_bench, "measure", _fake_measure)
    sweep = _bench.leaf_sweep([5, 20], steps=1, repeats=3)
    figures = []
    original = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    png = tmp_path / "overhead.png"
    _bench.plot_sweep(sweep, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = figures[0].axes
    assert "hand-written JAX" in ax.get_title()
    assert "hand-written JAX" in ax.get_ylabel()
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    bars = [c for c in ax.containers if c.has_yerr]
    assert len(bars) == 4
    naive = next(c for c in bars if c.get_label().startswith("tg naive loop"))
    (segments,) = naive.lines[2]  # one LineCollection: the vertical min-max bar per point
    first_point = segments.get_segments()[0]
    assert tuple(first_point[:, 1]) == pytest.approx((1.0, 3.0))


def test_measure_runs_every_system_once_per_repetition_in_changing_orders(monkeypatch):
    ran: list[str] = []

    def fake_systems(sizes, batch, anchors=True):
        names = ["a", "b", "c", "d", "e"]
        return {n: (lambda steps, n=n: ran.append(n)) for n in names}, ["note"], {"naive": [1]}

    monkeypatch.setattr(_bench, "_systems", fake_systems)
    times, cpu, notes, traces = _bench.measure([2, 1], 1, steps=4, repeats=6)
    assert ran[:5] == list("abcde")  # the warm-up, in order
    rounds = [ran[5 + 5 * i : 10 + 5 * i] for i in range(6)]
    assert all(sorted(r) == list("abcde") for r in rounds)
    # A fixed order would give each system the same predecessor every time.
    assert len({tuple(r) for r in rounds}) > 1
    assert all(len(times[n]) == len(cpu[n]) == 6 for n in "abcde")
    assert all(t >= 0 for n in "abcde" for t in cpu[n])
    assert (notes, traces) == (["note"], {"naive": [1]})


def test_table_has_the_control_and_cpu_column():
    systems, _, _ = _bench._systems([2, 3, 1], 4, anchors=False)
    assert _bench.CONTROL in systems and _bench.TWO in systems
    times = {name: [2.0, 2.0] for name in systems}
    times["jax.jit fused (hand-written)"] = [1.0, 1.0]
    cpu = {name: [4.0, 4.0] for name in systems}
    cpu["tg implicit loop"] = [5.0, 5.0]
    table = _bench.format_table("t", times, cpu)
    assert "cpu vs two-call" in table.splitlines()[1]
    implicit = next(line for line in table.splitlines() if line.startswith("tg implicit loop"))
    assert implicit.split()[-3:] == ["2.00", "1.00", "1.25"]


def test_processes_report_medians_and_paired_ratios_across_processes(monkeypatch):
    # Three processes; process 2 is slow for every system alike (its memory layout):
    # a ratio within each process is 1.5, the ratio of cross-process medians is not.
    per = [(1.0, 1.5), (10.0, 15.0), (1.2, 1.8)]
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        seed = int(cmd[-1])
        two, tg_ = per[seed]
        times = {"jax.jit fused (hand-written)": two, _bench.TWO: two, "tg implicit loop": tg_}
        out = {"times": times, "cpu": times, "notes": ["n"], "traces": {"naive": [1]}}
        return subprocess.CompletedProcess(
            cmd, 0, stdout="warm-up text\n" + json.dumps(out), stderr=""
        )

    monkeypatch.setattr(_bench.subprocess, "run", fake_run)
    m = _bench.measure_processes("tiny", steps=7, repeats=3, processes=3)
    assert [c[-4:] for c in calls] == [["tiny", "7", "3", str(s)] for s in range(3)]
    assert m.times["tg implicit loop"] == [1.5, 15.0, 1.8]  # in process order
    line = next(
        row
        for row in _bench.format_table("t", m.times, m.cpu, paired=True).splitlines()
        if row.startswith("tg implicit loop")
    )
    assert line.split()[-3:] == ["1.50", "1.50", "1.50"]
    assert "1500000.0-15000000.0" in line  # spread: min-max of the processes' medians


def test_a_failed_benchmark_process_names_itself_and_shows_its_error(monkeypatch):
    monkeypatch.setattr(
        _bench.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Boom: no jax"),
    )
    with pytest.raises(RuntimeError, match=r"benchmark process 1 of 2 failed \(exit 1\):\nBoom"):
        _bench.measure_processes("tiny", steps=1, repeats=1, processes=2)


@pytest.mark.slow  # two fresh processes, each compiling every system and the anchors: ~30 s
def test_bench_in_processes_end_to_end_prints_every_column(capsys):
    """The documented benchmark command, small: every system's row and column, the trace
    counts, the first calls and the per-call breakdown (measured in this process)."""
    argv = ["bench", "--sizes", "tiny", "--steps", "2", "--repeats", "1", "--processes", "2"]
    code = _cli.main([*argv, "--first-call", "3"])
    assert code == 0
    out = capsys.readouterr().out
    assert "2 processes of 1 repetitions: medians across processes" in out
    assert "tiny: process 2/2" in out
    assert next(r for r in out.splitlines() if r.startswith(_bench.CONTROL))
    for name in (
        "jax.jit fused (hand-written)",
        "jax two-call (hand-written)",
        "jax.jit fused, tg Modules (hand)",
        "tg.jit step",
        "tg.jit implicit step",
        "tg naive loop",
        "tg implicit loop",
    ):
        assert name in out
    assert "vs fused" in out and "vs two-call" in out
    assert "traces of the loss: naive loop 1, implicit loop 1" in out
    assert "first call" in out
    assert "per-call overhead breakdown" in out and "its compiled program alone" in out
    assert re.search(r"3 leaves: jax.jit\(jax.grad\) [0-9.]+s, tg.gradient [0-9.]+s \(ratio", out)
