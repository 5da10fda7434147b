"""Idle store reads of a 10-node cluster holding 1,000, 10,000 and 100,000 tasks (issue 33).

Ten consumer processes at the Consumer's defaults (FairBalancer, default ``balance_every``)
hold every task of a fresh namespace with async handlers that park until stopped. Once all
are held and ``settle`` seconds have passed, the store's work is counted over ``window``:

- PostgreSQL: rows returned (``tup_returned``), blocks touched (``blks_hit + blks_read``) and
  transactions of the benchmark's own database (``pg_stat_database``), plus the per-table
  rows read (``pg_stat_user_tables``: sequential + index) to say where reads go;
- SQLite: statements the nodes ran (each node counts its own through sqlite3's trace callback
  and reports every second; BEGIN/COMMIT/PRAGMA not counted);
- etcd: gRPC requests handled (``grpc_server_handled_total``) and keys returned by ranges
  are not exported by etcd, so requests/s stands for its load.

The window starts ``settle`` seconds after all are held, as a user would see it: the planner's
statistics may still say the rows are pending (autovacuum analyzes within a minute or so), and
the idle loops read nothing of the task table whatever it believes (their task reads are
min/max lookups at one end of a pending index). ``METAFORA_IDLE_AUTOVACUUM=1`` waits for
autovacuum first (``stats_wait_s``), for comparison.

The target (issue 33): flat in held tasks, PostgreSQL at most 50 rows/s per node.
``python -m benchmarks idle_cluster [--quick] [--stores ...]``; results in
``results/idle_cluster.json``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from benchmarks.common import RESULTS, Fleet, Stores, WorkerSpec, save, table
from benchmarks.scale import _etcd_calls
from benchmarks.storm import fill

NODES = 10
SIZES = (1_000, 10_000, 100_000)


def _pg_counters(url: str) -> dict[str, int]:
    import psycopg

    from metafora.core.config import parse_store_url

    db = parse_store_url(url).path.lstrip("/")
    with psycopg.connect(url.split("?", 1)[0], autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT tup_returned, blks_hit + blks_read, xact_commit + xact_rollback"
            " FROM pg_stat_database WHERE datname = %s", (db,)).fetchone()
        assert row is not None
        counters = {"rows": int(row[0]), "blocks": int(row[1]), "xacts": int(row[2])}
        for name, seq, idx in conn.execute(
                "SELECT relname, coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)"
                " FROM pg_stat_user_tables"):
            counters[f"table:{name}"] = int(seq) + int(idx)
    return counters


def _wait_for_autovacuum(url: str, since: float, timeout: float = 180.0) -> float:
    """Wait until autovacuum has vacuumed and analyzed the tasks table after ``since`` (its
    statistics then know the rows are claimed, not pending: before that the planner may walk
    the table for a pending count). Returns the seconds waited (``timeout`` at most)."""
    import psycopg

    began = time.monotonic()
    with psycopg.connect(url.split("?", 1)[0], autocommit=True) as conn:
        while time.monotonic() - began < timeout:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT extract(epoch FROM last_autoanalyze), extract(epoch FROM last_autovacuum)"
                " FROM pg_stat_user_tables WHERE relname = 'metafora_tasks'").fetchone()
            if row and row[0] and row[1] and min(float(row[0]), float(row[1])) >= since:
                break
            threading.Event().wait(2.0)
    return time.monotonic() - began


def _sql_statements(fleet: Fleet, latest: dict[str, int]) -> int:
    """Sum of the nodes' last reported statement counts (drains the event queue)."""
    while True:
        try:
            event = fleet.events.get_nowait()
        except Exception:
            break
        if event[0] == "sql":
            latest[event[1]] = int(event[2])
    return sum(latest.values())


def _held(kind: str, url: str) -> int:
    from benchmarks.storm import _held as held
    from metafora import open_client

    with open_client(url) as client:
        return held(kind, client)  # etcd: a count-only range (a full read timed out at 100,000)


def measure(stores: Stores, kind: str, n: int, settle: float, window: float) -> dict[str, Any]:
    """One cluster of NODES holding ``n`` tasks; every process is stopped before this returns."""
    url = stores.url(kind)
    fill(url, n)
    fleet = Fleet()
    latest: dict[str, int] = {}
    result: dict[str, Any] = {"store": kind, "tasks": n, "nodes": NODES,
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        began = time.monotonic()
        for i in range(NODES):
            fleet.spawn(WorkerSpec(url, f"n{i:02d}", mode="park-async", balancer="default",
                                   options={}, count_sql=kind == "sqlite"))
        deadline = began + 600
        while time.monotonic() < deadline:
            if _held(kind, url) >= n:
                break
            threading.Event().wait(1.0)
        result["seconds_to_all_held"] = time.monotonic() - began
        if kind == "postgresql" and os.environ.get("METAFORA_IDLE_AUTOVACUUM"):
            result["stats_wait_s"] = _wait_for_autovacuum(url, time.time())
        threading.Event().wait(settle)
        if kind == "postgresql":
            before = _pg_counters(url)
        elif kind == "etcd":
            before = {"requests": _etcd_calls(stores)}
        else:
            _sql_statements(fleet, latest)
            threading.Event().wait(1.5)
            before = {"statements": _sql_statements(fleet, latest)}
        t0 = time.monotonic()
        threading.Event().wait(window)
        if kind == "postgresql":
            after = _pg_counters(url)
        elif kind == "etcd":
            after = {"requests": _etcd_calls(stores)}
        else:
            after = {"statements": _sql_statements(fleet, latest)}
        span = time.monotonic() - t0
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        result["per_node_per_s"] = {k: v / span / NODES for k, v in delta.items()
                                    if not k.startswith("table:")}
        result["tables_rows_per_s"] = {k[6:]: v / span for k, v in delta.items()
                                       if k.startswith("table:") and v}
    finally:
        fleet.stop()
    return result


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every size on every store; print the table and save the results."""
    sizes = (1_000, 10_000) if quick else SIZES
    if os.environ.get("METAFORA_IDLE_SIZES"):
        sizes = tuple(int(x) for x in os.environ["METAFORA_IDLE_SIZES"].split(","))
    settle = float(os.environ.get("METAFORA_IDLE_SETTLE", "20"))
    window = float(os.environ.get("METAFORA_IDLE_WINDOW", "10" if quick else "30"))
    results: list[dict[str, Any]] = []
    for kind in stores.kinds:
        for n in sizes:
            r = measure(stores, kind, n, settle, window)
            r.update(settle_s=settle, window_s=window)
            print(kind, n, r)
            results.append(r)
            # saved after each cell, merged with the saved cells this run did not measure
            save("idle_cluster", {"results": merged(results), "settle_s": settle, "window_s": window})
    results = merged(results)
    table(f"idle cluster: {NODES} nodes at defaults, store work per node per second "
          f"({settle:.0f} s after all held, over {window:.0f} s)",
          ("store", "held tasks", "rows/s", "blocks/s", "xacts/s", "statements/s", "requests/s"),
          [(r["store"], r["tasks"], r["per_node_per_s"].get("rows", float("nan")),
            r["per_node_per_s"].get("blocks", float("nan")),
            r["per_node_per_s"].get("xacts", float("nan")),
            r["per_node_per_s"].get("statements", float("nan")),
            r["per_node_per_s"].get("requests", float("nan"))) for r in results])
    return {"results": results}


def merged(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` with the saved cells of other stores and sizes kept, by store then size."""
    path = RESULTS / "idle_cluster.json"
    kept: list[dict[str, Any]] = []
    try:
        kept = json.loads(path.read_text()).get("results", [])
    except (OSError, ValueError):
        pass
    fresh = {(r["store"], r["tasks"]) for r in results}
    rows = [r for r in kept if (r.get("store"), r.get("tasks")) not in fresh] + results
    order = {"postgresql": 0, "sqlite": 1, "etcd": 2}
    return sorted(rows, key=lambda r: (order.get(r["store"], 9), r["tasks"]))
