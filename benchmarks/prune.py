"""Pruning finished tasks while a consumer claims short tasks (issue 36).

``python -m benchmarks prune [--quick] [--stores postgresql,sqlite]``; the number of finished
tasks is ``METAFORA_PRUNE_ROWS`` (default 1,000,000; ``--quick`` 20,000). For each SQL store:

1. N finished tasks (``done``, finished two days ago; one in ten with a state-machine state)
   are written straight into the tables (a submit-claim-done of each would take hours);
2. a consumer process (``max_tasks`` 8, a no-op handler) claims short tasks a feeder keeps
   topping up, and reports its ``done`` counter four times a second;
3. rounds of ``METAFORA_PRUNE_ROUND`` seconds (default 20) alternate until the N tasks are
   gone: one without pruning, one pruning as a consumer's pruner does (policy done 1 day, so
   the short tasks stay; batches of 1,000 with the store's rest after each), ..., and a last
   one without. Each round with pruning is compared to the mean of the rounds without on
   either side of it (on a shared machine the load moves); the figure is the median.

Prints rows pruned per second (the rests included: the rate a backlog goes at) and the
consumer's throughput with pruning against without (target: at least 0.8x); saves
``results/prune.json`` with every round and the 1-minute load average at each round's end.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import text

from benchmarks.common import RESULTS, Stores, commit, save, table
from metafora import Task, open_client
from metafora.core.retention import PRUNE_BATCH, Cutoffs, Retention, RetentionOps

ROUND_SECONDS = 20.0
POLICY = Retention(timedelta(days=1), timedelta(days=1), timedelta(days=1))
"""Every old task goes; the short tasks the consumer finishes stay."""
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

    def watch_stdin() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
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


def _prune_for(store: RetentionOps, cutoffs: Cutoffs, seconds: float) -> tuple[int, bool]:
    """What a consumer's :class:`~metafora.core.retention.Pruner` does in a turn -- batches of
    PRUNE_BATCH and the store's rest after each -- for at most ``seconds`` (the Pruner's
    turn would run to the end; the rounds stop it between two batches); (pruned, finished)."""
    deadline = time.monotonic() + seconds
    total = 0
    while True:
        started = time.monotonic()
        count = store._prune_batch(cutoffs, PRUNE_BATCH)
        total += count
        if count < PRUNE_BATCH:
            return total, True
        rest = store._prune_pause(time.monotonic() - started)
        if time.monotonic() + rest >= deadline:
            time.sleep(max(0.0, deadline - time.monotonic()))
            return total, False
        time.sleep(rest)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(url: str, kind: str, rows: int, round_s: float) -> dict[str, Any]:
    """One store: fill, then rounds without and with pruning until every old task is gone."""
    started = time.perf_counter()
    _fill(url, kind, rows)
    fill_s = time.perf_counter() - started
    stop = threading.Event()
    feeder = threading.Thread(target=_feed, args=(url, stop), daemon=True)
    feeder.start()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.prune", "--worker", url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    without: list[float] = []
    with_: list[tuple[float, float, int]] = []  # (tasks/s, seconds pruning, rows pruned)
    load: list[float] = []
    try:
        counter = _Counter(proc)
        time.sleep(10.0)  # warm up
        with open_client(url) as client:
            cutoffs = Cutoffs.at(POLICY, client._prune_now())
            while True:
                without.append(counter.rate_over(round_s))
                t0, d0 = counter.last
                p0 = time.perf_counter()
                count, finished = _prune_for(client, cutoffs, round_s)
                seconds = time.perf_counter() - p0
                t1, d1 = counter.last
                with_.append(((d1 - d0) / max(t1 - t0, 1e-9), seconds, count))
                load.append(os.getloadavg()[0])
                print(f"{kind}: round {len(with_)}: {sum(c for _, _, c in with_):,} pruned,"
                      f" without {without[-1]:.0f}, with {with_[-1][0]:.0f} tasks/s,"
                      f" load {load[-1]:.1f}", file=sys.stderr, flush=True)
                if finished:
                    break
            without.append(counter.rate_over(round_s))
    finally:
        stop.set()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)
    pruned = sum(c for _, _, c in with_)
    prune_s = sum(s for _, s, _ in with_)
    # Each round with pruning against the mean of the rounds without on either side of it.
    # (A last round shorter than half a round is too short a window to count.)
    ratios = [w / ((without[i] + without[i + 1]) / 2) for i, (w, s, _) in enumerate(with_)
              if s >= round_s / 2 and without[i] + without[i + 1]]
    return {"store": kind, "rows": rows, "fill_s": fill_s, "pruned": pruned, "prune_s": prune_s,
            "rows_per_s": pruned / prune_s if prune_s else 0.0, "rounds": len(with_),
            "without_tasks_per_s": without, "with_tasks_per_s": [w for w, _, _ in with_],
            "median_without_tasks_per_s": _median(without),
            "median_with_tasks_per_s": _median([w for w, _, _ in with_]),
            "ratios": ratios, "ratio": _median(ratios), "load_1m": load,
            "median_load_1m": _median(load)}


def _merged(results: list[dict[str, Any]], rows: int, round_s: float) -> list[dict[str, Any]]:
    """``results`` with the saved ones of the other stores kept (same size and rounds); each
    says its own commit and start."""
    kept: list[dict[str, Any]] = []
    try:
        saved = json.loads((RESULTS / "prune.json").read_text())
        if saved.get("rows") == rows and saved.get("round_s") == round_s:
            kept = saved.get("results", [])
    except (OSError, ValueError):
        pass
    fresh = {r["store"] for r in results}
    return [r for r in kept if r.get("store") not in fresh] + results


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every SQL store of ``stores``: print and save."""
    rows = 20_000 if quick else int(os.environ.get("METAFORA_PRUNE_ROWS", "1000000"))
    round_s = 5.0 if quick else float(os.environ.get("METAFORA_PRUNE_ROUND", str(ROUND_SECONDS)))
    data = []
    for kind in stores.kinds:
        if kind in ("postgresql", "sqlite"):
            at, code = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), commit()
            data.append({**measure(stores.url(kind), kind, rows, round_s),
                         "started_at": at, "commit": code})
            save("prune", {"quick": quick, "rows": rows, "round_s": round_s,
                           "results": _merged(data, rows, round_s)})
    table(f"pruning {rows:,} finished tasks while a consumer claims short tasks",
          ("store", "pruned", "prune s", "rows/s", "rounds", "consumer tasks/s without (median)",
           "with (median)", "with / without (median of rounds)"),
          [(d["store"], d["pruned"], d["prune_s"], d["rows_per_s"], d["rounds"],
            d["median_without_tasks_per_s"], d["median_with_tasks_per_s"], f"{d['ratio']:.2f}x")
           for d in data])
    return {"results": data}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        raise SystemExit("run it as: python -m benchmarks prune [--quick]")
