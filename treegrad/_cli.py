"""The `treegrad` command: `treegrad demo` and `treegrad bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treegrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a digits classifier in both styles and compare")
    demo.add_argument("--epochs", type=int, default=20)
    demo.add_argument("--quick", action="store_true", help="3 epochs (for CI)")
    demo.add_argument("--plot", default="treegrad-demo.png", help="loss-curve PNG ('' for none)")

    bench = sub.add_parser("bench", help="per-step time against hand-written JAX")
    bench.add_argument("--steps", type=int, default=200, help="steps per timed repetition")
    bench.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    bench.add_argument("--sizes", default="tiny,deep", help="comma-separated: tiny,deep,wide")
    bench.add_argument("--plot", default="", help="write a PNG of overhead vs number of leaves")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run

        return run(epochs=3 if args.quick else args.epochs, plot=args.plot or None)
    from ._bench import main as bench_main

    return bench_main(
        steps=args.steps, repeats=args.repeats, sizes=args.sizes.split(","), plot=args.plot or None
    )


if __name__ == "__main__":
    sys.exit(main())
