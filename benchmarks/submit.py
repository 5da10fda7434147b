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
  (``open_async_client``) beside the sync client from 50 threads.
"""

from __future__ import annotations

import asyncio
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


def concurrent_seconds(url: str, n: int, use_async: bool) -> float:
    """Seconds for ``n`` ``submit_task`` calls from 50 coroutines (async client) or 50
    threads sharing one sync client."""
    tasks = [Task(f"t{i:06d}", {"i": i}) for i in range(n)]
    if not use_async:
        with open_client(url) as client:
            client.tasks()
            started = time.perf_counter()
            with ThreadPoolExecutor(COROUTINES) as pool:
                for _ in pool.map(client.submit_task, tasks):
                    pass
            return time.perf_counter() - started

    async def main() -> float:
        async with open_async_client(url) as client:
            await client.tasks()
            queue = list(reversed(tasks))

            async def worker() -> None:
                while queue:
                    await client.submit_task(queue.pop())

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(COROUTINES)))
            elapsed = time.perf_counter() - started
            assert len(await client.tasks("pending")) == n
            return elapsed

    return asyncio.run(main())


def run_application_side(stores: Stores, quick: bool) -> list[dict[str, Any]]:
    """Issue 35: the user's transaction (batch 1 and 1,000) and the async client (50
    coroutines), beside the plain and the sync client, on the SQL stores."""
    ones, thousands, concurrent = (300, 5000, 2000) if quick else (1000, 20_000, 5000)
    rows, data = [], []
    for kind in [k for k in stores.kinds if k in ("postgresql", "sqlite")]:
        for batch, n in ((1, ones), (1000, thousands)):
            plain = batched_seconds(stores.url(kind), n, batch, in_transaction=False)
            tx = batched_seconds(stores.url(kind), n, batch, in_transaction=True)
            rows.append((kind, f"batch of {batch:,}", n, n / plain, n / tx, f"{tx / plain - 1:+.0%}"))
            data.append({"store": kind, "path": "transaction", "batch": batch, "tasks": n,
                         "plain_tasks_per_s": n / plain, "transaction_tasks_per_s": n / tx})
        # Both clients get the same pool (the default: 10 + 10 overflow), and more patience for
        # a connection than the 5 s default (50 threads queued past it on a loaded machine).
        opts = {"connect_timeout": 60} if kind == "postgresql" else {}
        sync = concurrent_seconds(stores.url(kind, **opts), concurrent, use_async=False)
        asynchronous = concurrent_seconds(stores.url(kind, **opts), concurrent, use_async=True)
        rows.append((kind, f"{COROUTINES} concurrent", concurrent, concurrent / sync,
                     concurrent / asynchronous, f"{sync / asynchronous:.2f}x"))
        data.append({"store": kind, "path": "async", "concurrency": COROUTINES, "tasks": concurrent,
                     "sync_threads_tasks_per_s": concurrent / sync,
                     "async_tasks_per_s": concurrent / asynchronous})
    table("the application side: plain client vs in the user's transaction (time added), "
          f"sync client from {COROUTINES} threads vs async client from {COROUTINES} coroutines (ratio)",
          ("store", "path", "tasks", "plain|sync tasks/s", "transaction|async tasks/s", "difference"),
          rows)
    return data


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
    application = run_application_side(stores, quick)
    save("submit_application", {"quick": quick, "results": application})  # docs/benchmarks.md's table
    save("submit", {"quick": quick, "results": data, "application_side": application})
    return {"results": data, "application_side": application}
