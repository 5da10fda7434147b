"""etcd: raw client rates beside metafora's claim path, measured in the same run.

    python benchmarks/etcd_raw.py                 # starts a throw-away etcd on loopback
    python benchmarks/etcd_raw.py --url etcd://127.0.0.1:2379/bench -n 2000

Prints one table:
- raw put, raw create-if-absent txn with a lease (sequential, one client): the ceiling;
- metafora claim (one process, watch cache warm: one txn per claim), claim + done;
- outcomes: finish_many in batches of 42 and 256, done from 16 threads (group commit);
- claim + done with 2 consumer-less worker processes (spawn) sharing the tasks;
- raw watch latency (put -> event) and submit -> handler start through a Consumer, p50/p99.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from metafora import Task, open_client, open_coordinator, simple_handler
from metafora.consumer import Consumer
from metafora.contracts.coordinator import Finish, Outcome
from metafora.coordinators.etcd import EtcdConfig, EtcdCoordinator
from metafora.coordinators.etcd.driver import (
    EtcdDriver,
    Put,
    WatchBatch,
    absent,
)
from metafora.coordinators.etcd.layout import Keys
from metafora.core.config import parse_store_url
from metafora.testing import RecordingContext

SPAWN = multiprocessing.get_context("spawn")


@contextmanager
def local_etcd() -> Iterator[str]:
    """A throw-away single-member etcd on free loopback ports."""
    binary = os.environ.get("METAFORA_TEST_ETCD") or shutil.which("etcd")
    if not binary:
        sys.exit("no etcd binary: set METAFORA_TEST_ETCD or pass --url")
    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s)
    client, peer = (s.getsockname()[1] for s in ports)
    for s in ports:
        s.close()
    data = tempfile.mkdtemp(prefix="etcd-bench-")
    curl, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        [binary, "--data-dir", data, "--logger=zap", "--log-level=error",
         "--listen-client-urls", curl, "--advertise-client-urls", curl,
         "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
         "--initial-cluster", f"default={purl}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{curl}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                sys.exit("etcd did not start")
            threading.Event().wait(0.05)
        yield f"etcd://127.0.0.1:{client}/bench"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def fresh(url: str) -> str:
    base = url.rsplit("/", 1)[0]
    return f"{base}/b{uuid.uuid4().hex[:8]}"


def driver_for(url: str) -> tuple[EtcdDriver, Keys]:
    config = EtcdConfig.from_url(parse_store_url(url), {})
    driver = EtcdDriver(config.connection)
    driver.connect()
    return driver, Keys(config.namespace)


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}/s"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_raw(url: str, n: int) -> list[tuple[str, str, str]]:
    driver, keys = driver_for(url)
    rows = []
    try:
        t0 = time.perf_counter()
        for i in range(n):
            driver.txn([], [Put(keys.root + f"put/{i}".encode(), b"x")])
        rows.append(("raw put (txn of one put)", rate(n, time.perf_counter() - t0), f"n={n}"))
        lease, _ = driver.grant(60)
        t0 = time.perf_counter()
        for i in range(n):
            key = keys.root + f"cia/{i}".encode()
            driver.txn([absent(key)], [Put(key, b"node", lease)])
        rows.append(("raw create-if-absent txn + lease", rate(n, time.perf_counter() - t0),
                     f"n={n}"))
        # watch latency: put -> event on a prefix watch
        events: queue.Queue[float] = queue.Queue()
        handle = driver.watch_prefix(
            keys.root + b"w/", driver.txn([], []).revision + 1,
            lambda item: events.put(time.perf_counter()) if isinstance(item, WatchBatch) else None,
        )
        lat = []
        for i in range(min(n, 500)):
            t = time.perf_counter()
            driver.txn([], [Put(keys.root + f"w/{i}".encode(), b"x")])
            lat.append(events.get(timeout=10) - t)
        handle.cancel()
        rows.append(("raw watch latency put->event", f"p50 {pct(lat, .5) * 1e3:.2f} ms",
                     f"p99 {pct(lat, .99) * 1e3:.2f} ms"))
        driver.revoke(lease)
    finally:
        driver.close()
    return rows


def bench_claim(url: str, n: int) -> list[tuple[str, str, str]]:
    url = fresh(url)
    rows = []
    with open_client(url) as client:
        for i in range(n):
            client.submit_task(Task(f"c{i:06d}"))
        coord = open_coordinator(url, node_id="bench")
        assert isinstance(coord, EtcdCoordinator)
        coord.init(RecordingContext())
        offers: queue.Queue[Task] = queue.Queue()
        threading.Thread(target=coord.watch, args=(offers.put,), daemon=True).start()
        tasks = [offers.get(timeout=30) for _ in range(n)]  # the watch cache is warm now
        t0 = time.perf_counter()
        claimed = [coord.claim(t) for t in tasks]
        elapsed = time.perf_counter() - t0
        assert all(claimed)
        rows.append(("metafora claim (1 txn, sequential)", rate(n, elapsed), f"n={n}"))
        t0 = time.perf_counter()
        for c in claimed:
            assert c is not None
            coord.done(c)
        rows.append(("metafora done (1 fenced txn)", rate(n, time.perf_counter() - t0), f"n={n}"))
        rows += bench_finish_many(url, coord, n)
        coord.close()
        cold = open_coordinator(url, node_id="cold")
        cold.init(RecordingContext())
        for i in range(n):
            client.submit_task(Task(f"k{i:06d}"))
        t0 = time.perf_counter()
        got = [cold.claim(Task(f"k{i:06d}")) for i in range(n)]
        elapsed = time.perf_counter() - t0
        assert sum(g is not None for g in got) == n
        rows.append(("metafora claim, task not in cache (get + txn)", rate(n, elapsed), f"n={n}"))
        cold.close()
    return rows


def bench_finish_many(url: str, coord: EtcdCoordinator, n: int) -> list[tuple[str, str, str]]:
    """Outcomes many per txn: ``finish_many`` in batches, and ``done`` from 16 threads at
    once (group-committed), beside the one-txn-per-task figure above."""
    rows = []
    with open_client(url) as client:
        for batch in (42, 256):
            ids = [f"f{batch}-{i:06d}" for i in range(n)]
            client.submit_tasks(Task(i) for i in ids)
            claimed = claim_ids(coord, ids)
            t0 = time.perf_counter()
            for start in range(0, n, batch):
                results = coord.finish_many(
                    [Finish(t, Outcome.DONE) for t in claimed[start:start + batch]])
                assert not any(results), results
            rows.append((f"metafora finish_many, batches of {batch}",
                         rate(n, time.perf_counter() - t0), f"n={n}"))
        ids = [f"g-{i:06d}" for i in range(n)]
        client.submit_tasks(Task(i) for i in ids)
        claimed = claim_ids(coord, ids)
        todo: queue.SimpleQueue[Task] = queue.SimpleQueue()
        for task in claimed:
            todo.put(task)

        def finisher() -> None:
            while True:
                try:
                    coord.done(todo.get_nowait())
                except queue.Empty:
                    return

        threads = [threading.Thread(target=finisher) for _ in range(16)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append(("metafora done from 16 threads (group commit)",
                     rate(n, time.perf_counter() - t0), f"n={n}"))
    return rows


def claim_ids(coord: EtcdCoordinator, ids: list[str]) -> list[Task]:
    """Claim every task in ``ids`` (the watch cache may need a moment to see them)."""
    claimed: list[Task] = []
    deadline = time.monotonic() + 60
    while len(claimed) < len(ids) and time.monotonic() < deadline:
        have = {t.id for t in claimed}
        claimed += coord.claim_many([Task(i) for i in ids if i not in have], len(ids))
    assert len(claimed) == len(ids)
    return claimed


def claim_worker(url: str, node_id: str, expected: int, go: Any, results: Any) -> None:
    """Watch + claim + done until every task is done (by anyone)."""
    coord = open_coordinator(url, node_id=node_id)
    coord.init(RecordingContext())
    offers: queue.Queue[Task] = queue.Queue()
    threading.Thread(target=coord.watch, args=(offers.put,), daemon=True).start()
    client = open_client(url)
    go.wait()
    mine = 0
    seen: set[str] = set()
    while len(seen) < expected:
        try:
            batch = [offers.get(timeout=2)]
        except queue.Empty:
            if len(client.tasks("done")) >= expected:
                break
            continue
        while True:  # take what is offered and shuffle it, as the Consumer does
            try:
                batch.append(offers.get_nowait())
            except queue.Empty:
                break
        random.shuffle(batch)
        for task in batch:
            seen.add(task.id)
            got = coord.claim(task)
            if got is not None:
                coord.done(got)
                mine += 1
    results.put((node_id, mine, time.perf_counter()))
    coord.close()
    client.close()


def bench_two_processes(url: str, n: int) -> list[tuple[str, str, str]]:
    url = fresh(url)
    with open_client(url) as client:
        for i in range(n):
            client.submit_task(Task(f"p{i:06d}"))
        go = SPAWN.Event()
        results = SPAWN.Queue()
        procs = [SPAWN.Process(target=claim_worker, args=(url, f"w{j}", n, go, results))
                 for j in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60
        while sorted(client.nodes()) != ["w0", "w1"] and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        t0 = time.perf_counter()
        go.set()
        done = [results.get(timeout=300) for _ in procs]
        elapsed = max(r[2] for r in done) - t0
        for p in procs:
            p.join(30)
        split = "/".join(str(r[1]) for r in sorted(done))
    return [("claim+done, 2 processes (watch-driven)", rate(n, elapsed), f"n={n} split {split}")]


def consumer_worker(url: str, starts: Any, stop: Any) -> None:
    def work(task: Task, stopping: threading.Event) -> bool:
        starts.put((task.id, time.time()))
        return True

    consumer = Consumer(open_coordinator(url, node_id="lat"), simple_handler(work))
    threading.Thread(target=lambda: (stop.wait(), consumer.shutdown()), daemon=True).start()
    consumer.run()


def bench_latency(url: str, samples: int) -> list[tuple[str, str, str]]:
    url = fresh(url)
    starts = SPAWN.Queue()
    stop = SPAWN.Event()
    proc = SPAWN.Process(target=consumer_worker, args=(url, starts, stop))
    proc.start()
    lat = []
    try:
        with open_client(url) as client:
            deadline = time.monotonic() + 60
            while client.nodes() != ["lat"] and time.monotonic() < deadline:
                threading.Event().wait(0.05)
            for i in range(samples):
                sent = time.time()
                client.submit_task(Task(f"l{i:05d}"))
                task_id, started = starts.get(timeout=30)
                assert task_id == f"l{i:05d}"
                lat.append(started - sent)
    finally:
        stop.set()
        proc.join(60)
    return [("submit -> handler start (Consumer)", f"p50 {pct(lat, .5) * 1e3:.2f} ms",
             f"p99 {pct(lat, .99) * 1e3:.2f} ms (n={samples})")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="etcd:// URL (default: start a local etcd)")
    parser.add_argument("-n", type=int, default=2000, help="operations per measurement")
    parser.add_argument("--samples", type=int, default=300, help="latency samples")
    args = parser.parse_args()

    def run(url: str) -> None:
        rows = bench_raw(url, args.n)
        rows += bench_claim(url, args.n)
        rows += bench_two_processes(url, args.n)
        rows += bench_latency(url, args.samples)
        width = max(len(r[0]) for r in rows)
        print(f"{'measurement':<{width}}  {'rate / p50':>16}  notes")
        for name, value, note in rows:
            print(f"{name:<{width}}  {value:>16}  {note}")

    if args.url:
        run(args.url)
    else:
        with local_etcd() as url:
            run(url)


if __name__ == "__main__":
    main()
