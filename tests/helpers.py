"""Shared test helpers: polling with a deadline (never a bare sleep)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01,
               message: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` real seconds pass."""
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        gate.wait(interval)  # bounded poll, not synchronisation by sleeping
