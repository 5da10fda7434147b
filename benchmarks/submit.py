"""Bulk submit (issue 11 item 6): 20,000 tasks by ``Client.submit_tasks`` vs one at a time.

``python -m benchmarks submit [--quick] [--stores postgresql,sqlite,etcd]``. For each store:
one ``submit_tasks`` call of N tasks (batched: SQL 500 rows per INSERT, etcd 32 tasks per
128-op txn), then N ``submit_task`` calls from 8 threads (the way it had to be done before),
each on a fresh namespace; prints tasks/s and saves ``results/submit.json``.

Issue 35 adds, on PostgreSQL and SQLite:

- **in the user's transaction**: ``submit_tasks(batch, conn=...)`` on an application's
  SQLAlchemy connection (one transaction per batch: BEGIN, the submit, COMMIT), batches of 1
  and of 1,000, beside the plain client (``submit_task`` one at a time; ``submit_tasks`` of
  1,000 per call), both from one thread;
- **the async client**: N ``submit_task`` from 50 concurrent coroutines
  (``open_async_client``, whose concurrent single submits share one write: group commit)
  beside the sync client from 50 threads sharing one client (each call its own write), and
  beside the async client's single-task write called by the same coroutines (its layers alone,
  like with like against the threads). Both clients have the same connection pool (10 + 10
  overflow on PostgreSQL); the async client on SQLite runs its writes on its 8 threads.

The ways run in interleaved rounds (5; 3 with ``--quick``), every store's every way once a
round, the order rotated a round; the figures are the medians (and ranges) of the rounds,
with the load average before and after, in ``results/submit_application.json``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import create_engine, event

from benchmarks.common import Stores, save, table
from metafora import Task, open_async_client, open_client

THREADS = 8


def bulk_seconds(url: str, n: int) -> float:
    """Seconds for one ``submit_tasks`` call of ``n`` tasks (schema created beforehand)."""
    with open_client(url) as client:
        client.tasks()
        tasks = [Task(f"t{i:06d}", {"i": i}) for i in range(n)]
        started = time.perf_counter()
        client.submit_tasks(tasks)
        elapsed = time.perf_counter() - started
        assert len(client.tasks("pending")) == n
    return elapsed


def single_seconds(url: str, n: int) -> float:
    """Seconds for ``n`` ``submit_task`` calls spread over 8 threads sharing one client."""
    with open_client(url) as client:
        client.tasks()
        tasks = [Task(f"t{i:06d}", {"i": i}) for i in range(n)]
        started = time.perf_counter()
        with ThreadPoolExecutor(THREADS) as pool:
            for _ in pool.map(client.submit_task, tasks):
                pass
        elapsed = time.perf_counter() - started
        assert len(client.tasks("pending")) == n
    return elapsed


COROUTINES = 50


def app_url(store_url: str) -> str:
    """The SQLAlchemy URL of a SQL store's database (the application's engine)."""
    base = store_url.split("?", 1)[0]
    return base if base.startswith("sqlite:") else base.replace("postgresql://", "postgresql+psycopg://", 1)


def batched_seconds(url: str, n: int, batch: int, in_transaction: bool) -> float:
    """Seconds to submit ``n`` tasks in batches of ``batch`` from one thread: each batch in
    an application transaction (``conn=``), or through the plain client."""
    engine = create_engine(app_url(url))
    if url.startswith("sqlite:"):
        # As metafora's own connections: WAL's synchronous=NORMAL (FULL syncs every commit).
        event.listen(engine, "connect", lambda dbapi, _record: dbapi.execute("PRAGMA synchronous = NORMAL"))
    with open_client(url) as client:
        client.tasks()
        tasks = [Task(f"t{i:06d}", {"i": i}) for i in range(n)]
        groups = [tasks[i:i + batch] for i in range(0, n, batch)]
        with engine.connect():
            pass  # the application's pool is warm, as the client's is after tasks()
        started = time.perf_counter()
        for group in groups:
            if in_transaction:
                with engine.begin() as conn:
                    client.submit_tasks(group, conn=conn)
            elif batch == 1:
                client.submit_task(group[0])
            else:
                client.submit_tasks(group)
        elapsed = time.perf_counter() - started
        assert len(client.tasks("pending")) == n
    engine.dispose()
    return elapsed


def concurrent_seconds(url: str, n: int, way: str) -> float:
    """Seconds for ``n`` ``submit_task`` calls from 50 callers: ``"sync"`` 50 threads sharing
    one sync client; ``"async"`` 50 coroutines on one async client (its group commit);
    ``"async_alone"`` the same coroutines each writing its own task (the async client's
    single-task write, without the group commit: its layers alone against the threads)."""
    tasks = [Task(f"t{i:06d}", {"i": i}) for i in range(n)]
    if way == "sync":
        with open_client(url) as client:
            client.tasks()
            started = time.perf_counter()
            with ThreadPoolExecutor(COROUTINES) as pool:
                for _ in pool.map(client.submit_task, tasks):
                    pass
            elapsed = time.perf_counter() - started
            assert len(client.tasks("pending")) == n
            return elapsed

    async def main() -> float:
        async with open_async_client(url) as client:
            await client.tasks()
            queue = list(reversed(tasks))
            submit = (client.submit_task if way == "async"
                      else functools.partial(client._submit_one, mode="error"))

            async def worker() -> None:
                while queue:
                    await submit(queue.pop())

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(COROUTINES)))
            elapsed = time.perf_counter() - started
            assert len(await client.tasks("pending")) == n
            return elapsed

    return asyncio.run(main())


# The application side's cases: (path, batch or concurrency, the ways; the first is the baseline).
CASES = (("transaction", 1, ("plain", "transaction")),
         ("transaction", 1000, ("plain", "transaction")),
         ("async", COROUTINES, ("sync", "async_alone", "async")))
WAY_NAMES = {"plain": "plain client", "transaction": "in the user's transaction",
             "sync": f"sync client, {COROUTINES} threads", "async_alone": "async client, one write a call",
             "async": "async client (group commit)"}


def run_application_side(stores: Stores, quick: bool, rounds: int) -> list[dict[str, Any]]:
    """Issue 35 on the SQL stores, in ``rounds`` interleaved rounds (each round runs every
    store's every way once, in an order rotated by one a round, so no way always runs first
    or last on a machine whose load drifts); tasks/s per way, medians and ranges."""
    ones, thousands, concurrent = (200, 5000, 2000) if quick else (500, 10_000, 3000)
    sizes = {1: ones, 1000: thousands, COROUTINES: concurrent}
    kinds = [k for k in stores.kinds if k in ("postgresql", "sqlite")]
    runs = [(kind, path, size, way) for kind in kinds for path, size, ways in CASES for way in ways]
    rates: dict[tuple[str, str, int, str], list[float]] = {run: [] for run in runs}
    for r in range(rounds):
        for kind, path, size, way in runs[r % len(runs):] + runs[:r % len(runs)]:
            n = sizes[size]
            if path == "transaction":
                seconds = batched_seconds(stores.url(kind), n, size, in_transaction=way == "transaction")
            else:
                # Both clients get the same pool (the default: 10 + 10 overflow), and more
                # patience for a connection than the 5 s default (50 threads queue past it on
                # a loaded machine).
                opts = {"connect_timeout": 60} if kind == "postgresql" else {}
                seconds = concurrent_seconds(stores.url(kind, **opts), n, way)
            rates[kind, path, size, way].append(n / seconds)
    data, rows = [], []
    for kind in kinds:
        for path, size, ways in CASES:
            figures = {way: _spread(rates[kind, path, size, way]) for way in ways}
            data.append({"store": kind, "path": path, "size": size, "tasks": sizes[size],
                         "rounds": rounds, "tasks_per_s": figures})
            base = figures[ways[0]]["median"]
            for way in ways[1:]:
                label = f"batch of {size:,}" if path == "transaction" else f"{size} concurrent"
                rows.append((kind, label, WAY_NAMES[ways[0]], base, WAY_NAMES[way],
                             figures[way]["median"], f"{figures[way]['median'] / base:.2f}x"))
    table(f"the application side, medians of {rounds} interleaved rounds (tasks/s)",
          ("store", "path", "baseline", "tasks/s", "way", "tasks/s", "ratio"), rows)
    return data


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every store: bulk vs one at a time; the application side (issue 35); print and save."""
    n = 5000 if quick else 20_000
    rows, data = [], []
    for kind in stores.kinds:
        bulk = bulk_seconds(stores.url(kind), n)
        single = single_seconds(stores.url(kind), n)
        rows.append((kind, n, bulk, n / bulk, single, n / single, f"{single / bulk:.1f}x"))
        data.append({"store": kind, "tasks": n, "bulk_s": bulk, "bulk_tasks_per_s": n / bulk,
                     "single_8_threads_s": single, "single_tasks_per_s": n / single})
    table(f"submitting {n:,} tasks: submit_tasks (one call) vs submit_task from {THREADS} threads",
          ("store", "tasks", "bulk s", "bulk tasks/s", "single s", "single tasks/s", "speed-up"), rows)
    load_before = os.getloadavg()
    application = run_application_side(stores, quick, 3 if quick else 5)
    load = {"before": [round(v, 2) for v in load_before], "after": [round(v, 2) for v in os.getloadavg()]}
    # docs/benchmarks.md's table
    save("submit_application", {"quick": quick, "load_average": load, "results": application})
    save("submit", {"quick": quick, "results": data, "application_side": application})
    return {"results": data, "application_side": application}
