"""Claim-at-risk scenarios on real stores, shared by the tests and ``benchmarks/at_risk.py``.

A consumer runs one task whose handler records, on the monotonic clock, when it was warned
(``at_risk``), told ``recovered`` and stopped. A *fault* (a context manager) then takes the
store away from the node, and the scenario waits for the handler's stop:

- frozen: the store stops answering (SIGSTOP of the etcd or PostgreSQL processes; SQLite:
  another connection holds the write lock while the store's busy timeout is long), so a
  renewal hangs and nothing is reported failed;
- cut off: the store refuses at once (etcd / PostgreSQL killed: connections refused;
  SQLite: the write lock held with a short busy timeout, every renewal refused as busy).

The store is given back when the fault's block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psutil

from metafora import Consumer, Task, open_client, open_coordinator
from metafora.contracts.handler import AsyncHandler, Handler
from tests.helpers import sigstop, wait_until

Fault = Callable[[], AbstractContextManager[None]]

__all__ = ["Fault", "Outcome", "Recorder", "etcd_faults", "postgres_faults", "run_scenario",
           "sqlite_faults"]


@dataclass
class Recorder:
    """What one handler saw, on the monotonic clock."""

    task: Task | None = None
    started: threading.Event = field(default_factory=threading.Event)
    warned_at: float | None = None
    warned_until: datetime | None = None
    warned_wall: datetime | None = None
    at_risk_flag: bool | None = None  # task.at_risk() inside the hook
    recovered_at: float | None = None
    stopped_at: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def on_risk(self, until: datetime) -> None:
        if self.warned_at is None:
            self.warned_at = time.monotonic()
            self.warned_wall = datetime.now(UTC)
            self.warned_until = until
            self.at_risk_flag = self.task.at_risk() if self.task is not None else None

    def on_recovered(self, until: datetime) -> None:
        if self.recovered_at is None:
            self.recovered_at = time.monotonic()

    def on_stop(self) -> None:
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        self.stop.set()


class RecordingHandler(Handler):
    """Holds its task until stopped; records the notices."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def run(self) -> bool:
        self.rec.started.set()
        self.rec.stop.wait(300)
        return False

    def stop(self) -> None:
        self.rec.on_stop()

    def at_risk(self, until: datetime) -> None:
        self.rec.on_risk(until)

    def recovered(self, until: datetime) -> None:
        self.rec.on_recovered(until)


class AsyncRecordingHandler(AsyncHandler):
    """The same on the consumer's event loop (the notices come on the loop's thread)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._stopped: asyncio.Event | None = None

    async def run(self) -> bool:
        self._stopped = asyncio.Event()
        if self.rec.stop.is_set():
            return False
        self.rec.started.set()
        await self._stopped.wait()
        return False

    def stop(self) -> None:
        self.rec.on_stop()
        if self._stopped is not None:
            self._stopped.set()

    def at_risk(self, until: datetime) -> None:
        asyncio.get_running_loop()  # raises unless called on the loop's thread
        self.rec.on_risk(until)

    def recovered(self, until: datetime) -> None:
        self.rec.on_recovered(until)


@dataclass
class Outcome:
    """One scenario's figures (monotonic seconds)."""

    rec: Recorder
    fault_at: float
    valid_until: tuple[datetime, datetime]  # at start, and after a renewal moved it on
    at_start: datetime  # wall clock when valid_until was first read

    @property
    def lead_s(self) -> float:
        """Seconds from the warning to the handler's stop (the node's fence)."""
        assert self.rec.warned_at is not None and self.rec.stopped_at is not None
        return self.rec.stopped_at - self.rec.warned_at

    @property
    def warned_after_s(self) -> float:
        """Seconds from the fault to the warning."""
        assert self.rec.warned_at is not None
        return self.rec.warned_at - self.fault_at


def run_scenario(url: str, fault: Fault, *, renew_every: float, asynchronous: bool = False,
                 timeout: float = 60.0) -> Outcome:
    """Run one task on ``url``, inject ``fault`` once its claim was renewed, and return what
    the handler saw by the time it was stopped."""
    rec = Recorder()

    def make(task: Task) -> Handler | AsyncHandler:
        rec.task = task
        return AsyncRecordingHandler(rec) if asynchronous else RecordingHandler(rec)

    with open_client(url) as client:
        client.submit_task(Task("risky"))
    consumer = Consumer(open_coordinator(url, node_id="risky-node"), make, shutdown_timeout=5)
    thread = threading.Thread(target=consumer.run, name="risk-consumer", daemon=True)
    thread.start()
    try:
        assert rec.started.wait(timeout), "the handler did not start"
        task = rec.task
        assert task is not None
        first = task.valid_until()
        at_start = datetime.now(UTC)
        assert first is not None
        moved = wait_until(lambda: _moved_on(task, first, renew_every / 2), timeout,
                           "valid_until moved on by a renewal")
        with fault():
            fault_at = time.monotonic()
            wait_until(lambda: rec.stopped_at is not None, timeout, "the handler's stop")
        return Outcome(rec, fault_at, (first, moved), at_start)
    finally:
        rec.stop.set()
        consumer.shutdown(timeout=5)
        thread.join(60)


def _moved_on(task: Task, first: datetime, by: float) -> datetime | None:
    now = task.valid_until()
    return now if now is not None and now >= first + timedelta(seconds=by) else None


# -- faults ----------------------------------------------------------------------------------


def sqlite_faults(path: str) -> dict[str, Fault]:
    """SQLite: another connection holds the write lock (frozen and cut off differ by the
    store's busy timeout, set in the URL by the caller)."""

    @contextlib.contextmanager
    def locked() -> Iterator[None]:
        holder = sqlite3.connect(path, isolation_level=None, timeout=30)
        try:
            holder.execute("BEGIN EXCLUSIVE")
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()

    return {"frozen": locked, "cut": locked}


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def postgres_faults(cluster: Any) -> dict[str, Fault]:
    """A private PostgreSQL (TempPostgres): every process of it SIGSTOPped, or killed."""

    @contextlib.contextmanager
    def frozen() -> Iterator[None]:
        procs = _tree(cluster.pid)
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(signal.SIGCONT)

    @contextlib.contextmanager
    def cut() -> Iterator[None]:
        cluster.kill()
        try:
            yield
        finally:
            cluster.start()

    return {"frozen": frozen, "cut": cut}


def etcd_faults(server: Any) -> dict[str, Fault]:
    """A private etcd member: SIGSTOPped, or killed (SIGKILL) and started again."""

    @contextlib.contextmanager
    def frozen() -> Iterator[None]:
        pid = server.pid
        sigstop(pid)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    @contextlib.contextmanager
    def cut() -> Iterator[None]:
        server.kill()
        try:
            yield
        finally:
            server.start()

    return {"frozen": frozen, "cut": cut}
