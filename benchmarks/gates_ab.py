"""Gates throughput, this checkout against an earlier revision (see :mod:`benchmarks.ab`).

    python benchmarks/gates_ab.py --base aa98784^1 [--rounds 3] [--items 50000]
                                  [--stores postgresql,sqlite]

Writes ``benchmarks/results/gates_ab.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # python benchmarks/gates_ab.py

from benchmarks import ab
from benchmarks.common import RESULTS


def main() -> None:
    """``python benchmarks/gates_ab.py --base REV [--rounds N] [--items N] [--stores ...]``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/gates_ab.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the earlier revision (a git rev)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--stores", default="postgresql,sqlite")
    args = parser.parse_args()
    if args.rounds < 1 or args.items < 100:
        parser.error("--rounds must be at least 1 and --items at least 100")
    os.environ["METAFORA_GATES_ITEMS"] = str(args.items)  # both sides' runs inherit it
    RESULTS.mkdir(exist_ok=True)
    ab.run("gates", args.base, args.rounds, False, args.stores, save_as="gates_ab")


if __name__ == "__main__":
    main()
