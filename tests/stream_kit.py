"""Helpers for the stream tests: a list source, and a recorder of every job's start and end.

``ListJobs`` is the simplest :class:`~metafora.streams.Jobs`: indexes are positions in a
Python list shared by the test; with ``pushes=True`` an ``append`` calls the stream's wake.
``Recorder`` checks the window bounds at every start, as the issue asks (recorded per start).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from metafora.streams import Job, JobContext, Jobs, StreamFailing, Wake


class ListJobs(Jobs):
    """Jobs ``0 .. len(items)-1`` of a shared list; pushes new items if ``pushes``."""

    def __init__(self, items: list[Any], *, pushes: bool = False,
                 heads: list[int] | None = None) -> None:
        self.items = items
        self.pushes = pushes
        self.heads = heads  # when given: what head() answers, one value per call (then the last)
        self.wakes: list[Wake] = []
        self.head_calls = 0
        self.closed = False
        self._lock = threading.Lock()

    def head(self) -> int:
        with self._lock:
            self.head_calls += 1
            if self.heads:
                return self.heads.pop(0) if len(self.heads) > 1 else self.heads[0]
            return len(self.items) - 1

    def at_index(self, index: int) -> Job | None:
        with self._lock:
            if index >= len(self.items):
                return None
            return Job(index, f"job-{index}", self.items[index])

    def listen(self, wake: Wake) -> bool:
        if self.pushes:
            self.wakes.append(wake)
        return self.pushes

    def append(self, *values: Any) -> None:
        """Add jobs; wake the listening streams (a push source)."""
        with self._lock:
            self.items.extend(values)
        for wake in list(self.wakes):
            wake()

    def close(self) -> None:
        self.closed = True


class Recorder:
    """Records each start (index, jobs running then, the lowest index not done then) and each
    end; checks the bounds at each start."""

    def __init__(self, max_processing: int, max_search_ahead: int, start: int = 0) -> None:
        self.max_processing = max_processing
        self.max_search_ahead = max_search_ahead
        self.lock = threading.Lock()
        self.running: set[int] = set()
        self.done: set[int] = set()
        self.starts: list[tuple[int, int, int]] = []  # (index, in flight, processed)
        self.ends: list[int] = []
        self.violations: list[str] = []
        self._processed = start - 1

    def begin(self, index: int) -> None:
        with self.lock:
            self.running.add(index)
            while self._processed + 1 in self.done:
                self._processed += 1
            self.starts.append((index, len(self.running), self._processed))
            if len(self.running) > self.max_processing:
                self.violations.append(f"{len(self.running)} running at the start of {index}")
            # The recorder's processed index is at least the handler's (it sees each end
            # first), so an index beyond its window is beyond the handler's too.
            if index > self._processed + self.max_search_ahead:
                self.violations.append(f"{index} started with processed {self._processed}")

    def end(self, index: int, ok: bool = True) -> None:
        with self.lock:
            self.running.discard(index)
            if ok:
                self.done.add(index)
                self.ends.append(index)

    def started(self) -> list[int]:
        with self.lock:
            return [i for i, _, _ in self.starts]

    def sync_work(self, fail: Callable[[Job, JobContext], bool] | None = None,
                  pause: threading.Event | None = None) -> Callable[[Job, JobContext], None]:
        """A plain ``work`` recording starts and ends; raises while ``fail(job, ctx)``;
        waits on ``pause`` (if given) before finishing."""

        def work(job: Job, ctx: JobContext) -> None:
            self.begin(job.index)
            ok = False
            try:
                if pause is not None:
                    pause.wait(30)
                if fail is not None and fail(job, ctx):
                    raise RuntimeError(f"job {job.index} fails (attempt {ctx.attempt})")
                ok = True
            finally:
                self.end(job.index, ok)

        return work


def wait_failing(client: Any, task_id: str, timeout: float = 30.0) -> StreamFailing:
    """Wait until the stream is paused on a failing job (the failing progress is written
    just before the pause); its failing job."""
    from metafora.statemachine import StateCode, get_state
    from metafora.testing import wait_for

    def paused() -> StreamFailing | None:
        state = get_state(client, task_id)
        if state is None or state.code is not StateCode.PAUSED:
            return None
        failing: StreamFailing | None = client.stream(task_id).failing
        return failing

    return wait_for(paused, timeout, f"stream {task_id} paused on a failing job")
