"""SQL stores: metafora's claim path beside the raw claim statement, measured in one run.

    python benchmarks/sql_raw.py                       # SQLite and the PostgreSQL on :5432
    python benchmarks/sql_raw.py --stores sqlite -n 2000 --done 50000

For each store, with ``--done`` finished rows already in the table (the claim must not slow
down as they pile up), each process claims its own share of ``-n`` pending tasks:

- ``raw claim``: the coordinator's exact claim statement through the bare driver (psycopg
  with prepared statements in autocommit; sqlite3 with BEGIN IMMEDIATE and the counter row):
  the ceiling;
- ``metafora claim``: ``SQLCoordinator.claim`` (SQLAlchemy, the lease bookkeeping);
- ``metafora claim_many/50``: ``claim_many`` with 50 offered ids per statement (what the
  consumer does with a burst of offers);
- ``metafora claim+done``: a claim then a fenced done, the life of a short task;

with 1 and 2 processes (spawned). ``first/last 20 %`` are the rates over the first and last
fifth of each process's claims: equal rates mean the cost stays flat as claimed rows pile up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sqlite3
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Stores, save, table
from metafora import Task, open_client, open_coordinator
from metafora.coordinators.sql import SQLCoordinator
from metafora.coordinators.sql.options import parse_config
from metafora.coordinators.sql.store import Database
from metafora.core.config import parse_store_url
from metafora.testing import RecordingContext

SPAWN = multiprocessing.get_context("spawn")
MODES = ("raw claim", "metafora claim", "metafora claim_many/50", "metafora claim+done")
BATCH = 50


def fill(url: str, pending: list[str], done: int) -> None:
    """Insert ``done`` finished rows and the ``pending`` tasks directly (fast, one transaction)."""
    db = Database(parse_config(parse_store_url(url), {}))
    with open_client(url) as client:
        client.tasks("claimed")  # creates the schema
    ns = db.config.namespace
    now = db.dialect.to_db_time(datetime.now(UTC))
    rows = [{"ns": ns, "id": f"old-{i:07d}", "state": "done", "now": now} for i in range(done)]
    rows += [{"ns": ns, "id": task_id, "state": "pending", "now": now} for task_id in pending]
    stmt = text(
        "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, created_at,"
        " updated_at, finished_at) VALUES (:ns, :id, '{}', :state, 0, 0, :now, :now, :now)"
    )
    with db.transaction() as conn:
        for i in range(0, len(rows), 5000):
            conn.execute(stmt, rows[i : i + 5000])
    db.close()


def _raw_claimer(coord: SQLCoordinator) -> Any:
    """A function claiming one id with the coordinator's statement on a bare connection."""
    db: Database = coord._db
    session = coord._lease._session  # this node's live registration
    compiled = db.sql["claim"].compile(dialect=db.engine.dialect)
    sql = str(compiled)
    ns, node = db.config.namespace, coord.node_id
    if db.config.kind == "postgresql":
        import psycopg

        conn = psycopg.connect(**db.dialect.connect_kwargs(), autocommit=True)  # type: ignore[attr-defined]

        def claim_pg(task_id: str) -> bool:
            row = conn.execute(sql, {"ns": ns, "id": task_id, "node": node, "session": session,
                                     "labels": "{}"}, prepare=True).fetchone()
            return row is not None

        return claim_pg
    assert db.config.path is not None
    lite = sqlite3.connect(db.config.path, isolation_level=None, timeout=30)
    lite.execute("PRAGMA synchronous = NORMAL")  # as the coordinator's connections (WAL)
    order = list(compiled.positiontup or [])
    bump = "UPDATE metafora_counter SET value = ? WHERE name = 'token' AND value < ?"

    def claim_lite(task_id: str) -> bool:
        values = {"ns": ns, "id": task_id, "node": node, "session": session, "labels": "{}"}
        lite.execute("BEGIN IMMEDIATE")
        try:
            row = lite.execute(sql, [values[k] for k in order]).fetchone()
            if row is not None:
                lite.execute(bump, (row[0], row[0]))
        finally:
            lite.execute("COMMIT")
        return row is not None

    return claim_lite


def worker(url: str, node: str, mode: str, ids: list[str], barrier: Any, out: Any) -> None:
    """One process: claim its ids as fast as it can; report per-claim completion times."""
    coord = open_coordinator(url, node_id=node, lease_ttl=600)
    assert isinstance(coord, SQLCoordinator)
    coord.init(RecordingContext())
    raw = None
    if mode == "raw claim":
        # The raw claims are not tracked by the coordinator: keep its heartbeat from
        # "reconciling" them away (the registration stays live for the 600 s TTL).
        coord._pause_heartbeat()
        raw = _raw_claimer(coord)
    barrier.wait(120)
    times: list[float] = []
    missed = 0
    start = time.perf_counter()
    if mode == "metafora claim_many/50":
        for i in range(0, len(ids), BATCH):
            chunk = [Task(task_id) for task_id in ids[i : i + BATCH]]
            got = coord.claim_many(chunk, len(chunk))
            missed += len(chunk) - len(got)
            times.extend([time.perf_counter() - start] * len(chunk))
    for task_id in ids if mode != "metafora claim_many/50" else []:
        if raw is not None:
            ok = raw(task_id)
        else:
            claimed = coord.claim(Task(task_id))
            ok = claimed is not None
            if claimed is not None and mode == "metafora claim+done":
                coord.done(claimed)
        missed += not ok
        times.append(time.perf_counter() - start)
    out.put(json.dumps({"node": node, "times": times, "missed": missed}))
    coord.close()


def measure(url: str, mode: str, procs: int, n: int, done: int) -> dict[str, Any]:
    """Run ``procs`` claimers on a fresh namespace; the combined and per-window rates."""
    ids = [f"t-{i:07d}" for i in range(n)]
    fill(url, ids, done)
    barrier, out = SPAWN.Barrier(procs), SPAWN.Queue()
    shares = [ids[i::procs] for i in range(procs)]
    workers = [SPAWN.Process(target=worker, args=(url, f"bench{i}", mode, shares[i], barrier, out))
               for i in range(procs)]
    for w in workers:
        w.start()
    results = [json.loads(out.get(timeout=600)) for _ in workers]
    for w in workers:
        w.join(60)
    total = sum(len(r["times"]) for r in results)
    wall = max(r["times"][-1] for r in results)
    fifth = min(len(r["times"]) for r in results) // 5

    def window(first: bool) -> float:
        rate = 0.0
        for r in results:
            t = r["times"]
            span = t[fifth - 1] if first else t[-1] - t[-fifth - 1]
            rate += fifth / span
        return rate

    return {"claims": total, "missed": sum(r["missed"] for r in results),
            "per_s": total / wall, "first": window(True), "last": window(False)}


def main() -> None:
    """Parse arguments, run every mode on every store, print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=6000, help="claims per run (all processes)")
    parser.add_argument("--done", type=int, default=20000, help="finished rows already there")
    parser.add_argument("--stores", default="sqlite,postgresql")
    parser.add_argument("--procs", default="1,2")
    args = parser.parse_args()
    kinds = [k for k in args.stores.split(",") if k]
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    with Stores(kinds) as stores:
        for kind in kinds:
            for procs in (int(p) for p in args.procs.split(",")):
                for mode in MODES:
                    r = measure(stores.url(kind), mode, procs, args.n, args.done)
                    rows.append([kind, mode, procs, r["claims"], r["per_s"], r["first"], r["last"],
                                 r["missed"]])
                    results.append({"store": kind, "mode": mode, "procs": procs, **r})
                    print(f"{kind:10} {mode:20} x{procs}: {r['per_s']:8.0f} claims/s", flush=True)
    table(f"SQL claims ({args.done:,} done rows in the table, run id {uuid.uuid4().hex[:6]})",
          ["store", "path", "procs", "claims", "claims/s", "first 20 %/s", "last 20 %/s", "missed"],
          rows)
    path = save("sql_raw", {"n": args.n, "done_rows": args.done, "results": results})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
