"""etcd: outcomes many per txn (``finish_many``, group-committed ``done``) and batched claims.

Real etcd (the ``etcd_url`` fixture), no mocks: a lost answer is made by running a request
twice against the store (the first attempt applied, its answer dropped), as the driver's own
retry after a connection error does.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.contracts.coordinator import Finish, Outcome
from metafora.coordinators.etcd import EtcdCoordinator
from metafora.coordinators.etcd.driver import EtcdDriver, TxnRequest, TxnResult
from metafora.coordinators.etcd.outcomes import ITEMS_PER_TXN
from metafora.core.errors import ClaimLost, CoordinatorUnavailable, MetaforaError
from metafora.testing import RecordingContext
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


class Cluster:
    """A client and initialised coordinators on one namespace, closed at the end."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stack = ExitStack()
        self.client = self.stack.enter_context(open_client(url))

    def node(self, node_id: str) -> EtcdCoordinator:
        coord = open_coordinator(self.url, node_id=node_id)
        assert isinstance(coord, EtcdCoordinator)
        coord.init(RecordingContext())
        self.stack.callback(coord.close)
        return coord

    def submit(self, prefix: str, n: int) -> list[Task]:
        tasks = [Task(f"{prefix}{i:04d}") for i in range(n)]
        self.client.submit_tasks(tasks)
        return tasks

    def state(self, task_id: str) -> TaskState:
        return self.client.get_task(task_id).state


@pytest.fixture
def cluster(etcd_url: str) -> Iterator[Cluster]:
    c = Cluster(etcd_url)
    with c.stack:
        yield c


def claim_all(coord: EtcdCoordinator, tasks: Sequence[Task]) -> list[Task]:
    """Claim every one of ``tasks`` (waiting for the watch cache where needed)."""
    claimed: list[Task] = []

    def more() -> bool:
        ids = {c.id for c in claimed}
        claimed.extend(coord.claim_many([t for t in tasks if t.id not in ids], len(tasks)))
        return len(claimed) == len(tasks)

    wait_until(more, 30, "every task claimed")
    return sorted(claimed, key=lambda t: t.id)


def answer_lost(driver: EtcdDriver) -> list[int]:
    """Make the next ``txns`` call lose its answers: each request runs once (applied, the
    answer dropped), then again, and the caller sees the second answer, marked retried."""
    real = driver.txns
    calls: list[int] = []

    def txns(requests: Sequence[TxnRequest], **kwargs: Any) -> list[TxnResult | MetaforaError]:
        if calls:
            return real(requests, **kwargs)
        calls.append(len(requests))
        real(requests, **kwargs)
        again = real(requests, **kwargs)
        return [a if isinstance(a, MetaforaError) else dataclasses.replace(a, retried=True)
                for a in again]

    driver.txns = txns  # type: ignore[method-assign]
    return calls


def test_finish_many_writes_each_outcome(cluster: Cluster) -> None:
    node = cluster.node("a")
    d, r, f = claim_all(node, cluster.submit("t", 3))
    results = node.finish_many([Finish(d, Outcome.DONE), Finish(r, Outcome.RELEASE),
                                Finish(f, Outcome.FAIL, "ValueError: boom")])
    assert results == [None, None, None]
    assert cluster.state(d.id) is TaskState.DONE
    assert cluster.state(r.id) is TaskState.PENDING
    failed = cluster.client.get_task(f.id)
    assert failed.state is TaskState.FAILED and failed.error == "ValueError: boom"
    assert node.held() == []
    assert node.finish_many([]) == []


def test_a_stale_claim_in_a_batch_is_refused_alone(cluster: Cluster) -> None:
    node, other = cluster.node("a"), cluster.node("b")
    tasks = claim_all(node, cluster.submit("t", 5))
    # t0001: released, then claimed by b (a's token is stale); t0003: an old token of a's
    node.release(tasks[1])
    taken = claim_all(other, [tasks[1]])[0]
    stale = Task(tasks[3].id, tasks[3].props, tasks[3].token - 1)
    results = node.finish_many([Finish(t, Outcome.DONE) for t in
                                (tasks[0], tasks[1], tasks[2], stale, tasks[4])])
    assert results[0] is None and results[2] is None and results[4] is None
    assert isinstance(results[1], ClaimLost) and isinstance(results[3], ClaimLost)
    assert [cluster.state(t.id) for t in tasks] == [
        TaskState.DONE, TaskState.CLAIMED, TaskState.DONE, TaskState.CLAIMED, TaskState.DONE]
    assert cluster.client.get_task(taken.id).owner == "b"
    node.done(tasks[3])  # the real token still holds
    assert cluster.state(tasks[3].id) is TaskState.DONE


def test_more_outcomes_than_one_txn_holds(cluster: Cluster) -> None:
    n = 3 * ITEMS_PER_TXN + 5  # 4 txns, each near etcd's 128 ops a branch
    node = cluster.node("a")
    tasks = claim_all(node, cluster.submit("t", n))
    stale = {7, ITEMS_PER_TXN + 1, n - 1}
    batch = [Finish(Task(t.id, t.props, t.token - 1) if i in stale else t, Outcome.DONE)
             for i, t in enumerate(tasks)]
    results = node.finish_many(batch)
    assert [i for i, r in enumerate(results) if r is not None] == sorted(stale)
    assert all(isinstance(results[i], ClaimLost) for i in stale)
    counts = cluster.client.task_counts()
    assert counts[TaskState.DONE] == n - len(stale) and counts[TaskState.CLAIMED] == len(stale)


def test_big_error_texts_are_split_over_txns(cluster: Cluster) -> None:
    node = cluster.node("a")
    tasks = claim_all(node, cluster.submit("t", 12))
    error = "E" * 200_000  # 12 of them are over etcd's 1.5 MiB request limit together
    assert node.finish_many([Finish(t, Outcome.FAIL, error) for t in tasks]) == [None] * 12
    assert all(cluster.client.get_task(t.id).error == error for t in tasks)


def test_a_lost_answer_retried_is_not_applied_twice(cluster: Cluster) -> None:
    node = cluster.node("a")
    tasks = claim_all(node, cluster.submit("t", 4))
    calls = answer_lost(node.driver)
    results = node.finish_many([Finish(tasks[0], Outcome.DONE), Finish(tasks[1], Outcome.RELEASE),
                                Finish(tasks[2], Outcome.FAIL, "boom"),
                                Finish(tasks[3], Outcome.DONE)])
    assert calls == [1]
    assert results == [None] * 4  # applied by the lost attempt: recognised, not refused
    assert [cluster.state(t.id) for t in tasks] == [
        TaskState.DONE, TaskState.PENDING, TaskState.FAILED, TaskState.DONE]
    # the caller retrying the batch (its answer lost for good) is refused, never re-applied
    again = node.finish_many([Finish(t, Outcome.DONE) for t in tasks])
    assert all(isinstance(r, ClaimLost) for r in again)
    assert cluster.state(tasks[1].id) is TaskState.PENDING


def test_a_lost_answer_with_a_stale_claim_in_the_batch(cluster: Cluster) -> None:
    node = cluster.node("a")
    tasks = claim_all(node, cluster.submit("t", 3))
    stale = Task(tasks[1].id, tasks[1].props, tasks[1].token - 1)
    answer_lost(node.driver)  # both attempts refused (stale): the fresh ones go again
    results = node.finish_many([Finish(tasks[0], Outcome.DONE), Finish(stale, Outcome.DONE),
                                Finish(tasks[2], Outcome.DONE)])
    assert results[0] is None and results[2] is None and isinstance(results[1], ClaimLost)
    assert cluster.state(tasks[1].id) is TaskState.CLAIMED


def test_unreachable_store_raises_for_the_whole_batch(cluster: Cluster) -> None:
    node = cluster.node("a")
    tasks = claim_all(node, cluster.submit("t", 2))

    def down(requests: Sequence[TxnRequest], **kwargs: Any) -> list[TxnResult | MetaforaError]:
        return [CoordinatorUnavailable("etcd is down (test)") for _ in requests]

    real = node.driver.txns
    node.driver.txns = down  # type: ignore[method-assign]
    with pytest.raises(CoordinatorUnavailable):
        node.finish_many([Finish(t, Outcome.DONE) for t in tasks])
    node.driver.txns = real  # type: ignore[method-assign]
    assert node.finish_many([Finish(t, Outcome.DONE) for t in tasks]) == [None, None]


def test_concurrent_done_calls_share_txns_and_stay_fenced(cluster: Cluster) -> None:
    node = cluster.node("a")
    tasks = claim_all(node, cluster.submit("t", 60))
    stale = {5, 33}
    errors: dict[str, BaseException] = {}
    go = threading.Barrier(len(tasks))

    def finish(i: int, task: Task) -> None:
        go.wait(30)
        try:
            node.done(Task(task.id, task.props, task.token - 1) if i in stale else task)
        except BaseException as exc:
            errors[task.id] = exc

    threads = [threading.Thread(target=finish, args=(i, t)) for i, t in enumerate(tasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(errors) == sorted(tasks[i].id for i in stale)
    assert all(isinstance(e, ClaimLost) for e in errors.values())
    counts = cluster.client.task_counts()
    assert counts[TaskState.DONE] == len(tasks) - len(stale)


def test_claim_many_with_stale_views_and_rivals(cluster: Cluster) -> None:
    node, rival = cluster.node("a"), cluster.node("b")
    tasks = cluster.submit("t", 100)  # 4 claim txns in flight
    taken = claim_all(rival, tasks[10:20])
    wait_until(lambda: all(node.seen_taken(t) for t in taken), 30, "a's cache sees b's claims")
    # Make a's view of two tasks stale (as if a change had not reached its watch yet): their
    # compares fail, the failure branch re-reads them and the next round claims them.
    with node._state.lock:
        for i in (3, 60):
            node._cache.entries[tasks[i].id].props_mod -= 1
    free = tasks[:10] + tasks[20:]
    got = node.claim_many(free, len(free))
    assert sorted(t.id for t in got) == sorted(t.id for t in free)
    assert {t.id for t in node.held()} == {t.id for t in free}
    # a lost claim answer: the retried txn fails (owner key exists) and adopts it as ours
    more = cluster.submit("u", 3)
    wait_until(lambda: all(not node.seen_taken(t) for t in more) and all(
        node._cache.entries.get(t.id) is not None for t in more), 30)
    answer_lost(node.driver)
    adopted = node.claim_many(more, 3)
    assert sorted(t.id for t in adopted) == [t.id for t in more]
    infos = [cluster.client.get_task(t.id) for t in more]
    assert [(i.owner, i.token) for i in infos] == [("a", t.token) for t in
                                                   sorted(adopted, key=lambda t: t.id)]
    assert node.finish_many([Finish(t, Outcome.DONE) for t in adopted]) == [None] * 3


def test_one_task_twice_in_a_batch(cluster: Cluster) -> None:
    node = cluster.node("a")
    tasks = claim_all(node, cluster.submit("t", 3))
    # etcd refuses a txn writing a key twice: the second outcome goes in its own txn and
    # finds the claim ended by the first (whichever ran first wins, the other is refused)
    results = node.finish_many([Finish(tasks[0], Outcome.DONE), Finish(tasks[1], Outcome.DONE),
                                Finish(tasks[0], Outcome.DONE), Finish(tasks[2], Outcome.DONE)])
    assert results[1] is None and results[3] is None
    assert sorted(r is None for r in (results[0], results[2])) == [False, True]
    assert all(cluster.state(t.id) is TaskState.DONE for t in tasks)
    more = cluster.submit("u", 2)
    wait_until(lambda: all(node._cache.entries.get(t.id) is not None for t in more), 30)
    got = node.claim_many([more[0], more[1], more[0]], 3)
    assert sorted(t.id for t in got) == [t.id for t in more]
