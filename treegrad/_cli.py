"""The `treegrad` command: `treegrad demo` and `treegrad bench`."""

from __future__ import annotations

import argparse
import sys

# The benchmark's model sizes, named here so that parsing and `--help` need not import
# jax (~1 s); `tests/test_cli.py` checks that they are the keys of `_bench.SIZES`.
BENCH_SIZES = ("tiny", "deep", "wide")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _sizes(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCH_SIZES]
    if unknown or not names:
        given = ", ".join(repr(name) for name in unknown) or repr(text)
        raise argparse.ArgumentTypeError(
            f"unknown size {given}: choose one or more of {', '.join(BENCH_SIZES)}, "
            "comma-separated (e.g. --sizes tiny,deep)"
        )
    return names


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, except where it is off (False, '')."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, ""):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    """The command-line parser (defaults are shown in every `--help`)."""
    fmt = _ShowDefaults
    top = argparse.ArgumentParser(prog="treegrad", description=__doc__, formatter_class=fmt)
    sub = top.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a digits classifier in both styles and compare",
        description="Train a digits classifier in explicit and in implicit style from the "
        "same weights; exit 1 if the two styles disagree.",
        formatter_class=fmt,
    )
    demo.add_argument("--epochs", type=_positive_int, default=20, help="training epochs")
    demo.add_argument("--quick", action="store_true", help="3 epochs instead of --epochs (CI)")
    demo.add_argument("--plot", default="treegrad-demo.png", help="loss-curve PNG ('' for none)")

    bench = sub.add_parser(
        "bench",
        help="per-step time against hand-written JAX",
        description="One Adam step of an MLP per system, side by side with hand-written JAX "
        "(and equinox, flax, PyTorch when installed).",
        formatter_class=fmt,
    )
    bench.add_argument(
        "--steps", type=_positive_int, default=200, help="steps per timed repetition"
    )
    bench.add_argument("--repeats", type=_positive_int, default=5, help="interleaved repetitions")
    bench.add_argument(
        "--processes",
        type=_positive_int,
        default=1,
        help="run each table in this many fresh processes, one after another, and report "
        "the medians across them (a process's memory layout, fixed for its life, moves "
        "the small models' ratios by up to 20%%)",
    )
    bench.add_argument(
        "--sizes",
        type=_sizes,
        default="tiny,deep",
        help=f"comma-separated model sizes, from: {', '.join(BENCH_SIZES)}",
    )
    bench.add_argument(
        "--plot",
        default="",
        metavar="PNG",
        help="also run a sweep over 10 to 1,000 parameter arrays (takes several minutes; "
        "prints progress) and write a plot of each treegrad loop's time per step over "
        "hand-written JAX to this file (default: no sweep)",
    )
    bench.add_argument(
        "--first-call",
        type=_leaf_counts,
        default="10,100,2000",
        metavar="N,N,...",
        help="also time the first gradient (trace + compile) of models with these numbers "
        "of arrays, against jax.jit(jax.grad): medians of 5 pairs (3 from 1,000 arrays up); "
        "2000 takes about 15 s ('' for none)",
    )
    bench.add_argument(
        "--memory",
        action="store_true",
        help="also measure resident memory over 20,000 new lambdas and 2,000 distinct "
        "functions (about two minutes)",
    )
    return top


def _leaf_counts(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers (e.g. 10,100,2000), got {text!r}"
        ) from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"every number of arrays must be at least 1: {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    """Run `treegrad ARGS`; return the process exit code."""
    args = parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import run

        return run(epochs=3 if args.quick else args.epochs, plot=args.plot or None)
    from ._bench import main as bench_main

    code = bench_main(
        steps=args.steps,
        repeats=args.repeats,
        sizes=args.sizes,
        plot=args.plot or None,
        first_call_leaves=args.first_call,
        processes=args.processes,
    )
    if args.memory:
        from ._benchengine import memory

        print()
        print("\n".join(memory()))
    return code


if __name__ == "__main__":
    sys.exit(main())
