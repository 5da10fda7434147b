"""One run of a stream: the coroutine the state machine calls while the stream is runnable.

It owns the stream's :class:`~metafora.streams.progress.Window` and loops on one wake-up
event, set by: a job that finished, the claim's command mailbox (a check, pause, kill, a
stop or an at-risk notice; pushed by the store), the source's own push (``Jobs.listen``), and
timers (a job's next attempt, the next write, the fallback poll of a source that cannot
push). Each turn it takes the finished jobs, reads a command if one may be there, re-reads
``head()`` if asked, starts what the window allows, and writes the progress if due.

Threads (:mod:`metafora.streams.threads`): the source (``jobs(task)``, ``head()``,
``at_index()``, ``close()``) is called through a strand of the handler's shared pool, one call
at a time, so a source need not be thread-safe. Started jobs go, in index order, to the run's
:class:`~metafora.streams.lanes.Lanes`: at most ``max_processing`` lanes run them one at a
time each (a plain ``work`` on that pool, an ``async def work`` on the loop) and hand the
results back in batches -- with short jobs, per-job futures and wake-ups were the bound. A
few jobs beyond ``max_processing`` may wait in the lanes' queue (started in the window, not
yet given to ``work``; a stop drops them). An idle stream holds no thread. The writes
of the progress are the machine's fenced checkpoints (on the machine's worker threads), at
most one in flight.

Stopping (release, shutdown, a lost claim): no job starts any more; running jobs get
``stop_grace`` seconds, then async ones are cancelled and threads abandoned -- their jobs are
above the processed index, so the next owner runs them again (at least once). Cancelled
outright (a lost claim), nothing more is written: the store would refuse it anyway.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from metafora.contracts.coordinator import error_text
from metafora.core.task import Task
from metafora.statemachine.aio import AsyncCommands
from metafora.statemachine.machine import Message, MessageKind
from metafora.streams.jobs import Job, Jobs, StreamFailing
from metafora.streams.lanes import Lanes
from metafora.streams.progress import Progress, Window
from metafora.streams.reads import ReadAhead, fetch, runs, split
from metafora.streams.threads import Strand
from metafora.streams.work import JobContext, Work

if TYPE_CHECKING:
    from metafora.streams.threads import ElasticPool

__all__ = ["StreamRun"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_ENDING = frozenset({MessageKind.RELEASE, MessageKind.PAUSE, MessageKind.KILL, MessageKind.SLEEP})
QUEUE_AHEAD = 256
"""Started jobs that may wait in the lanes' queue beyond ``max_processing`` (within the window):
a lane takes the next one at once, and the run refills the queue once per batch of results."""


class _Options(Protocol):
    """What a run reads of its handler's options
    (:class:`~metafora.streams.handler.StreamOptions`)."""

    @property
    def max_processing(self) -> int: ...
    @property
    def max_search_ahead(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def poll_every(self) -> float: ...
    @property
    def flush_every(self) -> float: ...
    @property
    def stop_grace(self) -> float: ...
    def backoff(self, failures: int) -> float: ...


class _Handler(Protocol):
    """What a run uses of its handler (:class:`~metafora.streams.handler.StreamHandlerFunc`,
    which builds the run): named here by its use, so this module imports no handler and the
    two form no import circle."""

    @property
    def options(self) -> _Options: ...
    @property
    def jobs(self) -> Callable[[Task], Jobs]: ...
    @property
    def work(self) -> Work: ...
    @property
    def is_async(self) -> bool: ...
    def pool(self) -> ElasticPool: ...
    def left_running(self, task_id: str) -> list[concurrent.futures.Future[Any]]: ...
    def leave_running(self, task_id: str, threads: list[concurrent.futures.Future[Any]]) -> None: ...
    def report_lag(self, task_id: str, lag: int | None) -> None: ...


class _SourceError(Exception):
    """The source broke its contract (a job of another index, a head that went back)."""


class StreamRun:
    """The state of one run of one stream (see the module docstring)."""

    def __init__(self, func: _Handler, task: Task, cmds: AsyncCommands) -> None:
        self._func = func
        self._opts = func.options
        self._task = task
        self._cmds = cmds
        self._extra = {"task": task.id, "token": task.token}
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._pool = func.pool()
        self._strand = Strand(self._pool)  # the source's calls, one at a time
        self._source: Jobs | None = None
        self._pushes = False  # the source calls wake itself (no fallback poll)
        self._stopping = threading.Event()  # JobContext.stopping
        self._first = JobContext(task, 1, self._stopping)  # every job's first attempt shares it
        self._lanes = Lanes(func.work, func.is_async, self._pool, self._loop, self._kick.set,
                            self._first)
        self._cap = self._opts.max_processing + QUEUE_AHEAD  # jobs started and not finished
        self._left = func.left_running(task.id)  # abandoned by an earlier run, still running
        self._results: list[tuple[int, BaseException]] = []  # failed in the fetch
        self._failures: dict[int, int] = {}  # failed attempts per index, this run
        self._due: dict[int, float] = {}  # loop time of a waiting job's next attempt
        self._head: int | None = None
        self._head_wanted = True
        self._head_failures = 0
        self._head_due = 0.0
        self._next_poll = 0.0
        self._failing: StreamFailing | None = None
        self._ending: Message | None = None
        self._grace_until = 0.0
        self._writer: asyncio.Task[None] | None = None
        self._written: Progress | None = None
        self._last_write = float("-inf")
        self._force_write = False
        self._base = Progress.fresh(self._opts.start)
        self._window = Window(self._base.processed)
        self._reader = self._read_ahead()

    # -- the run ---------------------------------------------------------------------------

    async def run(self) -> Message:
        """Run the stream until it stops, pauses (failing) or is killed; the machine's message."""
        stored = Progress.from_cursor(self._cmds.cursor, self._opts.start)
        if self._cmds.cursor is None:
            # A new stream says it is one at once, before its source is built: listings
            # (`metafora streams`) then show it even if its factory fails on every call.
            await self._cmds.checkpoint(stored.to_cursor())
        if stored.failing is not None:
            # The machine calls a stream back while failing only when it was resumed
            # (`metafora stream retry`): the job gets fresh attempts.
            log.info("stream %s: retrying job %d", self._task.id, stored.failing.index,
                     extra={**self._extra, "action": "retry"})
            self._written = stored
            stored = replace(stored, failing=None)
        else:
            self._written = stored
        self._base = stored
        self._window = Window(stored.processed)
        self._reader = self._read_ahead()
        undo = self._cmds.on_wake(self._wake_threadsafe)
        for thread in self._left:  # each frees a slot when it ends
            thread.add_done_callback(lambda _: self._wake_threadsafe())
        try:
            source = await self._build_source()
            if not isinstance(source, Jobs):
                raise TypeError(f"the jobs factory returned {type(source).__name__}, not a "
                                "metafora.streams.Jobs")
            self._source = source
            self._pushes = bool(await self._in_source(source.listen, self._wake_threadsafe_source))
            return await self._turns()
        finally:
            undo()
            self._cleanup()

    async def _turns(self) -> Message:
        while True:
            self._kick.clear()
            self._collect()
            if self._ending is None:
                message = await self._cmds.poll()
                if message is not None:
                    self._on_command(message)
            if self._open():
                await self._read_head()
            if self._open():
                await self._start_jobs()
            if self._over():
                return await self._finish()
            self._report_lag()
            self._maybe_write()
            await self._wait()

    def _over(self) -> bool:
        """Whether the run ends now: stopping or failing, and nothing runs (or the grace is over)."""
        if self._ending is None and self._failing is None:
            return False
        return self._lanes.idle or (self._ending is not None
                                    and self._loop.time() >= self._grace_until)

    def _open(self) -> bool:
        """Whether jobs may start (not stopping, not failing)."""
        return self._ending is None and self._failing is None

    # -- commands and wake-ups ---------------------------------------------------------------

    def _wake_threadsafe(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits any more
            self._loop.call_soon_threadsafe(self._kick.set)

    def _wake_threadsafe_source(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._source_woke)

    def _source_woke(self) -> None:
        self._head_wanted = True
        self._kick.set()

    def _on_command(self, message: Message) -> None:
        kind = message.kind
        if kind in (MessageKind.CHECK, MessageKind.RUN):  # Client.check_stream: new jobs may exist
            self._head_wanted = True
            self._head_due = 0.0
        elif kind is MessageKind.CHECKPOINT:  # the claim is at risk: save the position now
            self._force_write = True
        elif kind in _ENDING:
            self._ending = message
            self._grace_until = self._loop.time() + self._opts.stop_grace
            self._stopping.set()
            self._unqueue()
            log.info("stream %s: %s; %d jobs running", self._task.id, message,
                     self._lanes.executing, extra={**self._extra, "action": kind.value})
        else:
            log.warning("stream %s: ignoring %s", self._task.id, message,
                        extra={**self._extra, "action": "ignore"})

    async def _wait(self) -> None:
        now = self._loop.time()
        dues: list[float] = []
        if self._open():
            if len(self._window.running) < self._cap:  # full: a job's end kicks
                dues.extend(self._due.values())
            if self._head_failures:
                dues.append(self._head_due)
            if not self._pushes:
                if now >= self._next_poll:
                    self._head_wanted = True
                    self._next_poll = now + self._opts.poll_every
                    return
                dues.append(self._next_poll)
        if self._ending is not None:
            dues.append(self._grace_until)
        if self._writer is None and self._dirty():
            dues.append(self._last_write + self._opts.flush_every)
        timeout = None if not dues else max(0.0, min(dues) - now)
        if self._head_wanted and self._open() and (not self._head_failures or timeout == 0.0):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._kick.wait(), timeout)

    # -- the source -------------------------------------------------------------------------

    def _read_ahead(self) -> ReadAhead:
        """A reader of the jobs from the window's next index on, at most a window ahead."""
        size = min(self._opts.max_search_ahead, self._cap)
        return ReadAhead(self._strand, self._loop, self._kick.set, size, self._window.next)

    async def _build_source(self) -> object:
        """``jobs(task)`` on the source's thread; cancelled meanwhile (a lost claim), the
        source it returns later is closed there (nothing else would: the run is gone)."""
        built = self._strand.submit(self._func.jobs, self._task)
        try:
            return await asyncio.wrap_future(built, loop=self._loop)
        except asyncio.CancelledError:
            built.add_done_callback(functools.partial(_close_built, task_id=self._task.id))
            raise

    async def _in_source(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._strand.submit(fn, *args), loop=self._loop)

    async def _read_head(self) -> None:
        if not self._head_wanted or (self._head_failures and self._loop.time() < self._head_due):
            return
        self._head_wanted = False
        source = self._source
        assert source is not None
        try:
            head = await self._in_source(source.head)
            self._check_head(head)
        except _SourceError as exc:
            self._fail_stream(str(exc), 1)
            return
        except Exception as exc:
            self._head_failures += 1
            if self._head_failures >= self._opts.max_attempts:
                self._fail_stream(f"head() failed: {error_text(exc)}", self._head_failures)
                return
            self._head_due = self._loop.time() + self._opts.backoff(self._head_failures)
            self._head_wanted = True
            log.warning("stream %s: head() failed (%d of %d): %s", self._task.id,
                        self._head_failures, self._opts.max_attempts, exc,
                        extra={**self._extra, "action": "head"})
            return
        self._head_failures = 0
        self._head = head

    def _check_head(self, head: object) -> None:
        if not isinstance(head, int) or isinstance(head, bool) or head < -1:
            raise _SourceError(f"head() returned {head!r}, not an integer >= -1")
        if self._head is not None and head < self._head:
            raise _SourceError(f"head() went backwards, from {self._head} to {head}")
        processed = self._window.processed
        if processed >= self._base.start and head < processed:
            raise _SourceError(f"head() is {head}, below the processed index {processed}: "
                               "jobs already processed are gone from the source")

    def _fail_stream(self, error: str, attempts: int) -> None:
        index = self._window.processed + 1
        log.error("stream %s: failing at index %d: %s", self._task.id, index, error,
                  extra={**self._extra, "action": "failing"})
        self._failing = StreamFailing(index, error, attempts)
        self._head_wanted = False

    # -- jobs -------------------------------------------------------------------------------

    async def _start_jobs(self) -> None:
        opts, window, lanes = self._opts, self._window, self._lanes
        # Jobs an earlier run left running hold their slots (max_processing on the node).
        lanes.limit = opts.max_processing - sum(1 for thread in self._left if not thread.done())
        # Nothing is started (nor fetched) while no lane may run; else a few may queue.
        slots = lanes.limit + QUEUE_AHEAD - len(window.running) if lanes.limit > 0 else 0
        if slots <= 0:
            lanes.push(())  # a slot freed by a left-running job may start a lane
            return
        now = self._loop.time()
        retries = sorted(i for i in window.waiting if self._due.get(i, 0.0) <= now)[:slots]
        head, source = self._head, self._source
        if head is None or source is None:
            lanes.push(())
            return
        # New indexes: those read ahead, as many as the window lets start.
        count = min(window.room(head, self._cap, opts.max_search_ahead), slots - len(retries))
        jobs, errors = self._reader.take(count)
        if jobs or errors:
            window.start_next(len(jobs) + len(errors))
            self._failed_fetch(errors)
        self._reader.refill(source, head)
        lanes.push(jobs)
        if retries:
            await self._start_retries(retries, source, head)

    async def _start_retries(self, retries: list[int], source: Jobs, head: int) -> None:
        """Start the waiting jobs due again (read afresh), before the queued ones."""
        window = self._window
        for index in retries:
            window.start(index)
            self._due.pop(index, None)
        jobs: list[Job] = []
        for start, stop in runs(retries):
            items, errors = await self._in_source(fetch, source, start, stop, head)
            good, failed = split(items, start, errors)
            jobs.extend(good)
            self._failed_fetch(failed)
        if not self._open():  # stopping or failing since: they never start
            for job in jobs:
                window.failed(job.index)  # (above the watermark: the next run does them)
            return
        contexts = {job.index: JobContext(self._task, self._failures.get(job.index, 0) + 1,
                                          self._stopping) for job in jobs}
        self._lanes.push(jobs, first=True, contexts=contexts)  # lower indexes: first

    def _failed_fetch(self, errors: list[tuple[int, BaseException]]) -> None:
        """Started jobs the source could not give: they fail as the job would have."""
        if errors:
            self._results.extend(errors)
            self._kick.set()

    def _unqueue(self) -> None:
        """Stopping or failing: the queued jobs do not start (they stay above the watermark)."""
        for index in self._lanes.drop_queued():
            self._window.failed(index)

    def _collect(self) -> None:
        writer = self._writer
        if writer is not None and writer.done():
            self._writer = None
            writer.result()  # a refused write (ClaimLost) or a store that stayed away ends the run
        failed, self._results = self._results, []
        done, more = self._lanes.results()
        failed.extend(more)
        window, opts = self._window, self._opts
        if done:
            if self._failures:
                for index in done:
                    self._failures.pop(index, None)
            window.finished_many(done)
        for index, error in failed:
            failures = self._failures[index] = self._failures.get(index, 0) + 1
            window.failed(index)
            text = error_text(error)
            if failures >= opts.max_attempts:
                if self._failing is None or index < self._failing.index:
                    log.error("stream %s: job %d failed %d times; the stream pauses: %s",
                              self._task.id, index, failures, text,
                              extra={**self._extra, "action": "failing"})
                    self._failing = StreamFailing(index, text, failures)
                    self._unqueue()
                continue
            delay = opts.backoff(failures)
            self._due[index] = self._loop.time() + delay
            log.warning("stream %s: job %d failed (attempt %d of %d), again in %.2gs: %s",
                        self._task.id, index, failures, opts.max_attempts, delay, text,
                        extra={**self._extra, "action": "job_error"})
        if done and (self._head is None or window.next > self._head):
            self._head_wanted = True  # a finished job checks: caught up with the head

    # -- progress ---------------------------------------------------------------------------

    def _progress(self) -> Progress:
        failing = self._failing if self._ending is None else None  # a move starts it afresh
        return self._window.progress(self._base, self._head, failing, self._lanes.executing)

    def _dirty(self) -> bool:
        written, now = self._written, self._progress()
        if written is None:
            return True
        return (self._force_write or written.processed != now.processed
                or written.head != now.head or written.failing != now.failing)

    def _maybe_write(self) -> None:
        if self._writer is not None or not self._dirty():
            return
        if not self._force_write and self._loop.time() < self._last_write + self._opts.flush_every:
            return
        self._writer = asyncio.ensure_future(self._write(self._progress()))

    async def _write(self, progress: Progress) -> None:
        self._force_write = False
        self._last_write = self._loop.time()
        await self._cmds.checkpoint(progress.to_cursor())
        self._written = progress
        self._kick.set()

    def _report_lag(self) -> None:
        head = self._head
        lag = None if head is None else max(0, head - self._window.processed)
        self._func.report_lag(self._task.id, lag if lag is not None else 0)

    async def _finish(self) -> Message:
        """The end of the run: abandon what still runs, write the progress, say why."""
        self._stopping.set()
        self._abandon()
        writer, self._writer = self._writer, None
        if writer is not None:
            await writer
        self._collect()
        progress = self._progress()
        if progress != self._written:
            await self._write(progress)
        if self._ending is not None:
            return self._ending
        assert self._failing is not None
        return Message.pause()

    def _abandon(self) -> list[concurrent.futures.Future[Any]]:
        """Queued jobs never start, async ones are cancelled, threads' jobs cannot be: those
        still running are abandoned (their lanes, returned)."""
        threads: list[concurrent.futures.Future[Any]] = list(self._lanes.abandon())
        return threads

    def _cleanup(self) -> None:
        self._stopping.set()
        threads = self._abandon()
        if self._writer is not None:
            self._writer.cancel()
        self._func.report_lag(self._task.id, None)
        source = self._source
        if source is not None:
            self._strand.submit(_close, source, self._task.id)  # after its calls in flight
        self._func.leave_running(self._task.id, threads)


def _close(source: Jobs, task_id: str) -> None:
    try:
        source.close()
    except Exception:  # a source's bug must not hide how the stream ended
        log.exception("stream %s: closing its source failed", task_id)


def _close_built(built: concurrent.futures.Future[Any], task_id: str) -> None:
    if not built.cancelled() and built.exception() is None and isinstance(built.result(), Jobs):
        _close(built.result(), task_id)
