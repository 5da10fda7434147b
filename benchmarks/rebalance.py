"""Rebalance: 300 tasks on 2 nodes, a 3rd joins (FairBalancer, balance_every 2 s).

Measured: time until every node is within the threshold (1.2 x average), and the number of
task moves (the minimum under FairBalancer's rule is 2 x (150 - 120) = 60), watched for a
while after convergence to catch ping-pong.
"""

from __future__ import annotations

import math
import queue
import time
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, save, table
from metafora import Task, open_client

TASKS = 300
THRESHOLD = 1.2
BALANCE_EVERY = 2.0


def measure(url: str, settle: float) -> dict[str, float]:
    """One run: seconds to converge, moves, and moves after convergence."""
    with Fleet() as fleet, open_client(url) as client:
        spec = {"mode": "hold", "balancer": "fair", "balance_every": BALANCE_EVERY}
        for node in ("rb0", "rb1"):
            fleet.start(WorkerSpec(url, node, **spec))  # type: ignore[arg-type]
        for i in range(TASKS):
            client.submit_task(Task(f"r{i:04d}"))
        started = 0
        while started < TASKS:
            fleet.expect("start", timeout=60)
            started += 1
        joined = time.monotonic()
        fleet.start(WorkerSpec(url, "rb2", **spec))  # type: ignore[arg-type]
        starts: list[float] = []
        converged: float | None = None
        converged_wall = 0.0
        limit = math.ceil(THRESHOLD * TASKS / 3)
        deadline = joined + 120
        while time.monotonic() < deadline:
            try:
                while True:  # drain: the queue lags the store
                    event = fleet.events.get(timeout=0.05)
                    if event[0] == "start":
                        starts.append(event[4])
            except queue.Empty:
                pass
            if converged is None:
                counts = client.node_task_count()
                if len(counts) == 3 and sum(counts.values()) == TASKS and max(counts.values()) <= limit:
                    converged, converged_wall = time.monotonic() - joined, time.time()
                    deadline = time.monotonic() + settle
        moves = len(starts)
        after = sum(1 for t in starts if t > converged_wall + 0.05) if converged is not None else 0
        return {"converge_s": converged if converged is not None else float("nan"),
                "moves": moves, "moves_after_converged": after,
                "final": client.node_task_count()}  # type: ignore[dict-item]


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Measure every store; print and save."""
    rows, data = [], {}
    for kind in stores.kinds:
        result = measure(stores.url(kind), settle=3 * BALANCE_EVERY if quick else 6 * BALANCE_EVERY)
        data[kind] = result
        rows.append((kind, result["converge_s"], result["moves"], 60, result["moves_after_converged"],
                     str(result["final"])))
    table("rebalance: 300 tasks, 2 nodes + 1 joining (FairBalancer 1.2, balance every 2 s)",
          ("store", "converge s", "moves", "min moves", "moves after", "final counts"), rows)
    save("rebalance", {"quick": quick, "results": data})
    return data
