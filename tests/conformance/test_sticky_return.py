"""Sticky return (metafora.core.holds), on every store: a graceful stop with a stable node id holds
its tasks for that id; the same id takes them back, others only after the window; a drain,
``leaving=True`` and a crash hold nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from metafora import Consumer, Task, TaskState, open_coordinator, simple_handler
from metafora.contracts.coordinator import Coordinator, Finish, Outcome
from metafora.core.holds import hold_note, is_held
from metafora.testing import LocalCluster, wait_for
from tests.conformance.test_coordinator import Cluster, _opened
from tests.conformance.test_limits import _kill

# etcd ends a hold with a lease: whole seconds, and no shorter than its minimum lease TTL.
WINDOW = 3.0
LONG = 300.0  # a window no test waits out


@pytest.fixture
def cluster(store_url: str) -> Iterator[Cluster]:
    yield from _opened(store_url)


def _claim(coord: object, task_id: str, timeout: float = 15.0) -> Task:
    """Claim ``task_id`` once it is claimable (a watch cache may learn of it late)."""
    got: list[Task] = []

    def attempt() -> bool:
        claimed = coord.claim(Task(task_id))  # type: ignore[attr-defined]
        if claimed is not None:
            got.append(claimed)
        return bool(got)

    wait_for(attempt, timeout, f"a claim of {task_id}")
    return got[0]


def test_graceful_close_holds_for_the_same_id_then_others(cluster: Cluster) -> None:
    for name in ("t1", "t2"):
        cluster.client.submit_task(Task(name))
    a = cluster.node("a")
    b = cluster.node("b")
    _claim(a, "t1")
    released = _claim(a, "t2")
    assert a.hold_releases(WINDOW) is True
    a.release(released)  # a release during the shutdown is held too
    a.close()
    now = datetime.now(UTC)
    for name in ("t1", "t2"):
        info = cluster.client.get_task(name)
        assert info.state is TaskState.PENDING
        assert info.held_for == "a" and info.held_until is not None
        assert is_held(info, now - timedelta(seconds=1))
        assert (hold_note(info, now - timedelta(seconds=1)) or "").startswith("held for a until ")
        assert info.to_dict()["held_for"] == "a"
        assert b.claim(Task(name)) is None  # held for a: refused to b by the store
    # a comes back under the same id within the window: it takes its task back
    again = cluster.node("a")
    back = _claim(again, "t1")
    assert cluster.client.get_task("t1").owner == "a" and back.token > released.token
    assert cluster.client.get_task("t1").held_for is None
    # the other one goes to b once the window is over, by the store's clock
    _claim(b, "t2", timeout=WINDOW + 15)
    info = cluster.client.get_task("t2")
    assert info.owner == "b" and info.held_for is None and info.held_until is None
    assert datetime.now(UTC) >= now + timedelta(seconds=WINDOW - 1)


def test_hold_end_is_offered_to_the_others(cluster: Cluster) -> None:
    """The watch of another node offers a held task when its hold ends (no claim polling)."""
    cluster.client.submit_task(Task("w"))
    a = cluster.node("a")
    _claim(a, "w")
    b = cluster.node("b")
    offers: list[Task] = []
    watcher = threading.Thread(target=b.watch, args=(offers.append,), daemon=True)
    watcher.start()
    a.hold_releases(WINDOW)
    a.close()
    started = len(offers)
    wait_for(lambda: any(t.id == "w" for t in offers[started:]), WINDOW + 15,
             "the held task offered to b at the end of its hold")
    assert b.claim(Task("w")) is not None
    b.close()
    watcher.join(15)


def test_drain_hands_held_tasks_off_at_once(cluster: Cluster) -> None:
    cluster.client.submit_task(Task("d"))
    a = cluster.node("a")
    b = cluster.node("b")
    _claim(a, "d")
    a.hold_releases(LONG)
    a.close()
    assert cluster.client.get_task("d").held_for == "a"
    assert b.claim(Task("d")) is None
    assert cluster.client.drain_node("a") == 1
    assert cluster.client.get_task("d").held_for is None
    _claim(b, "d")  # long before the window's end
    assert cluster.client.drain_node("a") == 0  # nothing left held
    assert cluster.client.drain_node("nobody") == 0


def test_no_hold_releases_to_everyone_at_once(cluster: Cluster) -> None:
    """Without hold_releases (leaving=True, a generated id, sticky_for=0) close releases as before."""
    cluster.client.submit_task(Task("n"))
    a = cluster.node("a")
    b = cluster.node("b")
    _claim(a, "n")
    a.hold_releases(LONG)
    a.hold_releases(0)  # turned off again
    a.close()
    assert cluster.client.get_task("n").held_for is None
    _claim(b, "n")


def test_a_crash_holds_nothing(cluster: Cluster) -> None:
    """A node that dies holds nothing, even one that asked to hold: its claims move after
    its lease, as before."""
    cluster.client.submit_task(Task("c"))
    a = cluster.node("a")
    b = cluster.node("b")
    _claim(a, "c")
    a.hold_releases(LONG)
    _kill(a)  # no graceful close: the lease ends in the store
    got = _claim(b, "c", timeout=30)
    assert got is not None and cluster.client.get_task("c").held_for is None


def _blocking(runs: list[tuple[str, str]], lock: threading.Lock, node: str) -> object:
    def work(task: Task, stop: threading.Event) -> bool:
        with lock:
            runs.append((task.id, node))
        stop.wait(60)
        return False

    return simple_handler(work)


def test_consumer_restart_under_the_same_id_takes_its_tasks_back(store_url: str) -> None:
    runs: list[tuple[str, str]] = []
    lock = threading.Lock()
    with LocalCluster(store_url) as c:
        a = c.add(_blocking(runs, lock, "a1"), "a", sticky_for=LONG, max_tasks=3)
        for i in range(3):
            c.client.submit_task(Task(f"s{i}"))
        wait_for(lambda: len(runs) == 3, 30, "a runs three tasks")
        b = c.add(_blocking(runs, lock, "b"), "b", max_tasks=3)
        c.stop(a, leaving=False)  # a restart's SIGTERM: held for a
        assert {i.held_for for i in c.client.tasks()} == {"a"}
        c.add(_blocking(runs, lock, "a2"), "a", sticky_for=LONG, max_tasks=3)
        wait_for(lambda: len(runs) == 6, 30, "a takes its three tasks back")
        with lock:
            assert sorted(n for _, n in runs[3:]) == ["a2"] * 3
        c.stop(b)
        assert not c.errors


def test_consumer_leaving_or_generated_id_hands_off_at_once(store_url: str) -> None:
    runs: list[tuple[str, str]] = []
    lock = threading.Lock()
    with LocalCluster(store_url) as c:
        x = c.add(_blocking(runs, lock, "x"), "x", sticky_for=LONG, max_tasks=1)
        coord = open_coordinator(store_url)  # a generated id: sticky_for is ignored
        assert coord.node_id_generated
        g = c.start(Consumer(coord, _blocking(runs, lock, "g"), sticky_for=LONG, max_tasks=1))
        c.client.submit_task(Task("l1"))
        c.client.submit_task(Task("l2"))
        wait_for(lambda: len(runs) == 2, 30, "x and g run one each")
        c.add(_blocking(runs, lock, "y"), "y", max_tasks=2)
        c.stop(x, leaving=True)  # a scale-down: nothing held
        c.stop(g, leaving=False)  # a graceful stop, but its id never comes back
        assert [i.held_for for i in c.client.tasks()] == [None, None]
        wait_for(lambda: sum(1 for _, n in runs if n == "y") == 2, 30, "y takes both at once")
        assert not c.errors


def _three_claimed(cluster: Cluster,
                   names: tuple[str, str, str]) -> tuple[Coordinator, Coordinator, list[Task]]:
    """Nodes a and b, and ``names`` submitted and claimed by a (in that order)."""
    for name in names:
        cluster.client.submit_task(Task(name))
    a = cluster.node("a")
    b = cluster.node("b")
    return a, b, [_claim(a, name) for name in names]


def test_outcomes_written_after_the_window_ends_are_not_lost(cluster: Cluster) -> None:
    """Handlers may stop after the hold's window is over (a shutdown longer than sticky_for):
    the outcomes written then land and a done task stays done (etcd's hold lease is gone by
    then: a txn naming it was refused whole, with the done outcome batched beside it)."""
    a, b, (done, later, early) = _three_claimed(cluster, ("t1", "t2", "t3"))
    a.hold_releases(WINDOW)
    a.release(early)  # held until the window ends: b's claim of it says the window is over
    _claim(b, "t3", timeout=WINDOW + 30)
    results = a.finish_many([Finish(done, Outcome.DONE), Finish(later, Outcome.RELEASE)])
    assert results == [None, None], results
    assert cluster.client.get_task("t1").state is TaskState.DONE
    # Released, for others at the latest after a window (SQL and memory hold each release
    # for the window from its own release; etcd's hold lease ended with the first window).
    assert cluster.client.get_task("t2").state is TaskState.PENDING
    _claim(b, "t2", timeout=WINDOW + 15)
    a.close()


def test_a_drain_during_the_shutdown_loses_no_outcome(cluster: Cluster) -> None:
    """``nodes drain`` while the node still stops its handlers (etcd revokes the hold lease):
    the outcomes the node writes after it are recorded, and the drained task is handed off."""
    a, b, (held, done, released) = _three_claimed(cluster, ("d1", "d2", "d3"))
    a.hold_releases(LONG)
    a.release(held)
    assert cluster.client.drain_node("a") == 1
    _claim(b, "d1")
    results = a.finish_many([Finish(done, Outcome.DONE), Finish(released, Outcome.RELEASE)])
    assert results == [None, None], results
    assert cluster.client.get_task("d2").state is TaskState.DONE
    assert cluster.client.get_task("d3").state is TaskState.PENDING
    a.close()
