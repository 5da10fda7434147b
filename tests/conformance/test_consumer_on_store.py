"""The issue-2 behaviours, end to end on every store: consumers sharing real leases."""

from __future__ import annotations

import threading

from metafora import Task, TaskState, simple_handler
from metafora.core import commands
from metafora.testing import LocalCluster, wait_for


class Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[tuple[str, str]] = []
        self.active: set[str] = set()
        self.overlaps: list[str] = []

    def handler(self, node: str, block: bool = False) -> object:
        def work(task: Task, stop: threading.Event) -> bool:
            with self.lock:
                if task.id in self.active:
                    self.overlaps.append(task.id)
                self.active.add(task.id)
                self.runs.append((task.id, node))
            try:
                if block:
                    stop.wait(60)
                    return False
                return True
            finally:
                with self.lock:
                    self.active.discard(task.id)

        return simple_handler(work)

    def nodes_of(self, task_id: str) -> list[str]:
        with self.lock:
            return [n for t, n in self.runs if t == task_id]


def test_two_consumers_share_fifty_tasks_exactly_once(store_url: str) -> None:
    ledger = Ledger()
    with LocalCluster(store_url) as cluster:
        cluster.add(ledger.handler("a"), "a")
        cluster.add(ledger.handler("b"), "b")
        for i in range(50):
            cluster.client.submit_task(Task(f"t{i:02d}"))
        wait_for(lambda: len(cluster.client.tasks("done")) == 50, 60, "50 tasks done")
        assert sorted(t for t, _ in ledger.runs) == [f"t{i:02d}" for i in range(50)]
        assert ledger.overlaps == []
        assert not cluster.errors


def test_freeze_stop_task_and_shutdown(store_url: str) -> None:
    ledger = Ledger()
    with LocalCluster(store_url) as cluster:
        a = cluster.add(ledger.handler("a", block=True), "a", release_backoff=60)
        cluster.client.submit_task(Task("mover"))
        wait_for(lambda: ledger.nodes_of("mover") == ["a"], 30, "a runs mover")
        b = cluster.add(ledger.handler("b", block=True), "b")
        cluster.client.submit_command("b", commands.freeze())
        wait_for(lambda: b.frozen, 30, "b frozen")
        cluster.client.submit_command("a", commands.stop_task("mover"))
        wait_for(lambda: cluster.client.get_task("mover").state is TaskState.PENDING, 30,
                 "mover released")
        assert ledger.nodes_of("mover") == ["a"]  # b is frozen, a backs off
        cluster.client.submit_command("b", commands.unfreeze())
        wait_for(lambda: ledger.nodes_of("mover") == ["a", "b"], 30, "mover moved to b")
        cluster.stop(b)
        info = cluster.client.get_task("mover")
        assert info.state is TaskState.PENDING and "b" not in cluster.client.nodes()
        assert a.node_id in cluster.client.nodes()
        assert ledger.overlaps == []
