"""Bulk submit (issue 11 item 6): 20,000 tasks by ``Client.submit_tasks`` vs one at a time.

``python -m benchmarks submit [--quick] [--stores postgresql,sqlite,etcd]``. For each store:
one ``submit_tasks`` call of N tasks (batched: SQL 500 rows per INSERT, etcd 32 tasks per
128-op txn), then N ``submit_task`` calls from 8 threads (the way it had to be done before),
each on a fresh namespace; prints tasks/s and saves ``results/submit.json``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import Stores, save, table
from metafora import Task, open_client

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


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every store: bulk vs one at a time; print and save."""
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
    save("submit", {"quick": quick, "results": data})
    return {"results": data}
