"""Bulk work without the cyclic garbage collector's quadratic toll.

A node that lists a large backlog builds hundreds of thousands of long-lived objects in a few
seconds (cache entries, offers, ignore deadlines). CPython's collector runs a full pass over
every tracked object each time the old generation grew by a quarter, so a growing heap is
scanned again and again while it is built: in the 100,000-task / 10-node etcd storm, 40 % of a
node's CPU during its first ten seconds (eight full passes), 18 % over the whole storm.

:func:`gc_paused` turns the collector off around such bulk work and back on after it (when it
was on), nested and from any thread: plain reference counting still frees everything that is
not a cycle, and what the bulk work built is collected in one pass afterwards. It is meant
for work of a second or so, never for a steady state: a cycle made meanwhile (by any thread
of the process) waits until the pause ends.

:func:`gc_paced` is for the steady state of a running consumer: every task in flight stays
alive from its claim to its outcome's write (its claim, entry, handler, run and outcome: tens
of objects), long enough to reach the old generation, so at a few thousand short tasks a second
the old generation grows by a quarter every ~1,300 tasks and CPython walks the whole heap each
time: on 20,000 no-op tasks on PostgreSQL (one node) 15 full passes, half of the node's CPU
(0.146 ms a task; 0.077 with one full pass). While a consumer runs, a full pass waits for 100
passes of the middle generation instead of 10 (``STEADY``); the young generations are
collected as before, so a cycle still goes young unless it lived long.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BULK", "DEFAULT", "STEADY", "gc_paced", "gc_paused"]

BULK = 500
"""From this many items, bulk work (a listing, a wave of offers) pauses the collector."""


class _Holders:
    """How many blocks hold a process-wide collector setting (nested, from any thread), and
    what the first one found (to put back with the last)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.found = False


_PAUSE = _Holders()  # found: the collector was on

DEFAULT = (700, 10, 10)
"""CPython's own thresholds: a process that set others keeps them (:func:`gc_paced`)."""
STEADY = (700, 10, 100)
"""The thresholds while a consumer runs: a full pass after 100 of the middle generation."""

_PACE = _Holders()  # found: the default thresholds (so they were paced)


@contextmanager
def gc_paused(items: int | None = None) -> Iterator[None]:
    """Pause the cyclic collector for the block (unless ``items`` is given and below
    :data:`BULK`); nesting and other threads' pauses are counted, and the collector comes
    back on with the last one only if it was on before the first."""
    if items is not None and items < BULK:
        yield
        return
    with _PAUSE.lock:
        if _PAUSE.count == 0:
            _PAUSE.found = gc.isenabled()
            gc.disable()
        _PAUSE.count += 1
    try:
        yield
    finally:
        with _PAUSE.lock:
            _PAUSE.count -= 1
            if _PAUSE.count == 0 and _PAUSE.found:
                gc.enable()


@contextmanager
def gc_paced() -> Iterator[None]:
    """Run the block with the collector at ``STEADY`` (a consumer's run), when the process
    has CPython's default thresholds; nested and from any thread, the defaults come back with
    the last block, unless someone set other thresholds meanwhile."""
    with _PACE.lock:
        if _PACE.count == 0:
            _PACE.found = gc.get_threshold() == DEFAULT
            if _PACE.found:
                gc.set_threshold(*STEADY)
        _PACE.count += 1
    try:
        yield
    finally:
        with _PACE.lock:
            _PACE.count -= 1
            if _PACE.count == 0 and _PACE.found and gc.get_threshold() == STEADY:
                gc.set_threshold(*DEFAULT)
