"""Group commit of handler outcomes: many done/release/fail writes in few store round trips.

A handler's end only queues its outcome here (no I/O on the handler's thread or the event
loop); one writer thread takes whatever has queued -- up to ``max_batch`` -- and records it
with :meth:`~metafora.contracts.coordinator.Coordinator.finish_many`. There is no timer: while one batch
is being written the next one gathers, so an idle node writes each outcome at once and a busy
one writes hundreds per round trip. Every outcome stays fenced by its own claim's token.

Per outcome, the semantics of a single write are kept: an outcome the store refused (the
claim is lost: :class:`~metafora.core.errors.ClaimLost`) is settled with that error; while the
store is unreachable (:class:`~metafora.core.errors.CoordinatorUnavailable`) the outcomes are
retried with a doubling back-off until :meth:`OutcomeWriter.stop`, after which one more try
is made and what still fails is settled with the error (given up). The queue is a
:class:`~metafora.core.groupcommit.Gathering`, the group commit the store writers share.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from metafora.contracts.coordinator import Coordinator, Finish
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.errors import CoordinatorUnavailable, MetaforaError, StoreError
from metafora.core.groupcommit import Gathering

__all__ = ["OutcomeWriter", "Pending"]

# The logger keeps the name it had before the consumer became a package.
log = logging.getLogger("metafora.outcomes")

Settle = Callable[[MetaforaError | None], None]
"""Told how one outcome ended: None when written, else the error that refused it."""


@dataclass(eq=False)
class Pending:
    """One outcome waiting to be written, and whom to tell how it ended (``queued``: when,
    ``time.monotonic()``)."""

    finish: Finish
    settle: Settle
    queued: float = field(default_factory=time.monotonic)


class OutcomeWriter:
    """Writes queued outcomes in batches on the thread that calls :meth:`run`.

    ``on_retry(count, error, delay)`` is called (to log) before each back-off while the store
    is unreachable; ``settle`` callbacks run on the writer thread and must not block long.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        max_batch: int = 256,
        retry_start: float = 0.1,
        retry_max: float = 5.0,
        clock: Clock | None = None,
        on_retry: Callable[[int, MetaforaError, float], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch!r}")
        self._coord = coordinator
        self._max_batch = max_batch
        self._retry_start = retry_start
        self._retry_max = retry_max
        self._clock = clock or SYSTEM_CLOCK
        self._on_retry = on_retry
        self._waiting: Gathering[Pending] = Gathering()
        self._cond = self._waiting.cond
        self._queue = self._waiting.items  # read here; changed only through self._waiting
        self._stop = threading.Event()
        self._writing = 0  # outcomes taken off the queue and not settled yet
        self._exited = False
        # Set by the consumer when its claims take queued outcomes along (see take): while
        # claim_soon() says a claim is on its way, an outcome waits up to ``linger`` seconds
        # for it before this thread writes it on its own.
        self.linger = 0.0
        self.claim_soon: Callable[[], bool] = lambda: False

    def put(self, item: Pending) -> bool:
        """Queue one outcome (never blocks on the store); False once :meth:`run` has returned
        (the caller writes it itself)."""
        with self._cond:
            if self._exited:
                return False
            if self._waiting.add(item) and not (self.linger and self.claim_soon()):
                # The writer waits only for an empty queue (or for its oldest outcome's
                # linger, which a newer one does not change): one wake-up per batch, not
                # per outcome; none while a claim is due to take it along (the claim loop
                # nudges the writer when a pass ends with none due).
                self._cond.notify()
            return True

    def nudge(self) -> None:
        """Wake the writer if outcomes wait and no claim is due to take them along."""
        if self._queue and not self.claim_soon():
            with self._cond:
                self._cond.notify()

    def pending(self) -> int:
        """Outcomes queued or being written."""
        with self._cond:
            return len(self._queue) + self._writing

    def stop(self) -> None:
        """Give up retrying: after one more try, what the store still cannot take is settled
        with its error; :meth:`run` returns once the queue is empty."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def run(self) -> None:
        """Write batches until :meth:`stop` was called and nothing is left."""
        while True:
            with self._cond:
                # After stop, outcomes another thread took (see take) are waited for: those
                # it could not write come back here.
                while not self._queue and not (self._stop.is_set() and not self._writing):
                    self._cond.wait(1.0)  # never wait without a timeout
                if not self._queue:
                    self._exited = True
                    return
                if self._lingering():
                    continue  # a claim took them along, or more may have come
                batch = self._take(self._max_batch)
            self._write(batch)

    def _lingering(self) -> bool:
        """Wait (holding the condition) while a claim that takes the outcomes along is due;
        True when the wait ended before the oldest outcome's ``linger`` was up."""
        if not self.linger or self._stop.is_set():
            return False
        left = self._queue[0].queued + self.linger - time.monotonic()
        if left <= 0 or not self.claim_soon():
            return False
        self._cond.wait(left)
        return True

    def take(self, count: int) -> list[Pending]:
        """Up to ``count`` queued outcomes, for another thread to write with its own request
        (the claim loop sends them along with its next claim); they must be handed back with
        :meth:`written` or :meth:`give_back`. Nothing once :meth:`stop` was called."""
        with self._cond:
            if self._stop.is_set() or self._exited:
                return []
            return self._take(count)

    def written(self, batch: list[Pending], results: list[MetaforaError | None]) -> None:
        """How the outcomes of :meth:`take` ended (one result each, in order): settled, except
        those the store could not be reached for, which go back to the writer to retry."""
        retry: list[Pending] = []
        for item, result in zip(batch, results, strict=True):
            if isinstance(result, CoordinatorUnavailable):
                retry.append(item)
            else:
                self._settle(item, result)
        if retry:
            self.give_back(retry)

    def give_back(self, batch: list[Pending]) -> None:
        """Outcomes of :meth:`take` that were not written: the writer writes them (first)."""
        with self._cond:
            self._writing -= len(batch)
            self._waiting.give_back(batch)
            self._cond.notify()

    def _take(self, count: int) -> list[Pending]:
        """Up to ``count`` queued outcomes (called holding the condition's lock)."""
        batch = self._waiting.take(count)
        self._writing += len(batch)
        return batch

    def _write(self, batch: list[Pending]) -> None:
        delay = self._retry_start
        while batch:
            try:
                results: list[MetaforaError | None] = self._coord.finish_many(
                    [p.finish for p in batch])
                if len(results) != len(batch):
                    raise StoreError(f"finish_many answered {len(results)} results for "
                                     f"{len(batch)} outcomes")
            except MetaforaError as exc:
                results = [exc] * len(batch)
            except Exception as exc:  # a bug in a store: settle (and log) rather than lose them
                log.exception("recording %d outcome(s) failed", len(batch))
                results = [StoreError(f"recording the outcome failed: {exc!r}")] * len(batch)
            retry: list[Pending] = []
            for item, result in zip(batch, results, strict=True):
                if isinstance(result, CoordinatorUnavailable) and not self._stop.is_set():
                    retry.append(item)
                else:
                    self._settle(item, result)
            if not retry:
                return
            error = next(r for r in results if isinstance(r, CoordinatorUnavailable))
            if self._on_retry is not None:
                self._on_retry(len(retry), error, delay)
            self._clock.wait(self._stop, delay)
            delay = min(delay * 2, self._retry_max)
            with self._cond:  # outcomes that queued meanwhile go along with the retry
                batch = retry + self._take(self._max_batch - len(retry))

    def _settle(self, item: Pending, result: MetaforaError | None) -> None:
        with self._cond:
            self._writing -= 1
            if not self._writing and self._stop.is_set():
                self._cond.notify_all()
        try:
            item.settle(result)
        except Exception:
            log.exception("settling the outcome of task %s failed", item.finish.task.id)
