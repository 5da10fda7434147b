"""Capacities on every store (issue 28 part 7): a node publishes the most tasks it can run
(its ``max_tasks``, its thread cap, or a capacity reduced after a failed start) and keeps it
current with its heartbeat; the others' shares never exceed it, so nobody gives tasks back
for a node that is full.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from metafora import Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.balancers.fair import FairBalancer
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.testing import LocalCluster, RecordingContext, wait_for


class CapacityContext(RecordingContext):
    """A coordinator context whose capacity the test sets."""

    def __init__(self, capacity: int | None) -> None:
        super().__init__()
        self.cap = capacity

    @property
    def capacity(self) -> int | None:
        return self.cap


@pytest.fixture
def client(store_url: str) -> Iterator[Client]:
    with open_client(store_url) as c:
        yield c


def node(url: str, node_id: str, ctx: RecordingContext) -> Coordinator:
    coord = open_coordinator(url, node_id=node_id, lease_ttl=3)
    coord.init(ctx)
    return coord


def test_capacities_are_published_and_follow_the_node(store_url: str) -> None:
    ctx = CapacityContext(3)
    a = node(store_url, "a", ctx)
    b = node(store_url, "b", RecordingContext())
    try:
        wait_for(lambda: b.node_capacities() == {"a": 3}, 30, "b sees a's capacity of 3")
        ctx.cap = 1  # a failed start reduced it
        wait_for(lambda: b.node_capacities() == {"a": 1}, 30, "b sees a's capacity go down")
        ctx.cap = None  # back to no bound
        wait_for(lambda: b.node_capacities() == {}, 30, "b sees a's bound gone")
        assert b.node_weights() == {"a": 1.0, "b": 1.0}  # the rest of the record is kept
    finally:
        a.close()
        b.close()


def test_a_full_node_is_not_given_back_tasks_it_cannot_run(store_url: str) -> None:
    """small runs at most 2; big holds the other 18 and releases nothing for small."""
    stop_all = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        while not (stop.is_set() or stop_all.is_set()):
            stop.wait(0.5)
        return False

    big_fair = FairBalancer(min_age=0)
    with LocalCluster(store_url, shutdown_timeout=30) as cluster:
        try:
            small = cluster.add(simple_handler(work), "small", FairBalancer(min_age=0),
                                max_tasks=2)
            big = cluster.add(simple_handler(work), "big", big_fair)
            cluster.client.submit_tasks([Task(f"t{i:02d}") for i in range(20)])
            wait_for(lambda: len(small.tasks()) == 2 and len(big.tasks()) == 18, 60,
                     "small runs 2, big the other 18")
            wait_for(lambda: big_fair.share() == 18, 30, "big's share counts small as full")
            for _ in range(3):
                assert big_fair.balance() == []
            claimed = cluster.client.tasks(TaskState.CLAIMED)
            assert len(claimed) == 20 and sum(t.attempts for t in claimed) == 20  # no moves
        finally:
            stop_all.set()
