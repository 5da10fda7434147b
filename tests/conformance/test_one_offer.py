"""Issue 51 point 2 on every store: one node per offer.

A fresh offer is claimed by the node rendezvous hashing ranks first among the live nodes; the
others try it only after a short delay, so when that node is full, frozen, or registered but
dead, another takes it. The other node ("a") runs on a fake clock: its delay never passes on
its own, so "b claimed it" cannot be a race a won or lost, and the fallback is shown by moving
a's clock (the delay's bound, 300 ms at most, is a unit test's: tests/unit/test_first_offer.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from metafora import Task, open_coordinator, simple_handler
from metafora.consumer.preference import preferred_node
from metafora.core import commands
from metafora.testing import FakeClock, LocalCluster, RecordingContext, wait_for

NODES = ["a", "b"]


def ids_for(node: str, count: int, prefix: str = "t") -> list[str]:
    """``count`` task ids rendezvous hashing gives to ``node`` among ``NODES``."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        task_id = f"{prefix}{i:04d}"
        if preferred_node(task_id, NODES) == node:
            out.append(task_id)
        i += 1
    return out


class Where:
    """Handlers that record where each task ran; ``block`` ids run until released."""

    def __init__(self, block: set[str] | None = None) -> None:
        self.lock = threading.Lock()
        self.ran: dict[str, list[str]] = {}
        self.block = block or set()
        self.release = threading.Event()

    def handler(self, node: str) -> object:
        def work(task: Task, stop: threading.Event) -> bool:
            with self.lock:
                self.ran.setdefault(task.id, []).append(node)
            if task.id in self.block:
                self.release.wait(60)
            return True

        return simple_handler(work)

    def nodes(self, task_id: str) -> list[str]:
        with self.lock:
            return list(self.ran.get(task_id, []))


@pytest.fixture
def cluster(store_url: str) -> Iterator[LocalCluster]:
    with LocalCluster(store_url, shutdown_timeout=10) as running:
        yield running


def _other(cluster: LocalCluster, where: Where, clock: FakeClock) -> None:
    """Node a, on a fake clock (its holds pass only when the test moves it)."""
    cluster.add(where.handler("a"), "a", clock=clock, balance_every=3600)


def _moved_until(clock: FakeClock, check: Callable[[], bool]) -> Callable[[], bool]:
    def step() -> bool:
        if check():
            return True
        clock.advance(0.05)
        return False

    return step


def test_an_offer_is_claimed_by_the_node_ranked_first(cluster: LocalCluster) -> None:
    where = Where()
    cluster.add(where.handler("b"), "b", balance_every=3600)
    _other(cluster, where, FakeClock())
    mine_b = ids_for("b", 5)
    for task_id in mine_b:  # one by one: each offer its own wave
        cluster.client.submit_task(Task(task_id))
    for task_id in mine_b:
        cluster.wait_for_state(task_id, "done", 30)
    # a heard every offer and never tried one (its hold never passed): no race, no claim.
    assert all(where.nodes(t) == ["b"] for t in mine_b), where.ran


def test_a_frozen_first_node_leaves_the_offer_to_another_after_the_delay(cluster: LocalCluster) -> None:
    where = Where()
    b = cluster.add(where.handler("b"), "b", balance_every=3600)
    clock = FakeClock()
    _other(cluster, where, clock)
    cluster.client.submit_command("b", commands.freeze())
    wait_for(lambda: b.frozen, 30, "b frozen")
    [task_id] = ids_for("b", 1)
    cluster.client.submit_task(Task(task_id))
    wait_for(_moved_until(clock, lambda: where.nodes(task_id) == ["a"]), 30, "a took it")
    cluster.wait_for_state(task_id, "done", 30)


def test_a_full_first_node_leaves_the_offer_to_another_after_the_delay(cluster: LocalCluster) -> None:
    blocker, task_id = ids_for("b", 2)
    where = Where(block={blocker})
    cluster.add(where.handler("b"), "b", balance_every=3600, max_tasks=1)
    cluster.client.submit_task(Task(blocker))
    wait_for(lambda: where.nodes(blocker) == ["b"], 30, "b full")
    clock = FakeClock()
    _other(cluster, where, clock)
    cluster.client.submit_task(Task(task_id))
    wait_for(_moved_until(clock, lambda: where.nodes(task_id) == ["a"]), 30, "a took it")
    where.release.set()
    cluster.wait_for_state(task_id, "done", 30)


def test_a_registered_but_dead_first_node_leaves_the_offer_to_another(cluster: LocalCluster) -> None:
    where = Where()
    dead = open_coordinator(cluster.url, node_id="b")  # registered, never claims
    dead.init(RecordingContext())
    try:
        clock = FakeClock()
        _other(cluster, where, clock)
        [task_id] = ids_for("b", 1)
        cluster.client.submit_task(Task(task_id))
        wait_for(_moved_until(clock, lambda: where.nodes(task_id) == ["a"]), 30, "a took it")
        cluster.wait_for_state(task_id, "done", 30)
    finally:
        dead.close()
