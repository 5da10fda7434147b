"""A stream's stored progress and its window of jobs (pure data and functions, no I/O).

The progress lives in the cursor of the stream task's state-machine
:class:`~metafora.statemachine.machine.State` (written fenced by the claim token), as JSON::

    {"stream": 1, "start": 0, "processed": 41, "head": 97, "in_flight": 8,
     "failing": null | {"index": 42, "error": "ValueError: ...", "attempts": 5}}

Only the **processed index** is a promise (every index from ``start`` up to it is done);
``head`` and ``in_flight`` are what the owner saw at its last write, for operators.

:class:`Window` is the watermark bookkeeping of one run (Kafka's committed offset, flow-go's
processed index): jobs finish in any order, those above the lowest gap wait in a small set
until it closes, and only the watermark moves.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from metafora.core.errors import MetaforaError
from metafora.statemachine.machine import MAX_CURSOR_LENGTH, cut_error_text
from metafora.streams.jobs import StreamFailing, StreamInfo

__all__ = ["FORMAT", "InvalidProgress", "Progress", "Window"]

FORMAT: Final = 1
"""The version of the progress JSON (its ``"stream"`` field)."""

_FIELDS: Final = frozenset({"stream", "start", "processed", "head", "in_flight", "failing"})


class InvalidProgress(MetaforaError, ValueError):
    """A task's stored cursor is not a stream's progress (another handler wrote it, or it is damaged)."""


def _int(obj: Mapping[str, Any], name: str, low: int, *, optional: bool = False) -> int | None:
    value = obj.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidProgress(f"stream progress: {name!r} must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class Progress:
    """A stream's progress as stored: ``processed`` >= ``start`` - 1 (see the module docstring)."""

    start: int
    processed: int
    head: int | None = None
    in_flight: int = 0
    failing: StreamFailing | None = None

    @classmethod
    def fresh(cls, start: int) -> Progress:
        """The progress of a stream nothing of which is done yet."""
        return cls(start=start, processed=start - 1)

    def info(self) -> StreamInfo:
        """What operators see of it."""
        return StreamInfo(self.processed, self.head, self.in_flight, self.failing)

    def to_cursor(self) -> str:
        """The JSON text stored as the state's cursor (always under MAX_CURSOR_LENGTH)."""
        failing = None
        if self.failing is not None:
            failing = {"index": self.failing.index, "error": cut_error_text(self.failing.error),
                       "attempts": self.failing.attempts}
        text = json.dumps({"stream": FORMAT, "start": self.start, "processed": self.processed,
                           "head": self.head, "in_flight": self.in_flight, "failing": failing},
                          separators=(",", ":"), sort_keys=True)
        assert len(text) <= MAX_CURSOR_LENGTH  # the error text is cut; the rest are numbers
        return text

    @classmethod
    def from_cursor(cls, cursor: str | None, start: int) -> Progress:
        """The progress in ``cursor`` (fresh from ``start`` when None). InvalidProgress if damaged."""
        if cursor is None:
            return cls.fresh(start)
        try:
            obj = json.loads(cursor)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or obj.get("stream") != FORMAT:
            raise InvalidProgress(
                f"the task's cursor is not a stream's progress (written by another handler?): "
                f"{cursor[:80]!r}")
        extra = set(obj) - _FIELDS
        if extra:
            raise InvalidProgress(f"stream progress has unknown fields: {', '.join(sorted(extra))}")
        begin = _int(obj, "start", 0)
        assert begin is not None
        processed = _int(obj, "processed", begin - 1)
        assert processed is not None
        head = _int(obj, "head", -1, optional=True)
        in_flight = _int(obj, "in_flight", 0)
        assert in_flight is not None
        failing = obj.get("failing")
        if failing is not None:
            if not isinstance(failing, dict) or set(failing) != {"index", "error", "attempts"} \
                    or not isinstance(failing["error"], str):
                raise InvalidProgress(f"stream progress: bad 'failing' {failing!r}")
            index = _int(failing, "index", 0)
            attempts = _int(failing, "attempts", 0)
            assert index is not None and attempts is not None
            failing = StreamFailing(index, failing["error"], attempts)
        return cls(begin, processed, head, in_flight, failing)


class Window:
    """The jobs of one run above the processed index: which to start next, which run, which
    finished above a gap. Not thread-safe (the stream's coroutine owns it)."""

    def __init__(self, processed: int) -> None:
        self.processed = processed
        self.next = processed + 1  # the lowest index never started in this run
        self.running: set[int] = set()
        self.done_above: set[int] = set()  # finished, but a lower index is not
        self.waiting: set[int] = set()  # failed, waiting for their next attempt

    def room(self, head: int, max_processing: int, max_search_ahead: int) -> int:
        """How many new indexes may start now (within the head, the pool and the window)."""
        last = min(head, self.processed + max_search_ahead)
        return max(0, min(last - self.next + 1, max_processing - len(self.running)))

    def start(self, index: int) -> None:
        """``index`` starts (a new one: the next; or a retry of a waiting one)."""
        if index == self.next:
            self.next += 1
        else:
            assert index in self.waiting and index < self.next
            self.waiting.discard(index)
        self.running.add(index)

    def start_next(self, count: int) -> range:
        """The next ``count`` new indexes start; them."""
        started = range(self.next, self.next + count)
        self.running.update(started)
        self.next += count
        return started

    def finished(self, index: int) -> bool:
        """``index`` is done; True when the processed index moved."""
        return self.finished_many((index,))

    def finished_many(self, indexes: Collection[int]) -> bool:
        """``indexes`` are done; True when the processed index moved.

        Every index started and not processed is running, waiting or done above: the lowest
        one running or waiting (or the next, none being) is the first gap, and every index
        below it is done. So the watermark moves by a few set operations in C per batch, not
        a step per job.
        """
        running, waiting, done = self.running, self.waiting, self.done_above
        running.difference_update(indexes)
        done.update(indexes)
        gap = min(running) if running else self.next
        if waiting and (low := min(waiting)) < gap:
            gap = low
        if gap - 1 <= self.processed:
            return False
        if len(done) == gap - 1 - self.processed:
            done.clear()  # (all of them: the usual case when the window empties)
        else:
            done.difference_update(range(self.processed + 1, gap))
        self.processed = gap - 1
        return True

    def failed(self, index: int) -> None:
        """``index`` raised: it waits for another attempt (never skipped)."""
        self.running.discard(index)
        self.waiting.add(index)

    def progress(self, base: Progress, head: int | None, failing: StreamFailing | None,
                 in_flight: int | None = None) -> Progress:
        """``base`` with this window's processed index and ``in_flight`` (default: the jobs
        started and not finished)."""
        return replace(base, processed=self.processed, head=head,
                       in_flight=len(self.running) if in_flight is None else in_flight,
                       failing=failing)
