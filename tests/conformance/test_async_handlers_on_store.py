"""Async handlers end to end on every store: outcomes, stop, shutdown, a lost claim."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

import pytest

from metafora import Consumer, HandlerFunc, Task, TaskState, simple_handler
from metafora.core import commands
from metafora.testing import LocalCluster, wait_for


class Seen:
    """Task ids by what happened to their async handler (appended on the event loop)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, list[str]] = {"started": [], "stopped": [], "cancelled": []}

    def add(self, what: str, task_id: str) -> None:
        with self.lock:
            self.events[what].append(task_id)

    def ids(self, what: str) -> list[str]:
        with self.lock:
            return sorted(self.events[what])


def handler(seen: Seen) -> HandlerFunc:
    """``ok*`` done, ``back*`` released, ``bad*`` raises, ``hold*`` waits for stop,
    ``deaf*`` ignores stop (only cancellation ends it)."""

    async def work(task: Task, stop: asyncio.Event) -> bool:
        seen.add("started", task.id)
        await asyncio.sleep(0)
        try:
            if task.id.startswith("bad"):
                raise RuntimeError(f"async failure of {task.id}")
            if task.id.startswith("hold"):
                await stop.wait()
                seen.add("stopped", task.id)
                return False
            if task.id.startswith("deaf"):
                await asyncio.Event().wait()
            return task.id.startswith("ok")
        except asyncio.CancelledError:
            seen.add("cancelled", task.id)
            raise

    return simple_handler(work)


def test_async_outcomes(store_url: str) -> None:
    seen = Seen()
    with LocalCluster(store_url) as cluster:
        cluster.add(handler(seen), "a", release_backoff=60)
        for task_id in ("ok-1", "ok-2", "back-1", "bad-1"):
            cluster.client.submit_task(Task(task_id))
        cluster.wait_for_state("ok-1", TaskState.DONE, 30)
        cluster.wait_for_state("ok-2", TaskState.DONE, 30)
        cluster.wait_for_state("bad-1", TaskState.FAILED, 30)
        wait_for(lambda: "back-1" in seen.ids("started")
                 and cluster.client.get_task("back-1").state is TaskState.PENDING, 30,
                 "back-1 released")
        assert "RuntimeError: async failure of bad-1" in (cluster.client.get_task("bad-1").error
                                                          or "")
        assert seen.ids("started") == ["back-1", "bad-1", "ok-1", "ok-2"]
        assert not cluster.errors


def test_async_stop_task_and_shutdown(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    seen = Seen()
    ids = [f"hold-{i:02d}" for i in range(20)]
    with LocalCluster(store_url) as cluster:
        consumer = cluster.add(handler(seen), "a", release_backoff=60)
        for task_id in ids:
            cluster.client.submit_task(Task(task_id))
        wait_for(lambda: seen.ids("started") == ids, 30, "20 async handlers running")
        cluster.client.submit_command("a", commands.stop_task("hold-00"))
        wait_for(lambda: cluster.client.get_task("hold-00").state is TaskState.PENDING, 30,
                 "hold-00 released by stop_task")
        with caplog.at_level(logging.WARNING, logger="metafora"):
            cluster.stop(consumer, timeout=30)
        assert seen.ids("stopped") == ids and seen.ids("cancelled") == []
        assert {t.state for t in cluster.client.tasks()} == {TaskState.PENDING}
        assert "a" not in cluster.client.nodes()
        assert not [r for r in caplog.records if "ignored stop" in r.getMessage()]


def test_a_lost_claim_cancels_an_async_handler(store_url: str) -> None:
    seen = Seen()
    with LocalCluster(store_url) as cluster:
        consumer = cluster.add(handler(seen), "a")
        cluster.client.submit_task(Task("deaf-1"))
        wait_for(lambda: seen.ids("started") == ["deaf-1"], 30, "deaf-1 running")
        cluster.client.delete_task("deaf-1")  # its owner is told the claim is gone
        wait_for(lambda: seen.ids("cancelled") == ["deaf-1"], 30,
                 "the handler of the deleted task cancelled")
        wait_for(lambda: not consumer.tasks(), 30, "deaf-1 no longer running")
        assert not cluster.errors


def _holds(consumer: Consumer, count: int) -> bool:
    return len(consumer.tasks()) == count


def test_a_graceful_shutdown_is_not_counted_as_a_crash(store_url: str) -> None:
    # Claims still held at shutdown are released by the coordinator's close() in one
    # request; that must count as a release (an outcome), not as a node that died.
    seen = Seen()
    ids = [f"hold-{i:03d}" for i in range(130)]  # etcd clears them 64 per txn
    with LocalCluster(store_url) as cluster:
        for node in ("a", "b"):
            consumer = cluster.add(handler(seen), node, max_crashes=1)
            if node == "a":
                for task_id in ids:
                    cluster.client.submit_task(Task(task_id))
            wait_for(functools.partial(_holds, consumer, len(ids)), 60, f"{node} holds the tasks")
            cluster.stop(consumer, timeout=30)
        assert {t.state for t in cluster.client.tasks()} == {TaskState.PENDING}
        assert seen.ids("started") == sorted(ids * 2)
