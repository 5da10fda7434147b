"""Waiting without sleeping: bounded polls, and holding a fault in place for a set time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from metafora.core.errors import MetaforaError

__all__ = ["hold", "poll"]

T = TypeVar("T")


def poll(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    """Call ``predicate`` every ``every`` s until it is truthy; AssertionError after ``timeout``.

    Store errors raised by the predicate (the store may be coming back) count as "not yet".
    """
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except MetaforaError as exc:
            last = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last})" if last is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")
        gate.wait(every)


def hold(seconds: float) -> None:
    """Keep a fault in place for ``seconds`` (a duration, not a synchronisation)."""
    # Holding a fault (SIGSTOP, a stopped store) for a set time: a duration, not a synchronisation.
    threading.Event().wait(seconds)
