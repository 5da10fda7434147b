"""What every part of the consumer shares: a running task's entry, and the node's log.

:class:`Running` is one running task: its claim, its handler and how far its end has gone.
Entries live in the consumer's ``running`` map (task id -> :class:`Running`, a
:class:`RunningMap`) under the consumer's one lock; every part (offers, handoff, launch,
finishing, shutdown) reads that map. :class:`NodeLog` is the consumer's logger, which every
part logs through.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from metafora.consumer.runner import Run
from metafora.contracts.balancer import RunningTask, SelectorKey, selector_key
from metafora.contracts.handler import AsyncHandler, Handler
from metafora.core.task import Task

__all__ = ["Flag", "NodeLog", "Running", "RunningMap", "handler_state"]


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
        return RunningTask(self.task, self.started, self.stopped, self.handler)


class RunningMap(dict[str, Running]):
    """The consumer's running map, task id -> :class:`Running`, that tallies the selectors
    of its tasks as entries come and go.

    The balancer asks which selectors the node's tasks have (``BalancerContext.held_selectors``)
    on every balance: the tally answers in O(distinct selectors) where a walk of the entries
    cost O(tasks held). Every change of the map goes through ``__setitem__``/``__delitem__``
    (the other mutators are routed through them), under the consumer's lock like any change;
    an entry's task is never replaced once it is in the map.
    """

    def __init__(self) -> None:
        super().__init__()
        self._selectors: Counter[SelectorKey] = Counter()

    def selectors(self) -> frozenset[SelectorKey]:
        """The distinct selectors of the tasks in the map (``()``: tasks without one)."""
        return frozenset(self._selectors)

    def __setitem__(self, key: str, value: Running) -> None:
        old = self.get(key)
        super().__setitem__(key, value)
        if old is not None:
            self._drop(old)
        tally = selector_key(value.task.selector)
        self._selectors[tally] = self._selectors.get(tally, 0) + 1  # no Counter.__missing__

    def __delitem__(self, key: str) -> None:
        entry = self[key]
        super().__delitem__(key)
        self._drop(entry)

    def pop(self, key: str, *default: Any) -> Any:
        """Remove ``key`` and return its entry (``default`` when absent, if given)."""
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        entry = self[key]
        del self[key]
        return entry

    def popitem(self) -> tuple[str, Running]:
        """Remove and return the last entry added."""
        key, entry = super().popitem()
        self._drop(entry)
        return key, entry

    def setdefault(self, key: str, default: Any = None) -> Any:
        """The entry of ``key``, added as ``default`` first when absent."""
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add or replace entries, one ``__setitem__`` each."""
        for key, entry in dict(*args, **kwargs).items():
            self[key] = entry

    def __ior__(self, other: Any) -> RunningMap:  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        """Remove every entry."""
        super().clear()
        self._selectors.clear()

    def _drop(self, entry: Running) -> None:
        key = selector_key(entry.task.selector)
        left = self._selectors[key] - 1
        if left > 0:
            self._selectors[key] = left
        else:
            del self._selectors[key]  # the set of keys is what held_selectors answers


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
