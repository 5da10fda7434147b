"""What the simulated clusters would ask of PostgreSQL and etcd (see :mod:`benchmarks.simulate`).

The simulation counts, per node, claim requests (and the offers in them), count reads
(``node_task_count`` / ``active_task_count``) and release writes. Extrapolated cluster-wide:

- **PostgreSQL**: every one is a transaction, plus each node's idle load (heartbeat, watch
  safety net, command safety net: ``benchmarks/results/idle.json``, one node measured at
  ~0.55 transactions/s). Server time: ``CLAIM_ROW_MS`` per offer in a claim request and per
  release (``claim_many`` of 50 on one process claimed 6,706 tasks/s here:
  ``benchmarks/results/sql_raw.json``; that includes the client, so it is an upper bound),
  ``REQUEST_MS`` per transaction, and a count read's time **measured** on this machine's
  PostgreSQL at the simulated size (``measure_count_reads``: the coordinator's own
  ``active_counts`` statement over that many nodes and claimed tasks): the statement counts
  every claimed row, so its cost grows with the tasks.
- **etcd**: a claim request is ``ceil(offers / 32)`` txns (etcd's claim burst is 32), releases
  are group-committed 42 per txn, count reads are answered from the watch cache (no request),
  plus each node's idle load (~0.3-0.5 requests/s measured). Every claim and release changes
  three keys that every node's watch receives: ``3 x (claims + releases) x nodes`` events/s.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import RESULTS, Stores

__all__ = ["extrapolate", "measure_count_reads"]

CLAIM_ROW_MS = 1000 / 6706  # server time per offer in a claim request (upper bound, see above)
REQUEST_MS = 0.3  # server time of a transaction's round trip itself (assumed)
ETCD_CLAIM_TXN = 32  # offers per etcd claim txn
ETCD_RELEASE_TXN = 42  # outcomes per etcd txn
ETCD_KEYS_PER_CHANGE = 3  # keys a claim or a release changes (owner, claim, running)
SCENARIOS = ("cold", "steady", "join", "leave", "rolling", "late")


def _idle() -> tuple[float, float]:
    """Idle requests/s of one node holding 1,000 tasks: PostgreSQL, etcd (measured figures)."""
    try:
        data = json.loads((RESULTS / "idle.json").read_text())["results"]
        return (float(data["postgresql/plain/1000"]["requests_per_s"]),
                float(data["etcd/plain/1000"]["requests_per_s"]))
    except (OSError, KeyError, ValueError):
        return 0.55, 0.45


def extrapolate(data: dict[str, Any], count_read_ms: float | None) -> dict[str, dict[str, float]]:
    """Per scenario: per-node rates and the cluster-wide PostgreSQL and etcd load."""
    pg_idle, etcd_idle = _idle()
    out: dict[str, dict[str, float]] = {}
    for scenario in SCENARIOS:
        w = data[scenario]
        seconds, nodes = w["window_s"], w["nodes"]
        if seconds <= 0:
            continue
        rate = {k: w[k] / seconds for k in ("claim_requests", "claim_rows", "etcd_txns", "count_reads",
                                            "release_requests", "releases", "starts")}
        pg_requests = rate["claim_requests"] + rate["count_reads"] + rate["release_requests"]
        busy_ms = ((rate["claim_rows"] + rate["releases"]) * CLAIM_ROW_MS
                   + (pg_requests + pg_idle * nodes) * REQUEST_MS)
        busy = math.nan if count_read_ms is None else (busy_ms + rate["count_reads"] * count_read_ms) / 1000
        etcd_release_txns = rate["releases"] / ETCD_RELEASE_TXN
        out[scenario] = {
            "window_s": seconds,
            "claims_node_s": rate["claim_requests"] / nodes,
            "count_reads_node_s": rate["count_reads"] / nodes,
            "releases_node_s": rate["release_requests"] / nodes,
            "pg_requests_s": pg_requests + pg_idle * nodes,
            "pg_busy_s_per_s": busy,
            "pg_count_read_share": (math.nan if count_read_ms is None or not busy
                                    else rate["count_reads"] * count_read_ms / 1000 / busy),
            "etcd_requests_s": rate["etcd_txns"] + etcd_release_txns + etcd_idle * nodes,
            "etcd_watch_events_s": ETCD_KEYS_PER_CHANGE * (rate["starts"] + rate["releases"]) * nodes,
        }
    return out


def measure_count_reads(sizes: Sequence[tuple[int, int]], repeat: int = 5) -> dict[str, float]:
    """Milliseconds of the coordinator's ``active_counts`` read on this machine's PostgreSQL,
    with ``nodes`` live nodes holding ``tasks`` claimed tasks (median of ``repeat``), keyed
    ``"{nodes}x{tasks}"``; empty when PostgreSQL is not reachable."""
    try:
        with Stores(["postgresql"]) as stores:
            return {f"{n}x{t}": _measure(stores.url("postgresql"), n, t, repeat) for n, t in sizes}
    except Exception as exc:  # a benchmark's side measure: say why and go on without it
        print(f"count reads not measured on PostgreSQL: {exc}")
        return {}


def _measure(url: str, nodes: int, tasks: int, repeat: int) -> float:
    from sqlalchemy import text

    from metafora import open_client
    from metafora.coordinators.sql.options import parse_config
    from metafora.coordinators.sql.store import Database
    from metafora.core.config import parse_store_url

    with open_client(url) as client:
        client.tasks("claimed")  # creates the schema
    db = Database(parse_config(parse_store_url(url), {}))
    ns = {"ns": db.config.namespace, "nodes": nodes, "tasks": tasks}
    try:
        with db.transaction() as conn:
            conn.execute(text(
                "INSERT INTO metafora_nodes (namespace, node_id, session, lease_until, started_at,"
                " renewed_at) SELECT :ns, 'n' || g, 's', now() + interval '1 hour', now(), now()"
                " FROM generate_series(0, :nodes - 1) g"), ns)
            conn.execute(text(
                "INSERT INTO metafora_tasks (namespace, id, props, state, owner, token, ready,"
                " claimed_at, created_at, updated_at) SELECT :ns, 't' || g, '{}', 'claimed',"
                " 'n' || (g % :nodes), 1, 0, now(), now(), now()"
                " FROM generate_series(0, :tasks - 1) g"), ns)
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE metafora_tasks"))
            conn.execute(text("VACUUM ANALYZE metafora_nodes"))
        times = []
        for i in range(repeat + 1):
            began = time.perf_counter()
            with db.read() as conn:
                rows = db.execute(conn, "active_counts", {}).fetchall()
            if i:  # the first read warms the cache and the plan
                times.append((time.perf_counter() - began) * 1000)
            assert len(rows) == nodes and sum(int(r[1]) for r in rows) == tasks, "unexpected counts"
        return statistics.median(times)
    finally:
        db.close()
