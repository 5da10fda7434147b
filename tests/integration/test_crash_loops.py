"""A task whose handler kills its process is failed after ``max_crashes`` claims in a row
(issue 13, item 2), on every real store; the other tasks complete on the same cluster.

Consumer processes run a handler that calls ``os._exit(1)`` on the task ``poison``: each claim
of it ends with the node dead, its lease expired and no outcome. Without the limit it would be
claimed again forever, killing every node in turn. The test keeps two worker processes alive
(starting a new one, under a new node id, whenever one dies) and counts the deaths.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from metafora import Consumer, Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_CRASHES = 3
HEALTHY = 10


def _worker(url: str, node_id: str, lease_ttl: float) -> None:
    """A consumer process: dies on ``poison``, runs anything else; SIGTERM shuts it down."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def work(task: Task, stop: threading.Event) -> bool:
        if task.id == "poison":
            # The process dies mid-task (after the tasks started beside it had time to finish:
            # they share each of its deaths, and count it too): no outcome is ever written.
            stop.wait(1.0)
            os._exit(1)
        return not stop.wait(0.05)

    coord = open_coordinator(url, node_id=node_id, lease_ttl=lease_ttl)
    consumer = Consumer(coord, simple_handler(work), max_crashes=MAX_CRASHES, balance_every=3600)
    runner = threading.Thread(target=consumer.run, name="consumer", daemon=True)
    runner.start()
    signal.sigwait({signal.SIGTERM})
    consumer.shutdown(timeout=10)
    runner.join(30)


class Pool:
    """Keeps ``size`` worker processes alive; counts those that died on their own."""

    def __init__(self, url: str, lease_ttl: float, size: int = 2) -> None:
        self.url = url
        self.lease_ttl = lease_ttl
        self.size = size
        self.ctx = multiprocessing.get_context("spawn")
        self.live: list[BaseProcess] = []
        self.deaths = 0
        self.started = 0

    def tend(self) -> int:
        """Reap dead workers and start new ones; returns the deaths so far."""
        for proc in [p for p in self.live if not p.is_alive()]:
            self.live.remove(proc)
            proc.join()
            self.deaths += 1
            assert proc.exitcode == 1, f"a worker ended with {proc.exitcode}"
        while len(self.live) < self.size:
            self.started += 1
            proc = self.ctx.Process(target=_worker, args=(self.url, f"w{self.started}", self.lease_ttl),
                                    daemon=True)
            proc.start()
            self.live.append(proc)
        return self.deaths

    def stop(self) -> None:
        for proc in self.live:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc in self.live:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)


@pytest.fixture(params=["sqlite", "postgresql", "etcd"])
def pool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pool]:
    fixture = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "etcd": "etcd_url"}[request.param]
    url = str(request.getfixturevalue(fixture))
    p = Pool(url, lease_ttl=2.0 if request.param == "etcd" else 1.0)
    try:
        yield p
    finally:
        p.stop()


def test_a_task_that_kills_its_node_fails_after_max_crashes(pool: Pool) -> None:
    with open_client(pool.url) as client:
        client.submit_task(Task("poison"))
        for i in range(HEALTHY):
            client.submit_task(Task(f"healthy-{i}"))

        def settled() -> bool:
            pool.tend()
            return client.get_task("poison").state is TaskState.FAILED

        wait_for(settled, 180, "the poison task to be failed")
        wait_for(lambda: len(client.tasks(TaskState.DONE)) == HEALTHY, 120, "the healthy tasks")
        info = client.get_task("poison")
        assert info.error is not None and "process died while running it" in info.error, info.error
        assert f"max_crashes={MAX_CRASHES}" in info.error
        pool.tend()
        assert pool.deaths == MAX_CRASHES, f"{pool.deaths} workers died"
        # It stays failed and kills nobody else; a retry starts its count afresh.
        client.retry_task("poison")
        wait_for(lambda: pool.tend() > MAX_CRASHES, 60, "the retried task to run (and kill a node)")
