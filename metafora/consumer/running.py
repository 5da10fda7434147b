"""What every part of the consumer shares: a running task's entry, and the node's log.

:class:`Running` is one running task: its claim, its handler and how far its end has gone.
Entries live in the consumer's ``running`` map (task id -> :class:`Running`) under the
consumer's one lock; every part (offers, handoff, launch, finishing, shutdown) reads that
map. :class:`NodeLog` is the consumer's logger, which every part logs through.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from metafora.balancer import RunningTask
from metafora.consumer.runner import Run
from metafora.handler import AsyncHandler, Handler
from metafora.task import Task

__all__ = ["Flag", "NodeLog", "Running", "handler_state"]


class Flag:
    """A flag set once and never cleared, that threads can wait for: ``threading.Event``'s
    ``set``/``is_set``/``wait`` at a fraction of its making cost (one lock, held while
    unset, instead of a Condition). Every running task has two, made on the hot path."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        """Whether it was set."""
        return self._set

    def set(self) -> None:
        """Set it and wake every waiter (setting it again does nothing)."""
        if self._set:
            return
        self._set = True
        self._release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set or ``timeout`` seconds (None: no limit) passed; whether it is set."""
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._release()  # pass the wake-up on to the next waiter
        return self._set

    def _release(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # two setters (or a setter and a waiter) raced: already free
            pass


@dataclass(eq=False)
class Running:
    """A claimed task whose handler was made (and, once ``run`` is set, started)."""

    task: Task
    handler: Handler | AsyncHandler
    started: datetime
    run: Run | None = None  # set once the runner started it
    stopped: datetime | None = None
    lost: bool = False
    abandoned: bool = False
    ran: float | None = None  # seconds from start to the handler's return, once it returned
    returned: Flag = field(default_factory=Flag)  # run() ended
    finished: Flag = field(default_factory=Flag)  # outcome written

    def view(self) -> RunningTask:
        """What the balancer sees of it."""
        return RunningTask(self.task, self.started, self.stopped)


def handler_state(handler: Handler | AsyncHandler) -> str | None:
    """A state-machine handler's current state, for /info (None for plain handlers)."""
    state = getattr(handler, "state", None)
    if callable(state):
        try:
            state = state()
        except Exception:
            return None
    if state is None:
        return None
    return str(getattr(state, "value", getattr(getattr(state, "code", None), "value", state)))


class NodeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Adds ``node`` to every record's extra, merged with the call's own extra."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs
