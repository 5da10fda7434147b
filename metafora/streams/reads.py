"""How a stream run gets its jobs from the source: checked reads, and a read ahead of its starts.

:func:`fetch` reads one range of indexes (``Jobs.at_range``; where it raises, ``at_index`` one
index at a time) and checks what came back: each index gets its job, or the error that fails
that job (None below the head, a job of another index, not a Job).

:class:`ReadAhead` keeps the jobs of the next indexes to start read before the window lets
them start. A run used to read a range only once the window had room for it, and then wait
for it: with short jobs the lanes ran dry during every read (the source's thread must wake and
take the GIL from the lanes; SQLite's driver gives it back on every row), and the stream ran
at the pace of its reads. Now, while the lanes run the jobs started, the next ones are read on
the source's strand: at most ``size`` indexes past the next start (so at most ``size`` past the
window), a new read when half of them are taken, never past the known head, one read in
flight. A job read ahead has not started: only the window starts jobs, as before. Its reads
(and its wake-ups: a read that lands kicks the run) are the run's, on the loop's thread; the
reads themselves run on the strand, one source call at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

from metafora.streams.jobs import Job, Jobs
from metafora.streams.threads import Strand

__all__ = ["ReadAhead", "fetch", "runs"]

Items = list["Job | BaseException"]


def fetch(source: Jobs, start: int, stop: int, head: int) -> tuple[Items, int]:
    """The jobs of ``start .. stop - 1`` (on the source's thread), checked: one entry per
    index, its job or the error that fails it; and how many are errors."""
    try:
        got: Sequence[object] = source.at_range(start, stop)
        if len(got) != stop - start:
            raise ValueError(f"at_range({start}, {stop}) returned {len(got)} entries, "
                             f"not {stop - start}")
    except Exception:
        got = [_call(source.at_index, index) for index in range(start, stop)]
    if _intact(got, start):
        return cast("Items", got if type(got) is list else list(got)), 0
    items: Items = [_checked(job, index, head) for index, job in zip(range(start, stop), got,
                                                                      strict=True)]
    return items, sum(1 for item in items if not isinstance(item, Job))


def split(items: Items, first: int, errors: int) -> tuple[list[Job], list[tuple[int, BaseException]]]:
    """``items`` (of ``first``, ``first + 1``, ...) as their jobs and ``(index, error)`` pairs."""
    if not errors:
        return cast("list[Job]", items), []
    jobs: list[Job] = []
    failed: list[tuple[int, BaseException]] = []
    for index, item in enumerate(items, first):
        if isinstance(item, Job):
            jobs.append(item)
        else:
            failed.append((index, item))
    return jobs, failed


def runs(indexes: list[int]) -> list[tuple[int, int]]:
    """``indexes`` (sorted within runs) as ``(start, stop)`` runs of consecutive ones, in order."""
    found: list[tuple[int, int]] = []
    for index in indexes:
        if found and found[-1][1] == index:
            found[-1] = (found[-1][0], index + 1)
        else:
            found.append((index, index + 1))
    return found


class ReadAhead:
    """The jobs of the indexes from ``first`` on, read ahead of their start (see the module
    docstring). Used on the loop's thread."""

    def __init__(self, strand: Strand, loop: asyncio.AbstractEventLoop, kick: Callable[[], None],
                 size: int, first: int) -> None:
        self._strand = strand
        self._loop = loop
        self._kick = kick
        self.size = size
        """The most indexes read and not taken (a new read starts when half are taken)."""
        self._items: Items = []
        self._taken = 0  # items before it are taken
        self._first = first  # the index of the first item not taken
        self._errors = 0  # errors among the items not taken
        self._reading: concurrent.futures.Future[tuple[Items, int]] | None = None
        self._broken: BaseException | None = None  # a read that raised (not one job's error)

    @property
    def ready(self) -> int:
        """Indexes read and not taken."""
        return len(self._items) - self._taken

    def take(self, count: int) -> tuple[list[Job], list[tuple[int, BaseException]]]:
        """The next ``count`` indexes' (fewer if fewer are read): their jobs, and the errors
        that fail the others ``(index, error)``. The caller starts them all. A read that
        raised raises here."""
        if self._broken is not None:
            raise self._broken
        count = min(count, self.ready)
        if count <= 0:
            return [], []
        items = self._items[self._taken:self._taken + count]
        first, self._first, self._taken = self._first, self._first + count, self._taken + count
        if self._taken == len(self._items):
            self._items, self._taken = [], 0
        if not self._errors:
            return cast("list[Job]", items), []
        jobs, failed = split(items, first, self._errors)
        self._errors -= len(failed)
        return jobs, failed

    def refill(self, source: Jobs, head: int) -> None:
        """Read the next indexes, up to ``head``, unless a read is in flight or more than half
        of ``size`` are read and not taken."""
        if self._reading is not None or self._broken is not None or self.ready > self.size // 2:
            return
        start = self._first + self.ready
        stop = min(head + 1, self._first + self.size)
        if start >= stop:
            return
        reading = self._strand.submit(fetch, source, start, stop, head)
        self._reading = reading
        reading.add_done_callback(functools.partial(self._landed_threadsafe, start))

    def _landed_threadsafe(self, start: int, reading: concurrent.futures.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run is gone
            self._loop.call_soon_threadsafe(self._landed, start, reading)

    def _landed(self, start: int, reading: concurrent.futures.Future[tuple[Items, int]]) -> None:
        if reading is not self._reading:
            return
        self._reading = None
        if reading.cancelled():
            return
        error = reading.exception()
        if error is not None:
            self._broken = error
        else:
            items, errors = reading.result()
            assert start == self._first + self.ready  # only this appends; take() keeps the end
            if self._taken:  # (the taken ones go now rather than be copied again and again)
                del self._items[:self._taken]
                self._taken = 0
            self._items.extend(items)
            self._errors += errors
        self._kick()


def _intact(got: Sequence[object], start: int) -> bool:
    """Whether ``got`` is exactly the jobs of ``start, start + 1, ...`` (the usual answer of a
    source, checked without a call per job; anything else is checked job by job)."""
    return (set(map(type, got)) <= {Job}
            and list(map(_INDEX, cast("Sequence[Job]", got))) == list(range(start, start + len(got))))


_INDEX = operator.attrgetter("index")


def _call(fn: Callable[[int], object], index: int) -> object:
    try:
        return fn(index)
    except Exception as exc:
        return exc


def _checked(job: object, index: int, head: int) -> Job | BaseException:
    """What the source gave for ``index``: its job, or the error that fails that job."""
    if isinstance(job, Exception):
        return job
    if job is None:
        return LookupError(f"at_index({index}) returned None, although head() is {head}")
    if not isinstance(job, Job):
        return TypeError(f"at_index({index}) returned {type(job).__name__}, not a Job")
    if job.index != index:
        return ValueError(f"at_index({index}) returned the job of index {job.index}")
    return job
