"""Join/leave rebalancing across consumer processes (issue 15 item 4), on each SQL store.

Three processes with FairBalancer and ``balance_every`` of an hour: only the stores'
membership events can make them balance. A third node joins two that hold every task:
within the dampening window the two release down to the fair share and the newcomer takes
it. Then one node shuts down (SIGTERM): its tasks are orphans, taken by the survivors at
once although they released tasks moments ago (``claim_delay`` of ten minutes).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.process import BaseProcess

import pytest

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.balancers import FairBalancer
from metafora.testing import wait_for
from tests.helpers import stop_processes

TASKS = 30
THRESHOLD = 1.2


def _worker(url: str, node_id: str) -> None:
    """A consumer process holding its tasks until stopped; shuts down cleanly on SIGTERM."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def hold(task: Task, stop: threading.Event) -> bool:
        stop.wait(600)
        return False

    # The default lease_ttl (30 s): nothing here waits for a lease to expire (the leave is
    # graceful), and a 3 s lease lapsed again and again on a saturated machine (load 60 on 2
    # cores), so the tasks kept moving and the cluster never settled within the deadline.
    coord = open_coordinator(url, node_id=node_id, poll_interval=0.2)
    consumer = Consumer(coord, simple_handler(hold), FairBalancer(THRESHOLD, claim_delay=600),
                        balance_every=3600, rebalance_window=1.0)
    runner = threading.Thread(target=consumer.run, name="consumer")
    runner.start()
    signal.sigwait({signal.SIGTERM})
    consumer.shutdown(timeout=10)
    runner.join(30)


class Procs:
    def __init__(self, url: str) -> None:
        self.url = url
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, BaseProcess] = {}

    def start(self, node: str) -> None:
        proc = self.ctx.Process(target=_worker, args=(self.url, node), name=f"worker-{node}",
                                daemon=True)
        proc.start()
        self.procs[node] = proc

    def term(self, node: str) -> None:
        proc = self.procs[node]
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(60)

    def stop_all(self) -> None:
        stop_processes(self.procs.values(), 30)


@pytest.fixture
def procs(sql_url: str) -> Iterator[Procs]:
    p = Procs(sql_url)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.mark.slow
def test_join_then_leave_rebalances_without_waiting_for_the_timer(procs: Procs) -> None:
    with open_client(procs.url) as client:
        procs.start("p0")
        procs.start("p1")
        wait_for(lambda: len(client.nodes()) == 2, 60, "two workers to register")
        for i in range(TASKS):
            client.submit_task(Task(f"r{i:02d}"))
        wait_for(lambda: sum(client.node_task_count().values()) == TASKS, 60, "every task claimed")

        procs.start("p2")
        limit = math.ceil(THRESHOLD * TASKS / 3)

        def balanced() -> bool:
            counts = client.node_task_count()
            return (len(counts) == 3 and sum(counts.values()) == TASKS
                    and max(counts.values()) <= limit and counts["p2"] > 0)

        wait_for(balanced, 90, f"every node at most {limit} tasks after p2 joined")

        procs.term("p1")  # graceful: p1's tasks are orphans
        assert "p1" not in client.nodes()

        def adopted() -> bool:
            counts = client.node_task_count()
            return set(counts) == {"p0", "p2"} and sum(counts.values()) == TASKS

        # Far below claim_delay (600 s): the survivors do not treat orphans as a rebalance.
        wait_for(adopted, 90, "p0 and p2 to take every task of p1")
