"""Periodic schedules: how late ticks become tasks, and what the schedulers cost the store.

    python -m benchmarks schedules --stores sqlite,postgresql,etcd [--quick]

For each store, three nodes (coordinators registered with ``init``, each running a
:class:`~metafora.consumer.schedule.Scheduler` on the real clock, in this process) share one schedule
``every 1s``. Measured over ``-n`` ticks (60, quick: 20):

- lateness: task ``created_at`` (the store's clock, same machine) minus the tick time, p50/p95/max;
- the atomic step: ``materialise`` calls per tick (all nodes race; one wins), and the
  duration of the winning calls (p50/p95, ms);
- schedule-list reads per tick (the racers that lost re-read);
- idle: with one schedule ``every 1h`` (no tick due), the schedule-list reads of the three nodes
  over a 20 s window: the cost of the safety net (30 s on pushed stores, 5 s on SQLite).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Stores, percentile, save, table
from metafora import open_client, open_coordinator
from metafora.consumer.schedule import Scheduler
from metafora.contracts.coordinator import Coordinator
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.schedule_model import Schedule
from metafora.core.task import Task, parse_time
from metafora.testing import RecordingContext


class _Counting:
    """Wraps a coordinator's schedule calls to count them and time the winning steps."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.lock = threading.Lock()
        self.reads = 0
        self.steps = 0
        self.won_ms: list[float] = []
        original_list, original_step = coord.schedules, coord.materialise

        def schedules() -> list[Schedule]:
            with self.lock:
                self.reads += 1
            return original_list()

        def materialise(schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
            started = time.perf_counter()
            won = original_step(schedule, tasks, cursor)
            with self.lock:
                self.steps += 1
                if won:
                    self.won_ms.append((time.perf_counter() - started) * 1000)
            return won

        coord.schedules = schedules  # type: ignore[method-assign]
        coord.materialise = materialise  # type: ignore[method-assign]


def _nodes(url: str) -> tuple[list[_Counting], list[Scheduler], list[threading.Thread]]:
    counted = []
    for i in range(3):
        coord = open_coordinator(url, f"s{i}")
        coord.init(RecordingContext())
        counted.append(_Counting(coord))
    schedulers = [Scheduler(c.coord, SYSTEM_CLOCK) for c in counted]
    threads = [threading.Thread(target=s.run, daemon=True) for s in schedulers]
    for t in threads:
        t.start()
    return counted, schedulers, threads


def _stop(counted: list[_Counting], schedulers: list[Scheduler], threads: list[threading.Thread]) -> None:
    for s in schedulers:
        s.stop()
    for t in threads:
        t.join(30)
    for c in counted:
        c.coord.close()


def measure(url: str, ticks: int, idle_window: float) -> dict[str, Any]:
    """One store: ``ticks`` ticks of a 1 s schedule on three nodes, then the idle window."""
    with open_client(url) as client:
        client.tasks()  # the schema, before the nodes start
        counted, schedulers, threads = _nodes(url)
        try:
            time.sleep(1.0)  # the nodes' first reads are not the ticks' cost
            reads0 = sum(c.reads for c in counted)
            client.add_schedule("bench", every="1s")
            deadline = time.monotonic() + ticks + 60
            while time.monotonic() < deadline:
                made = client.task_page(prefix="bench@", limit=ticks + 10)
                if len(made) >= ticks:
                    break
                time.sleep(0.5)
            client.pause_schedule("bench")
            infos = client.task_page(prefix="bench@", limit=10_000)
            late = []
            for info in infos:
                tick = parse_time(info.id.split("@", 1)[1], "tick")
                assert info.created_at is not None
                late.append((info.created_at - tick).total_seconds() * 1000)
            steps = sum(c.steps for c in counted)
            reads = sum(c.reads for c in counted) - reads0
            won = [ms for c in counted for ms in c.won_ms]
            client.delete_schedule("bench")
            client.add_schedule("idle", every="1h")
            time.sleep(2.0)  # the push (or the next safety-net read) of the change
            idle0 = sum(c.reads for c in counted)
            time.sleep(idle_window)
            idle_reads = sum(c.reads for c in counted) - idle0
        finally:
            _stop(counted, schedulers, threads)
    n = len(infos)
    ids = [i.id for i in infos]
    return {
        "ticks": n,
        "distinct": len(set(ids)),
        "late_ms_p50": percentile(late, 50),
        "late_ms_p95": percentile(late, 95),
        "late_ms_max": max(late) if late else float("nan"),
        "steps_per_tick": steps / n if n else float("nan"),
        "step_ms_p50": percentile(won, 50),
        "step_ms_p95": percentile(won, 95),
        "reads_per_tick": reads / n if n else float("nan"),
        "idle_window_s": idle_window,
        "idle_reads_3_nodes": idle_reads,
    }


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every store: print the table and save the JSON."""
    ticks = 20 if quick else 60
    data: dict[str, Any] = {}
    rows = []
    for kind in stores.kinds:
        result = measure(stores.url(kind), ticks, 20.0)
        data[kind] = result
        rows.append([kind, result["ticks"], result["distinct"], result["late_ms_p50"], result["late_ms_p95"],
                     result["late_ms_max"], result["steps_per_tick"], result["step_ms_p50"],
                     result["step_ms_p95"], result["reads_per_tick"], result["idle_reads_3_nodes"]])
    table("schedules: 3 nodes, every 1s", ["store", "ticks", "distinct", "late p50 ms", "late p95 ms",
                                            "late max ms", "steps/tick", "step p50 ms", "step p95 ms",
                                            "reads/tick", "idle reads/20s"], rows)
    path = save("schedules", data)
    print(f"saved {path}")
    return data


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stores", default="sqlite,postgresql,etcd")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    with Stores([k for k in args.stores.split(",") if k]) as provisioned:
        run(provisioned, args.quick)
