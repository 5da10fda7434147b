"""Helpers for users' own tests: a fake clock and an in-memory cluster.

>>> clock = FakeClock()
>>> coord = open_coordinator("memory://t1", node_id="a")   # in-process store
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Self, TypeVar

from metafora.balancer import Balancer
from metafora.clock import Clock
from metafora.connect import open_client, open_coordinator
from metafora.consumer import Consumer
from metafora.coordinator import DEFAULT_MAX_CRASHES, Client, CoordinatorContext
from metafora.errors import CoordinatorUnavailable
from metafora.handler import HandlerFunc
from metafora.task import Task, TaskState, validate_labels

__all__ = ["FakeClock", "FileLedger", "LedgerRun", "LocalCluster", "RecordingContext", "wait_for"]

T = TypeVar("T")

_REAL_SLICE = 0.005  # real seconds a fake wait blocks before re-checking fake time


class FakeClock(Clock):
    """A clock that only moves when told to (:meth:`advance`).

    ``wait`` returns as soon as the event is set or fake time reaches the deadline, so
    code under test that waits on this clock runs as fast as the test advances it.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2030, 1, 1, tzinfo=UTC)
        self._mono = 1000.0
        self._cond = threading.Condition()
        self._waiters: list[tuple[float, threading.Event]] = []

    def now(self) -> datetime:
        with self._cond:
            return self._now

    def monotonic(self) -> float:
        with self._cond:
            return self._mono

    def advance(self, seconds: float | timedelta) -> None:
        """Move time forward and wake every waiter whose deadline has come."""
        delta = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
        if delta < 0:
            raise ValueError("a clock does not go back")
        with self._cond:
            self._now += timedelta(seconds=delta)
            self._mono += delta
            self._cond.notify_all()

    def waiters(self) -> int:
        """How many threads wait on this clock now (lets a test know a loop is idle)."""
        with self._cond:
            return len(self._waiters)

    def wait_for_waiters(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block (in real time, up to ``timeout``) until ``count`` threads wait on the clock."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._waiters) >= count, timeout)

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        with self._cond:
            deadline = float("inf") if timeout is None else self._mono + max(0.0, timeout)
            if deadline <= self._mono:
                return event.is_set()
            entry = (deadline, event)
            self._waiters.append(entry)
            self._cond.notify_all()
        try:
            # The caller's event is never set by the clock: it may mean "stop" to the caller.
            while not event.is_set():
                with self._cond:
                    if self._mono >= deadline:
                        return False
                event.wait(_REAL_SLICE)
            return True
        finally:
            with self._cond:
                self._waiters.remove(entry)
                self._cond.notify_all()


class RecordingContext(CoordinatorContext):
    """A CoordinatorContext that records lost tasks (for driving a coordinator by hand)."""

    def __init__(self, *, max_crashes: int | None = DEFAULT_MAX_CRASHES,
                 labels: Mapping[str, str] | None = None) -> None:
        self.lost_tasks: list[Task] = []
        self.lost_event = threading.Event()
        self._lock = threading.Lock()
        self._max_crashes = max_crashes
        self._labels = validate_labels(labels or {}, "labels")

    @property
    def max_crashes(self) -> int | None:
        return self._max_crashes

    @property
    def labels(self) -> Mapping[str, str]:
        return self._labels

    def lost(self, task: Task) -> None:
        with self._lock:
            self.lost_tasks.append(task)
        self.lost_event.set()


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll ``predicate`` (every 10 ms of real time) until truthy; AssertionError after ``timeout``.

    A predicate that raises :class:`~metafora.errors.CoordinatorUnavailable` (a store briefly
    out of reach, as on a loaded CI machine) counts as not yet true; the timeout's message
    names the last such error.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    away: CoordinatorUnavailable | None = None
    while True:
        try:
            value = predicate()
        except CoordinatorUnavailable as exc:
            away = exc
        else:
            away = None
            if value:
                return value
        if time.monotonic() >= deadline:
            note = f" (the store was unreachable: {away})" if away is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{note}") from away
        pause.wait(0.01)


class LocalCluster:
    """Consumers running in threads of this process on one store, for users' tests.

    >>> with LocalCluster() as cluster:                       # memory:// by default
    ...     cluster.add(simple_handler(work)); cluster.add(simple_handler(work))
    ...     cluster.client.submit_task(Task("t1"))
    ...     cluster.wait_for_state("t1", TaskState.DONE)

    ``close()`` (or leaving the ``with`` block) shuts every consumer down and joins it.
    """

    def __init__(self, url: str | None = None, *, shutdown_timeout: float = 5.0) -> None:
        self._memory_name = None if url else f"cluster-{uuid.uuid4().hex[:8]}"
        self.url = url or f"memory://{self._memory_name}"
        self.client: Client = open_client(self.url)
        self.errors: list[BaseException] = []
        self._shutdown_timeout = shutdown_timeout
        self._consumers: list[tuple[Consumer, threading.Thread]] = []

    def add(
        self,
        handler_func: HandlerFunc,
        node_id: str | None = None,
        balancer: Balancer | None = None,
        *,
        coordinator_options: dict[str, Any] | None = None,
        **consumer_options: Any,
    ) -> Consumer:
        """Start a consumer in a thread; returns once its node is registered."""
        coord = open_coordinator(self.url, node_id=node_id, **(coordinator_options or {}))
        consumer = Consumer(coord, handler_func, balancer, **consumer_options)
        return self.start(consumer)

    def start(self, consumer: Consumer) -> Consumer:
        """Run an already built consumer in a thread; returns once its node is registered."""

        def run() -> None:
            try:
                consumer.run()
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=f"cluster-{consumer.node_id}", daemon=True)
        thread.start()
        self._consumers.append((consumer, thread))
        wait_for(lambda: consumer.node_id in self.client.nodes() or not thread.is_alive(),
                 what=f"node {consumer.node_id} to register")
        if self.errors:
            raise self.errors[-1]
        return consumer

    @property
    def consumers(self) -> list[Consumer]:
        """The consumers started so far."""
        return [c for c, _ in self._consumers]

    def wait_for_state(self, task_id: str, state: TaskState | str, timeout: float = 10.0) -> None:
        """Wait until the task is in ``state`` (real time, bounded)."""
        wanted = TaskState(state)
        wait_for(lambda: self.client.get_task(task_id).state is wanted, timeout,
                 f"task {task_id} to be {wanted.value}")

    def stop(self, consumer: Consumer, timeout: float | None = None) -> None:
        """Shut one consumer down and join its thread."""
        for entry in list(self._consumers):
            if entry[0] is consumer:
                consumer.shutdown(timeout=self._shutdown_timeout if timeout is None else timeout)
                entry[1].join(self._shutdown_timeout + 10)
                self._consumers.remove(entry)

    def close(self) -> None:
        """Shut every consumer down, join them, close the client."""
        for consumer, _ in list(self._consumers):
            self.stop(consumer)
        self.client.close()
        if self._memory_name is not None:
            from metafora.coordinators.memory import drop_store

            drop_store(f"{self._memory_name}/metafora")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class LedgerRun:
    """One handler run recorded in a :class:`FileLedger` (``end`` None: never finished)."""

    task: str
    node: str
    token: int
    start: float
    end: float | None
    outcome: str | None


class FileLedger:
    """An append-only file, outside the store, where handlers record every start and end.

    Processes on one machine append JSON lines (``O_APPEND`` makes each small write atomic),
    so tests and benchmarks can prove exactly-once runs and no overlap, even across SIGKILL.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def _append(self, record: Mapping[str, object]) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def start(self, task: Task, node: str) -> None:
        """Record that ``node`` started ``task`` under ``task.token``."""
        self._append({"e": "start", "task": task.id, "node": node, "token": task.token,
                      "t": time.time()})

    def end(self, task: Task, node: str, outcome: str) -> None:
        """Record that the run ended (``done``, ``release``, ``fail``...)."""
        self._append({"e": "end", "task": task.id, "node": node, "token": task.token,
                      "t": time.time(), "outcome": outcome})

    def runs(self) -> list[LedgerRun]:
        """Every run, in start order."""
        if not os.path.exists(self.path):
            return []
        starts: dict[tuple[str, str, int], dict[str, object]] = {}
        ends: dict[tuple[str, str, int], dict[str, object]] = {}
        with open(self.path, encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    continue  # a write cut by SIGKILL
                rec = json.loads(line)
                key = (rec["task"], rec["node"], rec["token"])
                (starts if rec["e"] == "start" else ends)[key] = rec
        out = []
        for key, rec in starts.items():
            end = ends.get(key)
            out.append(LedgerRun(key[0], key[1], key[2], float(rec["t"]),  # type: ignore[arg-type]
                                 None if end is None else float(end["t"]),  # type: ignore[arg-type]
                                 None if end is None else str(end["outcome"])))
        return sorted(out, key=lambda r: r.start)

    def overlaps(self, died: Mapping[str, float] | None = None) -> list[tuple[LedgerRun, LedgerRun]]:
        """Pairs of runs of one task that overlapped in time.

        A run with no end counts as running until its node died (``died[node]``, a
        ``time.time()``) or forever.
        """
        died = died or {}
        by_task: dict[str, list[LedgerRun]] = {}
        for run in self.runs():
            by_task.setdefault(run.task, []).append(run)
        bad = []
        for runs in by_task.values():
            for i, a in enumerate(runs):
                a_end = a.end if a.end is not None else died.get(a.node, float("inf"))
                for b in runs[i + 1:]:
                    if b.start < a_end:
                        bad.append((a, b))
        return bad

    def completed(self, outcome: str = "done") -> dict[str, int]:
        """Task id -> how many runs ended with ``outcome``."""
        counts: dict[str, int] = {}
        for run in self.runs():
            if run.outcome == outcome:
                counts[run.task] = counts.get(run.task, 0) + 1
        return counts
