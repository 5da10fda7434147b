"""The values and the source interface of a stream of indexed jobs (flow-go's jobqueue).

A stream reads its jobs from a :class:`Jobs` source by index: ``head()`` is the highest
index that exists now, ``at_index(i)`` the job at ``i``. Indexes are dense from the
stream's ``start``: every index up to ``head()`` has a job. The stream's progress is the
**processed index**: every index from ``start`` up to it is done.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

__all__ = ["Job", "Jobs", "StreamFailing", "StreamInfo", "Wake"]

Wake = Callable[[], None]
"""Called (no I/O, must not block) when new jobs may exist; it may be called spuriously."""


@dataclass(frozen=True)
class Job:
    """One job of a stream: its ``index`` in the source, a stable ``id`` and its payload."""

    index: int
    id: str
    payload: Any = None


class Jobs(abc.ABC):
    """A pull-style source of indexed jobs (flow-go's ``Jobs``: ``Head`` and ``AtIndex``)."""

    @abc.abstractmethod
    def head(self) -> int:
        """The highest index that exists now; -1 when there is none yet."""

    @abc.abstractmethod
    def at_index(self, index: int) -> Job | None:
        """The job at ``index`` (its ``index`` must equal the argument); None if not there yet."""

    def at_range(self, start: int, stop: int) -> Sequence[Job | None]:
        """The jobs at ``start .. stop - 1``, one entry per index (None: not there yet).

        Optional: a stream fetches the jobs it starts a run at a time through it, and a
        source that reads in batches (a SQL range scan) may override it; the default calls
        :meth:`at_index` for each. Each job is checked as ``at_index``'s is (its ``index`` must
        be its position's); if it raises, the stream asks ``at_index`` one index at a time,
        so an error stays with its job.
        """
        return [self.at_index(index) for index in range(start, stop)]

    def listen(self, wake: Wake) -> bool:
        """Call ``wake`` when new jobs may exist (a push channel of the source).

        Returns False when the source cannot push (the stream then re-reads ``head()`` on
        its fallback poll, on a check and when a job finishes).
        """
        return False

    def close(self) -> None:
        """Release what the source holds (connections, listeners). Idempotent."""
        return

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class StreamFailing:
    """The job a stream is stuck on: its index, the last error and how many attempts failed."""

    index: int
    error: str
    attempts: int


@dataclass(frozen=True)
class StreamInfo:
    """What an operator sees of a stream (``Client.stream(task_id)``).

    ``processed``: every index from the stream's start up to it is done (start - 1 when
    none is); ``head``: the source's highest index when the owner last looked (-1: none,
    None: not known); ``in_flight``: jobs running at the owner's last report; ``failing``:
    the job the stream is paused on after its attempts ran out, or None.
    """

    processed: int
    head: int | None
    in_flight: int
    failing: StreamFailing | None = None

    @property
    def lag(self) -> int | None:
        """Jobs that exist and are not yet processed (None when the head is not known)."""
        return None if self.head is None else max(0, self.head - self.processed)
