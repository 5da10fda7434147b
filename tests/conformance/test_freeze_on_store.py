"""Issue 50 point 3 on every store: a frozen node keeps every task through its periodic and
membership balances (Metafora's freeze "stops all task watching and balancing"); the
``balance`` command and ``stop_task`` still act on it.

"Nothing moves" is shown across counted balance turns (``ConsumerStats.balance_turns``,
every periodic or membership turn, run or skipped), not across wall time.
"""

from __future__ import annotations

import threading

from metafora import Consumer, Task, simple_handler
from metafora.balancers.fair import FairBalancer
from metafora.core import commands
from metafora.testing import LocalCluster, wait_for

TASKS = 20
TURNS = 4  # balance turns of the frozen node watched after the join (one is the join's)


class Where:
    """Handlers that run until stopped and record on which node each task runs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.where: dict[str, str] = {}

    def handler(self, node: str) -> object:
        def work(task: Task, stop: threading.Event) -> bool:
            with self.lock:
                self.where[task.id] = node
            try:
                stop.wait(120)
                return False
            finally:
                with self.lock:
                    if self.where.get(task.id) == node:
                        del self.where[task.id]

        return simple_handler(work)

    def on(self, node: str) -> list[str]:
        with self.lock:
            return sorted(t for t, n in self.where.items() if n == node)


def _turns(consumer: Consumer) -> int:
    return consumer.stats.balance_turns


def test_a_frozen_node_keeps_every_task_through_balances_and_a_join(store_url: str) -> None:
    where = Where()
    with LocalCluster(store_url, shutdown_timeout=30) as cluster:
        # Without the freeze, a's balance within the join's window (and every second after)
        # would release 10 of its 20 tasks to b.
        a = cluster.add(where.handler("a"), "a", FairBalancer(claim_delay=600),
                        balance_every=1, rebalance_window=0.2, release_backoff=600)
        cluster.client.submit_tasks(Task(f"t{i:02d}") for i in range(TASKS))
        wait_for(lambda: len(where.on("a")) == TASKS, 60, "a runs all 20")
        cluster.client.submit_command("a", commands.freeze())
        wait_for(lambda: a.frozen, 30, "a frozen")
        held = where.on("a")
        b = cluster.add(where.handler("b"), "b", balance_every=1, rebalance_window=0.2)
        start = _turns(a)
        wait_for(lambda: _turns(a) >= start + TURNS, 60, f"{TURNS} balance turns of a after b joined")
        assert where.on("a") == held  # not one task moved
        assert where.on("b") == []
        assert {t.id for t in a.tasks()} == set(held)
        assert a.stats.releases == 0

        # stop_task still acts on a frozen node: the task moves to b.
        cluster.client.submit_command("a", commands.stop_task("t00"))
        wait_for(lambda: where.on("b") == ["t00"], 60, "b runs t00 after stop_task")
        # So does an explicit balance command: a gives b its share.
        cluster.client.submit_command("a", commands.balance())
        wait_for(lambda: len(where.on("b")) == TASKS // 2, 60, "b runs its share after balance")
        assert len(where.on("a")) == TASKS // 2
        assert a.frozen  # still frozen: the command acted once, the turns skip again
        assert not cluster.errors
        del b
