"""The herd (issue 51 point 2): what one claim costs as the cluster grows.

2 and then 10 consumer processes (the Consumer's defaults, ``max_tasks=10``, handlers that return
at once) are started and idle; then 10,000 tasks are submitted: in bulk (``submit_tasks``, 1,000
a call: a few notifications, waves of offers; the default) or, with ``METAFORA_HERD_SUBMIT=single``,
one by one from 4 client threads (each submit its own transaction and notification: every
offer its own wave). Measured per store and cluster size, from the first submit until the last
task started:

- store transactions per task (PostgreSQL, ``pg_stat_database``), less the submits' own (one
  submit's cost is read first on an empty namespace of the same database);
- the nodes' CPU per task (user + system of every consumer process, from ``/proc``);
- claims lost to races per claim won (the consumers' ``races_lost`` / ``claims``);
- submit-to-start p50 and p99 (ms) and tasks/s (tasks over the seconds from the first submit to
  the last start).

The figures that must not grow with the cluster are the ratios 10 nodes / 2 nodes of the first
two. ``METAFORA_HERD_TASKS`` and ``METAFORA_HERD_NODES`` (``2,10``) change the sizes.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, percentile, save, table
from metafora import Task, open_client

THREADS = 4
SUBMIT = os.environ.get("METAFORA_HERD_SUBMIT", "bulk")  # or "single"
BULK = 1000
CALIBRATE = 200  # submits on an empty namespace that tell one submit's transactions
MAX_TASKS = 10


def _cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _xacts(kind: str, url: str) -> int:
    if kind != "postgresql":
        return 0
    from benchmarks.scale import _pg_xacts

    return _pg_xacts(url)


def _submit(url: str, ids: list[str], submitted: dict[str, float]) -> None:
    """Submit ``ids`` in bulk, or one by one from ``THREADS`` threads sharing one client."""
    with open_client(url) as client:
        client.tasks("pending")  # the schema and the connection first, outside the figures
        if SUBMIT == "bulk":
            for start in range(0, len(ids), BULK):
                now = time.time()
                submitted.update((i, now) for i in ids[start:start + BULK])
                client.submit_tasks(Task(i) for i in ids[start:start + BULK])
            return

        def one(task_id: str) -> None:
            submitted[task_id] = time.time()
            client.submit_task(Task(task_id))

        with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, ids))


def submit_cost(kind: str, stores: Stores) -> float:
    """Store transactions one ``submit_task`` costs (nobody listening)."""
    if kind != "postgresql":
        return 0.0
    url = stores.url(kind)
    with open_client(url) as client:
        client.tasks("pending")
    before = _xacts(kind, url)
    n = CALIBRATE if SUBMIT == "single" else 10 * BULK
    _submit(url, [f"c{i:05d}" for i in range(n)], {})
    return (_xacts(kind, url) - before - 2) / n  # less the open's read and the counter's


def herd(stores: Stores, kind: str, procs: int, n: int, per_submit: float) -> dict[str, Any]:
    """One run: ``procs`` idle nodes, then ``n`` submits; every process is stopped on return."""
    url = stores.url(kind)
    result: dict[str, Any] = {"store": kind, "nodes": procs, "tasks": n, "max_tasks": MAX_TASKS,
                              "submit": SUBMIT,
                              "load_before": os.getloadavg()[0]}
    fleet = Fleet()
    try:
        for i in range(procs):
            fleet.spawn(WorkerSpec(url, f"h{i:02d}", mode="instant", balancer="default",
                                   max_tasks=MAX_TASKS))
        for _ in range(procs):
            fleet.expect("ready", timeout=120)
        threading.Event().wait(1.0)  # registrations seen by every node
        pids = [p.pid for p in fleet.procs.values()]
        cpu_before = sum(_cpu(p) for p in pids)
        before = _xacts(kind, url)
        submitted: dict[str, float] = {}
        ids = [f"t{i:06d}" for i in range(n)]
        began = time.time()
        sender = threading.Thread(target=_submit, args=(url, ids, submitted), daemon=True)
        sender.start()
        started: dict[str, float] = {}
        deadline = time.monotonic() + 600
        while len(started) < n and time.monotonic() < deadline:
            try:
                event = fleet.events.get(timeout=5)
            except queue.Empty:
                continue
            if event[0] == "start":
                started.setdefault(event[2], event[4])
        sender.join(60)
        cpu = sum(_cpu(p) for p in pids) - cpu_before
        xacts = _xacts(kind, url) - before
        last = max(started.values()) if started else began
        lat = [started[i] - submitted[i] for i in started if i in submitted]
        result.update({
            "started": len(started), "seconds": last - began,
            "tasks_per_s": len(started) / (last - began) if last > began else float("nan"),
            "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
            "cpu_ms_per_task": cpu * 1000 / n,
            "xacts_per_task": (xacts - n * per_submit) / n if kind == "postgresql" else float("nan"),
            "submit_xacts": per_submit, "load_after": os.getloadavg()[0],
        })
    finally:
        fleet.stop()
    claims, races = fleet.claims_and_races()
    result["claims"] = claims
    result["races_lost_per_claim"] = races / claims if claims else float("nan")
    return result


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """2 and 10 nodes (quick: 2,000 tasks, else 10,000) on every store; print and save."""
    n = int(os.environ.get("METAFORA_HERD_TASKS", "2000" if quick else "10000"))
    sizes = [int(s) for s in os.environ.get("METAFORA_HERD_NODES", "2,10").split(",")]
    results = []
    for kind in stores.kinds:
        per_submit = submit_cost(kind, stores)
        rows = [herd(stores, kind, procs, n, per_submit) for procs in sizes]
        small = rows[0]
        for r in rows:
            for key in ("xacts_per_task", "cpu_ms_per_task"):
                r[f"{key}_vs_{small['nodes']}"] = r[key] / small[key] if small[key] else float("nan")
        results += rows
    table(f"the herd: {n:,} short tasks submitted ({SUBMIT}) to idle nodes (max_tasks={MAX_TASKS})",
          ("store", "nodes", "txns/task", "x", "CPU ms/task", "x", "races lost/claim", "p50 ms",
           "p99 ms", "tasks/s"),
          [(r["store"], r["nodes"], r["xacts_per_task"], r[f"xacts_per_task_vs_{sizes[0]}"],
            r["cpu_ms_per_task"], r[f"cpu_ms_per_task_vs_{sizes[0]}"], r["races_lost_per_claim"],
            r["p50_ms"], r["p99_ms"], r["tasks_per_s"]) for r in results])
    save("herd" if SUBMIT == "bulk" else f"herd_{SUBMIT}", {"quick": quick, "results": results})
    return {"results": results}
