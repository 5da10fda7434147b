"""Retention of finished tasks and the leaderless pruner (issue 36), on every store."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from metafora import Task, TaskState
from metafora.consumer.cluster_metrics import read_cluster
from metafora.contracts.coordinator import Coordinator
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import ConfigError
from metafora.core.retention import DEFAULT_RETENTION, Pruner, Retention
from metafora.statemachine.machine import Message, State, StateCode
from metafora.statemachine.store import commands_for, state_store_for
from tests.conformance.test_coordinator import Cluster, _opened
from tests.conformance.test_limits import _kill
from tests.helpers import wait_until


@pytest.fixture
def cluster(store_url: str) -> Iterator[Cluster]:
    yield from _opened(store_url)


def test_policy_default_set_show_and_bad_input(cluster: Cluster) -> None:
    c = cluster.client
    assert c.retention() == DEFAULT_RETENTION
    assert DEFAULT_RETENTION.describe() == "done 7d, failed 30d, killed 30d"
    got = c.set_retention(done=timedelta(hours=1), killed=None)
    assert got == Retention(timedelta(hours=1), timedelta(days=30), None)
    assert c.retention() == got
    assert c.set_retention(failed="2d").describe() == "done 1h, failed 2d, killed never"
    with pytest.raises(ConfigError, match="never"):
        c.set_retention(done="soon")
    with pytest.raises(ConfigError):
        c.set_retention(done=timedelta(0))
    assert c.retention().describe() == "done 1h, failed 2d, killed never"


def _finish(coord: Coordinator, task_id: str, outcome: str, machine: StateCode | None = None,
            ) -> None:
    claimed = coord.claim(Task(task_id))
    assert claimed is not None
    if machine is not None:
        state_store_for(coord).store(claimed, State(machine))
    if outcome == "done":
        coord.done(claimed)
    else:
        coord.fail(claimed, "boom")


def _fill(cluster: Cluster, coord: Coordinator, finished: int) -> list[str]:
    """``finished`` tasks done (with a state and a queued command), one failed, one killed, one
    stateful failed; one pending, one claimed and one sleeping left alive; the finished ids."""
    c = cluster.client
    ids = [f"done-{n:04d}" for n in range(finished)]
    c.submit_tasks([Task(i) for i in ids] + [Task(i) for i in (
        "failed", "killed", "sm-failed", "pending", "claimed", "sleeping")])
    commands = commands_for(c)
    for task_id in ids:
        _finish(coord, task_id, "done", StateCode.COMPLETED)
        commands.send(task_id, Message.pause())
    _finish(coord, "failed", "fail")
    _finish(coord, "killed", "done", StateCode.KILLED)
    _finish(coord, "sm-failed", "done", StateCode.FAILED)
    held = coord.claim(Task("claimed"))
    assert held is not None
    sleeping = coord.claim(Task("sleeping"))
    assert sleeping is not None
    state_store_for(coord).store(sleeping, State(
        StateCode.SLEEPING, until=datetime.now(UTC) + timedelta(hours=1)))
    return [*ids, "failed", "killed", "sm-failed"]


def _alive(cluster: Cluster) -> set[str]:
    return {info.id for info in cluster.client.tasks()}


def test_one_second_policy_prunes_finished_only(cluster: Cluster) -> None:
    coord = cluster.node("n1")
    finished = _fill(cluster, coord, 20)
    c = cluster.client
    c.set_retention(done="1s", failed="1s", killed="1s")
    pruner = Pruner(coord, SYSTEM_CLOCK, interval=0.2, batch=7)
    thread = threading.Thread(target=pruner.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: _alive(cluster) == {"pending", "claimed", "sleeping"}, timeout=20)
    finally:
        pruner.stop()
        thread.join(10)
    assert pruner.pruned == len(finished)
    store = state_store_for(c)
    commands = commands_for(c)
    for task_id in finished:
        assert store.get(task_id) is None
        assert commands.pending(task_id) == 0
    assert store.get("sleeping") is not None  # a sleeping task keeps its state
    assert c.get_task("claimed").state is TaskState.CLAIMED
    # A task submitted again under a pruned id starts clean.
    c.submit_task(Task("done-0000"))
    assert store.get("done-0000") is None
    assert commands.pending("done-0000") == 0


def test_kinds_follow_their_own_retention(cluster: Cluster) -> None:
    coord = cluster.node("n1")
    _fill(cluster, coord, 3)
    c = cluster.client
    c.set_retention(done=None, failed=None, killed="1s")
    wait_until(lambda: c.prune() > 0 or "killed" not in _alive(cluster), timeout=10)
    assert "killed" not in _alive(cluster)
    assert {"failed", "sm-failed", "done-0000"} <= _alive(cluster)
    c.set_retention(failed="1s")
    # failed and the state machine's failed (finished after killed: maybe not 1 s ago yet)
    pruned: list[int] = []

    def both() -> bool:
        pruned.append(c.prune())
        return sum(pruned) >= 2

    wait_until(both, timeout=10)
    assert sum(pruned) == 2
    assert _alive(cluster) == {"done-0000", "done-0001", "done-0002", "pending", "claimed",
                               "sleeping"}


def test_done_ones_go_while_killed_and_failed_ones_stay(cluster: Cluster) -> None:
    """A done task whose state machine says killed or failed follows that kind's policy (never
    here), not the done one's."""
    coord = cluster.node("n1")
    _fill(cluster, coord, 2)
    c = cluster.client
    c.set_retention(done="1s", failed=None, killed=None)
    wait_until(lambda: c.prune() < 0 or not {"done-0000", "done-0001"} & _alive(cluster), timeout=10)
    assert _alive(cluster) == {"failed", "killed", "sm-failed", "pending", "claimed", "sleeping"}


def test_three_nodes_prune_without_a_leader(cluster: Cluster) -> None:
    nodes = [cluster.node(f"n{i}") for i in range(3)]
    finished = _fill(cluster, nodes[0], 60)
    cluster.client.set_retention(done="1s", failed="1s", killed="1s")
    pruners = [Pruner(coord, SYSTEM_CLOCK, interval=0.3, batch=5) for coord in nodes]
    threads = [threading.Thread(target=p.run, daemon=True) for p in pruners]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: _alive(cluster) == {"pending", "claimed", "sleeping"}, timeout=30)
    finally:
        for p in pruners:
            p.stop()
        for t in threads:
            t.join(10)
    # Every finished task was deleted exactly once, whichever node had the turn.
    assert sum(p.pruned for p in pruners) == len(finished)


def test_purge_shares_the_pruning(cluster: Cluster) -> None:
    coord = cluster.node("n1")
    finished = _fill(cluster, coord, 5)
    c = cluster.client
    assert c.purge(timedelta(days=1)) == 0
    assert c.purge() == len(finished)
    assert state_store_for(c).get("done-0001") is None
    assert _alive(cluster) == {"pending", "claimed", "sleeping"}


def test_cluster_view_matches_the_store(cluster: Cluster) -> None:
    a = cluster.node("a")
    b = cluster.node("b")
    c = cluster.client
    c.submit_tasks([Task(f"t{n}") for n in range(10)])
    for n in range(3):
        assert a.claim(Task(f"t{n}")) is not None
    assert b.claim(Task("t3")) is not None

    def matches() -> bool:
        view = read_cluster(a)
        counts = c.task_counts()
        return (view.pending == counts[TaskState.PENDING] == 6
                and view.held == counts[TaskState.CLAIMED] == 4 and view.nodes == 2)

    wait_until(matches, timeout=10)
    view = read_cluster(c)
    assert (view.pending, view.held, view.nodes) == (6, 4, 2)
    assert "6 pending, 4 held" in view.describe()
    # A storm of submits, then b goes away holding t3 (its lease ended as a crash would on
    # memory://; closed elsewhere, as a SQL or etcd kill test's node keeps renewing): its claim
    # is claimable work again, and b is no longer counted.
    c.submit_tasks([Task(f"storm{n:03d}") for n in range(200)])
    if type(b).__name__ == "MemoryCoordinator":
        _kill(b)
    else:
        b.close()

    def after_kill() -> bool:
        view = read_cluster(a)
        return (view.pending, view.held, view.nodes) == (207, 3, 1)

    wait_until(after_kill, timeout=20)
    counts = c.task_counts()  # t3: pending again, or still claimed by the dead node
    assert counts[TaskState.PENDING] + counts[TaskState.CLAIMED] == 207 + 3


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_prune_takes_gate_items_and_partitions(kind: str, metafora_store_url: Any) -> None:
    from metafora.gates import ItemStore, NewItem

    url = metafora_store_url(kind)
    cluster = Cluster(url)
    items = ItemStore(url)
    with cluster.stack:
        cluster.stack.callback(items.close)
        coord = cluster.node("n1")
        cluster.client.submit_tasks([Task("job-old"), Task("job-live")])
        items.add("job-old", [NewItem(gate=0, data=b"x")] * 5)
        items.add("job-live", [NewItem(gate=0, data=b"y")] * 3)
        _finish(coord, "job-old", "done", StateCode.COMPLETED)
        cluster.client.set_retention(done="1s")
        wait_until(lambda: cluster.client.prune() == 1 or not items.list("job-old"), timeout=10)
        assert items.list("job-old") == []
        assert len(items.list("job-live")) == 3
        assert _alive(cluster) == {"job-live"}


def _pruned_keys(coord: Coordinator) -> int:
    """The ``pruned/`` keys of an etcd namespace (ids whose gate items are not deleted yet)."""
    from metafora.coordinators.etcd.ops import Range

    driver, keys, _ = coord._retention_parts()  # type: ignore[attr-defined]
    return len(driver.txn([], [Range(keys.root + b"pruned/", prefix=True, keys_only=True)]).ranges[0])


@pytest.mark.parametrize("tasks_kind", ["etcd", "memory"])
def test_prune_takes_gate_items_in_a_database_of_their_own(tasks_kind: str, metafora_store_url: Any) -> None:
    """An etcd coordinator's gate items live in SQL: pruning a partition's task deletes them
    through the item store the gate handler registered, with its state and commands."""
    from metafora.gates import ItemStore, NewItem, Response, handler_func

    url = metafora_store_url(tasks_kind)
    cluster = Cluster(url)
    items = ItemStore(metafora_store_url("sqlite"))
    with cluster.stack:
        cluster.stack.callback(items.close)
        coord = cluster.node("n1")
        handler_func(lambda item: Response(gate=0, done=True), coord, items)
        handler_func(lambda item: Response(gate=0, done=True), coord, items)  # registered once
        c = cluster.client
        c.submit_tasks([Task("job-old"), Task("job-live"), Task("plain-old")])
        items.add("job-old", [NewItem(gate=0, data=b"x")] * 5 + [NewItem(gate=1, data=b"z")])
        items.add("job-live", [NewItem(gate=0, data=b"y")] * 3)
        _finish(coord, "job-old", "done", StateCode.COMPLETED)
        commands_for(c).send("job-old", Message.pause())
        _finish(coord, "plain-old", "done")
        c.set_retention(done="1s")
        pruner = Pruner(coord, SYSTEM_CLOCK, interval=0.2)
        thread = threading.Thread(target=pruner.run, daemon=True)
        thread.start()
        try:
            wait_until(lambda: _alive(cluster) == {"job-live"}, timeout=20)
        finally:
            pruner.stop()
            thread.join(10)
        assert items.list("job-old") == []
        assert not items.info("job-old").exists
        assert len(items.list("job-live")) == 3
        assert state_store_for(c).get("job-old") is None
        assert commands_for(c).pending("job-old") == 0
        if tasks_kind == "etcd":
            assert _pruned_keys(coord) == 0


def test_etcd_node_dying_before_the_items_leaves_them_to_the_next(metafora_store_url: Any) -> None:
    """A node that dies after its txns deleted the tasks and before their items were deleted
    leaves the ids recorded; the next prune of a node with the item store deletes the items."""
    from metafora.gates import ItemStore, NewItem

    cluster = Cluster(metafora_store_url("etcd"))
    items = ItemStore(metafora_store_url("sqlite"))
    with cluster.stack:
        cluster.stack.callback(items.close)
        dying, other = cluster.node("dying"), cluster.node("other")
        c = cluster.client
        # More than one txn of pruned/ keys takes (100).
        jobs = 130
        c.submit_tasks([Task(f"job-{n}") for n in range(jobs)])
        for n in range(jobs):
            items.add(f"job-{n}", [NewItem(gate=0, data=b"x")] * 2)
            _finish(dying, f"job-{n}", "done")

        class Died(Exception):
            pass

        def die(ids: list[str]) -> None:
            raise Died(ids)  # the process ends between the etcd txns and the item store

        dying.prune_also(die)
        with pytest.raises(Died):
            dying.prune(Retention(timedelta(0), timedelta(0), timedelta(0)))
        assert _alive(cluster) == set()
        assert _pruned_keys(other) == jobs
        assert all(len(items.list(f"job-{n}")) == 2 for n in range(jobs))
        other.prune_also(items.delete_partitions)
        assert other.prune(Retention(timedelta(0), timedelta(0), timedelta(0))) == 0
        assert all(items.list(f"job-{n}") == [] for n in range(jobs))
        assert _pruned_keys(other) == 0
