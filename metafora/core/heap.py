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
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BULK", "gc_paused"]

BULK = 500
"""From this many items, bulk work (a listing, a wave of offers) pauses the collector."""


class _Pause:
    """Who holds the pause (nested, from any thread) and whether the collector was on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False


_PAUSE = _Pause()


@contextmanager
def gc_paused(items: int | None = None) -> Iterator[None]:
    """Pause the cyclic collector for the block (unless ``items`` is given and below
    :data:`BULK`); nesting and other threads' pauses are counted, and the collector comes
    back on with the last one only if it was on before the first."""
    if items is not None and items < BULK:
        yield
        return
    with _PAUSE.lock:
        if _PAUSE.depth == 0:
            _PAUSE.was_enabled = gc.isenabled()
            gc.disable()
        _PAUSE.depth += 1
    try:
        yield
    finally:
        with _PAUSE.lock:
            _PAUSE.depth -= 1
            if _PAUSE.depth == 0 and _PAUSE.was_enabled:
                gc.enable()

