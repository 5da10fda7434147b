"""The Handler interface users implement, and a function adapter."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable

from metafora.task import Task

__all__ = ["Handler", "HandlerFunc", "simple_handler"]


class Handler(abc.ABC):
    """Runs one claimed task.

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


HandlerFunc = Callable[[Task], Handler]
"""Builds the Handler for a claimed task (the task carries its fencing token)."""


class _SimpleHandler(Handler):
    def __init__(self, fn: Callable[[Task, threading.Event], bool], task: Task) -> None:
        self._fn = fn
        self._task = task
        self._stop = threading.Event()

    def run(self) -> bool:
        return bool(self._fn(self._task, self._stop))

    def stop(self) -> None:
        self._stop.set()


def simple_handler(fn: Callable[[Task, threading.Event], bool]) -> HandlerFunc:
    """Wrap ``fn(task, stop_event) -> bool`` as a HandlerFunc.

    ``stop_event`` is set when the consumer wants the task back; ``fn`` should return
    (usually ``False``, to release) soon after.
    """

    def make(task: Task) -> Handler:
        return _SimpleHandler(fn, task)

    return make
