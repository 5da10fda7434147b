"""The handler runner: sync handlers on reusable threads, async ones on one event loop.

A :class:`HandlerRunner` belongs to one Consumer. It starts each handler where it belongs
(a thread of its own for :class:`~metafora.contracts.handler.Handler`, a task on the node's event loop
for :class:`~metafora.contracts.handler.AsyncHandler`), delivers ``stop()`` and, for async handlers,
cancellation, and hands each handler's result to a ``finish`` callback where the handler
ended. ``finish`` only books the outcome; the store write it returns (which blocks) runs on
the handler's own thread, or for async handlers on a small pool of writer threads, **never
on the event loop**.

The event loop runs in a named thread started with the first async handler and is
supervised: if it dies, the consumer is told (``on_fatal``) and shuts down. A watchdog
thread warns when the loop is blocked (an async handler made a blocking call) for longer
than ``slow_callback`` seconds, naming the task and where it is stuck.

A handler that cannot be started (its thread cannot start: the process is out of threads
or memory; or the event loop is gone) makes :meth:`HandlerRunner.start` raise
:class:`CannotStart`, with nothing left running: the consumer releases the task.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import queue
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar, cast

from metafora.contracts.handler import AsyncHandler, Handler, is_async

__all__ = ["Around", "AsyncRun", "CannotStart", "Finish", "HandlerRunner", "Run", "SyncRun", "Write"]

# The logger keeps the name it had before the consumer became a package.
log = logging.getLogger("metafora.runner")

Write = Callable[[], None]
Finish = Callable[[bool | None, BaseException | None, Any], Write | None]
"""Called once a handler ended: ``(result, None, scope)``, or ``(None, error, scope)`` if it
raised; ``scope`` is what the ``around`` context manager of the run yielded (a tracing span).

It must not block (it may run on the event loop); it returns the blocking part (the store
write of the outcome), if any, which the runner runs off the loop, in the run's context. A
write with a ``queue()`` method that only queues it (True) or would block (False, nothing
done) is queued on the loop itself; only a False sends the write to a writer thread."""
Around = Callable[[], AbstractContextManager[Any]]
"""Entered around a handler's run and its ``finish`` (on the handler's thread, or inside its
asyncio task), e.g. a tracing span that the handler's own spans then hang under."""

_OUTCOME_WRITERS = 8  # threads writing async handlers' outcomes (the store serialises them anyway)

StartThread = Callable[[threading.Thread], None]
# What Thread.start() raises when the process is out of threads ("can't start new thread")
# or memory for one more stack.
_START_ERRORS = (RuntimeError, MemoryError)


class CannotStart(Exception):
    """A handler could not be started; nothing of it runs. ``kind``: ``"thread"`` or
    ``"async"``; ``cause``: what was raised (the exception's ``__cause__`` too)."""

    def __init__(self, kind: str, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind = kind
        self.cause = cause


class SyncRun:
    """A handler running on a thread: stop() is delivered directly; it cannot be cancelled."""

    is_async = False

    def __init__(self, handler: Handler, name: str) -> None:
        self.handler = handler
        self.name = name

    def stop(self) -> None:
        """Ask the handler to return (may raise what the handler's stop() raises)."""
        self.handler.stop()


class AsyncRun:
    """A handler running as a task on the node's event loop."""

    is_async = True

    def __init__(self, handler: AsyncHandler | Handler, loop: _EventLoop, name: str,
                 finish: Finish, around: Around) -> None:
        self.handler = handler
        self.name = name
        self.finish = finish
        self.around = around
        self.finished = False  # finish was called (inside the task, or by its done callback)
        self.task: asyncio.Task[Any] | None = None
        self._loop = loop

    def stop(self) -> None:
        """Call the handler's stop() on the loop's thread (where asyncio objects may be used)."""
        self._loop.call(lambda: _call_stop(self))

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop's thread soon (a notice to the handler, e.g. at risk)."""
        self._loop.call(fn)

    def cancel(self) -> None:
        """Cancel the handler's task (a lost claim, or stop() ignored at shutdown)."""
        self._loop.call(lambda: self.task.cancel() if self.task is not None else None)


Run = SyncRun | AsyncRun


def _call_stop(run: Run) -> None:
    try:
        run.handler.stop()
    except Exception:
        log.exception("stop() of handler %s raised", run.name)


_T = TypeVar("_T")


def _logged(name: str, fn: Callable[[], _T | None]) -> _T | None:
    """Run ``fn``, logging (not raising) a bug in the outcome path."""
    try:
        return fn()
    except Exception:  # a bug in the outcome path: an executor would keep it to itself
        log.exception("recording the outcome of async handler %s failed", name)
        return None


class _Workers:
    """Threads that run sync handlers: one thread per running handler, reused when idle.

    Short tasks would otherwise pay a thread start each; a thread idle for ``idle_for``
    seconds (or beyond ``keep`` idle ones) exits.
    """

    def __init__(self, start_thread: StartThread, keep: int = 32, idle_for: float = 30.0) -> None:
        self._start_thread = start_thread
        self._keep = keep
        self._idle_for = idle_for
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Callable[[], None] | None]] = []

    def run(self, name: str, job: Callable[[], None]) -> None:
        """Run ``job`` on an idle thread, or a new one (:class:`CannotStart` if it cannot start)."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put(job)
            return
        try:
            inbox = queue.SimpleQueue()
            inbox.put(job)
            self._start_thread(threading.Thread(target=self._loop, args=(inbox,), name=name,
                                                daemon=True))
        except _START_ERRORS as exc:
            raise CannotStart("thread", exc) from exc

    def _loop(self, inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            try:
                job = inbox.get(timeout=self._idle_for)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                job = inbox.get()  # taken from the idle list just now: a job is on its way
            if job is None:
                return
            try:
                job()
            except Exception:  # a bug in the outcome path: log it where operators look
                log.exception("handler thread failed outside the handler")
            with self._lock:
                if len(self._idle) >= self._keep:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        """Let idle threads exit."""
        with self._lock:
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)


class _EventLoop:
    """One asyncio loop in a named thread, with a watchdog for blocking callbacks."""

    def __init__(self, node_id: str, slow_callback: float,
                 on_fatal: Callable[[str, BaseException], None], start_thread: StartThread) -> None:
        self._node_id = node_id
        self._slow = slow_callback
        self._on_fatal = on_fatal
        self._loop = asyncio.new_event_loop()
        self._closing = threading.Event()
        # Strong references (asyncio keeps weak ones), and the runs a dead loop must end.
        self._tasks: dict[asyncio.Task[Any], AsyncRun] = {}
        # Runs spawned but not created yet, which a loop that dies must end too.
        self._spawn_lock = threading.Lock()
        self._spawning: set[AsyncRun] = set()
        # Spawned runs waiting for the loop, in order: a burst of claims wakes it once.
        self._queued: list[AsyncRun] = []
        self._stopped = False  # run_forever returned
        self._writers = concurrent.futures.ThreadPoolExecutor(
            _OUTCOME_WRITERS, thread_name_prefix=f"metafora-outcome-{node_id}"
        )
        self._thread = threading.Thread(target=self._serve, name=f"metafora-asyncio-{node_id}",
                                        daemon=True)
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name=f"metafora-asyncio-watchdog-{node_id}")
        try:
            start_thread(self._thread)
        except BaseException:
            self._loop.close()
            self._writers.shutdown(wait=False)
            raise
        try:
            start_thread(self._watchdog)
        except BaseException:  # no loop without its watchdog: stop the one just started
            self._closing.set()
            self.call(self._loop.stop)
            self._writers.shutdown(wait=False)
            raise

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop's thread soon (from any thread)."""
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop closed: nothing left to stop or cancel
            pass

    def spawn(self, run: AsyncRun) -> None:
        """Start ``run``'s handler as a task on the loop (:class:`CannotStart` if it is gone)."""
        with self._spawn_lock:
            if self._stopped or self._closing.is_set():
                raise CannotStart("async", RuntimeError("the event loop is not running"))
            self._spawning.add(run)
            self._queued.append(run)
            if len(self._queued) > 1:
                return  # the loop is told already: it creates the whole queue at once
        try:
            self._loop.call_soon_threadsafe(self._create_queued)
        except RuntimeError as exc:  # closed
            with self._spawn_lock:
                self._spawning.discard(run)
                self._queued.remove(run)
            raise CannotStart("async", exc) from exc

    def _create_queued(self) -> None:
        with self._spawn_lock:
            runs, self._queued = self._queued, []
        for i, run in enumerate(runs):
            try:
                self._create(run)
            except BaseException:
                # Not this burst's fault (the loop or the process is failing): the rest of the
                # burst still gets its turn, as each run had its own callback before.
                rest = runs[i + 1:]
                if rest:
                    with self._spawn_lock:
                        self._queued[:0] = rest
                    self._loop.call_soon(self._create_queued)
                raise

    def _create(self, run: AsyncRun) -> None:
        with self._spawn_lock:
            self._spawning.discard(run)
        try:
            coro = run.handler.run()
            if not asyncio.iscoroutine(coro):
                raise TypeError(f"async handler {run.name}: run() returned {type(coro).__name__}, "
                                "not a coroutine")
        except BaseException as exc:
            self._hand_off(run, None, exc, None, None)
            return
        task = self._loop.create_task(self._drive(run, coro), name=run.name)
        run.task = task
        self._tasks[task] = run
        task.add_done_callback(lambda t: self._ended(run, t))

    async def _drive(self, run: AsyncRun, coro: Any) -> None:
        """The handler's task: its run and the booking of its end, inside ``around``."""
        with run.around() as scope:
            result: bool | None = None
            error: BaseException | None = None
            try:
                result = bool(await coro)
            except BaseException as exc:  # its outcome; cancellation included
                error = exc
            # The context of the write: the run's span stays the parent of the outcome's.
            self._hand_off(run, result, error, scope, contextvars.copy_context())
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error

    def _ended(self, run: AsyncRun, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)
        if not run.finished:  # cancelled before its first step: _drive never ran
            self._hand_off(run, None, asyncio.CancelledError(f"{run.name} was cancelled"),
                           None, None)

    def _hand_off(self, run: AsyncRun, result: bool | None, error: BaseException | None,
                  scope: Any, context: contextvars.Context | None) -> None:
        # Booked here at once (10,000 handlers stopping at shutdown need no thread hop);
        # the store write, which blocks, never runs on the loop's thread.
        run.finished = True
        write = _logged(run.name, lambda: run.finish(result, error, scope))
        if write is None:
            return
        # A write that can only queue (the group commit) is queued right here: no hop.
        queue = getattr(write, "queue", None)
        if queue is not None and _logged(
                run.name, queue if context is None else (lambda: context.run(queue))) is not False:
            return
        job = write if context is None else (lambda: context.run(write))
        try:
            self._writers.submit(_logged, run.name, job)
        except RuntimeError:  # closing: the executor is gone; write from a thread of its own
            threading.Thread(target=job, name=f"{run.name}-outcome", daemon=True).start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        except BaseException as exc:
            died: BaseException = exc
        else:
            died = RuntimeError("the event loop stopped unexpectedly")
        with self._spawn_lock:
            self._stopped = True
            spawned, self._spawning = list(self._spawning), set()
        if self._closing.is_set():
            return
        self._on_fatal("asyncio", died)  # the node stops claiming and shuts down
        # Nothing will run these handlers again: end them as released (the node's close()
        # gives their tasks back), or shutdown would wait for them until its timeout.
        for run in [*self._tasks.values(), *spawned]:
            if not run.finished:  # a run that ended as the loop died was handed off already
                self._hand_off(run, False, None, None, None)
        self._tasks.clear()

    def _watch(self) -> None:
        # Ping the loop every slow_callback seconds; a ping not answered within 1.5 x
        # slow_callback while one task stays current means that task holds the loop: a stall
        # of 3 x slow_callback is always seen.
        while not self._closing.wait(self._slow):
            beat = threading.Event()
            sent = time.monotonic()
            self.call(beat.set)
            if beat.wait(self._slow) or self._closing.is_set():
                continue
            task = self._current_task()
            if task is None or beat.wait(self._slow / 2) or self._current_task() is not task:
                # Many short steps (10,000 handlers ending at once at shutdown), not one
                # handler's blocking call: worth a debug line, not an operator's attention.
                log.debug("the event loop of node %s was busy for over %.2fs",
                          self._node_id, self._slow)
                continue
            log.warning(
                "the event loop of node %s has been blocked for over %.2fs by task %s at %s; "
                "async handlers must not make blocking calls (use asyncio.to_thread)",
                self._node_id, self._slow, task.get_name(), self._where(),
                extra={"node": self._node_id, "action": "slow_callback"},
            )
            while not beat.wait(1.0) and not self._closing.is_set():
                pass
            log.warning("the event loop of node %s answers again (a ping waited %.1fs)",
                        self._node_id, time.monotonic() - sent,
                        extra={"node": self._node_id, "action": "slow_callback"})

    def _current_task(self) -> asyncio.Task[Any] | None:
        try:
            return asyncio.current_task(self._loop)
        except RuntimeError:
            return None

    def _where(self) -> str:
        """Where the loop's thread is now: the innermost frame, and the user's code under it."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return "?"
        stack = traceback.extract_stack(frame)
        if not stack:
            return "?"
        inner = stack[-1]
        where = f"{inner.filename}:{inner.lineno} ({inner.name})"
        library = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])
        mine = next((f for f in reversed(stack) if not f.filename.startswith(library)), None)
        if mine is not None and mine is not inner:
            where = f"{mine.filename}:{mine.lineno} ({mine.name}) in {where}"
        return where

    def cancel_all(self, runs: Iterable[AsyncRun]) -> None:
        """Cancel the tasks of ``runs`` in one loop callback."""
        batch = list(runs)

        def cancel() -> None:
            for run in batch:
                if run.task is not None:
                    run.task.cancel()

        self.call(cancel)

    def stop_all(self, runs: Iterable[AsyncRun]) -> None:
        """Call stop() of every handler of ``runs`` in one loop callback."""
        batch = list(runs)

        def stop() -> None:
            for run in batch:
                _call_stop(run)

        self.call(stop)

    def close(self, timeout: float) -> None:
        """Cancel what still runs, stop the loop, let queued outcomes be written."""
        self._closing.set()

        async def cancel_rest() -> None:
            rest = [t for t in list(self._tasks) if not t.done()]
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.wait(rest, timeout=timeout)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(timeout + 1.0)
            except (concurrent.futures.TimeoutError, RuntimeError):
                log.error("async handlers of node %s did not end after cancellation",
                          self._node_id)
        self.call(self._loop.stop)
        self._thread.join(timeout + 1.0)
        self._watchdog.join(timeout + 1.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._writers.shutdown(wait=False)


class HandlerRunner:
    """Runs one consumer's handlers; see the module docstring."""

    def __init__(self, node_id: str, *, slow_callback: float,
                 on_fatal: Callable[[str, BaseException], None]) -> None:
        self._node_id = node_id
        self._slow = slow_callback
        self._on_fatal = on_fatal
        self._workers = _Workers(self.start_thread)
        self._loop: _EventLoop | None = None
        self._lock = threading.Lock()
        self._busy = 0  # sync handlers started and not ended

    @property
    def busy_threads(self) -> int:
        """Sync handlers running now (each on a thread of its own)."""
        return self._busy

    def start_thread(self, thread: threading.Thread) -> None:
        """Start one of the runner's threads (a seam: tests make it fail as a full process does)."""
        thread.start()

    def start(self, name: str, handler: Handler | AsyncHandler, finish: Finish,
              around: Around = nullcontext) -> Run:
        """Start ``handler``; ``finish(result, error, scope)`` is called once it ended.

        Raises :class:`CannotStart` when it cannot be started (then ``finish`` is never called).
        """
        if is_async(handler):
            loop = self._event_loop()
            arun = AsyncRun(handler, loop, name, finish, around)
            loop.spawn(arun)
            return arun
        sync = SyncRun(cast(Handler, handler), name)  # duck-typed handlers are welcome
        with self._lock:
            self._busy += 1

        def ended(result: bool | None, error: BaseException | None, scope: Any) -> Write | None:
            # Uncounted before finish() tells the consumer a slot is free, which counts again.
            self._ended_sync()
            return finish(result, error, scope)

        try:
            self._workers.run(name, lambda: self._run_sync(name, sync, ended, around))
        except CannotStart:
            self._ended_sync()
            raise
        return sync

    def _ended_sync(self) -> None:
        with self._lock:
            self._busy -= 1

    @staticmethod
    def _run_sync(name: str, run: SyncRun, finish: Finish, around: Around) -> None:
        threading.current_thread().name = name
        with around() as scope:
            try:
                result = run.handler.run()
                if inspect.isawaitable(result):
                    # Truthy, so it would count as done without having run: refuse it loudly.
                    getattr(result, "close", lambda: None)()
                    raise TypeError(f"handler {name}: run() returned an awaitable; declare it "
                                    "'async def' (or subclass AsyncHandler) to run it on the loop")
            except BaseException as exc:
                write = finish(None, exc, scope)
            else:
                write = finish(bool(result), None, scope)
            if write is not None:
                write()

    def _event_loop(self) -> _EventLoop:
        with self._lock:
            if self._loop is None:
                try:
                    self._loop = _EventLoop(self._node_id, self._slow, self._on_fatal,
                                            self.start_thread)
                # Out of threads, memory or file descriptors (the loop's selector): tried
                # again at the next async handler.
                except (*_START_ERRORS, OSError) as exc:
                    raise CannotStart("async", exc) from exc
            return self._loop

    def stop(self, runs: Iterable[Run]) -> None:
        """Deliver stop() to every handler of ``runs`` (async ones in one loop callback).

        A stop() that raises is logged; the others are still stopped.
        """
        asyncs: list[AsyncRun] = []
        for run in runs:
            if isinstance(run, AsyncRun):
                asyncs.append(run)
            else:
                _call_stop(run)
        if asyncs and self._loop is not None:
            self._loop.stop_all(asyncs)

    def cancel(self, runs: Iterable[Run]) -> None:
        """Cancel the async handlers among ``runs`` (threads cannot be cancelled)."""
        asyncs = [r for r in runs if isinstance(r, AsyncRun)]
        if asyncs and self._loop is not None:
            self._loop.cancel_all(asyncs)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the event loop (cancelling leftovers) and let idle threads exit."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close(timeout)
        self._workers.close()
