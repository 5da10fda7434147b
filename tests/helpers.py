"""Shared test helpers: polling with a deadline (never a bare sleep)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from metafora.connect import open_coordinator
from metafora.coordinators.memory import MemoryCoordinator
from metafora.task import Task
from metafora.testing import LocalCluster, wait_for

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, message: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` real seconds pass."""
    return wait_for(predicate, timeout, message)


class RanIds:
    """A handler function (for ``simple_handler``) that records the ids it ran and finishes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ids: list[str] = []

    def __call__(self, task: Task, stop: threading.Event) -> bool:
        with self._lock:
            self.ids.append(task.id)
        return True


class Harness(LocalCluster):
    """A LocalCluster on a fresh memory store, with direct access to memory coordinators."""

    def coordinator(self, node: str) -> MemoryCoordinator:
        coord = open_coordinator(self.url, node_id=node)
        assert isinstance(coord, MemoryCoordinator)
        return coord
