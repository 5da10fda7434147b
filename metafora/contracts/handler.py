"""The Handler interfaces users implement (sync and async), and a function adapter."""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import overload

from metafora.core.task import Task

__all__ = ["AsyncHandler", "Handler", "HandlerFunc", "is_async", "simple_handler"]


class Handler(abc.ABC):
    """Runs one claimed task on a thread of its own.

    ``run`` blocks until the work ends: ``True`` means done (never runs again), ``False``
    means release (another consumer may claim it). An exception marks the task failed.
    ``stop`` asks ``run`` to return soon; it must not block and may be called more than once.
    """

    @abc.abstractmethod
    def run(self) -> bool:
        """Do the work; return True when done, False to release the task."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Ask run() to return soon. Must not block; may be called more than once."""

    def at_risk(self, until: datetime) -> None:
        """The claim is at risk: the node's lease renewals are failing, and unless one gets
        through, ``stop()`` comes at ``until`` (UTC) and the claim is lost soon after.

        Called once per at-risk episode, before that ``stop()``, from the consumer's
        watcher thread: must not block (set a flag; checkpoint from ``run``). The default
        does nothing. See ``docs/claim-at-risk.md``.
        """
        return  # optional hook

    def recovered(self, until: datetime) -> None:
        """A renewal got through after :meth:`at_risk`: the claim is guaranteed until
        ``until`` again. Must not block. The default does nothing."""
        return  # optional hook


class AsyncHandler(abc.ABC):
    """Runs one claimed task as a coroutine on the consumer's event loop.

    Outcomes are those of :class:`Handler`: ``await run()`` returns ``True`` (done) or
    ``False`` (release); an exception marks the task failed. ``stop()`` is plain (not async),
    must not block, and is called on the event loop's thread, so it may set an
    ``asyncio.Event``. A handler whose claim is lost is stopped and cancelled at once, and
    one that ignores ``stop()`` at shutdown is cancelled after ``shutdown_timeout``.

    ``run`` shares one loop with every other async handler of the node: a blocking call in
    it (``time.sleep``, a synchronous driver) stalls them all, and the consumer logs a warning
    when the loop is held longer than its ``slow_callback`` setting. Offload blocking work
    with ``await asyncio.to_thread(...)``.
    """

    @abc.abstractmethod
    async def run(self) -> bool:
        """Do the work; return True when done, False to release the task."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Ask run() to return soon. Must not block; may be called more than once."""

    def at_risk(self, until: datetime) -> None:
        """As :meth:`Handler.at_risk`, called on the event loop's thread (it may set an
        ``asyncio.Event``). The default does nothing."""
        return  # optional hook

    def recovered(self, until: datetime) -> None:
        """As :meth:`Handler.recovered`, on the event loop's thread. The default does nothing."""
        return  # optional hook


HandlerFunc = Callable[[Task], Handler | AsyncHandler]
"""Builds the Handler (or AsyncHandler) for a claimed task (the task carries its fencing token)."""

SyncFn = Callable[[Task, threading.Event], bool]
AsyncFn = Callable[[Task, asyncio.Event], Awaitable[bool]]


def is_async(handler: Handler | AsyncHandler) -> bool:
    """Whether ``handler`` runs on the event loop (its ``run`` is a coroutine function)."""
    return isinstance(handler, AsyncHandler) or inspect.iscoroutinefunction(handler.run)


def _is_coroutine_fn(fn: object) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object with an async __call__
    )


class _SimpleHandler(Handler):
    def __init__(self, fn: SyncFn, task: Task) -> None:
        self._fn = fn
        self._task = task
        self._stop = threading.Event()

    def run(self) -> bool:
        result = self._fn(self._task, self._stop)
        if inspect.isawaitable(result):
            # Truthy, so it would count as "done" without having run: refuse it loudly.
            close = getattr(result, "close", None)
            if callable(close):
                close()
            raise TypeError(
                f"handler {self._fn!r} returned an awaitable; simple_handler runs async "
                "functions only when they are declared with 'async def'"
            )
        return bool(result)

    def stop(self) -> None:
        self._stop.set()


class _SimpleAsyncHandler(AsyncHandler):
    """``async def fn(task, stop)`` with ``stop`` an ``asyncio.Event`` of the consumer's loop."""

    def __init__(self, fn: AsyncFn, task: Task) -> None:
        self._fn = fn
        self._task = task
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    async def run(self) -> bool:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        # Assigned before the flag is read, and stop() sets the flag before reading the
        # event: a stop() from another thread at this moment is seen by one side or the other.
        if self._stopped:
            self._event.set()
        return bool(await self._fn(self._task, self._event))

    def stop(self) -> None:
        self._stopped = True
        loop, event = self._loop, self._event
        if loop is None or event is None:
            return  # run() has not started; it sets the event when it does
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
            return
        try:
            loop.call_soon_threadsafe(event.set)  # asyncio.Event is not thread-safe
        except RuntimeError:
            pass  # the loop is closed: run() is over, there is nothing left to stop


@overload
def simple_handler(fn: AsyncFn) -> HandlerFunc: ...


@overload
def simple_handler(fn: SyncFn) -> HandlerFunc: ...


def simple_handler(fn: SyncFn | AsyncFn) -> HandlerFunc:
    """Wrap ``fn(task, stop) -> bool`` (a plain or an ``async def`` function) as a HandlerFunc.

    A plain function runs on a thread of its own and gets a ``threading.Event``; an
    ``async def`` function runs on the consumer's event loop and gets an ``asyncio.Event``
    (``stop.is_set()``, ``await stop.wait()``). ``stop`` is set when the consumer wants the
    task back; ``fn`` should return (usually ``False``, to release) soon after.
    """
    if _is_coroutine_fn(fn):
        async_fn: AsyncFn = fn  # type: ignore[assignment]

        def make_async(task: Task) -> Handler | AsyncHandler:
            return _SimpleAsyncHandler(async_fn, task)

        return make_async
    sync_fn: SyncFn = fn  # type: ignore[assignment]

    def make(task: Task) -> Handler | AsyncHandler:
        return _SimpleHandler(sync_fn, task)

    return make
