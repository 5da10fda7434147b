"""Run benchmarks: ``python -m benchmarks all --quick``, or one by name (see BENCHMARKS).

``peers`` (metafora beside pgqueuer and procrastinate, needs the ``bench`` extra) is not part of
``all``: ``python -m benchmarks peers [--quick] [--rounds 3] [--systems ...]``. Nor is ``simulate``
(a one-process simulation of 100 and 1,000 nodes; PostgreSQL, if in ``--stores``, only to measure a
count read): ``python -m benchmarks simulate [--quick]``.
"""

from __future__ import annotations

import argparse
import importlib

from benchmarks.common import STORES, Stores

BENCHMARKS = ("claims", "latency", "failover", "rebalance", "scale", "gates", "storm", "submit",
              "capacity", "idle", "placement", "schedules", "restart", "security", "at_risk",
              "limits", "prune", "idle_cluster", "streams", "herd", "rolling")


def main() -> None:
    """Parse arguments and run the chosen benchmarks."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("which", choices=("all", *BENCHMARKS, "peers", "simulate"))
    parser.add_argument("--quick", action="store_true", help="smaller runs (minutes, not tens)")
    parser.add_argument("--stores", default=",".join(STORES),
                        help=f"comma-separated subset of {','.join(STORES)}")
    parser.add_argument("--rounds", type=int, default=3, help="peers: interleaved rounds (default 3)")
    parser.add_argument("--systems", default=None,
                        help="peers: comma-separated subset of metafora-postgresql,metafora-sqlite,"
                             "pgqueuer-default,pgqueuer-recommended,"
                             "pgqueuer,procrastinate")
    parser.add_argument("--etcd-members", type=int, default=None,
                        help="etcd members started on loopback (default 1, or $METAFORA_BENCH_ETCD_MEMBERS)")
    args = parser.parse_args()
    if args.which == "peers":  # makes its own databases: no shared stores to provision
        from benchmarks import peers

        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        peers.run_peers(args.quick, args.rounds, peers.parse_systems(args.systems))
        return
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    if args.which == "simulate":  # no cluster of processes: no stores to provision
        from benchmarks import simulate

        simulate.run_simulate(args.quick, kinds)
        return
    names = BENCHMARKS if args.which == "all" else (args.which,)
    if args.etcd_members is not None and args.etcd_members < 1:
        parser.error("--etcd-members must be at least 1")
    members = {} if args.etcd_members is None else {"etcd_members": args.etcd_members}
    with Stores(kinds, **members) as stores:
        for name in names:
            try:
                module = importlib.import_module(f"benchmarks.{name}")
            except ImportError as exc:
                print(f"skipping {name}: {exc}")
                continue
            module.run(stores, args.quick)


if __name__ == "__main__":
    main()
