"""Start-up storm: N pending tasks, P consumer processes started at once (FairBalancer).

Measured per store: seconds from the spawn of the processes until every task is held, the
spread (max node / average) when all are held and after two balance periods, claims lost to
races per claim won (the consumers' ``races_lost`` / ``claims`` counters), and store requests
per task until all were held (PostgreSQL: transactions from pg_stat_database; etcd: gRPC calls
from its /metrics; SQLite has no such counter). Handlers park until stopped: async ones by
default (``METAFORA_STORM_MODE=park`` for threads: 100,000 of them exceed this machine's pid_max).
Each run replaces the saved rows of the stores and size it measured and keeps the others.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import threading
import time
from typing import Any

from benchmarks.common import RESULTS, Fleet, Stores, WorkerSpec, save, table
from metafora import MetaforaError, Task, open_client

BALANCE_EVERY = 5.0
BALANCER = os.environ.get("METAFORA_STORM_BALANCER", "fair")  # or "dumb"
MODE = os.environ.get("METAFORA_STORM_MODE", "park-async")  # or "park": a thread per task


def fill(url: str, n: int) -> float:
    """Submit ``n`` pending tasks; returns tasks/s (bulk when the client has submit_tasks)."""
    ids = [f"s{i:07d}" for i in range(n)]
    began = time.perf_counter()
    with open_client(url) as client:
        bulk = getattr(client, "submit_tasks", None)
        if bulk is not None:
            for start in range(0, n, 5000):
                bulk(Task(i) for i in ids[start:start + 5000])
        else:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: client.submit_task(Task(i)), ids))
    return n / (time.perf_counter() - began)


def _requests(kind: str, url: str, stores: Stores) -> int:
    from benchmarks.scale import _etcd_calls, _pg_xacts

    if kind == "postgresql":
        return _pg_xacts(url)
    if kind == "etcd":
        return _etcd_calls(stores)
    return 0


def _held(kind: str, client: Any) -> int:
    """Tasks held now. etcd: a count-only range of the owner keys (one small answer); the
    per-node counts read every owner key, which at 100,000 tasks cost the benchmark process
    and etcd more CPU than the nodes being measured (twice a second)."""
    if kind == "etcd":
        from metafora.coordinators.etcd.driver import Range

        return int(client._driver.count(Range(client._keys.owners, prefix=True)))
    return sum(client.node_task_count().values())


def _spread(counts: dict[str, int]) -> float:
    if not counts:
        return float("nan")
    avg = sum(counts.values()) / len(counts)
    return max(counts.values()) / avg if avg else float("nan")


def _timeline_text(timeline: list[tuple[float, int]], n: int) -> str:
    """When the held count first reached 10 %, 25 %, 50 %, 75 %, 90 %, 99 % and 100 %."""
    marks = []
    for part in (0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0):
        at = next((t for t, held in timeline if held >= part * n), None)
        marks.append(f"{part:.0%} at {at:.1f}s" if at is not None else f"{part:.0%} never")
    return ", ".join(marks)


def _pause(seconds: float) -> None:
    threading.Event().wait(seconds)


def storm(stores: Stores, kind: str, n: int, procs: int, timeout: float) -> dict[str, Any]:
    """One storm; every process is stopped before this returns."""
    url = stores.url(kind)
    submit_rate = fill(url, n)
    fleet = Fleet()
    result: dict[str, Any] = {"store": kind, "tasks": n, "processes": procs, "submit_per_s": submit_rate,
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "load_before": os.getloadavg()[0]}
    if kind == "etcd":
        result["etcd_members"] = stores.etcd_members
    with open_client(url) as client:
        # What one progress poll costs the store, less the cost of reading the counter itself.
        r0 = _requests(kind, url, stores)
        r1 = _requests(kind, url, stores)
        _held(kind, client)
        r2 = _requests(kind, url, stores)
        poll_cost = max(0, (r2 - r1) - (r1 - r0))
        before = _requests(kind, url, stores)
        began = time.monotonic()
        try:
            for i in range(procs):
                fleet.spawn(WorkerSpec(url, f"n{i:02d}", mode=MODE, balancer=BALANCER,
                                       balance_every=BALANCE_EVERY))
            polls, held = 0, 0
            timeline: list[tuple[float, int]] = []
            while time.monotonic() - began < timeout:
                try:
                    held = _held(kind, client)
                except MetaforaError as exc:  # an overloaded store: report it, poll again
                    print(f"progress poll failed: {exc}")
                    _pause(0.5)
                    continue
                polls += 1
                timeline.append((round(time.monotonic() - began, 1), held))
                if os.environ.get("METAFORA_STORM_NODES") and polls % 4 == 0:
                    counts_now = sorted(client.node_task_count().values())
                    print(f"  {time.monotonic() - began:5.1f}s held {held}: {counts_now}")
                if held >= n:
                    break
                _pause(0.5)
            result["held"] = held
            result["timeline"] = timeline
            print(f"{kind}: held over time: " + _timeline_text(timeline, n))
            result["seconds_to_all_held"] = time.monotonic() - began if held >= n else float("nan")
            after = _requests(kind, url, stores)
            counts = client.node_task_count()
            result["requests_per_task"] = (
                (after - before - polls * poll_cost) / n if kind != "sqlite" else float("nan")
            )
            result["load_at_all_held"] = os.getloadavg()[0]
            result["spread_at_all_held"] = _spread(counts)
            _pause(2 * BALANCE_EVERY + 1)
            result["spread_after_2_periods"] = _spread(client.node_task_count())
        finally:
            fleet.stop()
    claims, races = fleet.claims_and_races()
    result["races_lost_per_claim"] = races / claims if claims else float("nan")
    return result


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """100,000 tasks and 10 processes (quick: 10,000 and 4) on every store; print and save."""
    n, procs = (10_000, 4) if quick else (100_000, 10)
    results = [storm(stores, kind, n, procs, timeout=300) for kind in stores.kinds]
    table(f"start-up storm: {n:,} pending tasks, {procs} processes started at once (FairBalancer)",
          ("store", "s to all held", "spread held", "spread +2 periods", "races lost/claim",
           "requests/task", "submit/s"),
          [(r["store"], r["seconds_to_all_held"], r["spread_at_all_held"], r["spread_after_2_periods"],
            r["races_lost_per_claim"], r["requests_per_task"], r["submit_per_s"]) for r in results])
    save("storm", {"results": merged(results)})
    return {"results": results}


def merged(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` with the saved rows of the other stores and sizes kept (one run re-measures
    only what it ran), ordered by size, then store."""
    path = RESULTS / "storm.json"
    kept: list[dict[str, Any]] = []
    try:
        kept = json.loads(path.read_text(), parse_constant=lambda _: math.nan).get("results", [])
    except (OSError, ValueError):
        pass
    key = ("store", "tasks", "processes")
    fresh = {tuple(r[k] for k in key) for r in results}
    rows = [r for r in kept if tuple(r.get(k) for k in key) not in fresh] + results
    order = {"sqlite": 0, "postgresql": 1, "etcd": 2}
    return sorted(rows, key=lambda r: (r.get("tasks", 0), order.get(r.get("store"), 9)))
