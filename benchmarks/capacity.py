"""Capacity: one node holding 10,000 long-running tasks (async handlers and thread handlers).

    python -m benchmarks capacity --stores sqlite,postgresql
    python benchmarks/capacity.py --stores sqlite -n 10000 --modes async,threads

Handler kinds: ``async`` and ``threads`` (plain handlers waiting for ``stop``) and
``async-stateful`` (state machines waiting in ``await cmds.get()``). For each store and handler
kind, one consumer process (spawned, nothing else in it) claims
``-n`` pending tasks (SQL: inserted by one multi-row insert; etcd: submitted from 8 threads)
and holds them all: every handler waits for ``stop``. Measured:

- seconds until the node holds every task (the claim pipeline, batches of 16);
- RSS of the node process holding them (``VmRSS``), its peak (``VmHWM``) and its thread
  count, beside the RSS of the same node idle (0 tasks) on an empty store;
- ``shutdown()`` of the node holding them, with every handler honouring ``stop()``: seconds
  until ``run()`` returns (``shutdown_timeout`` is 30 s), how many handlers were reported as
  having ignored ``stop()`` (must be 0), and whether every task is pending again.

``--limit 10000,20000`` also probes how many thread handlers one process can start (SQLite).
Mind the machine: threads count against the system-wide ``kernel.pid_max`` that every user of
the machine shares (32,768 by default), and a process has room for about
``vm.max_map_count / 2`` threads (a stack mapping and its guard page each).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Stores, save, table
from metafora import Consumer, HandlerFunc, Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.contracts.coordinator import Coordinator
from metafora.statemachine import AsyncCommands, Message, handler_func

SPAWN = multiprocessing.get_context("spawn")
MODES = ("async", "threads", "async-stateful")
SHUTDOWN_TIMEOUT = 30.0
TARGET_RSS_MIB = 250


def _handler(mode: str, coord: Coordinator) -> HandlerFunc:
    if mode == "async-stateful":  # a state machine waiting in `await cmds.get()` (no thread)
        async def wait_for_command(task: Task, cmds: AsyncCommands) -> Message:
            message = await cmds.get()
            assert message is not None  # release, once stopped
            return message

        return handler_func(wait_for_command, coord)
    if mode == "async":
        async def hold_async(task: Task, stop: asyncio.Event) -> bool:
            await stop.wait()
            return False

        return simple_handler(hold_async)

    def hold(task: Task, stop: threading.Event) -> bool:
        stop.wait()
        return False

    return simple_handler(hold)


class _Ignored(logging.Handler):
    """Counts the consumer's "ignored stop()" reports."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "ignored stop()" in record.getMessage():
            self.count += 1


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        threading.Event().wait(0.05)  # a benchmark polling its own node, not a test
    return bool(predicate())


def node(url: str, mode: str, expected: int, conn: Any) -> None:
    """The measured consumer process: hold ``expected`` tasks, then shut down on request."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s capacity %(levelname)s %(message)s")
    ignored = _Ignored()
    logging.getLogger("metafora").addHandler(ignored)
    coord = open_coordinator(url, node_id=f"capacity-{mode}")
    consumer = Consumer(coord, _handler(mode, coord),
                        shutdown_timeout=SHUTDOWN_TIMEOUT, release_backoff=60)
    runner = threading.Thread(target=consumer.run, name="capacity-run")
    began = time.monotonic()
    runner.start()
    held = _wait(lambda: len(consumer.tasks()) >= expected and consumer.healthy(), 900)
    conn.send(("held", held, time.monotonic() - began, len(consumer.tasks())))
    conn.recv()  # the parent has read our RSS
    began = time.monotonic()
    consumer.shutdown()
    runner.join()
    conn.send(("stopped", time.monotonic() - began, ignored.count))


def _status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                fields[key] = int(value.split()[0])
    return fields


def _fill(kind: str, url: str, n: int) -> None:
    ids = [f"cap-{i:06d}" for i in range(n)]
    if kind != "etcd":
        from benchmarks.sql_raw import fill

        fill(url, ids, 0)  # one multi-row insert
        return
    with open_client(url) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda task_id: client.submit_task(Task(task_id)), ids))


def measure(stores: Stores, kind: str, mode: str, n: int) -> dict[str, Any]:
    """One node of ``mode`` handlers holding ``n`` tasks of store ``kind``."""
    result: dict[str, Any] = {"store": kind, "mode": mode, "tasks": n}
    for count in (0, n):
        url = stores.url(kind)
        if count:
            _fill(kind, url, count)
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=node, args=(url, mode, count, child), daemon=True)
        proc.start()
        try:
            if not parent.poll(1200):
                raise TimeoutError(f"{kind}/{mode}: no report from the node in 1200 s")
            _, held, seconds, holding = parent.recv()
            status = _status(proc.pid)  # type: ignore[arg-type]
            parent.send("stop")
            if not parent.poll(SHUTDOWN_TIMEOUT + 120):
                raise TimeoutError(f"{kind}/{mode}: the node did not shut down")
            _, stop_s, ignored = parent.recv()
            proc.join(60)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        if not count:
            result["idle_rss_mib"] = status["VmRSS"] / 1024
            continue
        with open_client(url) as client:
            pending = len(client.tasks(TaskState.PENDING))
        result.update(held=held, holding=holding, seconds_to_hold=seconds,
                      rss_mib=status["VmRSS"] / 1024, peak_rss_mib=status["VmHWM"] / 1024,
                      threads=status["Threads"], shutdown_s=stop_s, ignored_stop=ignored,
                      pending_after=pending)
    result["kib_per_task"] = (result["rss_mib"] - result["idle_rss_mib"]) * 1024 / n
    return result


def _limit_probe(url: str, n: int, conn: Any) -> None:
    """Can one process start ``n`` thread handlers?"""
    consumer = Consumer(coord := open_coordinator(url, node_id="limit"), _handler("threads", coord),
                        shutdown_timeout=SHUTDOWN_TIMEOUT)
    runner = threading.Thread(target=consumer.run, name="limit-run")
    runner.start()
    held = _wait(lambda: len(consumer.tasks()) >= n or not consumer.healthy(), 600)
    holding = len(consumer.tasks())
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
    began = time.monotonic()
    consumer.shutdown()
    runner.join(SHUTDOWN_TIMEOUT + 60)
    conn.send((held and holding >= n, holding, rss, time.monotonic() - began))


def limit(stores: Stores, n: int) -> dict[str, Any]:
    """Run :func:`_limit_probe` in its own process on a SQLite store of ``n`` tasks."""
    url = stores.url("sqlite")
    _fill("sqlite", url, n)
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_limit_probe, args=(url, n, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(1200):
            return {"threads": n, "ok": False, "error": "no report"}
        ok, holding, rss, stop_s = parent.recv()
        return {"threads": n, "ok": ok, "holding": holding, "rss_mib": rss, "shutdown_s": stop_s}
    except EOFError:
        return {"threads": n, "ok": False, "error": f"process died (exit {proc.exitcode})"}
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def run(stores: Stores, quick: bool, n: int | None = None,
        modes: tuple[str, ...] = MODES, probe: tuple[int, ...] = ()) -> dict[str, Any]:
    """Every store x handler kind: print and save."""
    n = n or (2000 if quick else 10_000)
    results = []
    for kind in stores.kinds:
        for mode in modes:
            try:
                results.append(measure(stores, kind, mode, n))
            except (TimeoutError, EOFError) as exc:  # report it in the table, go on
                results.append({"store": kind, "mode": mode, "tasks": n, "error": str(exc)})
            print(results[-1], flush=True)
    table(f"capacity: one node holding {n:,} tasks (RSS target < {TARGET_RSS_MIB} MB with async "
          f"handlers; shutdown_timeout {SHUTDOWN_TIMEOUT:.0f} s)",
          ("store", "handlers", "held", "s to hold", "RSS MiB", "peak MiB", "idle MiB",
           "KiB/task", "threads", "shutdown s", "ignored stop()", "pending after"),
          [(r["store"], r["mode"], *(r.get(k, "-") for k in (
              "holding", "seconds_to_hold", "rss_mib", "peak_rss_mib", "idle_rss_mib",
              "kib_per_task", "threads", "shutdown_s", "ignored_stop", "pending_after")))
           for r in results])
    limits = [limit(stores, count) for count in probe]
    if limits:
        table("thread handlers in one process (SQLite)",
              ("threads", "ok", "held", "RSS MiB", "shutdown s"),
              [(r["threads"], r["ok"], r.get("holding", r.get("error", "-")),
                r.get("rss_mib", float("nan")), r.get("shutdown_s", float("nan")))
               for r in limits])
    save("capacity", {"quick": quick, "tasks": n, "results": results, "thread_limit": limits})
    return {"results": results, "thread_limit": limits}


def main() -> None:
    """Command line: stores, task count, handler kinds."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--stores", default="sqlite,postgresql")
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--limit", default="",
                        help="comma-separated thread-handler counts to probe (SQLite)")
    args = parser.parse_args()
    with Stores([k for k in args.stores.split(",") if k]) as stores:
        run(stores, False, args.n, tuple(m for m in args.modes.split(",") if m),
            tuple(int(c) for c in args.limit.split(",") if c))


if __name__ == "__main__":
    main()
