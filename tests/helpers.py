"""Shared test helpers: polling with a deadline (never a bare sleep)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from metafora.testing import wait_for

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, message: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` real seconds pass."""
    return wait_for(predicate, timeout, message)
