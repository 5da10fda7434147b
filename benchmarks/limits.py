"""Group limits: what the limit check costs a claim (docs/limits.md).

    python -m benchmarks limits --stores sqlite,postgresql,etcd --quick
    python benchmarks/limits.py --stores sqlite -n 4000 --rounds 5

For each store, one node claims ``n`` offered tasks through ``claim_many`` (batches of 16) and
marks each batch done before the next, four ways:

- **no group**: tasks without a group (the claim statements/txns of before);
- **group, no limit**: every task in one group that has no limit;
- **max 64**: the group limited to 64 at once (never binding here: 16 run at a time), so the
  claim pays the check -- PostgreSQL: the group's limit row locked and its live claims
  counted; SQLite: the same count inside the write lock; etcd: the group's slots read, then
  one txn per task with the slot compare;
- **max 64 + rate**: also ``n`` claims per hour (the rate log / rate slots are written too).

The ways run in interleaved rounds (``--rounds``, default 5; 3 with ``--quick``): each round runs
every way once on a fresh store namespace, in an order rotated round by round, so no way always
runs first or last on a machine whose load drifts. Tasks per second each way (the median of the
rounds, and their range), and the cost against "no group" (medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Stores, save, table
from metafora import Task, open_client, open_coordinator
from metafora.testing import RecordingContext

BATCH = 16
WAYS = ("no group", "group, no limit", "max 64", "max 64 + rate")


def claim_rate(url: str, n: int, way: str) -> float:
    """Tasks per second one node claims (and marks done) through claim_many, batches of 16."""
    group = None if way == "no group" else "g"
    with open_client(url) as client:
        if way.startswith("max 64"):
            client.set_limit("g", max=64, rate=f"{n}/1h" if "rate" in way else None)
        client.submit_tasks([Task(f"c{i:06d}", group=group) for i in range(n)])
    coord = open_coordinator(url, node_id="claimer")
    coord.init(RecordingContext())
    try:
        tasks = [Task(f"c{i:06d}", group=group) for i in range(n)]
        started = time.perf_counter()
        got = 0
        for i in range(0, n, BATCH):
            won = coord.claim_many(tasks[i:i + BATCH], BATCH)
            got += len(won)
            for task in won:
                coord.done(task)
        elapsed = time.perf_counter() - started
        assert got == n, f"claimed {got} of {n}"
        return n / elapsed
    finally:
        coord.close()


def run(stores: Stores, quick: bool, n: int | None = None, rounds: int | None = None) -> dict[str, Any]:
    """Every store, every way, in interleaved rounds: claims per second (medians); print and save."""
    n = n or (800 if quick else 4000)
    rounds = rounds or (3 if quick else 5)
    rows, data = [], []
    for kind in stores.kinds:
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(rounds):
            for k in range(len(WAYS)):  # rotated: round r starts with way r
                way = WAYS[(r + k) % len(WAYS)]
                samples[way].append(claim_rate(stores.url(kind), n, way))
        rates = {way: statistics.median(values) for way, values in samples.items()}
        base = rates["no group"]
        rows.append((kind, *(f"{rates[w]:.0f} ({min(samples[w]):.0f}-{max(samples[w]):.0f})" for w in WAYS),
                     *(f"{(rates[w] / base - 1) * 100:+.0f}%" for w in WAYS[1:])))
        data.append({"store": kind, "tasks": n, "rounds": rounds,
                     **{f"per_s {w}": rates[w] for w in WAYS},
                     "samples": {w: samples[w] for w in WAYS}})
    table(f"claim_many + done of {n:,} tasks (batches of {BATCH}), one node, median of {rounds} "
          "interleaved rounds (range): tasks/s", ("store", *WAYS, *(f"cost: {w}" for w in WAYS[1:])), rows)
    save("limits", {"quick": quick, "rounds": rounds, "results": data})
    return {"results": data}


def main() -> None:
    """Parse arguments and run."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stores", default="sqlite,postgresql,etcd")
    parser.add_argument("-n", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every way")
    args = parser.parse_args()
    with Stores([k for k in args.stores.split(",") if k]) as stores:
        run(stores, quick=False, n=args.n, rounds=args.rounds)


if __name__ == "__main__":
    main()
