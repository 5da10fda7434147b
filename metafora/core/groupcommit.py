"""Group commit, written once: items that wait to share one write, and the two ways to write them.

Three writers share it: the consumer's outcome writer (:mod:`metafora.consumer.outcomes`: a
writer thread writes what gathered while the last batch was written), the etcd coordinator's
single outcomes (:class:`GroupCommit`: the caller that finds no write in flight writes for
everyone who queued meanwhile) and the gates' item results
(:mod:`metafora.gates.flush`: written with the owner's next write, or by a background
thread once the oldest is ``flush_interval`` old).

:class:`Gathering` is what they have in common: a FIFO of waiting items under one condition
(a plain lock: never re-entered), which says when an item is the first to wait (the writer
may be asleep and wants a wake-up; the time it came is :attr:`Gathering.oldest`), gives a
batch of the oldest items, and takes back items that were not written, first in line. Its
methods do no locking of their own: the caller holds :attr:`Gathering.cond` around them,
along with whatever state of its own goes with the queue.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import StoreError

__all__ = ["Gathering", "GroupCommit"]

log = logging.getLogger("metafora.groupcommit")  # its name before the move (users' log config names it)

T = TypeVar("T")
R = TypeVar("R")


class Gathering(Generic[T]):
    """Items waiting for a shared write, oldest first (hold :attr:`cond` around every call)."""

    __slots__ = ("cond", "items", "oldest")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        """Guards the queue (and what the owner keeps with it); writers wait on it."""
        self.items: collections.deque[T] = collections.deque()
        """The waiting items, oldest first (read it; change it through the methods)."""
        self.oldest = 0.0
        """When the oldest waiting item came (``SYSTEM_CLOCK.monotonic()``); only
        meaningful while items wait."""

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: T) -> bool:
        """Queue ``item``; True when it is the only one waiting (a writer may have to be woken)."""
        items = self.items
        items.append(item)
        if len(items) == 1:
            self.oldest = SYSTEM_CLOCK.monotonic()
            return True
        return False

    def take(self, limit: int | None = None) -> list[T]:
        """Up to ``limit`` of the oldest waiting items (all of them when None), off the queue."""
        items = self.items
        if limit is None or limit >= len(items):
            batch = list(items)
            items.clear()
            return batch
        return [items.popleft() for _ in range(limit)]

    def give_back(self, batch: Sequence[T]) -> None:
        """Items taken and not written: first in line again, in their order (:attr:`oldest`
        is left as it is)."""
        self.items.extendleft(reversed(batch))


@dataclass
class _Slot(Generic[T, R]):
    item: T
    done: bool = False
    result: R | None = None
    error: BaseException | None = None


class GroupCommit(Generic[T, R]):
    """Coalesce items submitted by many threads into calls of ``write`` (group commit).

    A caller that finds no write in flight writes its item (and any queued) at once: no
    added latency when idle. Callers that arrive meanwhile queue up, and the next of them
    to run writes the whole queue (up to ``max_batch``) in one call.
    """

    def __init__(self, write: Callable[[list[T]], list[R]], max_batch: int) -> None:
        self._write = write
        self._max = max_batch
        self._waiting: Gathering[_Slot[T, R]] = Gathering()
        self._cond = self._waiting.cond
        self._busy = False

    @property
    def pending(self) -> int:
        """How many items wait behind the write in flight."""
        with self._cond:
            return len(self._waiting)

    def submit(self, item: T) -> R:
        """Write ``item`` (with whatever else is queued); its result, or raise its error."""
        slot: _Slot[T, R] = _Slot(item)
        with self._cond:
            self._waiting.add(slot)
            while not slot.done and self._busy:
                self._cond.wait()
            while not slot.done:
                self._busy = True
                batch = self._waiting.take(self._max)
                self._cond.release()
                try:
                    self._run(batch)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._cond.notify_all()
        if slot.error is not None:
            raise slot.error
        return slot.result  # type: ignore[return-value]  # R may itself be Optional

    def _run(self, batch: list[_Slot[T, R]]) -> None:
        try:
            results = self._write([s.item for s in batch])
        except BaseException as exc:  # each waiter gets the error, none waits forever
            for slot in batch:
                slot.error = exc if slot is batch[0] else StoreError(f"outcome write failed: {exc}")
                slot.done = True
            log.debug("group commit of %d item(s) failed: %s", len(batch), exc)
            return
        for slot, result in zip(batch, results, strict=True):
            slot.result = result
            slot.done = True
