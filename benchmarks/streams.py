"""Streams of indexed jobs: jobs/s of one stream against the store's commit rate, and many
streams spread over worker processes.

- **one stream**: N jobs prefilled in a :class:`~metafora.streams.SQLJobLog`, one stream
  (an in-process consumer) with no-op work at ``max_processing`` 1, 8 and 64
  (``max_search_ahead`` = max(100, 4 x max_processing)), the other options at their defaults.
  Its **jobs/s** is the stream's rate: N over the time from the first job's start to the last
  job's end (the work notes both; a clock read per job). Also reported: the seconds from
  ``submit_task`` to the stored processed index at the last job (``Client.stream``, polled
  every 10 ms once the last job ran, every 0.5 s before: a 10 ms poll in the stream's own
  process took the GIL from it), which adds the claim, the source's start-up and the last
  write (the processed index is written at most every ``flush_every``, 0.5 s). Beside it,
  in the same run, the store's **raw commit rate**: a loop of single-row commits through
  the bare driver (SQLite: ``BEGIN IMMEDIATE`` / ``UPDATE`` / ``COMMIT`` in WAL with
  ``synchronous=NORMAL``, as the store runs; PostgreSQL: an autocommit ``UPDATE``). The
  target is at least 10x the commit rate at 64 in flight: the watermark is written batched,
  not once per job. The process's CPU time (every thread) per job and per commit is reported
  too: on a loaded machine it moves less than a rate does.
  A fourth run at 64 has ``async def`` no-op work (no thread hop per job).
- **many streams**: S streams x J jobs (S logs) over 4 worker processes (spawned consumers,
  ``max_processing=4``); timed from the first submit to every stream's processed index at
  its last job. Reports the jobs/s of the whole, ``metafora streams`` taken mid-run (the lag
  column), and the streams per node (their owners) when the jobs are done and once the fair
  balancer has evened them out (within one; its rounds are 60 s apart, so up to 90 s later).

    python -m benchmarks streams [--quick] [--stores sqlite,postgresql]
    python benchmarks/streams.py [--quick] [--stores sqlite,postgresql]

``METAFORA_STREAMS_JOBS``, ``METAFORA_STREAMS_MANY`` and ``METAFORA_STREAMS_PER`` change the
sizes (``METAFORA_STREAMS_MANY=0``: no many-streams run, as ``benchmarks/ab.py streams`` uses).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # python benchmarks/streams.py

from benchmarks.common import Stores, save, table
from metafora import Consumer, Task, open_client, open_coordinator
from metafora.coordinators.sql.options import parse_config
from metafora.core.config import parse_store_url
from metafora.streams import Job, JobContext, SQLJobLog, stream_handler
from metafora.streams.ops import stream_rows

SPAWN = multiprocessing.get_context("spawn")
SQL_STORES = ("sqlite", "postgresql")
IN_FLIGHT = (1, 8, 64)
PROCESSES = 4
_APPEND = 1000  # jobs per append when filling a log


def _noop(job: Job, ctx: JobContext) -> None:
    return None


class _Clock:
    """No-op work that notes when the first job started and the last one ended."""

    def __init__(self, last: int) -> None:
        self.last_index = last
        self.first = self.last = 0.0
        self.cpu_first = self.cpu_last = 0.0  # the process's CPU seconds (every thread)
        self.ran_last = threading.Event()

    def work(self, job: Job, ctx: JobContext) -> None:
        now = time.monotonic()
        if not self.first:
            self.first, self.cpu_first = now, time.process_time()
        self.last = now
        if job.index == self.last_index:
            self.cpu_last = time.process_time()
            self.ran_last.set()

    async def async_work(self, job: Job, ctx: JobContext) -> None:
        self.work(job, ctx)


def _source(task: Task) -> SQLJobLog:
    return SQLJobLog(task.props["url"], task.props["log"])


def fill(url: str, name: str, count: int) -> None:
    """Append ``count`` jobs to the log ``name`` (``_APPEND`` per transaction)."""
    log = SQLJobLog(url, name)
    try:
        for first in range(0, count, _APPEND):
            log.append([(f"j{i}", {"n": i}) for i in range(first, min(count, first + _APPEND))])
    finally:
        log.close()


# -- the store's raw commit rate -------------------------------------------------------------


def commit_rate(url: str, seconds: float) -> tuple[float, float]:
    """Single-row commits per second through the bare driver, for ``seconds``; and the
    process's CPU microseconds per commit."""
    config = parse_config(parse_store_url(url), {})
    if config.kind == "sqlite":
        conn = sqlite3.connect(f"{config.path}.commits", isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("CREATE TABLE IF NOT EXISTS bench (k INTEGER PRIMARY KEY, v INTEGER)")
        conn.execute("INSERT OR IGNORE INTO bench VALUES (1, 0)")

        def one() -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE bench SET v = v + 1 WHERE k = 1")
            conn.execute("COMMIT")
    else:
        import psycopg

        from metafora.coordinators.sql.dialect import PostgresDialect

        pg = psycopg.connect(**PostgresDialect(config).connect_kwargs(), autocommit=True)
        table_name = f"bench_commits_{config.namespace}"
        pg.execute(f'CREATE TABLE IF NOT EXISTS "{table_name}" (k INTEGER PRIMARY KEY, v INTEGER)')
        pg.execute(f'INSERT INTO "{table_name}" VALUES (1, 0) ON CONFLICT DO NOTHING')
        update = f'UPDATE "{table_name}" SET v = v + 1 WHERE k = 1'
        conn = pg  # type: ignore[assignment]

        def one() -> None:
            pg.execute(update, prepare=True)
    try:
        count, began, cpu = 0, time.monotonic(), time.process_time()
        while (elapsed := time.monotonic() - began) < seconds:
            one()
            count += 1
        return count / elapsed, (time.process_time() - cpu) / count * 1e6
    finally:
        conn.close()


# -- one stream ------------------------------------------------------------------------------


def _wait_processed(client: Any, task_id: str, last: int, timeout: float,
                    ran_last: threading.Event | None = None) -> float:
    """Poll the stored processed index until it is ``last``; returns when (monotonic).

    With ``ran_last`` (set when the last job ran, in this process) it polls every 0.5 s until
    then and every 10 ms after: a client polling the store every 10 ms in the stream's own
    process would take the GIL from the stream it measures (about a microsecond a job)."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        if ran_last is not None and not ran_last.wait(0.5):
            info = client.stream(task_id)
            if info.failing is not None:
                raise RuntimeError(f"stream {task_id} is failing: {info.failing}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {task_id} at {info.processed} of {last} after {timeout:g}s")
            continue
        info = client.stream(task_id)
        if info.processed >= last:
            return time.monotonic()
        if info.failing is not None:
            raise RuntimeError(f"stream {task_id} is failing: {info.failing}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"stream {task_id} at {info.processed} of {last} after {timeout:g}s")
        pause.wait(0.01)


def one_stream(url: str, count: int, in_flight: int, is_async: bool = False) -> dict[str, Any]:
    """Jobs/s of one stream of ``count`` prefilled jobs at ``in_flight`` jobs at once (no-op
    work: a plain function on the stream's threads, or an ``async def``)."""
    name = f"one-{in_flight}{'-async' if is_async else ''}"
    fill(url, name, count)
    coord = open_coordinator(url, node_id=f"bench-{name}")
    clock = _Clock(count - 1)
    handler = stream_handler(_source, clock.async_work if is_async else clock.work,
                             max_processing=in_flight, max_search_ahead=max(100, 4 * in_flight))
    consumer = Consumer(coord, handler)
    thread = threading.Thread(target=consumer.run, name="bench-consumer", daemon=True)
    thread.start()
    try:
        with open_client(url) as client:
            began = time.monotonic()
            client.submit_task(Task(name, {"url": url, "log": name}))
            run_s = _wait_processed(client, name, count - 1, 600, clock.ran_last) - began
    finally:
        consumer.shutdown(timeout=30)
        thread.join(30)
    span = clock.last - clock.first
    return {"jobs": count, "max_processing": in_flight, "work": "async def" if is_async else "def",
            "seconds": run_s, "jobs_seconds": span, "jobs_per_s": count / span,
            "end_to_end_jobs_per_s": count / run_s,
            "cpu_us_per_job": (clock.cpu_last - clock.cpu_first) / count * 1e6}


# -- many streams over processes --------------------------------------------------------------


def _worker(url: str, node: str) -> None:
    """A consumer process running streams (SIGTERM shuts it down)."""
    consumer = Consumer(open_coordinator(url, node_id=node),
                        stream_handler(_source, _noop, max_processing=4))
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    consumer.run()


def _cli_streams(url: str) -> str:
    """``metafora streams`` as an operator runs it."""
    done = subprocess.run([sys.executable, "-m", "metafora", "--url", url, "streams"], text=True,
                          capture_output=True, timeout=120, check=False,
                          env={**os.environ, "COLUMNS": "140"})
    return done.stdout if done.returncode == 0 else f"exit {done.returncode}: {done.stderr}"


_EVEN_WAIT = 90.0


def _owners(client: Any, names: list[str]) -> dict[str, int]:
    wanted = set(names)
    owners = Counter(str(info.owner) for info in client.tasks() if info.id in wanted)
    return dict(sorted(owners.items()))


def _even(owners: dict[str, int], processes: int) -> bool:
    counts = sorted(owners.values())
    return len(counts) == processes and counts[-1] - counts[0] <= 1


def many_streams(url: str, streams: int, jobs: int, processes: int = PROCESSES) -> dict[str, Any]:
    """``streams`` streams of ``jobs`` jobs each on ``processes`` worker processes."""
    names = [f"s{n:03d}" for n in range(streams)]
    for name in names:
        fill(url, name, jobs)
    procs: list[Any] = []
    try:
        for n in range(processes):
            proc = SPAWN.Process(target=_worker, args=(url, f"w{n}"), daemon=True)
            proc.start()
            procs.append(proc)
        with open_client(url) as client:
            pause = threading.Event()
            deadline = time.monotonic() + 120
            while len(client.nodes()) < processes:
                if time.monotonic() > deadline:
                    raise TimeoutError("worker processes did not start")
                pause.wait(0.05)
            began = time.monotonic()
            client.submit_tasks([Task(name, {"url": url, "log": name}) for name in names])
            listing, lag_seen, done_at = "", 0, None
            deadline = time.monotonic() + 1200
            while done_at is None:
                rows = {row.id: row for row in stream_rows(client)}
                processed = sum(max(0, r.info.processed + 1) for r in rows.values())
                if not listing and processed >= streams * jobs // 3:
                    listing = _cli_streams(url)  # mid-run: the lag column is not all zero
                    lag_seen = sum(1 for r in rows.values() if (r.info.lag or 0) > 0)
                if len(rows) == streams and processed == streams * jobs:
                    done_at = time.monotonic()
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"{processed} of {streams * jobs} jobs after 1200 s")
                else:
                    pause.wait(0.2)
            at_done = _owners(client, names)
            # The first claims race; the fair balancer evens the nodes out on its rounds
            # (every 60 s by default): wait for it, up to 90 s after the jobs are done.
            owners, even_after = at_done, None
            while time.monotonic() < done_at + _EVEN_WAIT:
                owners = _owners(client, names)
                if _even(owners, processes):
                    even_after = time.monotonic() - done_at
                    break
                pause.wait(1.0)
        return {"streams": streams, "jobs_per_stream": jobs, "processes": processes,
                "seconds": done_at - began, "jobs_per_s": streams * jobs / (done_at - began),
                "per_node_at_done": at_done, "per_node": owners,
                "even_within_one": _even(owners, processes), "even_after_done_s": even_after,
                "lagging_streams_mid_run": lag_seen, "metafora_streams_mid_run": listing}
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Measure every SQL store in ``stores``; print and save the tables."""
    count = int(os.environ.get("METAFORA_STREAMS_JOBS") or (10_000 if quick else 100_000))
    many_env = os.environ.get("METAFORA_STREAMS_MANY")
    streams = int(many_env) if many_env else (20 if quick else 100)
    per_stream = int(os.environ.get("METAFORA_STREAMS_PER") or (200 if quick else 1_000))
    load = os.getloadavg()
    data: dict[str, Any] = {"quick": quick, "load_before": load, "results": {}}
    one_rows, many_rows = [], []
    for kind in stores.kinds:
        if kind not in SQL_STORES:
            continue  # the log lives in SQL (beside an etcd coordinator it would be one of these)
        rate, commit_cpu = commit_rate(stores.url(kind), 3.0)
        ones = [one_stream(stores.url(kind), count, n) for n in IN_FLIGHT]
        ones.append(one_stream(stores.url(kind), count, IN_FLIGHT[-1], is_async=True))
        for r in ones:
            one_rows.append((kind, r["max_processing"], r["work"], r["jobs"], r["jobs_per_s"], rate,
                             r["jobs_per_s"] / rate, r["cpu_us_per_job"], commit_cpu, r["seconds"]))
        data["results"][kind] = {"commit_rate": rate, "commit_cpu_us": commit_cpu, "one_stream": ones}
        if not streams:  # METAFORA_STREAMS_MANY=0: one stream only (benchmarks/ab.py streams)
            continue
        many = many_streams(stores.url(kind), streams, per_stream)
        even = "no" if many["even_after_done_s"] is None else f"{many['even_after_done_s']:.0f} s after"
        many_rows.append((kind, f"{streams} x {per_stream}", PROCESSES, many["seconds"], many["jobs_per_s"],
                          " ".join(f"{v}" for v in many["per_node_at_done"].values()),
                          " ".join(f"{v}" for v in many["per_node"].values()), even,
                          many["lagging_streams_mid_run"]))
        data["results"][kind]["many_streams"] = many
        print(f"`metafora streams` mid-run on {kind} (first lines):")
        print("\n".join(many["metafora_streams_mid_run"].splitlines()[:8]))
    data["load_after"] = os.getloadavg()
    table(f"one stream, no-op work, {count} jobs in a SQLJobLog (load {load[0]:.1f})",
          ("store", "max_processing", "work", "jobs", "jobs/s", "raw commits/s", "x commit rate",
           "CPU us/job", "CPU us/commit", "s to stored"),
          one_rows)
    table(f"many streams over {PROCESSES} worker processes, no-op work",
          ("store", "streams x jobs", "processes", "seconds", "jobs/s", "per node at done",
           "per node", "even (within one)", "lagging mid-run"), many_rows)
    save("streams_quick" if quick else "streams", data)
    return data


def main() -> None:
    """``python benchmarks/streams.py [--quick] [--stores ...]``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/streams.py", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="10,000 jobs and 20 x 200 instead of 100,000 and 100 x 1,000")
    parser.add_argument("--stores", default=",".join(SQL_STORES))
    args = parser.parse_args()
    with Stores([k.strip() for k in args.stores.split(",") if k.strip()]) as stores:
        run(stores, args.quick)


if __name__ == "__main__":
    main()
