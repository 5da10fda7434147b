"""The lanes of one stream run: the workers that run its started jobs, one job at a time each.

A job used to be one pool call (a plain ``work``) or one asyncio task (an ``async def``), with
a future and a wake-up of the stream's coroutine per job: with short jobs that bookkeeping,
not the work, bounded a stream (a few thousand jobs a second). Here the run hands its started
jobs, in index order, to a queue; at most ``limit`` lanes (``max_processing`` less the jobs an
earlier run left running) take them one at a time and run them, and hand back the results in
a list that the run collects in one go, woken once per batch, not once per job. So:

- **max_processing holds**: a lane runs one job at a time, and no more than ``limit`` lanes
  live. A queued job has not started: the run's window counts it, ``work`` has not seen it.
- **plain work** runs on lanes of the handler's shared pool: one lane to begin with; each
  time the lanes have not once emptied the queue within :data:`SPAWN_AFTER` (their jobs wait
  or take long), as many lanes again start (up to the limit). So instant jobs do not wake a
  thread each, and slow ones soon run ``limit`` at once. A lane ends when the queue is
  empty (an idle stream holds no thread).
- **async work** runs on lane tasks on the loop: one lane to begin with; another starts only
  when a job really waits (its coroutine suspends) while jobs are queued, so jobs that finish
  without waiting cost no task each, and jobs that wait still run ``limit`` at once. A lane
  yields to the loop every :data:`YIELD_EVERY` jobs, so a run of instant jobs cannot hold it.
- **stopping** (:meth:`abandon`): queued jobs never start; an async lane is cancelled (its
  job with it); a thread lane ends after its job, its future handed to the caller to count.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import types
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future
from typing import Any, Final

from metafora.streams.jobs import Job
from metafora.streams.threads import ElasticPool
from metafora.streams.work import JobContext, Work, refuse_awaitable

__all__ = ["YIELD_EVERY", "Lanes"]

YIELD_EVERY: Final = 64
"""Jobs an async lane runs back to back before it lets the loop run others."""
SPAWN_AFTER: Final = 0.002
"""Seconds queued jobs wait behind busy thread lanes before more lanes start for them."""

_DONE: Final = object()  # an async job that finished in its first step
Failure = tuple[int, BaseException]


@types.coroutine
def _resume(coro: Any, yielded: Any) -> Generator[Any, Any, Any]:
    """Await the rest of ``coro``, which has run up to its first suspension (``yielded``):
    what ``await coro`` would have done from there (values and cancellations pass through)."""
    while True:
        try:
            sent = yield yielded
        except BaseException as exc:  # a cancellation (or a throw) goes to the job
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value


class Lanes:
    """The lanes of one run (see the module docstring). Its methods are called on the loop's
    thread, but for the lanes' own (:meth:`_next`), which is thread-safe."""

    def __init__(self, work: Work, is_async: bool, pool: ElasticPool,
                 loop: asyncio.AbstractEventLoop, wake: Callable[[], None],
                 first: JobContext) -> None:
        self._work = work
        self._async = is_async
        self._pool = pool
        self._loop = loop
        self._wake = wake  # the run's kick, on the loop's thread
        self._first = first  # the context of every job's first attempt (shared)
        self._lock = threading.Lock()
        self._queue: deque[Job] = deque()
        self._contexts: dict[int, JobContext] = {}  # queued retries' contexts (not first)
        # Results, taken by the run in one go: done indexes as plain ints (no tuple, nothing
        # for the garbage collector to track, per job), failures with their errors.
        self._done: list[int] = []
        self._failed: list[Failure] = []
        self._signalled = False  # a wake is on its way: lanes need not send another
        self._lanes = 0  # alive
        self._executing = 0
        self._waiting = 0  # async lanes whose job waits (suspended)
        self._stopped = False
        self._spawn_due = False
        self._emptied = False  # the queue was empty once since the watch began (thread lanes)
        self._threads: set[Future[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.limit = 1
        """The most lanes at once (the run sets it: max_processing less the left-running)."""

    @property
    def executing(self) -> int:
        """Jobs running now (``work`` called, not returned)."""
        return self._executing

    @property
    def idle(self) -> bool:
        """No lane is alive (nothing runs, nothing is queued)."""
        return self._lanes == 0 and not self._queue

    def push(self, jobs: Iterable[Job], *, first: bool = False,
             contexts: dict[int, JobContext] | None = None) -> None:
        """Queue started jobs (``first``: before those queued, as retries of lower indexes);
        ``contexts``: the context of those that are not at their first attempt, by index."""
        with self._lock:
            if contexts:
                self._contexts.update(contexts)
            if first:
                self._queue.extendleft(reversed(list(jobs)))
            else:
                self._queue.extend(jobs)
            # One lane to take them if none is free; more when the jobs wait (_spawn).
            busy = self._waiting if self._async else self._executing
            spawn = 1 if self._queue and self._lanes <= busy and self._lanes < self.limit else 0
            self._lanes += spawn
        for _ in range(spawn):
            self._start_lane()
        self._watch()

    def drop_queued(self) -> list[int]:
        """Take back the queued jobs (they never start); their indexes."""
        with self._lock:
            dropped, self._queue = [job.index for job in self._queue], deque()
            self._contexts.clear()
        return dropped

    def results(self) -> tuple[list[int], list[Failure]]:
        """The results handed back since the last call: the indexes done, and the failures
        ``(index, error)``."""
        with self._lock:
            self._signalled = False  # a result added after this wakes the run again
            done, self._done = self._done, []
            failed, self._failed = self._failed, []
        return done, failed

    def abandon(self) -> list[Future[None]]:
        """Stop: no queued job starts, async lanes are cancelled; the thread lanes still in a
        job (their futures: each ends after its job)."""
        self._stopped = True
        self.drop_queued()
        for task in list(self._tasks):
            task.cancel()
        threads = list(self._threads)
        for thread in threads:
            thread.cancel()  # a lane queued on the pool, not started: it never runs
        return [thread for thread in threads if not thread.done()]

    # -- the lanes ---------------------------------------------------------------------------

    def _start_lane(self) -> None:
        try:
            if self._async:
                task = self._loop.create_task(self._async_lane())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                thread = self._pool.submit(self._thread_lane)
                self._threads.add(thread)
                thread.add_done_callback(self._threads.discard)
        except BaseException:  # no thread (the process's limit): the lane never was
            with self._lock:
                self._lanes -= 1
            raise

    def _next(self, index: int, error: BaseException | None) -> Job | None:
        """A thread lane's: hand back the result of job ``index`` (-1: none, the lane begins)
        and take the next job, in one hold of the lock; None: the lane ends."""
        wake = False
        with self._lock:
            if index >= 0:
                self._executing -= 1
                if error is None:
                    self._done.append(index)
                else:
                    self._failed.append((index, error))
                wake, self._signalled = not self._signalled, True
            queue = self._queue
            if queue and not self._stopped:
                self._executing += 1
                job: Job | None = queue.popleft()
                if not queue:
                    self._emptied = True
            else:
                job = None
                self._emptied = True
                self._lanes -= 1
        if wake:  # one wake per batch of results (a second is harmless)
            self._wake_run()
        return job

    def _context(self, job: Job) -> JobContext:
        contexts = self._contexts  # (a retry's is put before the job is queued)
        return contexts.pop(job.index, self._first) if contexts else self._first

    def _wake_run(self) -> None:
        if self._async:
            self._wake()
        else:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
                self._loop.call_soon_threadsafe(self._wake)

    def _thread_lane(self) -> None:
        work, first = self._work, self._first
        job = self._next(-1, None)
        while job is not None:
            error: BaseException | None = None
            try:
                result = work(job, first if not self._contexts else self._context(job))
                if result is not None:
                    refuse_awaitable(work, result)
            except BaseException as exc:  # the job's failure, handed to the run
                error = exc
            job = self._next(job.index, error)
        self._wake_run()  # a stopping run waits for its lanes to end

    async def _async_lane(self) -> None:
        # Async lanes run on the loop's thread, as does everything else that touches the
        # lanes' state in async mode (push, results, drop_queued, abandon; no thread lane):
        # between two awaits nothing else runs, so a job that ends in its first step costs
        # no lock and no call of the lanes' own.
        work, first = self._work, self._first
        job: Job | None = None
        ran = 0
        try:
            while True:
                queue = self._queue  # (drop_queued replaces it: read after every await)
                if not queue or self._stopped:
                    break
                job = queue.popleft()
                self._executing += 1
                error: BaseException | None = None
                try:
                    result = work(job, first if not self._contexts else self._context(job))
                    rest: Any
                    if type(result) is types.CoroutineType:  # its first step, inline
                        try:
                            rest = _resume(result, result.send(None))
                        except StopIteration:
                            rest = _DONE
                    else:
                        rest = self._first_step(result)
                    if rest is not _DONE:  # the job waits: so may the lane, and others start
                        self._want_lane()
                        await self._wait_in(rest)
                except asyncio.CancelledError:
                    if self._stopped:
                        raise
                    # The job raised CancelledError itself: a failure like any other
                    # (dropping it would stall the watermark on it for good).
                    error = asyncio.CancelledError(f"job {job.index} was cancelled")
                except Exception as exc:
                    error = exc
                self._executing -= 1
                if error is None:
                    self._done.append(job.index)
                else:
                    self._failed.append((job.index, error))
                job = None
                if not self._signalled:  # one kick per batch of results
                    self._signalled = True
                    self._wake()
                ran += 1
                if ran % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        finally:
            if job is not None:  # cancelled (or a BaseException) mid-job: its lane ends
                self._executing -= 1
            self._lanes -= 1
            self._wake()

    @staticmethod
    def _first_step(result: Any) -> Any:
        """What ``work(job, ctx)`` returned (not a coroutine: those the lane steps itself)
        run up to its first wait: ``_DONE`` if it finished without one (no task, no await:
        most short jobs), else what to await for the rest of it."""
        if isinstance(result, asyncio.Future):
            return result
        if type(result) is not types.CoroutineType and not asyncio.iscoroutine(result):
            raise TypeError(f"async work returned {type(result).__name__}, not an awaitable")
        try:
            yielded = result.send(None)
        except StopIteration:
            return _DONE
        return _resume(result, yielded)

    async def _wait_in(self, awaitable: Any) -> None:
        self._waiting += 1
        try:
            await awaitable
        finally:
            self._waiting -= 1

    def _watch(self) -> None:
        """Thread lanes: a thread cannot tell a job that waits (I/O) from one that computes;
        if the lanes have not once emptied the queue within SPAWN_AFTER, they fall behind."""
        if (not self._async and not self._spawn_due and not self._stopped and self._queue
                and self._lanes < self.limit):
            self._spawn_due = True
            self._emptied = False
            self._loop.call_later(SPAWN_AFTER, self._spawn)

    def _want_lane(self) -> None:
        if not self._spawn_due and self._queue and self._lanes < self.limit:
            self._spawn_due = True
            self._loop.call_soon(self._spawn)

    def _spawn(self) -> None:
        """Start lanes for the queued jobs while the others wait in theirs: async, as many
        as jobs are queued; threads, as many again as there are (a loaded machine can look
        like waiting jobs), then watch again."""
        self._spawn_due = False
        if self._stopped:
            return
        if not self._async and self._emptied:
            # The lanes kept up this time; jobs queued since then get a watch of their own
            # (a push during the timer armed none: without this, a queue refilled within
            # the window would wait for the next push with most lanes never started).
            self._watch()
            return
        with self._lock:
            spawn = min(self.limit - self._lanes, len(self._queue))
            if not self._async:
                spawn = min(spawn, max(1, self._lanes))
            spawn = max(0, spawn)
            self._lanes += spawn
        for _ in range(spawn):
            self._start_lane()
        self._watch()
