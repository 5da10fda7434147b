"""Claim throughput: N pending tasks, 1/2/4 consumer processes, handlers that return at once.

Beside each figure, in the same run, two bare loops, one per process, each on its own share
of the tasks:

- one by one: the claim statement for a single task (SQL: the coordinator's exact UPDATE on a
  bare driver connection; etcd: a create-if-absent txn with a lease);
- batch: the store's own batch path, as the consumer claims (SQL: ``claim_many`` with 50 ids per
  statement; etcd: one txn of 32 create-if-absent puts).

The limit is the faster of the two (the batch path, unless something is wrong with it). A
consumer does more per task than either loop (claim, then a fenced done; the watch; the lease),
so the ratio consumer / limit is the cost of the whole pipeline.

The consumers run as a user starts them (the default balancer); the same with
``DumbBalancer`` is an extra, labelled column.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, save, table
from metafora import Task, open_client

SPAWN = multiprocessing.get_context("spawn")


def consumer_rate(url: str, procs: int, n: int, balancer: str = "default") -> float:
    """Tasks claimed and finished per second by ``procs`` consumer processes (``balancer``:
    a :class:`benchmarks.common.WorkerSpec` balancer name)."""
    with open_client(url) as client:  # in bulk: the figure starts once the consumers are ready
        client.submit_tasks(Task(f"t{i:06d}") for i in range(n))
    fleet = Fleet()
    try:
        for i in range(procs):  # start together: no process gets a long head start
            fleet.spawn(WorkerSpec(url, f"c{i}", balancer=balancer))
        ready, starts, last_ready = 0, [], 0.0
        deadline = time.monotonic() + 600
        while len(starts) < n and time.monotonic() < deadline:
            event = fleet.events.get(timeout=120)
            if event[0] == "ready":
                ready += 1
                last_ready = time.time()
            elif event[0] == "start":
                starts.append(event[4])
        window = [t for t in starts if t >= last_ready]
        if len(window) < 2 or ready < procs:
            return float("nan")
        return len(window) / (max(window) - last_ready)
    finally:
        fleet.stop()


def raw_rate(kind: str, url: str, procs: int, n: int) -> float:
    """The bare claim loop's rate with ``procs`` processes."""
    if kind == "etcd":
        return _etcd_raw(url, procs, n)
    from benchmarks.sql_raw import measure

    return float(measure(url, "raw claim", procs, n, 0)["per_s"])


ETCD_BATCH = 32  # puts per txn in the etcd batch loop (the consumer's claim txn size)


def batch_rate(kind: str, url: str, procs: int, n: int) -> float:
    """The store's batch claim path with ``procs`` processes (see the module doc)."""
    if kind == "etcd":
        return _etcd_raw(url, procs, n, ETCD_BATCH)
    from benchmarks.sql_raw import measure

    return float(measure(url, "metafora claim_many/50", procs, n, 0)["per_s"])


def _etcd_worker(url: str, share: int, count: int, barrier: Any, out: Any, batch: int = 1) -> None:
    from benchmarks.etcd_raw import driver_for
    from metafora.coordinators.etcd.driver import Put, absent

    driver, keys = driver_for(url)
    lease, _ = driver.grant(600)
    names = [keys.root + f"raw/{share}/{i}".encode() for i in range(count)]
    barrier.wait(60)
    start = time.perf_counter()
    for i in range(0, len(names), batch):
        chunk = names[i:i + batch]
        driver.txn([absent(key) for key in chunk], [Put(key, b"node", lease) for key in chunk])
    out.put((len(names), time.perf_counter() - start))
    driver.close()


def _etcd_raw(url: str, procs: int, n: int, batch: int = 1) -> float:
    barrier, out = SPAWN.Barrier(procs), SPAWN.Queue()
    per = n // procs
    workers = [SPAWN.Process(target=_etcd_worker, args=(url, f"{batch}-{i}", per, barrier, out, batch))
               for i in range(procs)]
    for w in workers:
        w.start()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(30)
    return sum(r[0] for r in results) / max(r[1] for r in results)


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every store x 1/2/4 processes; print and save."""
    # METAFORA_CLAIMS_TASKS: more tasks, so that on a loaded machine the window after the last
    # consumer is ready still holds tasks (an empty window is no figure: NaN)
    n = int(os.environ.get("METAFORA_CLAIMS_TASKS") or (2000 if quick else 10_000))
    # METAFORA_CLAIMS_PROCS: a subset of the process counts, e.g. "1,2" (an A/B of a few cells)
    counts = [int(p) for p in os.environ.get("METAFORA_CLAIMS_PROCS", "1,2,4").split(",")]
    rows, data = [], []
    for kind in stores.kinds:
        for procs in counts:
            raw = raw_rate(kind, stores.url(kind), procs, n)
            batch = batch_rate(kind, stores.url(kind), procs, n)
            limit = max(raw, batch)
            ours = consumer_rate(stores.url(kind), procs, n)
            dumb = consumer_rate(stores.url(kind), procs, n, "dumb")
            rows.append((kind, procs, n, raw, batch, ours, f"{ours / limit:.0%}", dumb))
            data.append({"store": kind, "procs": procs, "tasks": n, "raw_claims_per_s": raw,
                         "batch_claims_per_s": batch, "limit_claims_per_s": limit,
                         "consumer_tasks_per_s": ours, "ratio": ours / limit,
                         "balancer": "default", "dumb_tasks_per_s": dumb})
    table(f"claim throughput, {n:,} tasks (consumer: claim + run + fenced done per task)",
          ("store", "procs", "tasks", "one by one claim/s", "batch claim/s", "consumer tasks/s",
           "consumer / limit", "DumbBalancer tasks/s (extra)"), rows)
    save("claims", {"quick": quick, "results": data})
    return {"results": data}
