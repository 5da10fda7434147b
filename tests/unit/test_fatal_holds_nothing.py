"""A node that ends on a fatal error holds nothing for its id, whatever its ``sticky_for``:
sticky return is for a graceful stop (a restart), and a node in a crash loop would otherwise
keep its tasks from everyone for the window on every cycle (a crash behaves as before)."""

from __future__ import annotations

import threading
from typing import Any

from metafora import Consumer, Task, simple_handler
from metafora.coordinators.memory import MemoryClient, MemoryCoordinator, MemoryStore
from metafora.core.clock import SYSTEM_CLOCK
from metafora.testing import wait_for


class _WatchDies(MemoryCoordinator):
    """The in-memory coordinator whose watch fails (a bug, not a store error) once told to."""

    def __init__(self, store: MemoryStore, node_id: str) -> None:
        super().__init__(store, node_id)
        self.die = threading.Event()

    def watch(self, out: Any) -> None:
        inner = threading.Thread(target=super().watch, args=(out,), daemon=True)
        inner.start()
        self.die.wait(60)
        raise RuntimeError("the watch broke")


def test_a_fatal_error_holds_nothing_for_the_id() -> None:
    store = MemoryStore("fatal-holds", SYSTEM_CLOCK)
    coord = _WatchDies(store, "a")
    started = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        started.set()
        stop.wait(60)
        return False

    consumer = Consumer(coord, simple_handler(work), sticky_for=300.0, shutdown_timeout=5)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:  # the fatal error run() re-raises
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    client = MemoryClient(store)
    client.submit_task(Task("f"))
    wait_for(started.is_set, 30, "the task started")
    coord.die.set()
    runner.join(30)
    assert not runner.is_alive()
    assert errors and "the watch broke" in str(errors[0])
    info = client.get_task("f")
    assert info.held_for is None, info
