"""Pruning finished tasks while a consumer claims short tasks (issue 36).

``python -m benchmarks prune [--quick] [--stores postgresql,sqlite]``; the number of finished
tasks is ``METAFORA_PRUNE_ROWS`` (default 1,000,000; ``--quick`` 20,000). For each SQL store:

1. N finished tasks (``done``, finished two days ago; one in ten with a state-machine state)
   are written straight into the tables (a submit-claim-done of each would take hours);
2. a consumer process (``max_tasks`` 8, a no-op handler) claims short tasks a feeder keeps
   topping up, and reports its ``done`` counter four times a second;
3. its throughput is measured for 15 s without pruning, then while ``Client.prune`` deletes
   the N tasks (policy done 1 day: the short tasks stay) in batches of 1,000 -- the statements
   and the rests between batches of every node's pruner -- then 15 s without again (on a
   shared machine the load moves: the baseline is the mean of before and after).

Prints rows pruned per second and the consumer's throughput during the prune against the
baseline (target: at least 0.8x); saves ``results/prune.json``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import text

from benchmarks.common import Stores, save, table
from metafora import Task, open_client
from metafora.retention import Retention

BASELINE_SECONDS = 15.0
_FILL_PG = (
    "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, attempts, created_at,"
    " updated_at, finished_at) SELECT :ns, 'old-' || lpad(g::text, 8, '0'), '{}', 'done', 1, 0, 1,"
    " now() - interval '3 days', now() - interval '2 days', now() - interval '2 days'"
    " FROM generate_series(CAST(:lo AS BIGINT), CAST(:hi AS BIGINT)) g"
)
_STATE_PG = (
    "INSERT INTO metafora_state (namespace, task_id, token, body, updated_at)"
    " SELECT :ns, 'old-' || lpad(g::text, 8, '0'), 1, '{\"state\":\"completed\"}', now()"
    " FROM generate_series(CAST(:lo AS BIGINT), CAST(:hi AS BIGINT)) g WHERE g % 10 = 0"
)
_OLD = "strftime('%Y-%m-%d %H:%M:%f', 'now', '-2 days')"
_FILL_SQLITE = (
    "WITH RECURSIVE g(x) AS (SELECT :lo UNION ALL SELECT x + 1 FROM g WHERE x < :hi)"
    " INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, attempts, created_at,"
    f" updated_at, finished_at) SELECT :ns, 'old-' || printf('%08d', x), '{{}}', 'done', 1, 0, 1,"
    f" {_OLD}, {_OLD}, {_OLD} FROM g"
)
_STATE_SQLITE = (
    "WITH RECURSIVE g(x) AS (SELECT :lo UNION ALL SELECT x + 1 FROM g WHERE x < :hi)"
    " INSERT INTO metafora_state (namespace, task_id, token, body, updated_at)"
    f" SELECT :ns, 'old-' || printf('%08d', x), 1, '{{\"state\":\"completed\"}}', {_OLD}"
    " FROM g WHERE x % 10 = 0"
)


def _worker(url: str) -> None:
    """The consumer process: runs until stdin closes, printing ``monotonic done`` lines."""
    from metafora import Consumer, open_coordinator, simple_handler

    coord = open_coordinator(url, node_id="bench-worker")
    consumer = Consumer(coord, simple_handler(lambda task, stop: True), max_tasks=8,
                        prune_every=86400)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    while not closed.wait(0.25):
        print(f"{time.monotonic()} {consumer.stats.done}", flush=True)
    consumer.shutdown()


def _fill(url: str, kind: str, rows: int) -> None:
    with open_client(url) as client:
        client.tasks("claimed")  # the schema
        db = client._retention_db()  # type: ignore[attr-defined]
        fill, state = (_FILL_PG, _STATE_PG) if kind == "postgresql" else (_FILL_SQLITE, _STATE_SQLITE)
        step = 50_000
        for lo in range(1, rows + 1, step):
            hi = min(rows, lo + step - 1)
            with db.transaction() as conn:
                params = {"ns": db.config.namespace, "lo": lo, "hi": hi}
                conn.execute(text(fill), params)
                conn.execute(text(state), params)
        if kind == "postgresql":
            with db.transaction() as conn:
                conn.execute(text("ANALYZE metafora_tasks"))
                conn.execute(text("ANALYZE metafora_state"))


class _Counter:
    """The worker's last reported (monotonic, done)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.last = (time.monotonic(), 0)
        self._proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            at, done = line.split()
            self.last = (float(at), int(done))

    def rate_over(self, seconds: float, stop: threading.Event | None = None) -> float:
        """Tasks/s over the next ``seconds`` (or until ``stop``)."""
        t0, d0 = self.last
        if stop is None:
            time.sleep(seconds)
        else:
            stop.wait()
        t1, d1 = self.last
        return (d1 - d0) / max(t1 - t0, 1e-9)


def _feed(url: str, stop: threading.Event) -> None:
    """Keep about 4,000 short tasks pending."""
    n = 0
    with open_client(url) as client:
        while not stop.is_set():
            if client.pending_count() < 4000:
                client.submit_tasks([Task(f"s{n + i:08d}") for i in range(2000)])
                n += 2000
            stop.wait(0.2)


def measure(url: str, kind: str, rows: int) -> dict[str, Any]:
    """One store: fill, baseline, prune; the figures."""
    started = time.perf_counter()
    _fill(url, kind, rows)
    fill_s = time.perf_counter() - started
    stop = threading.Event()
    feeder = threading.Thread(target=_feed, args=(url, stop), daemon=True)
    feeder.start()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.prune", "--worker", url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        counter = _Counter(proc)
        time.sleep(10.0)  # warm up
        baseline = counter.rate_over(BASELINE_SECONDS)
        done = threading.Event()
        result: dict[str, float] = {}

        def prune() -> None:
            with open_client(url) as client:
                t0 = time.perf_counter()
                result["pruned"] = client.prune(Retention(timedelta(days=1), timedelta(days=1),
                                                          timedelta(days=1)))
                result["seconds"] = time.perf_counter() - t0
            done.set()

        threading.Thread(target=prune, daemon=True).start()
        during = counter.rate_over(0, stop=done)
        after = counter.rate_over(BASELINE_SECONDS)
    finally:
        stop.set()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)
    return {"store": kind, "rows": rows, "fill_s": fill_s, "pruned": result["pruned"],
            "prune_s": result["seconds"], "rows_per_s": result["pruned"] / result["seconds"],
            "before_tasks_per_s": baseline, "after_tasks_per_s": after,
            "during_tasks_per_s": during,
            "ratio": during / ((baseline + after) / 2) if baseline + after else 0.0}


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every SQL store of ``stores``: print and save."""
    rows = 20_000 if quick else int(os.environ.get("METAFORA_PRUNE_ROWS", "1000000"))
    data = [measure(stores.url(kind), kind, rows) for kind in stores.kinds
            if kind in ("postgresql", "sqlite")]
    table(f"pruning {rows:,} finished tasks while a consumer claims short tasks",
          ("store", "pruned", "prune s", "rows/s", "consumer tasks/s before", "during", "after",
           "during / mean(before, after)"),
          [(d["store"], d["pruned"], d["prune_s"], d["rows_per_s"], d["before_tasks_per_s"],
            d["during_tasks_per_s"], d["after_tasks_per_s"], f"{d['ratio']:.2f}x") for d in data])
    save("prune", {"quick": quick, "rows": rows, "results": data})
    return {"results": data}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        raise SystemExit("run it as: python -m benchmarks prune [--quick]")
