"""metafora beside the Python PostgreSQL queues users compare it with (issue 17).

``python -m benchmarks peers [--quick] [--rounds 3] [--systems metafora-postgresql,pgqueuer,...]``
(the peers come with the ``bench`` extra: ``pip install -e '.[dev,bench]'``).

Systems: metafora on PostgreSQL and on SQLite at the Consumer's defaults (no max_tasks: an async
handler is not capped; a labelled extra row caps it at 10),
pgqueuer at the defaults of its worker command and at its recommended settings (issue 51: the
peer at its best; the published ratio is the lowest against any pgqueuer row), procrastinate
(concurrency 10), each in 2 worker processes; every row is labelled with its settings (SETTINGS,
QUALIFIERS; extra rows by name: pgqueuer capped at 10, DumbBalancer). They run in
interleaved rounds of one run (round 1: A B C D, round 2: B C D A, ...: the order rotates so no
system always follows the same neighbour), each run on a fresh database (a throw-away
PostgreSQL database, or a fresh SQLite file). Workloads:

- throughput: N no-op tasks submitted in bulk first, then the 2 worker processes start (together,
  once both have imported their system); tasks/s from the first handler start (reported by
  the workers, ``time.time()``) to the moment the store says nothing is left unfinished (the
  parent counts unfinished rows every 10 ms: the store's word, not the workers'), and the first
  second: spawn to the first handler start and imports done (``go``) to it.
  ``METAFORA_PEERS_TRACE=DIR`` writes every start's time per worker there (the ramp);
- idle submit-to-start latency: with both workers idle, one task at a time is submitted and
  the next only after its handler started; latency = the handler's ``time.time()`` at start
  minus the parent's ``time.time()`` just before the submit call (same machine, same clock).
  The first 10 submits warm connections and caches up and are not counted;
- crash recovery: one task, its handler holds it; the worker running it is SIGKILLed; seconds
  from the kill until the other worker's handler starts it. Each system with a 3 s failure
  detection (CRASH_SETTINGS): the defaults (30 s for all three) would measure only the default.

The pure parts (rotation, statistics, the table and ratios) need neither peer installed and
are unit-tested in tests/unit/test_bench_peers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import json
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import sqlite3
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

SYSTEMS = ("metafora-postgresql", "metafora-sqlite", "pgqueuer-default", "pgqueuer-recommended",
           "procrastinate", "pgqueuer", "metafora-postgresql-dumb", "metafora-sqlite-dumb",
           "metafora-postgresql-100", "metafora-postgresql-10")
# metafora as a user starts it (the Consumer's default balancer); the -dumb rows are an extra,
# labelled: DumbBalancer, which claims everything and never releases (issue 33's yardstick).
BASE_SYSTEMS = ("metafora-postgresql", "metafora-sqlite")
# pgqueuer's worker capped at metafora's max_tasks (the row published until issue 51): an extra,
# labelled, since the cap costs pgqueuer throughput (see SETTINGS).
EXTRA_SYSTEMS = ("pgqueuer", "metafora-postgresql-dumb", "metafora-sqlite-dumb", "metafora-postgresql-100",
                 "metafora-postgresql-10")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in EXTRA_SYSTEMS)
PROCESSES = 2
CONCURRENCY = 10
#: metafora rows not at the default max_tasks (None: an async handler is not capped), each an
#: extra, labelled: 100 (as many in flight per worker as pgqueuer's recommended batch picks at
#: once) and 10 (the cap the defaults rows passed until issue 51, matched to pgqueuer's old cap).
MAX_TASKS = {"metafora-postgresql-100": 100, "metafora-postgresql-10": CONCURRENCY}
PGQ_BATCH = 5
PGQ_BEST_BATCH = 100
#: QueueManager.run()'s arguments per pgqueuer row (the crash workload adds its timeouts).
PGQ_RUN: dict[str, dict[str, Any]] = {
    "pgqueuer": {"batch_size": PGQ_BATCH, "max_concurrent_tasks": CONCURRENCY},
    "pgqueuer-default": {},
    "pgqueuer-recommended": {"batch_size": PGQ_BEST_BATCH},
}
#: The pgqueuer rows whose worker loop runs as ``pgq run`` (and pgqueuer's own benchmark) runs
#: it: on uvloop, a dependency of pgqueuer; the capped row keeps asyncio.run, as it always had.
PGQ_CLI_LOOP = ("pgqueuer-default", "pgqueuer-recommended")
WARMUP = 10
POLL = 0.01

#: What each system runs with (printed under the table and saved with the results).
SETTINGS = {
    "metafora-postgresql": "Consumer at its defaults, async no-op handler (max_tasks None: not capped;"
                           " FairBalancer, lease_ttl 30 s, poll_interval 15 s, pool_size 10); psycopg 3",
    "metafora-sqlite": "Consumer at its defaults, async no-op handler (max_tasks None: not capped;"
                       " FairBalancer, lease_ttl 30 s, poll_interval 0.25 s)",
    "metafora-postgresql-dumb": "extra row: as metafora-postgresql with balancer=DumbBalancer()",
    "metafora-sqlite-dumb": "extra row: as metafora-sqlite with balancer=DumbBalancer()",
    "metafora-postgresql-100": "extra row: as metafora-postgresql with max_tasks 100 (as many in flight"
                               " per worker as pgqueuer's recommended batch_size picks at once)",
    "metafora-postgresql-10": f"extra row: as metafora-postgresql with max_tasks {CONCURRENCY} (the cap the"
                              " defaults rows passed until issue 51, matched to pgqueuer's old cap)",
    "pgqueuer-default": "as `pgq run` starts a worker: QueueManager.run() at its defaults (batch_size 10,"
                        " no max_concurrent_tasks, dequeue_timeout 30 s) on pgqueuer's own runner (uvloop,"
                        " a dependency of pgqueuer), async no-op entrypoint, LISTEN/NOTIFY, asyncpg driver",
    "pgqueuer-recommended": f"as pgqueuer's own benchmark (tools/benchmark.py) runs it: uvloop, asyncpg,"
                            f" no concurrency cap, with batch_size {PGQ_BEST_BATCH} (the best of 10, 20,"
                            " 50, 100 and 200 measured here) and the autovacuum settings"
                            " pgqueuer recommends (`pgq autovac`: Queries.optimize_autovacuum())",
    "pgqueuer": f"extra row, the one published before issue 51: QueueManager.run(batch_size={PGQ_BATCH},"
                f" max_concurrent_tasks={CONCURRENCY}) on asyncio.run, the cap matched to metafora's"
                " max_tasks. The cap costs pgqueuer: a finished job stays in its queue table, counted"
                " against the cap, until its status buffer flushes (every batch_size jobs or 0.1 s), so"
                " a capped worker waits for its own flushes",
    "procrastinate": f"run_worker_async(concurrency={CONCURRENCY}), async no-op task, LISTEN/NOTIFY,"
                     " PsycopgConnector, defaults otherwise (jobs kept, not deleted)",
}
#: The row labels' qualifiers: every row says which settings it ran with.
QUALIFIERS = {
    "metafora-postgresql": "defaults", "metafora-sqlite": "defaults",
    "metafora-postgresql-dumb": "DumbBalancer, extra", "metafora-sqlite-dumb": "DumbBalancer, extra",
    "metafora-postgresql-100": "max_tasks 100, extra",
    "metafora-postgresql-10": f"max_tasks {CONCURRENCY}, extra",
    "pgqueuer-default": "defaults (pgq run)", "pgqueuer-recommended": "recommended",
    "pgqueuer": f"capped at {CONCURRENCY}, extra", "procrastinate": "defaults",
}
#: How each system detects a dead worker in the crash workload.
CRASH_TTL = 3
CRASH_SETTINGS = {
    "metafora-postgresql": f"lease_ttl {CRASH_TTL} s",
    "metafora-sqlite": f"lease_ttl {CRASH_TTL} s",
    "metafora-postgresql-dumb": f"lease_ttl {CRASH_TTL} s",
    "metafora-sqlite-dumb": f"lease_ttl {CRASH_TTL} s",
    "metafora-postgresql-100": f"lease_ttl {CRASH_TTL} s",
    "metafora-postgresql-10": f"lease_ttl {CRASH_TTL} s",
    "pgqueuer": f"heartbeat_timeout {CRASH_TTL} s, dequeue_timeout 1 s (an idle worker re-polls then;"
                " the default 30 s made recovery take 30 s)",
    "pgqueuer-default": f"heartbeat_timeout {CRASH_TTL} s, dequeue_timeout 1 s (as pgqueuer)",
    "pgqueuer-recommended": f"heartbeat_timeout {CRASH_TTL} s, dequeue_timeout 1 s (as pgqueuer)",
    "procrastinate": f"update_heartbeat_interval 1 s, stalled_worker_timeout {CRASH_TTL} s,"
                     " fetch_job_polling_interval 1 s (a retried job is found by polling), and a loop in"
                     " each worker that retries get_stalled_jobs(seconds_since_heartbeat="
                     f"{CRASH_TTL}) every 0.5 s (procrastinate does not retry stalled jobs by itself)",
}
_DIST = {**{s: "pgqueuer" for s in SYSTEMS if s.startswith("pgqueuer")}, "procrastinate": "procrastinate"}
SPAWN = multiprocessing.get_context("spawn")


# --------------------------------------------------------------------------- pure parts


def rounds_order(systems: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, system)`` in run order: every round runs every system once, and the order
    rotates by one each round (A B C D, then B C D A, ...) so position effects even out."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    order: list[tuple[int, str]] = []
    for r in range(rounds):
        shift = r % len(systems) if systems else 0
        order += [(r + 1, s) for s in (*systems[shift:], *systems[:shift])]
    return order


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over the rounds."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values`` (NaN values, failed runs, are left out; all NaN for none)."""
        good = [v for v in values if v == v]
        if not good:
            nan = float("nan")
            return cls(nan, nan, nan)
        return cls(statistics.median(good), min(good), max(good))


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1))))
    return ordered[rank]


FIGURES = ("tasks_per_s", "p50_ms", "p99_ms", "recovery_s", "spawn_to_first_s", "go_to_first_s",
           "cpu_ms_per_task")


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Spread]]:
    """Per system: spreads of ``tasks_per_s``, ``p50_ms``, ``p99_ms``, ``recovery_s`` over its runs
    (each run is a dict with ``system`` and whichever of those figures it measured)."""
    by_system: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_system.setdefault(run["system"], []).append(run)
    return {
        system: {key: Spread.of([r[key] for r in rs if key in r]) for key in FIGURES}
        for system, rs in by_system.items()
    }


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``, NaN when either is missing or ``theirs`` is 0."""
    if ours != ours or theirs != theirs or theirs == 0:
        return float("nan")
    return ours / theirs


def _num(value: float, unit: str = "") -> str:
    if value != value:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}{unit}"
    return f"{value:.1f}{unit}" if abs(value) >= 10 else f"{value:.2f}{unit}"


def _spread(s: Spread) -> str:
    if s.median != s.median:
        return "-"
    return f"{_num(s.median)} ({_num(s.low)} - {_num(s.high)})"


def _times(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"


def _measured(summary: dict[str, dict[str, Spread]], key: str) -> bool:
    return any(f.get(key, Spread.of([])).median == f.get(key, Spread.of([])).median for f in summary.values())


def markdown(summary: dict[str, dict[str, Spread]], labels: dict[str, str], rounds: int,
             tasks: int, submits: int) -> str:
    """The docs table: one row per system, then metafora ÷ each peer, then the published ratio
    (the lowest against any pgqueuer row); the crash and first-start columns only when a run
    measured them."""
    extra = [(key, head) for key, head in (
        ("recovery_s", f" crash recovery s ({CRASH_TTL} s detection) |"),
        ("spawn_to_first_s", " spawn→first start s |"),
        ("go_to_first_s", " imports done→first start s |"),
        ("cpu_ms_per_task", " workers' CPU ms per task |")) if _measured(summary, key)]
    out = [
        f"| system | tasks/s, {tasks:,} tasks (median of {rounds}; range) |"
        f" submit→start p50 ms, idle ({submits} submits) | p99 ms |" + "".join(h for _, h in extra),
        "|---|---|---|---|" + "---|" * len(extra),
    ]
    for system, figures in summary.items():
        out.append(f"| {labels.get(system, system)} | {_spread(figures['tasks_per_s'])} |"
                   f" {_spread(figures['p50_ms'])} | {_spread(figures['p99_ms'])} |"
                   + "".join(f" {_spread(figures.get(k, Spread.of([])))} |" for k, _ in extra))
    rows = ratio_rows(summary)
    if rows:
        out += ["", "| ratio (medians) | tasks/s (> 1: metafora faster) | p50 (< 1: metafora sooner) |"
                " p99 |", "|---|---|---|---|"]
        out += [f"| {a} ÷ {b} | {_times(t)} | {_times(p50)} | {_times(p99)} |" for a, b, t, p50, p99 in rows]
    lowest = published(summary)
    if lowest:
        out += ["", "| published ratio: the lowest against any pgqueuer row | tasks/s | against |",
                "|---|---|---|"]
        out += [f"| {labels.get(a, a)} | {_times(t)} | {labels.get(b, b)} |" for a, b, t in lowest]
    return "\n".join(out)


def ratio_rows(summary: dict[str, dict[str, Spread]]) -> list[tuple[str, str, float, float, float]]:
    """``(metafora system, peer, throughput ratio, p50 ratio, p99 ratio)`` for every pair
    measured: each metafora system against its own DumbBalancer row and against every peer."""
    rows = []
    for ours in (s for s in summary if s in BASE_SYSTEMS or s in MAX_TASKS):
        for theirs in (s for s in summary
                       if s == f"{ours}-dumb" or not s.startswith("metafora-")):
            a, b = summary[ours], summary[theirs]
            rows.append((ours, theirs, ratio(a["tasks_per_s"].median, b["tasks_per_s"].median),
                         ratio(a["p50_ms"].median, b["p50_ms"].median),
                         ratio(a["p99_ms"].median, b["p99_ms"].median)))
    return rows


def labels_for(systems: Sequence[str], versions: dict[str, str]) -> dict[str, str]:
    """Row labels with the peers' versions and the settings each ran with
    (``pgqueuer 1.6.0, recommended``, ``metafora, PostgreSQL, defaults``)."""
    out = {}
    for system in systems:
        name = system.removesuffix("-dumb").replace("metafora-", "metafora, ")
        name = name.replace("postgresql", "PostgreSQL").replace("sqlite", "SQLite").split("-")[0]
        if system in versions:
            name = f"{name} {versions[system]}"
        qualifier = QUALIFIERS.get(system)
        out[system] = f"{name}, {qualifier}" if qualifier else name
    return out


def published(summary: dict[str, dict[str, Spread]]) -> list[tuple[str, str, float]]:
    """``(metafora system, pgqueuer row, ratio)``: for each metafora system the lowest of its
    throughput ratios against the pgqueuer rows measured, the one to publish (issue 51: the
    peer at its best, whichever of its settings that is); none without a row of pgqueuer at
    its defaults or its recommended settings."""
    out: list[tuple[str, str, float]] = []
    if not {"pgqueuer-default", "pgqueuer-recommended"} & set(summary):
        return out  # only the capped row (runs before issue 51): no ratio to publish
    peers = [s for s in summary if s.startswith("pgqueuer")]
    for ours in (s for s in summary if s in BASE_SYSTEMS):
        ratios = [(ratio(summary[ours]["tasks_per_s"].median, summary[p]["tasks_per_s"].median), p)
                  for p in peers]
        ratios = [r for r in ratios if r[0] == r[0]]
        if ratios:
            low, peer = min(ratios)
            out.append((ours, peer, low))
    return out


def parse_systems(text: str | None) -> list[str]:
    """The ``--systems`` list (comma-separated; all by default), validated."""
    if not text:
        return list(DEFAULT_SYSTEMS)
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown or not chosen:
        raise SystemExit(f"unknown system(s) {', '.join(unknown) or '(none)'};"
                         f" choose from {', '.join(SYSTEMS)}")
    return chosen


# --------------------------------------------------------------------------- databases


def _pg_base() -> str:
    base = os.environ.get("METAFORA_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    return base.replace("postgresql+psycopg://", "postgresql://")


@contextlib.contextmanager
def fresh_database(system: str, workdir: Path) -> Iterator[str]:
    """A throw-away PostgreSQL database (or, for metafora-sqlite, a fresh SQLite file): its URL."""
    if system.startswith("metafora-sqlite"):
        path = workdir / f"peers-{uuid.uuid4().hex[:8]}.db"
        try:
            yield f"sqlite:///{path}"
        finally:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    Path(f"{path}{suffix}").unlink()
        return
    import psycopg

    base = _pg_base()
    name = f"metafora_peers_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield base.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --------------------------------------------------------------------------- workers (child processes)


class _Reporter:
    """Tells the parent when a handler starts: every start (latency) or the first only (throughput:
    a queue message per task would cost more than the no-op task being measured)."""

    def __init__(self, node: str, events: Any, mode: str) -> None:
        self.node, self.events, self.mode, self.sent = node, events, mode, False
        self.every = mode != "throughput"
        self.hold = mode == "crash"
        # METAFORA_PEERS_TRACE=DIR: every start's time kept in memory, written at exit (the ramp)
        self.trace: list[float] | None = [] if os.environ.get("METAFORA_PEERS_TRACE") else None

    def dump(self) -> None:
        """Write the kept start times to ``$METAFORA_PEERS_TRACE/<node>-<pid>.json``."""
        if self.trace is not None:
            path = Path(os.environ["METAFORA_PEERS_TRACE"]) / f"{self.node}-{os.getpid()}.json"
            path.write_text(json.dumps(self.trace))

    def __call__(self, key: str) -> None:
        now = time.time()
        if self.trace is not None:
            self.trace.append(now)
        if self.every or not self.sent:
            self.sent = True
            self.events.put(("start", self.node, key, now))

    def ready(self) -> None:
        self.events.put(("ready", self.node, os.getpid()))


def worker_main(system: str, url: str, node: str, events: Any, mode: str, go: Any) -> None:
    """One worker process of ``system`` until SIGTERM (run in a spawned process); ``mode`` is
    the workload (``throughput``, ``latency``, ``crash``: handlers hold their task).

    The system's modules are imported first, then the process waits for ``go``: both workers
    of a throughput run start their worker loops together, not one an import later.
    """
    logging.basicConfig(level=os.environ.get("METAFORA_BENCH_LOG", "WARNING"),
                        format=f"%(asctime)s {system} {node} %(name)s %(levelname)s %(message)s")
    report = _Reporter(node, events, mode)
    if system.startswith("metafora"):
        import metafora  # noqa: F401
        from metafora.core.config import parse_store_url

        try:
            from metafora.contracts.backends import backend_of as load_store
        except ImportError:  # older revisions (ab.py runs this code on them)
            try:
                from metafora.contracts.backends import hooks_of as load_store  # type: ignore[attr-defined,no-redef]
            except ImportError:  # before the stores' hooks: they load when opened
                load_store = None  # type: ignore[assignment]
        if load_store is not None:
            # The store's modules and its driver too (open_coordinator imports them when
            # called), as the peers' workers import theirs: all the imports before go.
            parsed = parse_store_url(url)
            load_store(parsed)
            if parsed.scheme.startswith("postgres"):
                importlib.import_module("psycopg")
    elif system.startswith("pgqueuer"):
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    else:
        import procrastinate  # noqa: F401
    events.put(("loaded", node, os.getpid()))
    if not go.wait(120):
        raise SystemExit("no go from the benchmark in 120 s")
    if system.startswith("metafora"):
        trace = os.environ.get("METAFORA_BENCH_STATEMENTS")  # set by benchmarks/hotpath.py
        if trace:
            from benchmarks.statements import count_statements
            with count_statements(Path(trace) / f"{node}.json"):
                _metafora_worker(url, node, report, system.endswith("-dumb"), MAX_TASKS.get(system))
        else:
            _metafora_worker(url, node, report, system.endswith("-dumb"), MAX_TASKS.get(system))
    elif system.startswith("pgqueuer"):
        _pgqueuer_loop(system)(_pgqueuer_worker(url, report, system))
    elif system == "procrastinate":
        asyncio.run(_procrastinate_worker(url, node, report))
    else:
        raise SystemExit(f"unknown system {system!r}")
    report.dump()


def _metafora_worker(url: str, node: str, report: _Reporter, dumb: bool = False,
                     max_tasks: int | None = None) -> None:
    from metafora import Consumer, Task, open_coordinator, simple_handler
    from metafora.balancers import DumbBalancer

    async def noop(task: Task, stop: asyncio.Event) -> bool:
        report(task.id)
        if report.hold:
            await stop.wait()
            return False
        return True

    # The Consumer's default balancer, as a user gets it; DumbBalancer only for the -dumb rows.
    # max_tasks only for the rows that name one: the defaults rows run at the Consumer's default.
    chosen: dict[str, Any] = {"balancer": DumbBalancer()} if dumb else {}
    if max_tasks is not None:
        chosen["max_tasks"] = max_tasks
    consumer = Consumer(open_coordinator(url, node_id=node), simple_handler(noop), **chosen,
                        shutdown_timeout=5)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())

    def announce() -> None:
        deadline = time.monotonic() + 60
        while consumer.info()["started"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        report.ready()

    threading.Thread(target=announce, daemon=True).start()
    consumer.run()


def _pgqueuer_loop(system: str) -> Callable[[Any], Any]:
    """How the worker's loop is run: ``asyncio.run``, or as ``pgq run`` runs it (pgqueuer's own
    runner, which takes uvloop, a dependency of pgqueuer, when it is installed)."""
    if system not in PGQ_CLI_LOOP:
        return asyncio.run
    from pgqueuer.adapters.cli.cli import asyncio_run

    return asyncio_run


async def _pgqueuer_worker(url: str, report: _Reporter, system: str = "pgqueuer") -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.models import Job

    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("noop")
    async def noop(job: Job) -> None:
        report((job.payload or b"").decode())
        if report.hold:
            await asyncio.Event().wait()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    report.ready()
    settings: dict[str, Any] = dict(PGQ_RUN[system])
    if report.hold:
        settings |= {"heartbeat_timeout": timedelta(seconds=CRASH_TTL),
                     "dequeue_timeout": timedelta(seconds=1)}
    await qm.run(**settings)
    await conn.close()


def _procrastinate_app(url: str) -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))
    return app


async def _procrastinate_worker(url: str, node: str, report: _Reporter) -> None:
    app = _procrastinate_app(url)

    @app.task(name="noop")
    async def noop(key: str) -> None:
        report(key)
        if report.hold:
            await asyncio.Event().wait()

    async def retry_stalled() -> None:
        # the recipe of procrastinate's docs ("retry stalled jobs"), run often enough to compare
        while True:
            for job in await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=CRASH_TTL):
                await app.job_manager.retry_job(job)
            await asyncio.sleep(0.5)

    async with app.open_async():
        report.ready()
        if not report.hold:
            # its own SIGTERM handler stops the worker gracefully
            await app.run_worker_async(concurrency=CONCURRENCY, name=node)
            return
        retrier = asyncio.create_task(retry_stalled())
        await app.run_worker_async(concurrency=CONCURRENCY, name=node, update_heartbeat_interval=1.0,
                                   stalled_worker_timeout=float(CRASH_TTL), fetch_job_polling_interval=1.0)
        retrier.cancel()


# --------------------------------------------------------------------------- the parent's side of each system


class _System:
    """Set-up, submission and the store's unfinished count for one system (parent side)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def setup(self) -> None:
        """Create the schema."""

    def submit_many(self, keys: Sequence[str]) -> None:
        """Submit tasks in bulk (the system's own batch call)."""
        raise NotImplementedError

    def submit(self, key: str) -> None:
        """Submit one task."""
        raise NotImplementedError

    def unfinished(self) -> int:
        """Tasks not finished yet, counted in the store."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections."""


class _Metafora(_System):
    def setup(self) -> None:
        from metafora import open_client

        self.client = open_client(self.url)
        self.client.tasks()  # creates the schema
        plain = self.url.split("?", 1)[0]  # without metafora's options (lease_ttl=...)
        if plain.startswith("sqlite"):
            self.reader: Any = sqlite3.connect(plain.removeprefix("sqlite:///"), timeout=30)
        else:
            import psycopg

            self.reader = psycopg.connect(plain, autocommit=True)

    def submit_many(self, keys: Sequence[str]) -> None:
        from metafora import Task

        self.client.submit_tasks([Task(k) for k in keys])

    def submit(self, key: str) -> None:
        from metafora import Task

        self.client.submit_task(Task(key))

    def unfinished(self) -> int:
        row = self.reader.execute("SELECT count(*) FROM metafora_tasks WHERE state <> 'done'").fetchone()
        return int(row[0])

    def close(self) -> None:
        self.client.close()
        self.reader.close()


class _Async(_System):
    """A peer whose client is async: one event loop of the parent's, kept for the run."""

    def setup(self) -> None:
        import psycopg

        self.loop = asyncio.new_event_loop()
        self.reader = psycopg.connect(self.url, autocommit=True)
        self.loop.run_until_complete(self._setup())

    async def _setup(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.loop.run_until_complete(self._close())
        self.loop.close()
        self.reader.close()

    async def _close(self) -> None:
        raise NotImplementedError


class _Pgqueuer(_Async):
    async def _setup(self) -> None:
        import asyncpg
        from pgqueuer import AsyncpgDriver, Queries

        self.conn = await asyncpg.connect(self.url)
        self.queries = Queries(AsyncpgDriver(self.conn))
        await self.queries.install()

    def submit_many(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):
            chunk = keys[i:i + 1000]
            self.loop.run_until_complete(self.queries.enqueue(
                ["noop"] * len(chunk), [k.encode() for k in chunk], [0] * len(chunk)))

    def submit(self, key: str) -> None:
        self.loop.run_until_complete(self.queries.enqueue("noop", key.encode()))

    def unfinished(self) -> int:
        # a finished job leaves the queue table (its outcome goes to pgqueuer_log)
        return int(self.reader.execute("SELECT count(*) FROM pgqueuer").fetchone()[0])  # type: ignore[index]

    async def _close(self) -> None:
        await self.conn.close()


class _PgqueuerRecommended(_Pgqueuer):
    async def _setup(self) -> None:
        await super()._setup()
        await self.queries.optimize_autovacuum()  # pgqueuer's recommended autovacuum settings


class _Procrastinate(_Async):
    async def _setup(self) -> None:
        self.app = _procrastinate_app(self.url)

        @self.app.task(name="noop")
        async def noop(key: str) -> None:
            """Never run here: the parent only defers."""

        self.task = noop
        await self.app.open_async()
        await self.app.schema_manager.apply_schema_async()

    def submit_many(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):
            self.loop.run_until_complete(self.task.batch_defer_async(*({"key": k} for k in keys[i:i + 1000])))

    def submit(self, key: str) -> None:
        self.loop.run_until_complete(self.task.defer_async(key=key))

    def unfinished(self) -> int:
        row = self.reader.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')").fetchone()
        return int(row[0])  # type: ignore[index]

    async def _close(self) -> None:
        await self.app.close_async()


def _system(name: str, url: str) -> _System:
    if name.startswith("metafora"):
        return _Metafora(url)
    if name == "pgqueuer-recommended":
        return _PgqueuerRecommended(url)
    return {"procrastinate": _Procrastinate}.get(name, _Pgqueuer)(url)


class _Workers:
    """``PROCESSES`` spawned worker processes reporting on ``events``; stopped by pid.

    Each process writes to a queue of its own, forwarded here by a thread: a process SIGKILLed
    while holding a shared queue's write lock would silence the other one (the crash workload).
    """

    def __init__(self, system: str, url: str, mode: str) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.go = SPAWN.Event()
        self.inboxes = [SPAWN.Queue() for _ in range(PROCESSES)]
        self.procs = [SPAWN.Process(target=worker_main, args=(system, url, f"w{i}", inbox, mode, self.go),
                                    name=f"{system}-w{i}", daemon=True)
                      for i, inbox in enumerate(self.inboxes)]

    def __enter__(self) -> _Workers:
        for proc, inbox in zip(self.procs, self.inboxes, strict=True):
            proc.start()
            threading.Thread(target=self._forward, args=(proc, inbox), daemon=True).start()
        return self

    def _forward(self, proc: Any, inbox: Any) -> None:
        while True:
            try:
                self.events.put(inbox.get(timeout=0.5))
            except queue.Empty:
                if not proc.is_alive():
                    return
            except (EOFError, OSError, ValueError):
                return

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            proc.join(20)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)

    def kill(self, node: str) -> float:
        """SIGKILL the worker ``node`` (by pid); the ``time.time()`` just before."""
        proc = next(p for p in self.procs if p.name.endswith(f"-{node}"))
        sent = time.time()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        return sent

    def next(self, timeout: float) -> tuple[Any, ...]:
        """The next event (``queue.Empty`` after ``timeout`` s); a dead worker is an error."""
        try:
            return tuple(self.events.get(timeout=timeout))
        except queue.Empty:
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"worker(s) {', '.join(dead)} died") from None
            raise

    def wait_for(self, kind: str, timeout: float = 120) -> None:
        """Until every process sent an event of ``kind`` (``loaded``, ``ready``)."""
        deadline, seen = time.monotonic() + timeout, 0
        while seen < len(self.procs):
            if self.next(max(0.1, deadline - time.monotonic()))[0] == kind:
                seen += 1

    def start_together(self) -> None:
        """Once every process has imported its system, let them all go."""
        self.wait_for("loaded")
        self.go.set()

    def wait_ready(self, timeout: float = 120) -> None:
        """Let the processes go; return when every one said it is ready (idle, listening)."""
        self.start_together()
        self.wait_for("ready", timeout)


# --------------------------------------------------------------------------- workloads


def _cpu_s(pids: Sequence[int | None]) -> float:
    """The CPU time (user + system, s) the processes ``pids`` used so far (``/proc``; NaN
    where it cannot be read)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def throughput(system: str, url: str, tasks: int, deadline_s: float = 900) -> dict[str, Any]:
    """Submit ``tasks`` no-op tasks, start the workers; tasks/s from the first start to the
    moment the store has nothing unfinished; the workers' CPU per task from go to that
    moment (the imports left out: a figure the machine's load does not inflate as it does
    the wall-clock ones)."""
    side = _system(system, url)
    side.setup()
    try:
        side.submit_many([f"t{i:06d}" for i in range(tasks)])
        spawned = time.time()
        with _Workers(system, url, "throughput") as workers:
            workers.start_together()
            went = time.time()
            pids = [p.pid for p in workers.procs]
            cpu_went = _cpu_s(pids)
            cpu_done = float("nan")
            first: list[float] = []
            end = time.time() + deadline_s
            last = float("nan")
            while time.time() < end:
                polled = time.time()
                if side.unfinished() == 0:
                    last = polled
                    cpu_done = _cpu_s(pids)
                    break
                with contextlib.suppress(queue.Empty):
                    while True:  # drain the few first-start events without blocking
                        event = workers.events.get_nowait()
                        if event[0] == "start":
                            first.append(event[3])
                dead = [p.name for p in workers.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"worker(s) {', '.join(dead)} died")
                time.sleep(POLL)
            with contextlib.suppress(queue.Empty):
                while len(first) < PROCESSES:  # a worker that ran tasks has reported its first
                    event = workers.next(5)
                    if event[0] == "start":
                        first.append(event[3])
        if last != last or not first:
            return {"system": system, "tasks": tasks, "tasks_per_s": float("nan"),
                    "throughput_error": f"not finished in {deadline_s} s"}
        seconds = last - min(first)
        # the first second: spawn (imports included) and go (imports done) to the first start
        return {"system": system, "tasks": tasks, "seconds": seconds, "tasks_per_s": tasks / seconds,
                "spawn_to_first_s": min(first) - spawned, "go_to_first_s": min(first) - went,
                "cpu_ms_per_task": (cpu_done - cpu_went) * 1000 / tasks}
    finally:
        side.close()


def latency(system: str, url: str, submits: int) -> dict[str, Any]:
    """Submit one task at a time to 2 idle workers; submit→handler-start p50/p99 in ms."""
    side = _system(system, url)
    side.setup()
    try:
        with _Workers(system, url, "latency") as workers:
            workers.wait_ready()
            samples = []
            for i in range(submits + WARMUP):
                key = f"l{i:05d}"
                before = time.time()
                side.submit(key)
                while True:
                    event = workers.next(60)
                    if event[0] == "start" and event[2] == key:
                        break
                if i >= WARMUP:
                    samples.append((event[3] - before) * 1000)
        return {"system": system, "submits": submits, "p50_ms": percentile(samples, 50),
                "p99_ms": percentile(samples, 99), "max_ms": max(samples)}
    finally:
        side.close()


def crash(system: str, url: str, deadline_s: float = 120) -> dict[str, Any]:
    """One held task; SIGKILL its worker; seconds until the other worker's handler starts it."""
    if system.startswith("metafora"):
        url += ("&" if "?" in url else "?") + f"lease_ttl={CRASH_TTL}"
    side = _system(system, url)
    side.setup()
    try:
        with _Workers(system, url, "crash") as workers:
            workers.wait_ready()
            side.submit("c0")
            holder = _expect_start(workers, "c0", None, deadline_s)[1]
            killed = workers.kill(holder)
            again = _expect_start(workers, "c0", holder, deadline_s)
        return {"system": system, "recovery_s": again[3] - killed}
    finally:
        side.close()


def _expect_start(workers: _Workers, key: str, not_on: str | None, timeout: float) -> tuple[Any, ...]:
    """The next start of ``key`` on a node other than ``not_on``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            event = tuple(workers.events.get(timeout=1))
            if event[0] == "start" and event[2] == key and event[1] != not_on:
                return event
    raise TimeoutError(f"{key} did not start again within {timeout} s")


# --------------------------------------------------------------------------- the run


def versions(systems: Sequence[str]) -> dict[str, str]:
    """Installed versions of the peers (and of metafora), or a clear error when a peer is missing."""
    out = {}
    for system in systems:
        dist = _DIST.get(system)
        if dist is None:
            continue
        try:
            out[system] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{dist} is not installed: pip install -e '.[bench]'"
                             f" (or leave it out with --systems)") from None
    return out


def run_peers(quick: bool, rounds: int, systems: Sequence[str], with_crash: bool = True,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every round runs every system (throughput, latency, crash recovery); print and save."""
    from benchmarks.common import save

    found = versions(systems)
    tasks, submits = (1000, 50) if quick else (5000, 200)
    tasks = int(os.environ.get("METAFORA_PEERS_TASKS", tasks))  # issue 33 also runs 20,000
    workloads_wanted = os.environ.get("METAFORA_PEERS_WORKLOADS",
                                      "throughput,latency,crash").split(",")
    with_crash = with_crash and "crash" in workloads_wanted
    workdir = Path(tempfile.mkdtemp(prefix="metafora-peers-"))
    runs: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    try:
        for rnd, system in rounds_order(systems, rounds):
            result: dict[str, Any] = {"round": rnd, "system": system}
            workloads: list[tuple[str, Callable[[str], dict[str, Any]]]] = [
                ("throughput", lambda url, s=system: throughput(s, url, tasks)),
                ("latency", lambda url, s=system: latency(s, url, submits)),
            ]
            workloads = [w for w in workloads if w[0] in workloads_wanted]
            if with_crash:
                workloads.append(("crash", lambda url, s=system: crash(s, url)))
            for name, workload in workloads:
                try:
                    with fresh_database(system, workdir) as url:
                        result.update(workload(url))
                except Exception as exc:  # one failure must not lose the other figures
                    result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            say(f"round {rnd} {system}: " + ", ".join(
                f"{k} {_num(v) if isinstance(v, float) else v}" for k, v in result.items()
                if k not in ("round", "system")))
            runs.append(result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(runs)
    labels = labels_for(systems, found)
    text = markdown(summary, labels, rounds, tasks, submits)
    say(text)
    say("\nSettings: " + "; ".join(f"{labels[s]}: {SETTINGS[s]}" for s in systems))
    if with_crash:
        say("Crash workload: " + "; ".join(f"{labels[s]}: {CRASH_SETTINGS[s]}" for s in systems))
    save(os.environ.get("METAFORA_PEERS_NAME", "peers"), {
        "quick": quick, "rounds": rounds, "tasks": tasks, "submits": submits, "processes": PROCESSES,
        "concurrency": CONCURRENCY, "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0], "versions": found,
        "settings": {s: SETTINGS[s] for s in systems}, "labels": labels, "runs": runs,
        "crash_settings": {s: CRASH_SETTINGS[s] for s in systems} if with_crash else {},
        "summary": {s: {k: vars(v) for k, v in f.items()} for s, f in summary.items()},
    })
    return {"runs": runs, "summary": summary}


def readme_text(data: dict[str, Any]) -> str:
    """The docs table from a saved ``results/peers.json``."""
    summary = {s: {k: Spread(**v) for k, v in f.items()} for s, f in data["summary"].items()}
    settings = "\n".join(f"- {data['labels'][s]}: {text}" for s, text in data["settings"].items())
    if data.get("crash_settings"):
        settings += "\n\nCrash recovery (one held task, its worker SIGKILLed; seconds until the other" \
                    " worker starts it), failure detection per system:\n\n" + "\n".join(
                        f"- {data['labels'][s]}: {text}" for s, text in data["crash_settings"].items())
    return (
        f"Side by side with the Python PostgreSQL queues (`python -m benchmarks peers`; {data['rounds']}"
        f" interleaved rounds of one run, {data['processes']} worker processes per system, a fresh"
        " database per run, PostgreSQL on this machine; throughput = tasks submitted first, first"
        " handler start to the store's last finish):\n\n"
        + markdown(summary, data["labels"], data["rounds"], data["tasks"], data["submits"])
        + "\n\nSettings:\n\n" + settings + "\n"
    )
