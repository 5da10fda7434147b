"""An even cluster with the fewest moves (issue 28), across consumer processes, on every store.

Workers run the ``Consumer``'s default balancer (``FairBalancer``) with ``hold`` handlers (a task
runs until it is stopped, like a stream consumer); every handler start is reported to the test,
so a task's first start is its placement and every later start is a move.

- a cold start of workers started together ends even with no node at 0, placing (almost) every
  task once;
- a joiner gets its share (the others release to it, and nobody else takes what they release)
  and moves about that share; a graceful leave moves only the leaver's tasks; repeated joins
  and leaves move a bounded number of tasks each time (no ping-pong), and a quiet cluster moves
  nothing;
- selectors are respected: a task is never started on a node whose labels do not match.

Deadlines are generous (a busy 2-core machine); the figures against the targets are in
``benchmarks/restart.py``.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import pytest

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.contracts.client import Client
from metafora.testing import wait_for
from tests.helpers import stop_processes

pytestmark = pytest.mark.slow

EVEN_WITHIN = 0.10


def _worker(url: str, node_id: str, labels: Mapping[str, str], weight: float, go: MpEvent,
            events: multiprocessing.Queue[Any]) -> None:
    """A consumer process holding its tasks until stopped; shuts down cleanly on SIGTERM."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def hold(task: Task, stop: threading.Event) -> bool:
        events.put(("start", node_id, task.id))
        stop.wait(600)
        return False

    go.wait(120)  # imported and ready: the workers of a cold start begin together
    coord = open_coordinator(url, node_id=node_id, poll_interval=0.2)
    consumer = Consumer(coord, simple_handler(hold), labels=dict(labels), weight=weight,
                        balance_every=5, rebalance_window=1.0)
    runner = threading.Thread(target=consumer.run, name="consumer")
    runner.start()
    signal.sigwait({signal.SIGTERM})
    consumer.shutdown(timeout=20)
    runner.join(30)


class Fleet:
    """Worker processes over one store, and every handler start they reported."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ctx = multiprocessing.get_context("spawn")
        self.events: multiprocessing.Queue[Any] = self.ctx.Queue()
        self.procs: dict[str, BaseProcess] = {}
        self.starts: list[tuple[str, str]] = []  # (node, task) in the order reported
        self.gates: list[MpEvent] = []  # kept: a child unpickles its gate after start()

    def start(self, *nodes: str, labels: Mapping[str, str] | None = None,
              weight: float = 1.0) -> None:
        """Start ``nodes`` together: each waits until all of them are spawned."""
        go = self.ctx.Event()
        self.gates.append(go)
        for node in nodes:
            proc = self.ctx.Process(target=_worker, name=f"worker-{node}", daemon=True,
                                    args=(self.url, node, dict(labels or {}), weight, go,
                                          self.events))
            proc.start()
            self.procs[node] = proc
        go.set()

    def term(self, node: str) -> None:
        """Shut ``node`` down gracefully (SIGTERM) and wait for its process to end."""
        proc = self.procs.pop(node)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(60)
        assert not proc.is_alive(), f"{node} did not shut down"

    def drain(self, wait: float = 0.0) -> None:
        """Take the start events reported so far."""
        try:
            while True:
                event = self.events.get(timeout=wait) if wait else self.events.get_nowait()
                self.starts.append((event[1], event[2]))
        except queue.Empty:
            pass

    def moves_since(self, mark: int, placed: set[str]) -> int:
        """Starts after ``mark`` of tasks started before it (``placed`` is updated)."""
        moved = 0
        for _, task in self.starts[mark:]:
            if task in placed:
                moved += 1
            placed.add(task)
        return moved

    def stop_all(self) -> None:
        stop_processes(self.procs.values(), 30)


@pytest.fixture(params=["sqlite", "postgresql", "etcd"])
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    url = str(request.getfixturevalue(f"{request.param}_url" if request.param != "postgresql"
                                      else "postgres_url"))
    f = Fleet(url)
    try:
        yield f
    finally:
        f.stop_all()


def even(counts: Mapping[str, int], nodes: set[str], total: int) -> bool:
    """Exactly ``nodes`` hold every task, each within 10 % (or one task) of its share."""
    if set(counts) != nodes or sum(counts.values()) != total:
        return False
    share = total / len(nodes)
    return all(abs(n - share) <= max(1.0, EVEN_WITHIN * share) for n in counts.values())


def quiet(fleet: Fleet, seconds: float = 5.0) -> None:
    """Take the starts reported over ``seconds``: a membership change is followed by one more
    balance a few seconds later (``Rebalancer``), whose moves belong to that change."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        fleet.drain(0.2)


def settle(fleet: Fleet, client: Client, nodes: set[str], total: int, what: str) -> dict[str, int]:
    """Wait until the cluster is even over ``nodes``; the counts then."""
    def check() -> dict[str, int]:
        fleet.drain()
        counts = client.node_task_count()
        return counts if even(counts, nodes, total) else {}

    return wait_for(check, 120, what)


def test_even_from_a_cold_start_and_the_fewest_moves_on_joins_and_leaves(fleet: Fleet) -> None:
    tasks = 120
    with open_client(fleet.url) as client:
        client.submit_tasks(Task(f"e{i:03d}") for i in range(tasks))
        fleet.start("a", "b", "c")
        counts = settle(fleet, client, {"a", "b", "c"}, tasks, "a cold start to end even")
        assert min(counts.values()) > 0
        placed: set[str] = set()
        extra = fleet.moves_since(0, placed)
        # docs/benchmarks.md's target for a cold start: at most 0.05 extra starts per task
        # (measured 0.00: the nodes wait for each other before claiming)
        assert extra <= math.floor(0.05 * tasks), f"{extra} moves on a cold start: {counts}"

        # Two joins and leaves: the second join meets a cluster that has moved tasks before,
        # so ping-pong would show (a third cycle proved nothing more, 25 s a store).
        for cycle in range(2):
            mark = len(fleet.starts)
            fleet.start("d")
            counts = settle(fleet, client, {"a", "b", "c", "d"}, tasks, f"join {cycle} to end even")
            quiet(fleet)  # the follow-up balance: its moves are the join's
            share = math.ceil(tasks / 4)
            moved = fleet.moves_since(mark, placed)
            assert counts["d"] > 0
            assert moved <= 1.2 * share + 2, f"join {cycle} moved {moved} (share {share}): {counts}"

            mark = len(fleet.starts)
            held = client.node_task_count().get("d", 0)
            fleet.term("d")
            settle(fleet, client, {"a", "b", "c"}, tasks, f"leave {cycle} to end even")
            quiet(fleet)
            moved = fleet.moves_since(mark, placed)
            # the leaver's tasks move; what it held when asked may differ by a claim in flight
            assert moved <= held + 2, f"leave {cycle} moved {moved} for {held} held"

        mark = len(fleet.starts)
        end = time.monotonic() + 6  # more than one balance_every with nothing changing
        while time.monotonic() < end:
            fleet.drain(0.2)
        assert fleet.moves_since(mark, placed) == 0, "a steady cluster moved tasks"


def test_tasks_with_a_selector_run_only_on_matching_nodes(fleet: Fleet) -> None:
    with open_client(fleet.url) as client:
        client.submit_tasks([Task(f"x{i:02d}", selector={"zone": "x"}) for i in range(40)]
                            + [Task(f"p{i:02d}") for i in range(40)])
        fleet.start("x1", "x2", labels={"zone": "x"})
        fleet.start("plain")

        def all_held() -> bool:
            fleet.drain()
            counts = client.node_task_count()
            return len(counts) == 3 and sum(counts.values()) == 80 and min(counts.values()) > 0

        wait_for(all_held, 120, "every task held, by all three nodes")
        fleet.drain(0.5)
        wrong = sorted(t for node, t in fleet.starts if node == "plain" and t.startswith("x"))
        assert wrong == []
        counts = client.node_task_count()
        # 40 selector tasks between x1 and x2, 40 plain among three: plain holds about 40 / 3
        # to 40 of them, never the selector tasks
        assert counts["plain"] <= 40


def test_a_node_twice_as_heavy_holds_twice_as_much(fleet: Fleet) -> None:
    with open_client(fleet.url) as client:
        client.submit_tasks(Task(f"w{i:02d}") for i in range(90))
        fleet.start("heavy", weight=2.0)
        fleet.start("light1", "light2")

        def weighted() -> dict[str, int]:
            fleet.drain()
            counts = client.node_task_count()
            ok = (len(counts) == 3 and sum(counts.values()) == 90
                  and abs(counts["heavy"] - 45) <= 4.5
                  and all(abs(counts[n] - 22.5) <= 2.5 for n in ("light1", "light2")))
            return counts if ok else {}

        wait_for(weighted, 120, "heavy to hold half the tasks, each light node a quarter")
        assert {n.id: n.weight for n in client.node_infos()} == {
            "heavy": 2.0, "light1": 1.0, "light2": 1.0}
