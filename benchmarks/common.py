"""Shared benchmark plumbing: store provisioning, consumer processes, tables, JSON results."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# METAFORA_BENCH_RESULTS: elsewhere (an A/B run keeps the committed results as they are).
RESULTS = Path(os.environ.get("METAFORA_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
STORES = ("sqlite", "postgresql", "etcd")
ETCD_MEMBERS_ENV = "METAFORA_BENCH_ETCD_MEMBERS"
console = Console(width=140)


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1))))
    return ordered[rank]


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().split("\n", 1)[0]
        info["memory"] = mem.split(":", 1)[1].strip()
    return info


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a table of results."""
    out = Table(title=title)
    for col in columns:
        out.add_column(col, justify="left" if col == columns[0] else "right")
    for row in rows:
        out.add_row(*(_fmt(v) for v in row))
    console.print(out)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files other than
    the results files), or ``unknown``."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks/results"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


SETTING_PREFIXES = ("METAFORA_CLAIMS_", "METAFORA_PEERS_", "METAFORA_GATES_", "METAFORA_STORM_",
                    "METAFORA_IDLE_", "METAFORA_BENCH_ETCD_MEMBERS", "METAFORA_BENCH_PROBE",
                    "METAFORA_STREAMS_", "METAFORA_HERD_", "METAFORA_ROLLING_",
                    "METAFORA_BENCH_COUNT")


def settings() -> dict[str, str]:
    """The benchmarks' size and mode variables of this run (the command line does not show
    them; no URL, which could carry a password)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTING_PREFIXES)}


ALLOW_DIRTY = "METAFORA_BENCH_ALLOW_DIRTY"
"""Set to 1 to save figures measured on a checkout with uncommitted changes (see :func:`save`)."""


class DirtyCheckout(RuntimeError):
    """Figures measured on uncommitted code: no commit reproduces them."""


def save(name: str, data: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/NAME.json`` with the machine, the command and the commit (which
    ``python -m benchmarks.tables`` prints under each table made from the file).

    A checkout with uncommitted changes (``+dirty``) is refused with :class:`DirtyCheckout`
    (the figures are then in a temporary file it names), unless ``METAFORA_BENCH_ALLOW_DIRTY=1``:
    a file saved so says ``+dirty`` and its tables say it cannot be reproduced from a commit."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    script = os.path.relpath(sys.argv[0], Path(__file__).resolve().parent.parent)
    command = " ".join(["python -m benchmarks" if script == "benchmarks/__main__.py" else f"python {script}",
                        *sys.argv[1:]])
    payload = {"benchmark": name, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine(), "command": command, "environment": settings(),
               "commit": commit(), **data}
    text = json.dumps(payload, indent=2, default=str) + "\n"
    if payload["commit"].endswith("+dirty") and os.environ.get(ALLOW_DIRTY) != "1":
        kept = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".json")[1])
        kept.write_text(text)
        raise DirtyCheckout(f"not saving {path.name}: the checkout has uncommitted changes, so no "
                            f"commit reproduces these figures (kept in {kept}); commit first, or "
                            f"set {ALLOW_DIRTY}=1 to save them marked +dirty")
    path.write_text(text)
    return path


@dataclass
class Stores:
    """Provisions each store kind once per benchmark run; ``url(kind)`` is a fresh namespace."""

    kinds: Sequence[str]
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="metafora-bench-")))
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _bases: dict[str, str] = field(default_factory=dict)
    etcd_servers: list[Any] = field(default_factory=list)
    etcd_members: int = field(default_factory=lambda: int(os.environ.get(ETCD_MEMBERS_ENV, "1")))
    """etcd members on loopback (``--etcd-members`` or ``METAFORA_BENCH_ETCD_MEMBERS``; default 1)."""

    def __enter__(self) -> Stores:
        for kind in self.kinds:
            self._bases[kind] = self._provision(kind)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _provision(self, kind: str) -> str:
        if kind == "sqlite":
            return "sqlite"
        if kind == "postgresql":
            return self._postgres()
        if kind == "etcd":
            from tests.fixtures.etcd import find_etcd, start_server

            binary = find_etcd()
            if binary is None:
                raise SystemExit("no etcd binary: apt-get install etcd-server")
            if self.etcd_members > 1:
                from metafora.testing.servers import start_etcd_cluster

                cluster = start_etcd_cluster(binary, self.workdir / "etcd-cluster", self.etcd_members)
                self.etcd_servers.extend(cluster.members)
                self._stack.callback(cluster.stop_all)
                return f"etcd://{cluster.endpoints}"
            server = start_server(binary, self.workdir)
            self.etcd_servers.append(server)
            self._stack.callback(server.stop)
            return f"etcd://{server.endpoint}"
        raise SystemExit(f"unknown store {kind!r}; choose from {', '.join(STORES)}")

    def _postgres(self) -> str:
        import psycopg

        base = os.environ.get("METAFORA_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
        name = f"metafora_bench_{uuid.uuid4().hex[:8]}"
        libpq = base.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

        def drop() -> None:
            with psycopg.connect(libpq, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

        self._stack.callback(drop)
        return libpq.rsplit("/", 1)[0] + f"/{name}"

    def url(self, kind: str, **options: Any) -> str:
        """A fresh, empty store of ``kind`` (own namespace or own SQLite file)."""
        ns = "b" + uuid.uuid4().hex[:10]
        query = "&".join(f"{k}={v}" for k, v in options.items())
        base = self._bases[kind]
        if kind == "sqlite":
            return f"sqlite:///{self.workdir / ns}.db" + (f"?{query}" if query else "")
        if kind == "etcd":
            return f"{base}/{ns}" + (f"?{query}" if query else "")
        return f"{base}?namespace={ns}" + (f"&{query}" if query else "")


@dataclass
class WorkerSpec:
    """What a consumer process does (see :func:`benchmarks.worker.main`)."""

    url: str
    node: str
    mode: str = "instant"  # instant | hold
    balancer: str = "dumb"  # dumb | fair | default (the Consumer's own default)
    balance_every: float = 60.0
    max_tasks: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    count_sql: bool = False  # report ("sql", node, statements so far) every second (SQLite)
    sticky_for: float = 0.0  # Consumer(sticky_for=): 0, the default, releases at once on SIGTERM


class Fleet:
    """Consumer processes (spawned: gRPC and fork do not mix) reporting events on one queue."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.events: queue.Queue[Any] = queue.Queue()
        self.procs: dict[str, Any] = {}

    def spawn(self, spec: WorkerSpec) -> None:
        """Start one consumer process (without waiting for it).

        Each process gets its own multiprocessing queue, forwarded here by a thread: a process
        SIGKILLed while holding a shared queue's write lock would silence every other one.
        """
        from benchmarks.worker import main

        inbox = self.ctx.Queue()
        proc = self.ctx.Process(target=main, args=(spec, inbox), name=spec.node, daemon=True)
        proc.start()
        self.procs[spec.node] = proc

        def forward() -> None:
            while True:
                try:
                    self.events.put(inbox.get(timeout=1.0))
                except queue.Empty:
                    if not proc.is_alive():
                        return
                except (EOFError, OSError):
                    return

        threading.Thread(target=forward, name=f"fleet-{spec.node}", daemon=True).start()

    def start(self, spec: WorkerSpec) -> None:
        """Start one consumer process; returns once it has registered."""
        self.spawn(spec)
        self.expect("ready", node=spec.node, timeout=60)

    def expect(self, kind: str, node: str | None = None, timeout: float = 60) -> tuple[Any, ...]:
        """Wait for the next event of ``kind`` (from ``node``); other events are dropped."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind} event from {node or 'any node'} in {timeout}s")
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"no {kind} event from {node or 'any node'} in {timeout}s") from None
            if event[0] == kind and (node is None or event[1] == node):
                return tuple(event)

    def kill(self, node: str, sig: int = signal.SIGKILL) -> float:
        """Signal a consumer process; returns the time.time() it was sent."""
        proc = self.procs[node]
        sent = time.time()
        os.kill(proc.pid, sig)
        return sent

    def claims_and_races(self) -> tuple[int, int]:
        """Once stopped: claims won and races lost, summed over the processes' final stats."""
        claims = races = 0
        while True:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                return claims, races
            if event[0] == "stats":
                claims += event[2].get("claims", 0)
                races += event[2].get("races_lost", 0)

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL) by pid."""
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            proc.join(15)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        self.procs.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
