"""Placement and priorities: what the selector check and the priority order cost, and what they buy.

    python -m benchmarks placement --stores sqlite,postgresql,etcd
    python benchmarks/placement.py --stores sqlite -n 20000

For each store, with ``-n`` pending tasks submitted in bulk:

- **urgent offer**: one task of priority 100 among ``n - 1`` of priority 0, its id sorting
  last; a coordinator's watch starts and the seconds until that task is offered, and its
  place among the offers (1 = first), are measured. Without priorities it came at a random
  place of the backlog (the scan starts at a random pending id).
- **claim cost of a selector**: one node claims 2,000 offered tasks in batches of 16
  (``claim_many``), once with tasks that carry no selector and once with tasks selecting
  ``gpu=1`` (the node is labelled ``gpu=1,zone=eu``): tasks per second each way.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Stores, save, table
from metafora import Task, open_client, open_coordinator
from metafora.testing import RecordingContext

CLAIMS = 2000
BATCH = 16


def urgent_offer(url: str, n: int) -> tuple[float, int]:
    """(seconds until the urgent task is offered, its place among the offers)."""
    with open_client(url) as client:
        client.submit_tasks([Task(f"t{i:07d}") for i in range(n - 1)]
                            + [Task("zz-urgent", priority=100)])
    coord = open_coordinator(url, node_id="watcher")
    coord.init(RecordingContext())
    offers: queue.Queue[Task] = queue.Queue()
    started = time.perf_counter()
    watcher = threading.Thread(target=coord.watch, args=(offers,), daemon=True)
    watcher.start()
    place = 0
    try:
        while True:
            task = offers.get(timeout=300)
            place += 1
            if task.id == "zz-urgent":
                return time.perf_counter() - started, place
    finally:
        coord.close()
        watcher.join(30)


def claim_rate(url: str, selector: dict[str, str]) -> float:
    """Tasks per second one node claims through claim_many, batches of 16."""
    with open_client(url) as client:
        client.submit_tasks([Task(f"c{i:06d}", selector=selector) for i in range(CLAIMS)])
    coord = open_coordinator(url, node_id="claimer")
    coord.init(RecordingContext(labels={"gpu": "1", "zone": "eu"}))
    try:
        tasks = [Task(f"c{i:06d}") for i in range(CLAIMS)]
        started = time.perf_counter()
        got = 0
        for i in range(0, CLAIMS, BATCH):
            got += len(coord.claim_many(tasks[i:i + BATCH], BATCH))
        elapsed = time.perf_counter() - started
        assert got == CLAIMS, f"claimed {got} of {CLAIMS}"
        return CLAIMS / elapsed
    finally:
        coord.close()


def run(stores: Stores, quick: bool, n: int | None = None) -> dict[str, Any]:
    """Every store: the urgent offer and the claim cost of a selector; print and save."""
    n = n or (5000 if quick else 20_000)
    rows, data = [], []
    for kind in stores.kinds:
        seconds, place = urgent_offer(stores.url(kind), n)
        plain = claim_rate(stores.url(kind), {})
        placed = claim_rate(stores.url(kind), {"gpu": "1"})
        rows.append((kind, n, f"{seconds:.3f}", place, f"{plain:.0f}", f"{placed:.0f}",
                     f"{(placed / plain - 1) * 100:+.1f}%"))
        data.append({"store": kind, "backlog": n, "urgent_offer_s": seconds, "urgent_place": place,
                     "claims_per_s_plain": plain, "claims_per_s_selector": placed})
    table(f"priority 100 among {n:,} pending; claim_many of {CLAIMS:,} (batches of {BATCH})",
          ("store", "backlog", "urgent offered after s", "its place", "claims/s plain",
           "claims/s selector", "selector cost"), rows)
    save("placement", {"quick": quick, "results": data})
    return {"results": data}


def main() -> None:
    """Parse arguments and run."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stores", default="sqlite,postgresql,etcd")
    parser.add_argument("-n", type=int, default=20_000)
    args = parser.parse_args()
    with Stores([k for k in args.stores.split(",") if k]) as stores:
        run(stores, quick=False, n=args.n)


if __name__ == "__main__":
    main()
