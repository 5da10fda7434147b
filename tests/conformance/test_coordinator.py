"""The coordinator contract (docs/coordinators.md), checked against every store."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.core import commands
from metafora.core.errors import (
    ClaimLost,
    InvalidProps,
    InvalidTaskId,
    InvalidTaskState,
    NodeExists,
    NodeNotFound,
    TaskExists,
    TaskNotFound,
)
from metafora.testing import RecordingContext
from tests.helpers import wait_until


class Cluster:
    """Opens coordinators (already init'ed) and a client on one store; closes them all."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stack = ExitStack()
        self.client: Client = self.stack.enter_context(open_client(url))
        self.contexts: dict[str, RecordingContext] = {}

    def node(self, node_id: str, **options: object) -> Coordinator:
        coord = open_coordinator(self.url, node_id=node_id, **options)
        ctx = RecordingContext()
        coord.init(ctx)
        self.contexts[node_id] = ctx
        self.stack.callback(coord.close)
        return coord


def _opened(url: str) -> Iterator[Cluster]:
    c = Cluster(url)
    with c.stack:
        yield c


@pytest.fixture
def cluster(store_url: str) -> Iterator[Cluster]:
    yield from _opened(store_url)


def test_submit_and_list(cluster: Cluster) -> None:
    cluster.client.submit_task(Task("b", {"n": 2}))
    cluster.client.submit_task(Task("a", {"n": 1, "nested": {"x": [1, "y"]}}))
    infos = cluster.client.tasks()
    assert [i.id for i in infos] == ["a", "b"]
    assert infos[0].props == {"n": 1, "nested": {"x": [1, "y"]}}
    assert all(i.state is TaskState.PENDING and i.owner is None for i in infos)
    assert cluster.client.get_task("b").props == {"n": 2}
    with pytest.raises(TaskExists):
        cluster.client.submit_task(Task("a"))
    with pytest.raises(TaskNotFound):
        cluster.client.get_task("zzz")
    with pytest.raises(InvalidTaskId):
        cluster.client.get_task("")


def test_claim_once_and_tokens_increase(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    cluster.client.submit_task(Task("t", {"k": "v"}))
    first = a.claim(Task("t"))
    assert first is not None and first.token > 0 and first.props == {"k": "v"}
    assert b.claim(Task("t")) is None
    info = cluster.client.get_task("t")
    assert (info.state, info.owner, info.token) == (TaskState.CLAIMED, "a", first.token)
    a.release(first)
    assert cluster.client.get_task("t").state is TaskState.PENDING
    second = b.claim(Task("t"))
    assert second is not None and second.token > first.token
    b.done(second)
    cluster.client.delete_task("t")
    cluster.client.submit_task(Task("t"))
    third = a.claim(Task("t"))
    assert third is not None and third.token > second.token
    assert a.claim(Task("absent")) is None


def test_fenced_writes_refuse_stale_tokens(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    cluster.client.submit_task(Task("t"))
    old = a.claim(Task("t"))
    assert old is not None
    a.release(old)
    with pytest.raises(ClaimLost):
        a.done(old)
    new = b.claim(Task("t"))
    assert new is not None
    for write in (a.release, a.done):
        with pytest.raises(ClaimLost):
            write(old)
    with pytest.raises(ClaimLost):
        a.fail(old, "zombie")
    with pytest.raises(ClaimLost):
        a.done(new)  # right token, wrong owner
    assert cluster.client.get_task("t").owner == "b"
    b.done(new)
    assert cluster.client.get_task("t").state is TaskState.DONE


def test_done_fail_retry(cluster: Cluster) -> None:
    a = cluster.node("a")
    for name in ("ok", "bad"):
        cluster.client.submit_task(Task(name))
    ok, bad = a.claim(Task("ok")), a.claim(Task("bad"))
    assert ok is not None and bad is not None
    a.done(ok)
    a.fail(bad, ValueError("boom"))
    done = cluster.client.get_task("ok")
    assert done.state is TaskState.DONE and done.finished_at is not None
    failed = cluster.client.get_task("bad")
    assert failed.state is TaskState.FAILED and failed.error == "ValueError: boom"
    assert a.claim(Task("ok")) is None and a.claim(Task("bad")) is None
    with pytest.raises(InvalidTaskState):
        cluster.client.retry_task("ok")
    with pytest.raises(TaskNotFound):
        cluster.client.retry_task("nope")
    cluster.client.retry_task("bad")
    again = cluster.client.get_task("bad")
    assert again.state is TaskState.PENDING and again.error is None
    assert a.claim(Task("bad")) is not None
    assert [i.id for i in cluster.client.tasks(state="done")] == ["ok"]
    assert [i.id for i in cluster.client.tasks(TaskState.CLAIMED)] == ["bad"]


def test_claim_race_has_one_winner(cluster: Cluster) -> None:
    coords = [cluster.node(f"n{i}") for i in range(4)]
    for i in range(5):
        cluster.client.submit_task(Task(f"r{i}"))
    results: list[tuple[str, int]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(coords))

    def racer(coord: Coordinator) -> None:
        barrier.wait(10)
        for i in range(5):
            got = coord.claim(Task(f"r{i}"))
            if got is not None:
                with lock:
                    results.append((got.id, got.token))

    threads = [threading.Thread(target=racer, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r[0] for r in results) == [f"r{i}" for i in range(5)]


def test_watch_offers_existing_new_and_released(cluster: Cluster) -> None:
    a = cluster.node("a")
    cluster.client.submit_task(Task("before"))
    offers: queue.Queue[Task] = queue.Queue()
    watcher = threading.Thread(target=a.watch, args=(offers,), daemon=True)
    watcher.start()

    def next_offer(want: str) -> Task:
        while True:
            task = offers.get(timeout=10)
            if task.id == want:
                return task

    assert next_offer("before").id == "before"
    cluster.client.submit_task(Task("after", {"x": 1}))
    assert next_offer("after").props == {"x": 1}
    claimed = a.claim(Task("after"))
    assert claimed is not None
    a.release(claimed)
    assert next_offer("after").id == "after"
    a.close()
    watcher.join(10)
    assert not watcher.is_alive()


def test_commands_fifo_per_node(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    sent = [commands.freeze(), commands.stop_task("x"), commands.balance(), commands.unfreeze()]
    for cmd in sent:
        cluster.client.submit_command("a", cmd)
    cluster.client.submit_command("b", commands.balance())
    got = [a.command(timeout=5) for _ in sent]
    assert got == sent
    assert a.command(timeout=0.05) is None
    assert b.command(timeout=5) == commands.balance()
    with pytest.raises(NodeNotFound):
        cluster.client.submit_command("ghost", commands.freeze())


def test_command_waits_for_arrival(cluster: Cluster) -> None:
    a = cluster.node("a")
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(a.command(timeout=20)))
    reader.start()
    cluster.client.submit_command("a", commands.stop_task("t9"))
    reader.join(25)
    assert got == [commands.stop_task("t9")]


def test_nodes_counts_and_close(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    with pytest.raises(NodeExists):
        cluster.node("a")
    assert cluster.client.nodes() == ["a", "b"]
    for i in range(3):
        cluster.client.submit_task(Task(f"t{i}"))
    assert a.claim(Task("t0")) and a.claim(Task("t1")) and b.claim(Task("t2"))
    assert cluster.client.node_task_count() == {"a": 2, "b": 1}
    assert a.node_task_count() == {"a": 2, "b": 1}
    a.close()
    a.close()  # idempotent
    assert cluster.client.nodes() == ["b"]
    assert cluster.client.node_task_count() == {"b": 1}
    assert {i.id for i in cluster.client.tasks("pending")} == {"t0", "t1"}
    # The same id can come back once the old registration is gone.
    again = cluster.node("a")
    assert again.claim(Task("t0")) is not None


def test_lease_time_left_says_how_fresh_the_nodes_lease_is(cluster: Cluster) -> None:
    """What /readyz asks: seconds to the fencing deadline while registered, 0 once closed
    (None on the memory store, which bounds nothing by the clock)."""
    a = cluster.node("a")
    left = a.lease_time_left()
    if cluster.url.startswith("memory"):
        assert left is None
        return
    assert left is not None and left > 0
    a.close()
    assert a.lease_time_left() == 0.0


def test_delete_running_task_tells_owner(cluster: Cluster) -> None:
    a = cluster.node("a")
    cluster.client.submit_task(Task("victim"))
    claimed = a.claim(Task("victim"))
    assert claimed is not None
    cluster.client.delete_task("victim")
    ctx = cluster.contexts["a"]
    assert ctx.lost_event.wait(20), "owner was not told its task was deleted"
    assert [t.id for t in ctx.lost_tasks] == ["victim"]
    with pytest.raises(TaskNotFound):
        cluster.client.get_task("victim")
    with pytest.raises(ClaimLost):
        a.done(claimed)
    with pytest.raises(TaskNotFound):
        cluster.client.delete_task("victim")


def test_launch_at_and_expires_at(cluster: Cluster) -> None:
    a = cluster.node("a")
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    soon = datetime.now(UTC) + timedelta(seconds=0.5)  # an expires_at already past is refused
    cluster.client.submit_task(Task("later", {"launch_at": future}))
    cluster.client.submit_task(Task("now", {"launch_at": past}))
    cluster.client.submit_task(Task("stale", {"expires_at": soon.isoformat()}))
    assert a.claim(Task("later")) is None
    assert a.claim(Task("now")) is not None
    wait_until(lambda: datetime.now(UTC) > soon + timedelta(seconds=0.2), message="stale's expiry passed")
    assert a.claim(Task("stale")) is None
    wait_until(lambda: cluster.client.get_task("stale").state is TaskState.EXPIRED,
               message="stale task expired")


def test_a_task_that_could_never_be_claimed_is_refused(cluster: Cluster) -> None:
    now = datetime.now(UTC)
    launch, expires = now + timedelta(hours=1), now + timedelta(seconds=30)
    with pytest.raises(InvalidProps, match="is not after launch_at"):
        cluster.client.submit_task(Task("inverted", {"launch_at": launch.isoformat(),
                                                     "expires_at": expires.isoformat()}))
    with pytest.raises(InvalidProps, match="already past"):
        cluster.client.submit_task(Task("late", {"expires_at": (now - timedelta(seconds=1)).isoformat()}))
    assert cluster.client.tasks() == []  # refused before anything was written


def test_launch_at_soon_is_offered_when_due(cluster: Cluster) -> None:
    a = cluster.node("a")
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    cluster.client.submit_task(Task("soon", {"launch_at": soon}))
    offers: queue.Queue[Task] = queue.Queue()
    watcher = threading.Thread(target=a.watch, args=(offers,), daemon=True)
    watcher.start()
    task = offers.get(timeout=15)
    assert task.id == "soon"
    assert a.claim(task) is not None
    a.close()
    watcher.join(10)


def test_purge_removes_finished_only(cluster: Cluster) -> None:
    a = cluster.node("a")
    for name in ("d", "f", "p"):
        cluster.client.submit_task(Task(name))
    d, f = a.claim(Task("d")), a.claim(Task("f"))
    assert d is not None and f is not None
    a.done(d)
    a.fail(f, "x")
    assert cluster.client.purge(older_than=timedelta(hours=1)) == 0
    assert cluster.client.purge() == 2
    assert [i.id for i in cluster.client.tasks()] == ["p"]


def test_claim_many_takes_what_is_still_claimable(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    for i in range(6):
        cluster.client.submit_task(Task(f"m{i}", {"i": i}))
    offered = [Task(f"m{i}") for i in range(6)] + [Task("absent")]
    first = a.claim_many(offered[:3], 3)
    assert sorted(t.id for t in first) == ["m0", "m1", "m2"]
    assert all(t.token > 0 for t in first)
    # b may have seen a's claims (etcd's cache) or not (SQL): either way it gets only the rest.
    wait_until(lambda: cluster.client.get_task("m2").owner == "a", message="a owns m2")
    second = b.claim_many(offered, 2)
    assert len(second) == 2 and {t.id for t in second} <= {"m3", "m4", "m5"}
    assert {t.id: t.props for t in second} == {t.id: {"i": int(t.id[1])} for t in second}
    rest = b.claim_many(offered, 10)
    assert {t.id for t in rest} == {"m3", "m4", "m5"} - {t.id for t in second}
    assert b.claim_many([], 5) == [] and b.claim_many(offered, 0) == []
    counts = cluster.client.node_task_count()
    assert counts == {"a": 3, "b": 3}
    for task in second:
        b.done(task)


@pytest.fixture
def sql_cluster(sql_url: str) -> Iterator[Cluster]:
    yield from _opened(sql_url)


def test_sql_claimable_and_contended_claims(sql_cluster: Cluster) -> None:
    """SQL: ``claimable`` names the offers still claimable; after a claim that lost most of
    its offers, the next (SQLite: read first, then claim only those) still claims right."""
    cluster = sql_cluster
    a, b = cluster.node("a"), cluster.node("b")
    cluster.client.submit_tasks(Task(f"c{i:03d}") for i in range(300))
    offered = [Task(f"c{i:03d}") for i in range(300)]
    won = a.claim_many(offered[:250], 250)
    assert len(won) == 250
    left = b.claimable([*offered, Task("absent")])  # type: ignore[attr-defined]
    assert [t.id for t in left] == [t.id for t in offered[250:]]
    assert a.claimable(offered[:250]) == []  # type: ignore[attr-defined]
    # b loses 250 of 300 offers: contended. Its next claims still take exactly the rest.
    first = b.claim_many(offered, 300)
    assert [t.id for t in first] == [t.id for t in offered[250:]]
    assert b.claim_many(offered, 300) == []
    for task in first[:10]:
        b.release(task)
    again = b.claim_many(offered, 5)
    assert [t.id for t in again] == [t.id for t in first[:5]]
    assert all(t.token > f.token for t, f in zip(again, first, strict=False))
    assert cluster.client.node_task_count() == {"a": 250, "b": 45}
