"""The threads of a stream handler: one elastic pool per bound handler, a strand per source.

A stream used to keep a source thread and a pool of ``max_processing`` work threads for as
long as it ran: 100 streams held 500 threads on a node, idle or not. Here every stream of a
bound handler shares one :class:`ElasticPool`, whose threads start on demand and end after
``idle`` seconds without work (an idle node holds none). A stream's concurrency is bounded by
its window (``max_processing``), so the pool needs no cap of its own. A source's calls go
through a :class:`Strand`: one at a time, in order, so a source need not be thread-safe.

Both hand out :class:`concurrent.futures.Future` objects: a queued call can be cancelled, a
running one cannot (a job that ignores the stop runs on, abandoned, and is counted until it
ends: ``StreamHandlerFunc.left_running``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from metafora.core.clock import SYSTEM_CLOCK

__all__ = ["DEFAULT_THREAD_IDLE", "ElasticPool", "Strand"]

T = TypeVar("T")

DEFAULT_THREAD_IDLE = 2.0
"""Seconds a pool thread waits for more work before it ends."""

_Item = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _run(item: _Item) -> None:
    future, fn, args = item
    if not future.set_running_or_notify_cancel():
        return  # cancelled while queued
    try:
        result = fn(*args)
    except BaseException as exc:  # handed to the waiter, as a pool does
        future.set_exception(exc)
    else:
        future.set_result(result)


class ElasticPool:
    """Threads on demand: a call starts on an idle thread or on a new one; a thread ends
    after ``idle`` seconds without work. Thread-safe; nothing to shut down."""

    def __init__(self, name: str, idle: float = DEFAULT_THREAD_IDLE) -> None:
        self._name = name
        self._idle_seconds = idle
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._idle = 0  # threads waiting for work
        self._threads = 0
        self._serial = 0

    @property
    def threads(self) -> int:
        """Threads alive now (running a call or waiting for one)."""
        with self._cond:
            return self._threads

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a pool thread; its future."""
        future: Future[T] = Future()
        item: _Item = (future, fn, args)
        with self._cond:
            self._queue.append(item)
            if len(self._queue) <= self._idle:  # a waiting thread takes it
                self._cond.notify()
                return future
            self._threads += 1
            self._serial += 1
            name = f"{self._name}-{self._serial}"
        try:
            threading.Thread(target=self._work, name=name, daemon=True).start()
        except BaseException:  # no thread (the process's limit): the call is not made
            with self._cond:
                self._threads -= 1
                if item in self._queue:
                    self._queue.remove(item)
            raise
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                deadline = SYSTEM_CLOCK.monotonic() + self._idle_seconds
                while not self._queue:
                    left = deadline - SYSTEM_CLOCK.monotonic()
                    if left <= 0:
                        self._threads -= 1
                        return
                    self._idle += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._idle -= 1
                item = self._queue.popleft()
            _run(item)


class Strand:
    """Calls run one at a time, in submission order, on a shared pool; a thread is held only
    while calls are queued."""

    def __init__(self, pool: ElasticPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._queue: deque[_Item] = deque()
        self._busy = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` behind the strand's earlier calls; its future."""
        future: Future[T] = Future()
        item: _Item = (future, fn, args)
        with self._lock:
            self._queue.append(item)
            if self._busy:
                return future
            self._busy = True
        try:
            self._pool.submit(self._drain)
        except BaseException:  # not queued after all: the caller learns it at once
            with self._lock:
                self._busy = False
                if item in self._queue:
                    self._queue.remove(item)
            raise
        return future

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._busy = False
                    return
                item = self._queue.popleft()
            _run(item)
