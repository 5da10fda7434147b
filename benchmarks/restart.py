"""An even cluster with the fewest moves: cold start, late starter, join, leave, rolling restart.

Consumer processes (``hold`` handlers: a task runs until it is stopped, like a stream consumer)
over one store. Every handler start is an event; a task's first start is its placement, every
later start is a **move** (a stop, a handoff and a restart elsewhere), the expensive event for
long-running tasks. The store's ``node_task_count()`` says when the cluster is even: every node
within 10 % of its share (or +-1 task), the share being ``held / live nodes``.

Scenarios (one store at a time):

- **cold**: N processes start together over T pending tasks: seconds until even, starts beyond
  the first per task, and the counts then and at the end.
- **late**: N - 1 processes start, the last one ``LATE_S`` seconds later: seconds from its start
  until it holds its share (within 10 %).
- **steady**: the even cluster watched for ``STEADY_S`` seconds with no change: moves.
- **join**: one more process joins the even cluster: tasks moved (target <= 1.2 x the new share)
  and seconds until even.
- **leave**: one process shuts down gracefully (SIGTERM): tasks moved (target = the leaver's
  tasks) and seconds until the others hold everything.
- **rolling**: every process in turn shuts down gracefully and starts again (same node id),
  waiting for the cluster to hold every task between two: starts beyond the first per task over
  the whole restart (target <= 2).

    python -m benchmarks restart [--quick] [--stores sqlite,postgresql,etcd]

Environment: ``METAFORA_RESTART_BALANCER`` (``fair`` or ``dumb``; default: the Consumer's
default), ``METAFORA_RESTART_BALANCE_EVERY`` (seconds, default 5).
"""

from __future__ import annotations

import math
import os
import queue
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, save, table
from metafora import Task, open_client
from metafora.contracts.client import Client

BALANCER = os.environ.get("METAFORA_RESTART_BALANCER", "default")
BALANCE_EVERY = float(os.environ.get("METAFORA_RESTART_BALANCE_EVERY", "5"))
# Sticky return is opt-in (default 0, what a user gets); a run with it set is a labelled row.
STICKY_FOR = float(os.environ.get("METAFORA_RESTART_STICKY_FOR", "0"))
LATE_S = 3.0
EVEN_WITHIN = 0.10  # a node is even within 10 % of its share, or +-1 task
CONVERGE_LIMIT = 60.0  # seconds a phase may take before it is reported as not converged


def is_even(counts: dict[str, int], total: int) -> bool:
    """Every live node holds its share of ``total`` within 10 % (or +-1 task), and all is held."""
    if not counts or sum(counts.values()) != total:
        return False
    share = total / len(counts)
    slack = max(1.0, EVEN_WITHIN * share)
    return all(abs(n - share) <= slack for n in counts.values())


@dataclass
class Run:
    """One store's cluster: the fleet, the client, and every start seen so far."""

    url: str
    fleet: Fleet
    client: Client
    starts: list[tuple[str, str, float]] = field(default_factory=list)  # (node, task, time.time())

    def spec(self, node: str) -> WorkerSpec:
        """The worker every scenario runs: hold handlers, the benchmark's balancer."""
        return WorkerSpec(self.url, node, mode="hold", balancer=BALANCER, balance_every=BALANCE_EVERY,
                          sticky_for=STICKY_FOR)

    def drain(self, wait: float = 0.05) -> None:
        """Record the start events the fleet has sent (the queue lags the store)."""
        try:
            while True:
                event = self.fleet.events.get(timeout=wait)
                if event[0] == "start":
                    self.starts.append((event[1], event[2], event[4]))
        except queue.Empty:
            pass

    def wait_until(self, ok: Any, limit: float = CONVERGE_LIMIT) -> float:
        """Seconds until ``ok(counts)`` holds (NaN if not within ``limit``)."""
        began = time.monotonic()
        while time.monotonic() - began < limit:
            self.drain()
            if ok(self.client.node_task_count()):
                return time.monotonic() - began
        return float("nan")

    def moves_since(self, mark: int) -> int:
        """Starts since ``mark`` of tasks that had started before (moves, not placements)."""
        seen = {task for _, task, _ in self.starts[:mark]}
        moved = 0
        for _, task, _ in self.starts[mark:]:
            if task in seen:
                moved += 1
            seen.add(task)
        return moved


def _extra_starts(starts: list[tuple[str, str, float]], tasks: int) -> float:
    return (len(starts) - len({t for _, t, _ in starts})) / tasks


def cold_and_after(url: str, nodes: int, tasks: int, steady_s: float) -> dict[str, Any]:
    """cold, steady, join, leave and rolling on one cluster, in that order."""
    out: dict[str, Any] = {}
    with Fleet() as fleet, open_client(url) as client:
        run = Run(url, fleet, client)
        client.submit_tasks(Task(f"r{i:06d}") for i in range(tasks))
        names = [f"n{i}" for i in range(nodes)]
        for name in names:  # together: nobody waits for another's registration
            fleet.spawn(run.spec(name))
        cold_s = run.wait_until(lambda c: len(c) == nodes and is_even(c, tasks))
        run.wait_until(lambda c: sum(c.values()) == tasks)
        out["cold"] = {"even_s": cold_s, "extra_starts_per_task": _extra_starts(run.starts, tasks),
                       "counts": sorted(client.node_task_count().values(), reverse=True)}
        mark = len(run.starts)
        end = time.monotonic() + steady_s
        while time.monotonic() < end:
            run.drain(0.2)
        out["steady"] = {"seconds": steady_s, "moves": run.moves_since(mark),
                         "counts": sorted(client.node_task_count().values(), reverse=True)}
        mark = len(run.starts)
        fleet.spawn(run.spec("joiner"))
        join_s = run.wait_until(lambda c: len(c) == nodes + 1 and is_even(c, tasks))
        out["join"] = {"even_s": join_s, "moves": run.moves_since(mark),
                       "new_share": math.ceil(tasks / (nodes + 1)),
                       "counts": sorted(client.node_task_count().values(), reverse=True)}
        mark = len(run.starts)
        leaver = names[-1]
        held = client.node_task_count().get(leaver, 0)
        fleet.kill(leaver, signal.SIGTERM)
        left = set(names[:-1]) | {"joiner"}
        leave_s = run.wait_until(lambda c: set(c) == left and sum(c.values()) == tasks)
        run.drain(0.5)
        out["leave"] = {"adopted_s": leave_s, "moves": run.moves_since(mark), "leaver_held": held}
        out["rolling"] = rolling(run, sorted(left), tasks)
    return out


def rolling(run: Run, names: list[str], tasks: int) -> dict[str, Any]:
    """Every node in turn: SIGTERM, wait until it stopped, start it again, wait until all held."""
    mark = len(run.starts)
    began = time.monotonic()
    for name in names:
        run.fleet.kill(name, signal.SIGTERM)
        run.fleet.procs[name].join(60)
        run.fleet.procs.pop(name)
        run.fleet.spawn(run.spec(name))
        run.wait_until(lambda c, n=name: n in c and sum(c.values()) == tasks)
    even_s = run.wait_until(lambda c: is_even(c, tasks))
    window = run.starts[mark:]
    per_task = Counter(t for _, t, _ in window)
    return {"seconds": time.monotonic() - began, "even_after_s": even_s,
            "starts_beyond_first_per_task": sum(per_task.values()) / tasks,
            "max_moves_of_a_task": max(per_task.values(), default=0),
            "counts": sorted(run.client.node_task_count().values(), reverse=True)}


def late_starter(url: str, nodes: int, tasks: int) -> dict[str, Any]:
    """N - 1 nodes start, the last one LATE_S later: seconds until it holds its share."""
    with Fleet() as fleet, open_client(url) as client:
        run = Run(url, fleet, client)
        client.submit_tasks(Task(f"l{i:06d}") for i in range(tasks))
        for i in range(nodes - 1):
            fleet.spawn(run.spec(f"e{i}"))
        end = time.monotonic() + LATE_S
        while time.monotonic() < end:
            run.drain(0.1)
        fleet.spawn(run.spec("late"))
        share = tasks / nodes
        held_s = run.wait_until(lambda c: c.get("late", 0) >= share * (1 - EVEN_WITHIN) - 1)
        return {"late_share_s": held_s, "late_held": client.node_task_count().get("late", 0),
                "share": share, "extra_starts_per_task": _extra_starts(run.starts, tasks)}


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every scenario on every store; print and save."""
    nodes, tasks, steady_s = (5, 2_000, 30.0) if quick else (5, 10_000, 300.0)
    data: dict[str, Any] = {}
    for kind in stores.kinds:
        data[kind] = cold_and_after(stores.url(kind), nodes, tasks, steady_s)
        data[kind]["late"] = late_starter(stores.url(kind), nodes, tasks)
    title = (f"restart: {nodes} processes, {tasks:,} long-running tasks, balancer {BALANCER}, "
             f"balance every {BALANCE_EVERY:g} s")
    rows = []
    for kind, r in data.items():
        rows.append((kind, r["cold"]["even_s"], r["cold"]["extra_starts_per_task"], str(r["cold"]["counts"]),
                     r["late"]["late_share_s"], r["steady"]["moves"],
                     f"{r['join']['moves']} / {r['join']['new_share']}",
                     f"{r['leave']['moves']} / {r['leave']['leaver_held']}",
                     r["rolling"]["starts_beyond_first_per_task"]))
    table(title, ("store", "cold: even s", "cold: extra starts/task", "cold: counts", "late: share s",
                  f"steady {steady_s:g} s: moves", "join: moves / share", "leave: moves / held",
                  "rolling: starts/task"), rows)
    save("restart", {"quick": quick, "nodes": nodes, "tasks": tasks, "balancer": BALANCER,
                     "balance_every": BALANCE_EVERY, "sticky_for": STICKY_FOR,
                     "load_average": os.getloadavg(), "results": data})
    return data
