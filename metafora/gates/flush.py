"""Group commit of a claim's item results: durable within ``flush_interval`` of finishing.

The gate handler hands every result to a :class:`ResultFlusher` as soon as its item is
processed. The results wait for one of two writes, whichever comes first:

- the owner's next fenced write (taking the next batch writes the results of the last one in
  the same transaction, :meth:`ResultFlusher.commit`), so a fast processor costs one write
  per batch as before;
- a background thread's write once the oldest waiting result is ``flush_interval`` old, so
  with a slow processor (an HTTP call of seconds) no finished item waits longer than that
  for its write.

A kill -9 therefore re-runs at most the items in work and those finished within the last
``flush_interval``. Both writes go through the same lock, one at a time. A background write
that fails (the claim was lost, or the store stayed unreachable) is kept as :attr:`error`
and raised to the owner by its next :meth:`commit`; no result is written after it. The
waiting results are a :class:`~metafora.core.groupcommit.Gathering`, the queue of the group
commit the outcome writers share.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.groupcommit import Gathering
from metafora.gates.model import ItemResult

__all__ = ["ResultFlusher"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_JOIN_TIMEOUT = 30.0  # seconds close() waits for a background write in progress

Write = Callable[[int, Sequence[ItemResult]], T]
"""``write(gate, results)``: a fenced write of results of items processed at ``gate``."""


class ResultFlusher:
    """Results of one claim waiting to be written (see the module docstring).

    ``write(gate, results)`` is the background write (a fenced ``finish``); ``on_error`` is
    called from the background thread when it fails (the owner should stop taking items).
    Every result added belongs to the gate of the batch in work: the owner commits before
    it moves to another gate.
    """

    def __init__(self, write: Write[object], interval: float, name: str,
                 on_error: Callable[[], None]) -> None:
        self._write = write
        self._interval = interval
        self._name = name
        self._on_error = on_error
        self._waiting: Gathering[ItemResult] = Gathering()
        self._cond = self._waiting.cond
        self._commit_lock = threading.Lock()
        self._gate = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        # The background thread is woken by add() only from an untimed wait: while results
        # keep coming it ticks at the interval instead (a fast processor would otherwise
        # wake it once per batch for nothing).
        self._untimed = False
        self._recent = False
        self.error: BaseException | None = None
        """The failure of a background write (None while all went well)."""

    @property
    def pending(self) -> int:
        """How many results wait for their write."""
        with self._cond:
            return len(self._waiting)

    def add(self, gate: int, outcome: ItemResult) -> None:
        """A result to write within ``interval`` (thread-safe)."""
        with self._cond:
            if self._waiting.add(outcome) and self._untimed:
                self._cond.notify()
            self._recent = True
            self._gate = gate
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def commit(self, write: Write[T]) -> T:
        """Run ``write(gate, results)`` now with every waiting result (it may do more in the
        same transaction, e.g. take the next batch); raises the error of a failed
        background write instead. A result whose write raised is not retried here: the
        claim ends (lost or unreachable) and the next owner runs the item again."""
        with self._commit_lock:
            if self.error is not None:
                raise self.error
            gate, results = self._drain()
            return write(gate, results)

    def close(self) -> None:
        """Stop the background thread (waiting results are not written: commit first)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A write in progress ends within one store call: the owner is stopping, so
            # the handler's store retries give up at once.
            thread.join(_JOIN_TIMEOUT)
            if thread.is_alive():
                log.warning("%s: a result write is still running after %gs; not waiting for it",
                            self._name, _JOIN_TIMEOUT)

    def _drain(self) -> tuple[int, list[ItemResult]]:
        with self._cond:
            return self._gate, self._waiting.take()

    def _due(self) -> bool:
        """Wait until the oldest result is ``interval`` old (True) or closing (False)."""
        with self._cond:
            while not self._closed:
                if self._waiting.items:
                    left = self._waiting.oldest + self._interval - SYSTEM_CLOCK.monotonic()
                    if left <= 0:
                        return True
                    self._cond.wait(left)
                elif self._recent:  # any result within one interval ago lands in a tick
                    self._recent = False
                    self._cond.wait(self._interval)
                else:
                    self._untimed = True
                    self._cond.wait()
                    self._untimed = False
            return False

    def _loop(self) -> None:
        while self._due():
            try:
                self.commit(self._write_if_any)
            except Exception as exc:  # kept (self.error) and raised to the owner's thread
                log.warning("%s: writing item results failed; the claim stops: %s", self._name, exc)
                self._on_error()
                return

    def _write_if_any(self, gate: int, results: Sequence[ItemResult]) -> None:
        if not results:
            return
        try:
            self._write(gate, results)
        except Exception as exc:
            self.error = exc  # still under the commit lock: no later commit writes past it
            raise
