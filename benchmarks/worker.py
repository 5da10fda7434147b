"""A consumer process for benchmarks: reports ready / start / end events on a queue."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from typing import Any

from metafora import Consumer, Handler, Task, open_coordinator, simple_handler
from metafora.balancers import DumbBalancer, FairBalancer
from metafora.contracts.balancer import Balancer


class _Handler(Handler):
    def __init__(self, task: Task, node: str, mode: str, events: Any) -> None:
        self.task, self.node, self.mode, self.events = task, node, mode, events
        self._stop = threading.Event()

    def run(self) -> bool:
        self.events.put(("start", self.node, self.task.id, self.task.token, time.time()))
        if self.mode == "hold":
            self._stop.wait()
            self.events.put(("end", self.node, self.task.id, self.task.token, time.time()))
            return False
        return True

    def stop(self) -> None:
        self._stop.set()


async def _park(task: Task, stop: Any) -> bool:
    """An async handler that holds its task until stopped (the storm's long-running work)."""
    await stop.wait()
    return False


def _park_thread(task: Task, stop: threading.Event) -> bool:
    stop.wait()
    return False


def _handler_func(spec: Any, events: Any) -> Any:
    """``instant``/``hold`` report each start on ``events``; ``park``/``park-async`` are silent
    (100,000 events would cost more than the claims being measured)."""
    if spec.mode == "park":
        return simple_handler(_park_thread)
    if spec.mode == "park-async":
        return simple_handler(_park)
    return lambda task: _Handler(task, spec.node, spec.mode, events)


def _report_sql_statements(node: str, events: Any) -> None:
    """Count this process's SQL statements (not BEGIN/COMMIT/PRAGMA) and report the running
    total on ``events`` every second, as ``("sql", node, count)``."""
    from benchmarks.statements import count_sqlite_statements

    count = count_sqlite_statements()

    def report() -> None:
        while True:
            time.sleep(1.0)
            events.put(("sql", node, count[0]))

    threading.Thread(target=report, name="sql-count", daemon=True).start()


def _probe(consumer: Any, node: str) -> None:
    """Every 2 s, print what the node's offer pipeline holds, its CPU and the cyclic
    collector's share of it (``METAFORA_BENCH_PROBE=1``): a diagnostic for benchmarks whose
    nodes fall behind, reading the consumer's private parts."""
    began = time.monotonic()
    offers = consumer._offers
    gc_cpu = [0.0, 0.0]  # CPU seconds in the cyclic collector; when the current pass began

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_cpu[1] = time.thread_time()
        else:
            gc_cpu[0] += time.thread_time() - gc_cpu[1]

    gc.callbacks.append(timed)
    while True:
        time.sleep(2.0)
        now = time.monotonic()
        due = offers.ignores.next_due()
        print(f"probe {node} {now - began:6.1f}s running={len(consumer._running)} "
              f"ignored={len(offers.ignores)} next_due={'-' if due is None else f'{due - now:.1f}'} "
              f"queued={consumer._events.qsize()} loss={offers.spares.loss:.2f} "
              f"claims={consumer.stats.counters().get('claims')} cpu={time.process_time():.1f}s "
              f"gc_cpu={gc_cpu[0]:.2f}s gc_passes={[s['collections'] for s in gc.get_stats()]}",
              flush=True)


def main(spec: Any, events: Any) -> None:
    """Run a consumer described by ``spec`` (a benchmarks.common.WorkerSpec) until SIGTERM."""
    logging.basicConfig(level=os.environ.get("METAFORA_BENCH_LOG", "WARNING"),
                        format=f"%(asctime)s {spec.node} %(levelname)s %(message)s")
    if os.environ.get("METAFORA_BENCH_COUNT"):  # a diagnostic: benchmarks/statement_counts.py
        from benchmarks.statement_counts import ENV, install

        install(spec.node, os.environ[ENV])
    if getattr(spec, "count_sql", False):
        _report_sql_statements(spec.node, events)
    coord = open_coordinator(spec.url, node_id=spec.node, **spec.options)
    balancers: dict[str, Balancer] = {"dumb": DumbBalancer(), "fair": FairBalancer()}
    chosen: dict[str, Any] = {} if spec.balancer == "default" else {"balancer": balancers[spec.balancer]}
    if getattr(spec, "sticky_for", 0.0):  # passed only when set: an older revision (ab.py) lacks it
        chosen["sticky_for"] = spec.sticky_for
    consumer = Consumer(coord, _handler_func(spec, events), **chosen,
                        balance_every=spec.balance_every, max_tasks=spec.max_tasks, shutdown_timeout=5)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    signal.signal(signal.SIGINT, lambda *_: consumer.shutdown())

    def announce() -> None:
        deadline = time.monotonic() + 60
        while consumer.info()["started"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        events.put(("ready", spec.node, os.getpid(), time.time()))

    threading.Thread(target=announce, daemon=True).start()
    if os.environ.get("METAFORA_BENCH_PROBE"):
        threading.Thread(target=_probe, args=(consumer, spec.node), daemon=True).start()
    consumer.run()
    events.put(("stats", spec.node, consumer.stats.counters()))
    events.put(("stopped", spec.node, time.time()))
