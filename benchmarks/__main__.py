"""Run benchmarks: ``python -m benchmarks all --quick``, or one by name (see BENCHMARKS)."""

from __future__ import annotations

import argparse
import importlib

from benchmarks.common import STORES, Stores

BENCHMARKS = ("claims", "latency", "failover", "rebalance", "scale", "gates", "storm", "submit",
              "capacity", "idle", "schedules")


def main() -> None:
    """Parse arguments and run the chosen benchmarks."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("which", choices=("all", *BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="smaller runs (minutes, not tens)")
    parser.add_argument("--stores", default=",".join(STORES),
                        help=f"comma-separated subset of {','.join(STORES)}")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    names = BENCHMARKS if args.which == "all" else (args.which,)
    with Stores(kinds) as stores:
        for name in names:
            try:
                module = importlib.import_module(f"benchmarks.{name}")
            except ImportError as exc:
                print(f"skipping {name}: {exc}")
                continue
            module.run(stores, args.quick)


if __name__ == "__main__":
    main()
