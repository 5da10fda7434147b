"""Gated partitions: items/s through the gate handler with a callable processor.

- **one partition**: N items (90 % at gate 0, 10 % at gate 1) in one partition, one consumer
  (a thread of this process); timed from ``submit_task`` to the task being done, so it
  includes the claim, every batch's fenced read and write, and the gate jump. The
  processor returns at once, so the figure is the store's and the handler's cost per item.
  Also measured: ``ItemStore.add`` of those items (one transaction).
- **10 partitions / 3 processes**: 10 partitions of N/10 items on 3 consumer processes
  (``spawn``), timed from the first submit to the last partition done.

    python -m benchmarks gates [--quick] [--stores sqlite,postgresql]
    python benchmarks/gates.py [--quick] [--stores sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # python benchmarks/gates.py

from benchmarks.common import Stores, save, table
from metafora import Consumer, Task, TaskState, open_client, open_coordinator

# ab.py runs this file against revisions from before metafora.gates was its own package: there
# the gates have their first name only (which now fails loudly).
try:
    from metafora import gates
except ImportError:
    from metafora.statemachine import gates  # type: ignore[no-redef]

SPAWN = multiprocessing.get_context("spawn")
SQL_STORES = ("sqlite", "postgresql")


def _instant(item: gates.Item) -> gates.Response:
    return gates.Response(gate=item.gate, done=True)


def _new_items(count: int) -> list[gates.NewItem]:
    payload = b"x" * 64
    gate0 = count * 9 // 10
    return [gates.NewItem(0 if n < gate0 else 1, payload) for n in range(count)]


def _wait_done(url: str, ids: list[str], timeout: float) -> float:
    """Poll until every task in ``ids`` is done; returns when (monotonic)."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    with open_client(url) as client:
        while True:
            states = {info.id: info.state for info in client.tasks()}
            if all(states.get(i) is TaskState.DONE for i in ids):
                return time.monotonic()
            bad = [i for i in ids if states.get(i) is TaskState.FAILED]
            if bad:
                raise RuntimeError(f"partition(s) failed: {bad}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions not done in {timeout:g}s")
            pause.wait(0.005)


def one_partition(url: str, count: int, batch_size: int) -> dict[str, float]:
    """Items/s of one partition on one in-process consumer."""
    items = gates.ItemStore(url)
    try:
        began = time.monotonic()
        items.add("bench", _new_items(count))
        add_s = time.monotonic() - began
        coord = open_coordinator(url, node_id="bench-1")
        consumer = Consumer(coord, gates.handler_func(_instant, coord, items, batch_size=batch_size))
        thread = threading.Thread(target=consumer.run, name="bench-consumer", daemon=True)
        thread.start()
        try:
            with open_client(url) as client:
                began = time.monotonic()
                client.submit_task(Task("bench"))
            run_s = _wait_done(url, ["bench"], 600) - began
        finally:
            consumer.shutdown(timeout=30)
            thread.join(30)
        info = items.info("bench")
        assert info.total("complete") == count, info
        return {"items": count, "seconds": run_s, "items_per_s": count / run_s, "add_per_s": count / add_s}
    finally:
        items.close()


def _worker(url: str, node: str, batch_size: int) -> None:
    """A consumer process (SIGTERM shuts it down)."""
    items = gates.ItemStore(url)
    coord = open_coordinator(url, node_id=node)
    consumer = Consumer(coord, gates.handler_func(_instant, coord, items, batch_size=batch_size),
                        max_tasks=4)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    try:
        consumer.run()
    finally:
        items.close()


def many_partitions(url: str, count: int, batch_size: int, processes: int = 3,
                    partitions: int = 10) -> dict[str, float]:
    """Items/s of ``partitions`` partitions on ``processes`` consumer processes."""
    names = [f"bench-{n}" for n in range(partitions)]
    items = gates.ItemStore(url)
    procs: list[Any] = []
    try:
        for name in names:
            items.add(name, _new_items(count // partitions))
        for n in range(processes):
            proc = SPAWN.Process(target=_worker, args=(url, f"bench-w{n}", batch_size), daemon=True)
            proc.start()
            procs.append(proc)
        with open_client(url) as client:
            pause = threading.Event()
            deadline = time.monotonic() + 60
            while len(client.nodes()) < processes:
                if time.monotonic() > deadline:
                    raise TimeoutError("consumer processes did not start")
                pause.wait(0.05)
            began = time.monotonic()
            for name in names:
                client.submit_task(Task(name))
        run_s = _wait_done(url, names, 600) - began
        total = sum(items.info(name).total("complete") for name in names)
        assert total == count // partitions * partitions
        return {"items": total, "seconds": run_s, "items_per_s": total / run_s}
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        items.close()


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Measure every SQL store in ``stores``; print and save the table."""
    # METAFORA_GATES_ITEMS: more items for a steadier figure (an A/B of two checkouts).
    count = int(os.environ.get("METAFORA_GATES_ITEMS") or (5_000 if quick else 20_000))
    rows, data = [], {}
    for kind in stores.kinds:
        if kind not in SQL_STORES:
            continue  # items live in SQL; an etcd coordinator would use one of these for them
        results = {
            "1 partition, batch 100": one_partition(stores.url(kind), count, 100),
            "1 partition, batch 500": one_partition(stores.url(kind), count, 500),
            "10 partitions, 3 processes": many_partitions(stores.url(kind), count, 100),
        }
        for scenario, r in results.items():
            rows.append((kind, scenario, int(r["items"]), r["seconds"], r["items_per_s"],
                         r.get("add_per_s", float("nan"))))
        data[kind] = results
    table("gated partitions, callable processor (returns at once)",
          ("store", "scenario", "items", "seconds", "items/s", "add items/s"), rows)
    save("gates", {"quick": quick, "results": data})
    return data


def main() -> None:
    """``python benchmarks/gates.py [--quick] [--stores ...]``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/gates.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="5,000 items instead of 20,000")
    parser.add_argument("--stores", default=",".join(SQL_STORES))
    args = parser.parse_args()
    with Stores([k.strip() for k in args.stores.split(",") if k.strip()]) as stores:
        run(stores, args.quick)


if __name__ == "__main__":
    main()
