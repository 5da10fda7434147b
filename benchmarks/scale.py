"""Scale: claims with 100,000 tasks in the store, the claim plan, a consumer's memory, idle load.

- claims/s of the coordinator's claim with 10,000 and with 100,000 finished tasks already in the
  store (SQL: done rows piling up; etcd: finished task keys in the watch cache): within 20 %;
- PostgreSQL's plan for the claim statement (indexed: no sequential scan of the tasks table);
- RSS of one consumer process running 1,000 tasks at once (one thread each);
- idle load: store requests per second per idle node (PostgreSQL transactions from
  pg_stat_database; etcd gRPC calls from its /metrics), 3 idle nodes.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.request
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, save, table
from metafora import Task, open_client, open_coordinator
from metafora.testing import RecordingContext


def _fill_etcd(url: str, pending: list[str], done: int) -> None:
    """Finished tasks (submitted, claimed, done) and pending ones, through the public API."""
    with open_client(url) as client:
        def submit(task_id: str) -> None:
            client.submit_task(Task(task_id))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(submit, [f"old-{i:07d}" for i in range(done)] + pending))
    coord = open_coordinator(url, node_id="filler")
    coord.init(RecordingContext())
    try:
        def finish(task_id: str) -> None:
            got = coord.claim(Task(task_id))
            if got is not None:
                coord.done(got)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(finish, [f"old-{i:07d}" for i in range(done)]))
    finally:
        coord.close()


def claim_rate(kind: str, url: str, n: int, done: int) -> float:
    """Sequential claims/s of one coordinator with ``done`` finished tasks in the store."""
    if kind != "etcd":
        from benchmarks.sql_raw import measure

        return float(measure(url, "metafora claim", 1, n, done)["per_s"])
    ids = [f"t-{i:07d}" for i in range(n)]
    _fill_etcd(url, ids, done)
    coord = open_coordinator(url, node_id="bench")
    coord.init(RecordingContext())
    try:
        start = time.perf_counter()
        got = sum(coord.claim(Task(i)) is not None for i in ids)
        return got / (time.perf_counter() - start)
    finally:
        coord.close()


def claim_plan(url: str) -> str:
    """PostgreSQL's plan of the claim statement, one line per node."""
    from metafora.coordinators.sql.options import parse_config
    from metafora.coordinators.sql.store import Database
    from metafora.core.config import parse_store_url

    db = Database(parse_config(parse_store_url(url), {}))
    try:
        stmt = db.sql["claim"]
        with db.transaction() as conn:
            conn.exec_driver_sql("SET LOCAL enable_seqscan = on")
            compiled = stmt.compile(dialect=db.engine.dialect)
            params = {"ns": db.config.namespace, "id": "t-0000001", "node": "n", "session": "s",
                      "labels": "{}"}
            sql = "EXPLAIN (FORMAT JSON) " + str(compiled)
            plan = conn.exec_driver_sql(sql, {k: params[k] for k in compiled.params}).scalar()
            conn.rollback()
    finally:
        db.close()
    nodes: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        nodes.append(f"{node['Node Type']} {node.get('Index Name') or node.get('Relation Name') or ''}"
                     .strip())
        for child in node.get("Plans", []):
            walk(child)

    walk((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"])
    return "; ".join(nodes)


def consumer_rss(url: str, tasks: int) -> float:
    """MiB of RSS of one consumer process running ``tasks`` tasks at once."""
    with Fleet() as fleet, open_client(url) as client:
        fleet.start(WorkerSpec(url, "rss", mode="hold"))
        for i in range(tasks):
            client.submit_task(Task(f"m{i:05d}"))
        for _ in range(tasks):
            fleet.expect("start", timeout=120)
        pid = fleet.procs["rss"].pid
        with open(f"/proc/{pid}/status") as fh:
            kib = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        return kib / 1024


def _pg_xacts(url: str) -> int:
    import psycopg

    from metafora.core.config import parse_store_url

    db = parse_store_url(url).path.lstrip("/")
    with psycopg.connect(url.split("?", 1)[0]) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database"
                           " WHERE datname = %s", (db,)).fetchone()
        assert row is not None
        return int(row[0])


def _etcd_calls(stores: Stores) -> int:
    """gRPC calls etcd has handled, summed over the members (clients talk to any of them)."""
    total = 0
    for server in stores.etcd_servers:
        with urllib.request.urlopen(f"{server.client_url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def idle_load(stores: Stores, kind: str, seconds: float) -> float:
    """Store requests per second per idle node (3 nodes, no tasks)."""
    url = stores.url(kind)
    with Fleet() as fleet:
        for i in range(3):
            fleet.start(WorkerSpec(url, f"idle{i}"))
        threading.Event().wait(2)  # let start-up traffic pass
        count = (lambda: _pg_xacts(url)) if kind == "postgresql" else (lambda: _etcd_calls(stores))
        before = count()
        threading.Event().wait(seconds)
        after = count()
    return (after - before - 2) / seconds / 3  # the two reads of the counter itself


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every store: print and save."""
    n = 2000 if quick else 5000
    big = 30_000 if quick else 100_000
    rows, data = [], {}
    for kind in stores.kinds:
        small_rate = claim_rate(kind, stores.url(kind), n, 10_000)
        big_rate = claim_rate(kind, stores.url(kind), n, big)
        plan = claim_plan(stores.url(kind)) if kind == "postgresql" else "-"
        rss = consumer_rss(stores.url(kind), 1000)
        idle = idle_load(stores, kind, 5 if quick else 20) if kind != "sqlite" else float("nan")
        data[kind] = {"claims_per_s_10k": small_rate, f"claims_per_s_{big}": big_rate,
                      "change": big_rate / small_rate - 1, "claim_plan": plan,
                      "rss_mib_1000_tasks": rss, "idle_requests_per_s_per_node": idle}
        rows.append((kind, small_rate, big_rate, f"{big_rate / small_rate - 1:+.0%}", rss, idle))
    table(f"scale: claims with 10,000 vs {big:,} finished tasks in the store; consumer RSS; idle load",
          ("store", "claims/s 10k", f"claims/s {big // 1000}k", "change", "RSS MiB (1,000 tasks)",
           "idle req/s/node"), rows)
    if "postgresql" in data:
        print("PostgreSQL claim plan:", data["postgresql"]["claim_plan"])
    save("scale", {"quick": quick, "results": data})
    return data
