"""Submit-to-start latency on an idle cluster of 3 consumer processes.

Each task is submitted once the previous one has started (the cluster is idle at every
submit); latency = the handler's start time minus the time just before ``submit_task``.
The raw figure beside it is the store's own wake-up: NOTIFY (PostgreSQL), a watch event
(etcd), the poll interval (SQLite, which has no push).
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, percentile, save, table
from metafora import Task, open_client


def measure(url: str, submits: int) -> list[float]:
    """Latencies (seconds) of ``submits`` sequential submits on 3 idle consumers."""
    with Fleet() as fleet, open_client(url) as client:
        for i in range(3):
            fleet.start(WorkerSpec(url, f"lat{i}", balancer="default"))  # as a user starts them
        latencies = []
        for i in range(submits + 10):
            before = time.time()
            client.submit_task(Task(f"l{i:05d}"))
            event = fleet.expect("start", timeout=30)
            if i >= 10:  # the first ten warm connections and caches up
                latencies.append(event[4] - before)
        return latencies


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Measure every store in ``stores``; print and save the table."""
    rows, data = [], {}
    for kind in stores.kinds:
        n = (200 if quick else 1000) if kind != "sqlite" else (50 if quick else 200)
        lat = measure(stores.url(kind), n)
        p50, p99 = percentile(lat, 50) * 1000, percentile(lat, 99) * 1000
        rows.append((kind, n, p50, p99, max(lat) * 1000))
        data[kind] = {"submits": n, "p50_ms": p50, "p99_ms": p99, "max_ms": max(lat) * 1000}
    table("submit-to-start latency, 3 idle consumers (ms)", ("store", "submits", "p50", "p99", "max"), rows)
    save("latency", {"quick": quick, "results": data})
    return data
