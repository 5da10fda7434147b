"""Faults on real stores: a crashed process, a PostgreSQL server that goes away and comes back."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from multiprocessing.synchronize import Event as MPEvent

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.core.errors import CoordinatorUnavailable, NodeExists
from metafora.testing import RecordingContext, wait_for
from tests.fixtures.postgres import TempCluster


def _claim_and_hang(url: str, claimed: MPEvent) -> None:
    """Child process: register as node 'a', claim 't', then hang until killed."""
    coord = open_coordinator(url, node_id="a", lease_ttl=2)
    coord.init(RecordingContext())
    got = coord.claim(Task("t"))
    assert got is not None
    claimed.set()
    threading.Event().wait(120)  # (not a multiprocessing primitive: we SIGKILL this process)


@pytest.mark.timing
def test_restarted_node_replaces_its_dead_registration_and_retakes_its_tasks(sql_url: str) -> None:
    client = open_client(sql_url)
    client.submit_task(Task("t", {"k": "v"}))
    ctx = multiprocessing.get_context("spawn")
    claimed = ctx.Event()
    proc = ctx.Process(target=_claim_and_hang, args=(sql_url, claimed), daemon=True)
    proc.start()
    try:
        assert claimed.wait(60), "child did not claim"
        before = client.get_task("t")
        assert (before.state, before.owner) == (TaskState.CLAIMED, "a")
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        killed_at = time.monotonic()
        ttl = 2
        again = open_coordinator(sql_url, node_id="a", lease_ttl=ttl)
        with pytest.raises(NodeExists):
            again.init(RecordingContext())  # the dead process's lease is still live

        def registered() -> bool:
            try:
                again.init(RecordingContext())
            except NodeExists:
                return False
            return True

        wait_for(registered, 10, "the dead registration to expire")
        assert time.monotonic() - killed_at < 3 * ttl  # a TTL and a renewal, and slack
        info = client.get_task("t")
        assert (info.state, info.owner) == (TaskState.PENDING, None)
        got = again.claim(Task("t"))
        assert got is not None and got.token > before.token and got.props == {"k": "v"}
        assert client.nodes() == ["a"]
        again.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        client.close()


def _next_offer(offers: queue.Queue[Task], want: str, timeout: float) -> Task:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            task = offers.get(timeout=left)
        except queue.Empty:
            break
        if task.id == want:
            return task
    raise AssertionError(f"task {want!r} was not offered within {timeout}s")


@pytest.mark.slow
@pytest.mark.timing
def test_postgres_going_away_and_coming_back_loses_nothing(temp_postgres: TempCluster) -> None:
    url = f"{temp_postgres.url}?namespace=outage&connect_timeout=2"
    client = open_client(url)
    ttl = 3
    coord = open_coordinator(url, node_id="a", lease_ttl=ttl, poll_interval=0.5)
    ctx = RecordingContext()
    coord.init(ctx)
    offers: queue.Queue[Task] = queue.Queue()
    errors: list[BaseException] = []

    def watch() -> None:
        try:
            coord.watch(offers)
        except BaseException as exc:  # the watch must survive the outage
            errors.append(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        client.submit_task(Task("t1"))
        held = coord.claim(_next_offer(offers, "t1", 10))
        assert held is not None

        temp_postgres.kill()
        down_at = time.monotonic()
        # The owner cannot renew: it fences itself within 2/3 of the TTL.
        assert ctx.lost_event.wait(10), "the owner did not fence itself"
        assert time.monotonic() - down_at < ttl  # before its lease could lapse in the store
        assert [t.id for t in ctx.lost_tasks] == ["t1"]
        with pytest.raises(CoordinatorUnavailable):
            client.submit_task(Task("t2"))
        assert coord.claim(Task("t1")) is None  # no claims on a lease it cannot renew

        temp_postgres.start()
        # The node registers again once its old lease has expired by the database clock;
        # that frees its old claim, which the watch offers again. (It may be offered first as
        # a claim of an expired registration, before the node is live: claim() says None.)
        deadline = time.monotonic() + 30
        again = None
        while again is None:
            again = coord.claim(_next_offer(offers, "t1", deadline - time.monotonic()))
        assert again.token > held.token
        client.submit_task(Task("t2"))
        assert coord.claim(_next_offer(offers, "t2", 15)) is not None
        assert {i.id: i.state for i in client.tasks()} == {"t1": TaskState.CLAIMED,
                                                           "t2": TaskState.CLAIMED}
        assert client.nodes() == ["a"]
        assert watcher.is_alive() and errors == []
    finally:
        coord.close()
        watcher.join(10)
        client.close()
    assert not watcher.is_alive() and errors == []


