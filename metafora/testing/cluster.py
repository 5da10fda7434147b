"""Consumers on one store in threads of the test's process, and the waits tests need.

:class:`LocalCluster` starts consumers in threads and shuts them down; :func:`wait_for` polls a
condition against a real-time deadline; :class:`RecordingContext` drives a coordinator by
hand and records the tasks it loses.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar

from metafora.consumer import Consumer
from metafora.contracts.balancer import Balancer
from metafora.contracts.client import Client
from metafora.contracts.coordinator import DEFAULT_MAX_CRASHES, CoordinatorContext
from metafora.contracts.handler import HandlerFunc
from metafora.core.errors import CoordinatorUnavailable
from metafora.core.task import Task, TaskState, validate_labels
from metafora.surfaces.connect import open_client, open_coordinator

__all__ = ["LocalCluster", "RecordingContext", "wait_for"]

T = TypeVar("T")


class RecordingContext(CoordinatorContext):
    """A CoordinatorContext that records lost tasks (for driving a coordinator by hand)."""

    def __init__(self, *, max_crashes: int | None = DEFAULT_MAX_CRASHES,
                 labels: Mapping[str, str] | None = None, weight: float = 1.0) -> None:
        self.lost_tasks: list[Task] = []
        self.lost_event = threading.Event()
        self._lock = threading.Lock()
        self._max_crashes = max_crashes
        self._labels = validate_labels(labels or {}, "labels")
        self._weight = weight  # checked by the coordinator's init, as a consumer's is

    @property
    def max_crashes(self) -> int | None:
        return self._max_crashes

    @property
    def labels(self) -> Mapping[str, str]:
        return self._labels

    @property
    def weight(self) -> float:
        return self._weight

    def lost(self, task: Task) -> None:
        with self._lock:
            self.lost_tasks.append(task)
        self.lost_event.set()


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll ``predicate`` (every 10 ms of real time) until truthy; AssertionError after ``timeout``.

    A predicate that raises :class:`~metafora.core.errors.CoordinatorUnavailable` (a store briefly
    out of reach, as on a loaded CI machine) counts as not yet true; the timeout's message
    names the last such error.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    away: CoordinatorUnavailable | None = None
    while True:
        try:
            value = predicate()
        except CoordinatorUnavailable as exc:
            away = exc
        else:
            away = None
            if value:
                return value
        if time.monotonic() >= deadline:
            note = f" (the store was unreachable: {away})" if away is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{note}") from away
        pause.wait(0.01)


class LocalCluster:
    """Consumers running in threads of this process on one store, for users' tests.

    >>> with LocalCluster() as cluster:                       # memory:// by default
    ...     cluster.add(simple_handler(work)); cluster.add(simple_handler(work))
    ...     cluster.client.submit_task(Task("t1"))
    ...     cluster.wait_for_state("t1", TaskState.DONE)

    ``close()`` (or leaving the ``with`` block) shuts every consumer down and joins it.
    """

    def __init__(self, url: str | None = None, *, shutdown_timeout: float = 5.0) -> None:
        self._memory_name = None if url else f"cluster-{uuid.uuid4().hex[:8]}"
        self.url = url or f"memory://{self._memory_name}"
        self.client: Client = open_client(self.url)
        self.errors: list[BaseException] = []
        self._shutdown_timeout = shutdown_timeout
        self._consumers: list[tuple[Consumer, threading.Thread]] = []

    def add(
        self,
        handler_func: HandlerFunc,
        node_id: str | None = None,
        balancer: Balancer | None = None,
        *,
        coordinator_options: dict[str, Any] | None = None,
        **consumer_options: Any,
    ) -> Consumer:
        """Start a consumer in a thread; returns once its node is registered."""
        coord = open_coordinator(self.url, node_id=node_id, **(coordinator_options or {}))
        consumer = Consumer(coord, handler_func, balancer, **consumer_options)
        return self.start(consumer)

    def start(self, consumer: Consumer) -> Consumer:
        """Run an already built consumer in a thread; returns once its node is registered."""

        def run() -> None:
            try:
                consumer.run()
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=f"cluster-{consumer.node_id}", daemon=True)
        thread.start()
        self._consumers.append((consumer, thread))
        wait_for(lambda: consumer.node_id in self.client.nodes() or not thread.is_alive(),
                 what=f"node {consumer.node_id} to register")
        if self.errors:
            raise self.errors[-1]
        return consumer

    @property
    def consumers(self) -> list[Consumer]:
        """The consumers started so far."""
        return [c for c, _ in self._consumers]

    def wait_for_state(self, task_id: str, state: TaskState | str, timeout: float = 10.0) -> None:
        """Wait until the task is in ``state`` (real time, bounded)."""
        wanted = TaskState(state)
        wait_for(lambda: self.client.get_task(task_id).state is wanted, timeout,
                 f"task {task_id} to be {wanted.value}")

    def stop(self, consumer: Consumer, timeout: float | None = None, *, leaving: bool = True) -> None:
        """Shut one consumer down and join its thread.

        As a scale-down by default (``leaving=True``: its tasks go to the others at once);
        ``leaving=False`` is a restart's graceful stop: a node with an explicit id holds its
        tasks for that id for its ``sticky_for`` (see :mod:`metafora.core.holds`)."""
        for entry in list(self._consumers):
            if entry[0] is consumer:
                consumer.shutdown(timeout=self._shutdown_timeout if timeout is None else timeout,
                                  leaving=leaving)
                entry[1].join(self._shutdown_timeout + 10)
                self._consumers.remove(entry)

    def close(self) -> None:
        """Shut every consumer down, join them, close the client."""
        for consumer, _ in list(self._consumers):
            self.stop(consumer)
        self.client.close()
        if self._memory_name is not None:
            from metafora.coordinators.memory import drop_store

            drop_store(f"{self._memory_name}/metafora")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
