"""Failover: SIGKILL one of 3 consumers holding 100 tasks, then SIGTERM another.

Measured: time from the kill until every task of the victim has started elsewhere (target:
lease_ttl + 1 s), and the same after a graceful SIGTERM (target: 1 s).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, save, table
from metafora import Task, open_client

LEASE_TTL = 3.0


def _moved(fleet: Fleet, owners: dict[str, str], victim: str, timeout: float) -> float:
    """Wait until every task of ``victim`` starts on another node; time of the last start."""
    waiting = {t for t, n in owners.items() if n == victim}
    last = 0.0
    deadline = time.monotonic() + timeout
    while waiting:
        try:
            event = fleet.expect("start", timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(f"tasks of {victim} not restarted: {sorted(waiting)[:10]}") from None
        _, node, task_id, _, at = event
        owners[task_id] = node
        if task_id in waiting and node != victim:
            waiting.discard(task_id)
            last = max(last, at)
    return last


def measure(url: str, tasks: int) -> dict[str, float]:
    """One failover run; returns seconds for the kill and for the graceful stop."""
    with Fleet() as fleet, open_client(url) as client:
        nodes = [f"fo{i}" for i in range(3)]
        for node in nodes:
            fleet.start(WorkerSpec(url, node, mode="hold", options={"lease_ttl": LEASE_TTL}))
        for i in range(tasks):
            client.submit_task(Task(f"f{i:04d}"))
        owners: dict[str, str] = {}
        while len(owners) < tasks:
            _, node, task_id, _, _ = fleet.expect("start", timeout=60)
            owners[task_id] = node
        victim = Counter(owners.values()).most_common(1)[0][0]
        held = sum(1 for n in owners.values() if n == victim)
        killed_at = fleet.kill(victim, signal.SIGKILL)
        kill_s = _moved(fleet, owners, victim, LEASE_TTL * 5 + 30) - killed_at
        second = next(n for n in nodes if n != victim)
        held2 = sum(1 for n in owners.values() if n == second)
        stopped_at = fleet.kill(second, signal.SIGTERM)
        graceful_s = _moved(fleet, owners, second, 30) - stopped_at
        return {"kill_s": kill_s, "kill_tasks": held, "graceful_s": graceful_s, "graceful_tasks": held2}


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Measure every store; print and save."""
    rows, data = [], {}
    for kind in stores.kinds:
        result = measure(stores.url(kind), 100)
        data[kind] = {"lease_ttl_s": LEASE_TTL, **result}
        rows.append((kind, LEASE_TTL, result["kill_tasks"], result["kill_s"], LEASE_TTL + 1,
                     result["graceful_tasks"], result["graceful_s"], 1.0))
    table("failover of a node holding tasks (s)",
          ("store", "lease_ttl", "tasks killed", "SIGKILL", "target", "tasks stopped", "SIGTERM", "target"),
          rows)
    save("failover", {"quick": quick, "results": data})
    return data
