"""Side-by-side benchmark of treegrad against hand-written JAX (and anchors if installed).

Usage: python benchmarks/run.py [--steps N] [--repeats N] [--sizes tiny,deep,wide] [--plot out.png]

The same measurement as `treegrad bench` (treegrad/_bench.py), kept in the
package so the installed command needs no checkout. Results: docs/benchmarks.md.
"""

import sys

from treegrad._cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
