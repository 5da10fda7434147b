"""A rolling restart of consumer processes holding long-running tasks (issue 51 point 1).

N processes hold T tasks (``hold`` handlers: a task runs until stopped, like a stream consumer);
once the cluster is even, each process in turn gets SIGTERM, is joined, and is started again.
Two ways to come back:

- **same ids** (a StatefulSet pod, a systemd unit): the process comes back under its node id,
  with ``Consumer(sticky_for=STICKY)`` (opt-in; the default, 0, releases at once): its tasks are
  held for it and it takes them back. Target: at most 1.05 starts per task over the whole
  restart, each task's gap (its handler's stop to its next start) at most its process's restart
  (SIGTERM to registered again) plus 1 s, and even again after each restart.
- **new ids** (a Deployment): each process comes back with a new node id, at the defaults;
  nothing is held, tasks move as before (about two starts per task).

Figures per (store, size, ids): starts per task during the restart, the largest number of
starts of one task, each restart's seconds (SIGTERM to registered), the gaps beyond their
process's restart (the largest, and how many exceed 1 s), seconds until even after each restart.

    python -m benchmarks rolling [--quick] [--stores sqlite,postgresql]

``--quick`` runs 3 x 300 only; the full run adds 5 x 10,000. ``METAFORA_ROLLING_SIZES`` (e.g.
``3x300,5x10000``) and ``METAFORA_ROLLING_STICKY_FOR`` (seconds, default 60) override.
"""

from __future__ import annotations

import bisect
import os
import queue
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, save, table
from benchmarks.restart import is_even
from metafora import Task, open_client
from metafora.contracts.client import Client

STICKY_FOR = float(os.environ.get("METAFORA_ROLLING_STICKY_FOR", "60"))
LIMIT = 180.0  # seconds a phase may take before it is reported as not converged
CHECK_EVERY = 0.5  # seconds between two looks at the store (see Cluster.wait_until)


def _sizes(quick: bool) -> list[tuple[int, int]]:
    raw = os.environ.get("METAFORA_ROLLING_SIZES") or ("3x300" if quick else "3x300,5x10000")
    return [(int(n), int(t)) for n, t in (part.split("x") for part in raw.split(","))]


@dataclass
class Cluster:
    """One cluster's processes and every start, stop and registration they reported."""

    url: str
    fleet: Fleet
    client: Client
    starts: list[tuple[str, str, float]] = field(default_factory=list)  # (node, task, time)
    ends: list[tuple[str, str, float]] = field(default_factory=list)
    ready: dict[str, float] = field(default_factory=dict)  # node -> time its consumer started

    def spec(self, node: str, sticky: bool) -> WorkerSpec:
        # sticky_for passed only when set: the base of an A/B (before sticky return) lacks it.
        extra = {"sticky_for": STICKY_FOR} if sticky and STICKY_FOR else {}
        return WorkerSpec(self.url, node, mode="hold", balancer="default", balance_every=60.0,
                          **extra)

    def drain(self, wait: float = 0.05) -> None:
        """Record the events the processes sent, for ``wait`` seconds (their times are the
        processes' own, so a late drain moves no figure)."""
        end = time.monotonic() + wait
        try:
            while True:
                event = self.fleet.events.get(timeout=max(0.0, end - time.monotonic()))
                if event[0] == "start":
                    self.starts.append((event[1], event[2], event[4]))
                elif event[0] == "end":
                    self.ends.append((event[1], event[2], event[4]))
                elif event[0] == "ready":  # (ready, node, pid, the time it started)
                    self.ready[event[1]] = event[3]
        except queue.Empty:
            pass

    def wait_until(self, ok: Any) -> float:
        """Seconds until ``ok()`` holds (NaN if not within LIMIT), asked every CHECK_EVERY s:
        an exact count reads every claim, and asked in a tight loop it took the CPU the
        restarted node needed to take its tasks back (1.5 s for 2,000 became 5-7 s)."""
        began = time.monotonic()
        while time.monotonic() - began < LIMIT:
            self.drain(CHECK_EVERY)
            if ok():
                return time.monotonic() - began
        return float("nan")

    def counts(self) -> dict[str, int]:
        return self.client.node_task_count()


def _gaps(cl: Cluster, since: float, restarts: dict[str, tuple[float, float]]) -> list[float]:
    """Each task stopped during the restart: its gap (stop to next start) less the restart
    time of the process that stopped it (SIGTERM to its successor's start)."""
    over = []
    starts: dict[str, list[float]] = {}  # task -> its start times since ``since``, in order
    for _, task, at in sorted(cl.starts, key=lambda s: s[2]):
        if at >= since:
            starts.setdefault(task, []).append(at)
    for node, task, stopped in cl.ends:
        if stopped < since or node not in restarts:
            continue
        times = starts.get(task, [])
        i = bisect.bisect_left(times, stopped)
        if i < len(times):
            over.append((times[i] - stopped) - restarts[node][1])
    return over


def one(url: str, nodes: int, tasks: int, same_ids: bool) -> dict[str, Any]:
    """Start the cluster, wait until even, restart every process in turn; the figures."""
    with Fleet() as fleet, open_client(url) as client:
        cl = Cluster(url, fleet, client)
        names = [f"n{i}" for i in range(nodes)]
        client.submit_tasks(Task(f"r{i:06d}") for i in range(tasks))
        for name in names:
            fleet.spawn(cl.spec(name, same_ids))
        cold_s = cl.wait_until(lambda: len(cl.counts()) == nodes and is_even(cl.counts(), tasks))
        cl.wait_until(lambda: len({t for _, t, _ in cl.starts}) == tasks)
        since = time.time()
        mark = len(cl.starts)
        restarts: dict[str, tuple[float, float]] = {}  # old node -> (its SIGTERM, restart s)
        even_after: list[float] = []
        live = list(names)
        for i, name in enumerate(names):
            began = time.time()
            fleet.kill(name, signal.SIGTERM)
            fleet.procs[name].join(120)
            fleet.procs.pop(name)
            new = name if same_ids else f"{name}r"
            cl.ready.pop(new, None)
            fleet.spawn(cl.spec(new, same_ids))
            live[i] = new
            cl.wait_until(lambda n=new: n in cl.ready)
            restarts[name] = (began, cl.ready.get(new, float("nan")) - began)
            even_after.append(cl.wait_until(
                lambda: set(cl.counts()) == set(live) and is_even(cl.counts(), tasks)))
        # Every stopped task's next start is written once it ran: wait for all of them.
        cl.wait_until(lambda: len({t for _, t, at in cl.starts[mark:]}) >= len(
            {t for _, t, at in cl.ends if at >= since}))
        cl.drain(1.0)
        window = cl.starts[mark:]
        per_task = Counter(t for _, t, _ in window)
        over = _gaps(cl, since, restarts)
        return {"nodes": nodes, "tasks": tasks, "ids": "same" if same_ids else "new",
                "sticky_for": STICKY_FOR if same_ids else 0.0, "cold_even_s": cold_s,
                "starts_per_task": len(window) / tasks,
                "max_starts_of_a_task": max(per_task.values(), default=0),
                "restart_s": [round(r[1], 2) for r in restarts.values()],
                "gaps": len(over), "max_gap_over_restart_s": max(over, default=float("nan")),
                "gaps_over_restart_plus_1s": sum(1 for g in over if g > 1.0),
                "even_after_each_s": [round(e, 2) for e in even_after],
                "counts": sorted(cl.counts().values(), reverse=True)}


def run(stores: Stores, quick: bool) -> list[dict[str, Any]]:
    """Every size, both ways of coming back, on every store; print and save."""
    results: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    for nodes, tasks in _sizes(quick):
        for kind in stores.kinds:
            for same in (True, False):
                r = {"store": kind, **one(stores.url(kind), nodes, tasks, same)}
                load.append(os.getloadavg()[0])
                results.append(r)
                print(r, flush=True)
    table("rolling restart", ("store", "size", "ids", "starts/task", "max starts", "restart s (max)",
                              "max gap - restart s", "gaps > restart + 1 s", "even after (max s)"),
          [(r["store"], f"{r['nodes']} x {r['tasks']:,}", r["ids"], r["starts_per_task"],
            r["max_starts_of_a_task"], max(r["restart_s"]), r["max_gap_over_restart_s"],
            f"{r['gaps_over_restart_plus_1s']} of {r['gaps']}", max(r["even_after_each_s"]))
           for r in results])
    name = os.environ.get("METAFORA_ROLLING_NAME") or ("rolling_quick" if quick else "rolling")
    save(name, {"quick": quick, "sticky_for": STICKY_FOR, "load_average": load, "results": results})
    return results
