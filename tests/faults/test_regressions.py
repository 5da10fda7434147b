"""Regression tests for the bugs the fault campaign found (single process, fast).

1. etcd: one task key written by hand under an id no :class:`~metafora.Task` may have (a
   control character, more than 256 characters), or with an invalid ``launch_at``, made
   ``Task(...)`` raise inside every consumer's watch: the watch died and EVERY consumer of
   the cluster shut down. Now the invalid id is logged once and skipped, and a task whose
   stored props are invalid is failed by the claim with ``invalid props: ...``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from metafora import Task, TaskState, simple_handler
from metafora.testing import LocalCluster, wait_for

pytestmark = [pytest.mark.integration]


def _etcd_put(url: str, key_tail: str, value: bytes) -> None:
    """Put ``/metafora/<namespace>/<key_tail>`` straight into etcd."""
    from metafora.coordinators.etcd.config import EtcdConfig
    from metafora.coordinators.etcd.driver import EtcdDriver, Put
    from metafora.coordinators.etcd.layout import Keys
    from metafora.core.config import parse_store_url

    config = EtcdConfig.from_url(parse_store_url(url), {})
    driver = EtcdDriver(config.connection)
    driver.connect()
    try:
        driver.txn([], [Put(Keys(config.namespace).root + key_tail.encode(), value)])
    finally:
        driver.close()


@pytest.fixture
def ran() -> list[str]:
    """Ids of the tasks a handler ran."""
    return []


@pytest.fixture
def etcd_cluster_of_two(etcd_url: str, ran: list[str]) -> Iterator[LocalCluster]:
    """Two consumers in threads on a fresh etcd namespace, recording what they run."""
    lock = threading.Lock()

    def work(task: Task, stop: threading.Event) -> bool:
        with lock:
            ran.append(task.id)
        return True

    with LocalCluster(etcd_url) as cluster:
        for node in ("a", "b"):
            cluster.add(simple_handler(work), node_id=node, coordinator_options={"lease_ttl": 2})
        yield cluster


def test_etcd_consumers_survive_keys_with_invalid_ids_and_fail_invalid_props(
    etcd_cluster_of_two: LocalCluster, ran: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = etcd_cluster_of_two
    _etcd_put(cluster.url, "tasks/bad%01id/props", b'{"props": {}}')
    _etcd_put(cluster.url, "tasks/" + "x" * 300 + "/props", b'{"props": {}}')
    _etcd_put(cluster.url, "tasks/bad-launch/props", b'{"props": {"launch_at": "garbage"}}')
    cluster.client.submit_task(Task("good"))
    cluster.wait_for_state("good", TaskState.DONE)
    cluster.wait_for_state("bad-launch", TaskState.FAILED)
    info = cluster.client.get_task("bad-launch")
    assert info.error is not None and info.error.startswith("invalid props:"), info.error
    assert ran == ["good"]
    # Both consumers still run: a new task is still picked up.
    cluster.client.submit_task(Task("after"))
    cluster.wait_for_state("after", TaskState.DONE)
    assert cluster.errors == []
    assert all(c.healthy() for c in cluster.consumers)
    wait_for(lambda: any("invalid id" in r.getMessage() for r in caplog.records), 5,
             "the invalid ids to be logged")


def test_etcd_offers_refused_while_re_registering_are_made_again(
    etcd_url: str, ran: list[str]
) -> None:
    """Found by the network-cut scenario: pending tasks sat idle until the 30 s re-list.

    While a node has no lease (fenced, re-registering) its ``claim`` returns None and the
    consumer drops the offer. Nothing changes in etcd afterwards to offer the task again,
    so it waited for the safety-net re-list (``poll_interval``, 30 s by default) although
    every consumer was idle. Now a node that re-registers re-offers every claimable task.
    """
    from metafora import Consumer, open_coordinator
    from metafora.coordinators.etcd import EtcdCoordinator

    coord = open_coordinator(etcd_url, node_id="a", lease_ttl=2, poll_interval=60)
    assert isinstance(coord, EtcdCoordinator)
    refused: list[str] = []
    real_claim_many = coord.claim_many

    def spy(tasks: Sequence[Task], limit: int) -> list[Task]:
        got = real_claim_many(tasks, limit)
        taken = {t.id for t in got}
        refused.extend(t.id for t in tasks if t.id not in taken)
        return got

    coord.claim_many = spy  # type: ignore[method-assign]

    def work(task: Task, stop: threading.Event) -> bool:
        ran.append(task.id)
        return True

    with LocalCluster(etcd_url) as cluster:
        cluster.start(Consumer(coord, simple_handler(work)))
        coord.suspend_keepalive()  # cut off: the node fences and drops its lease
        wait_for(lambda: coord.lease_id is None, 10, "the node to fence")
        cluster.client.submit_task(Task("while-away"))
        wait_for(lambda: "while-away" in refused, 10, "the offer to be refused")
        coord.resume_keepalive()  # back: it re-registers...
        cluster.wait_for_state("while-away", TaskState.DONE, timeout=10)  # ...and claims it
        assert ran == ["while-away"] and cluster.errors == []


def test_offers_deferred_behind_a_batch_that_lost_every_claim_are_retried() -> None:
    """Found by the network-cut scenario: an idle node ignored waiting tasks for 20 s.

    The consumer approves offers up to its free slots and defers the rest ("full"). When
    every claim of that approved batch was lost to other nodes, the slots stayed free but
    the deferred offers were only retried when a handler finished: on an idle node, never
    (until the coordinator offered something again). Now they are retried at once.
    """
    import random

    from metafora import Consumer, open_coordinator
    from metafora.coordinators.memory import MemoryCoordinator

    class LosesRaces(MemoryCoordinator):
        """Every claim of a task named ``taken-*`` is lost to another node."""

        def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
            return super().claim_many([t for t in tasks if not t.id.startswith("taken-")], limit)

    class Sorted(random.Random):
        """Offers in id order: the ``taken-*`` ones first, ``zz-free`` last."""

        def shuffle(self, x: Any) -> None:
            x.sort(key=lambda task: task.id)

    ran: list[str] = []

    def work(task: Task, stop: threading.Event) -> bool:
        ran.append(task.id)
        return True

    with LocalCluster() as cluster:
        for task_id in ("taken-1", "taken-2", "zz-free"):
            cluster.client.submit_task(Task(task_id))
        plain = open_coordinator(cluster.url, node_id="a")
        assert isinstance(plain, MemoryCoordinator)
        coord = LosesRaces(plain._store, "a")  # the same in-process store
        cluster.start(Consumer(coord, simple_handler(work), max_tasks=2, rng=Sorted()))
        cluster.wait_for_state("zz-free", TaskState.DONE, timeout=5)
        assert ran == ["zz-free"] and cluster.errors == []


def test_etcd_fenced_handlers_get_the_margin_before_their_tasks_can_be_claimed(
    etcd_url: str,
) -> None:
    """Found by the long store-restart scenario: two runs of one task overlapped.

    A node whose renewals fail self-fences ``margin`` before its lease expires, so its
    handlers have that long to stop before anyone else may claim their tasks. But the node
    re-registered at once after the fence, revoking the old lease, which freed the tasks at
    once: another node claimed one 0.3 s later while the fenced handler was still inside a
    state write. Now the old lease is revoked only when it would have expired anyway.
    """
    from metafora import open_coordinator
    from metafora.coordinators.etcd import EtcdCoordinator
    from metafora.coordinators.etcd.config import ETCD_FENCING
    from metafora.testing import RecordingContext

    ttl = 2
    a = open_coordinator(etcd_url, node_id="a", lease_ttl=ttl)
    b = open_coordinator(etcd_url, node_id="b", lease_ttl=ttl)
    assert isinstance(a, EtcdCoordinator) and isinstance(b, EtcdCoordinator)
    ctx = RecordingContext()
    with LocalCluster(etcd_url) as cluster:
        a.init(ctx)
        b.init(RecordingContext())
        try:
            cluster.client.submit_task(Task("t"))
            assert a.claim(Task("t")) is not None
            a.suspend_keepalive()  # renewals stop getting through...
            assert ctx.lost_event.wait(10)
            lost_at = time.monotonic()
            a.resume_keepalive()  # ...and work again right after the fence
            claimed = wait_for(lambda: b.claim(Task("t")), 10, "b to claim the task")
            waited = time.monotonic() - lost_at
            assert claimed is not None
            assert waited >= 0.8 * ETCD_FENCING.margin(ttl), f"claimable {waited:.2f}s after the fence"
        finally:
            a.close()
            b.close()
