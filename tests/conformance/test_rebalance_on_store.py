"""Issue 15 items 4-5 on every store: membership events, leaving nodes, orphans.

- a node that announces it is leaving is not counted by balancers (Metafora's issue #92);
- the store tells listeners when a node joins, leaves or announces leaving;
- a join makes the others balance within the dampening window, not after ``balance_every``;
- tasks freed by a leaving node are orphans: survivors take them despite ``claim_delay``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from metafora import (
    Consumer,
    Task,
    TaskState,
    commands,
    open_client,
    open_coordinator,
    simple_handler,
)
from metafora.balancers.fair import FairBalancer
from metafora.statemachine import Commands, handler_func
from metafora.statemachine.machine import Message, MessageKind
from metafora.testing import LocalCluster, RecordingContext, wait_for


class Running:
    """Handlers that block until stopped; ``stubborn`` ids ignore stop() until ``unblock``."""

    def __init__(self, stubborn: tuple[str, ...] = ()) -> None:
        self.lock = threading.Lock()
        self.where: dict[str, str] = {}
        self.stubborn = stubborn
        self.unblock = threading.Event()

    def handler(self, node: str) -> object:
        def work(task: Task, stop: threading.Event) -> bool:
            with self.lock:
                self.where[task.id] = node
            try:
                if task.id in self.stubborn and not self.unblock.is_set():
                    self.unblock.wait(120)  # ignores stop() until the test lets it go
                else:
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


def _rung_until(heard: threading.Event, done: Callable[[], bool], what: str) -> None:
    """Wait for rings until one brings ``done``: a node's registration changes for other
    reasons too (it publishes its count a second after a change), so the ring after a
    ``clear`` may be an earlier change's. ``done`` is checked only right after a ring, so a
    view that changed without one is never what passes."""
    deadline = time.monotonic() + 30
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and heard.wait(left), f"timed out: {what}"
        heard.clear()
        if done():
            return


def test_leaving_nodes_are_not_counted_and_membership_is_pushed(store_url: str) -> None:
    # A 6 s lease: SQLite hears of a node that comes or goes at the listener's renewal (every
    # lease_ttl / 3), so the default 30 s made its four waits 10 s each.
    a = open_coordinator(store_url, node_id="a", lease_ttl=6)
    b = open_coordinator(store_url, node_id="b", lease_ttl=6)
    c = open_coordinator(store_url, node_id="c", lease_ttl=6)
    heard = threading.Event()
    try:
        a.init(RecordingContext())
        assert a.listen_membership(heard.set)
        b.init(RecordingContext())
        _rung_until(heard, lambda: set(a.active_task_count()) == {"a", "b"}, "a hears b join")
        b.announce_leaving()
        _rung_until(heard, lambda: set(a.active_task_count()) == {"a"},
                    "a hears b announce leaving")
        assert set(a.node_task_count()) == {"a", "b"}  # still live, still holding its claims
        b.close()
        _rung_until(heard, lambda: set(a.node_task_count()) == {"a"}, "a hears b leave")
        c.init(RecordingContext())  # a new node is counted, and heard
        _rung_until(heard, lambda: set(a.active_task_count()) == {"a", "c"}, "a hears c join")
    finally:
        for coord in (a, b, c):
            coord.close()


def test_issue_92_a_shutting_down_node_is_not_averaged_over(store_url: str) -> None:
    """6 tasks split 4|2; node2 shuts down with one handler still blocked; node1 then holds 5
    and a balance on node1 keeps its 5 (it used to release one, averaging over node2's 1)."""
    running = Running(stubborn=("t4",))
    fair = FairBalancer(claim_delay=600)
    with LocalCluster(store_url, shutdown_timeout=60) as cluster:
        node1 = cluster.add(running.handler("node1"), "node1", fair,
                            balance_every=3600, rebalance_window=3600)
        for i in range(4):
            cluster.client.submit_task(Task(f"t{i}"))
        wait_for(lambda: len(running.on("node1")) == 4, 60, "node1 runs 4")
        cluster.client.submit_command("node1", commands.freeze())
        wait_for(lambda: node1.frozen, 30, "node1 frozen")
        node2 = cluster.add(running.handler("node2"), "node2")
        for i in (4, 5):
            cluster.client.submit_task(Task(f"t{i}"))
        wait_for(lambda: running.on("node2") == ["t4", "t5"], 60, "node2 runs t4, t5")
        cluster.client.submit_command("node1", commands.unfreeze())
        wait_for(lambda: not node1.frozen, 30, "node1 unfrozen")
        stopper = threading.Thread(target=cluster.stop, args=(node2, 60.0), daemon=True)
        stopper.start()
        try:
            wait_for(lambda: len(running.on("node1")) == 5, 60, "node1 takes t5")
            assert running.on("node2") == ["t4"]  # still blocked on node2
            assert "node2" in cluster.client.nodes()
            assert fair.balance() == []  # node1 keeps its 5
        finally:
            running.unblock.set()
            stopper.join(90)
        wait_for(lambda: len(running.on("node1")) == 6, 60, "node1 takes t4 once node2 left")
        assert not cluster.errors


def test_a_join_balances_at_once_and_orphans_skip_claim_delay(store_url: str) -> None:
    running = Running()
    fair = FairBalancer(claim_delay=600)
    with LocalCluster(store_url, shutdown_timeout=30) as cluster:
        # balance_every is an hour: only the join's membership event can make a balance.
        cluster.add(running.handler("a"), "a", fair, balance_every=3600, rebalance_window=0.5)
        for i in range(6):
            cluster.client.submit_task(Task(f"t{i}"))
        wait_for(lambda: len(running.on("a")) == 6, 60, "a runs 6")
        b = cluster.add(running.handler("b"), "b")
        wait_for(lambda: len(running.on("b")) == 3 and len(running.on("a")) == 3, 60,
                 "a releases 3 to b after b joined (b's share)")
        assert fair.refusing_until is not None  # a refuses claims for 10 minutes...
        cluster.stop(b)
        # ... but b's tasks are orphans, not a rebalance: a takes them well before that.
        wait_for(lambda: len(running.on("a")) == 6, 60, "a takes b's orphans")
        assert not cluster.errors


class Items:
    """A stateful handler working through items 0..N-1, one per ~20 ms; its cursor is the
    next item. Asked to release, it hands off with the exact position (a final checkpoint)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.lock = threading.Lock()
        self.done: list[tuple[int, str]] = []

    def on(self, node: str) -> list[int]:
        with self.lock:
            return [i for i, n in self.done if n == node]

    def handler(self, node: str) -> Callable[[Task, Commands], Message]:
        def step(task: Task, cmds: Commands) -> Message:
            i = int(cmds.cursor or 0)
            while i < self.total:
                with self.lock:
                    self.done.append((i, node))
                i += 1
                msg = cmds.get(timeout=0.02)  # paces the work; answers release when asked
                if msg is not None and msg.kind is MessageKind.RELEASE:
                    return cmds.handoff(str(i))
                if msg is not None:
                    return msg
            return Message.complete()

        return step


def test_a_stateful_task_handed_off_resumes_exactly_where_it_stopped(store_url: str) -> None:
    items = Items(total=150)
    with LocalCluster(store_url, shutdown_timeout=30) as cluster:
        a_coord = open_coordinator(store_url, node_id="a")
        cluster.start(Consumer(a_coord, handler_func(items.handler("a"), a_coord, poll_interval=0.02),
                               release_backoff=600))
        cluster.client.submit_task(Task("job"))
        wait_for(lambda: len(items.on("a")) >= 10, 60, "a works on job")
        b_coord = open_coordinator(store_url, node_id="b")
        cluster.start(Consumer(b_coord, handler_func(items.handler("b"), b_coord, poll_interval=0.02)))
        cluster.client.submit_command("a", commands.stop_task("job"))  # as `metafora stop` does
        wait_for(lambda: len(items.on("b")) >= 1, 60, "b resumes job")
        cluster.wait_for_state("job", TaskState.DONE, 60)
        with items.lock:
            order = [i for i, _ in items.done]
        assert order == list(range(150))  # no item twice, none skipped
        assert items.on("a") and items.on("b")
        assert not cluster.errors


def test_a_handler_that_ignores_a_release_is_abandoned_after_the_handoff_timeout(
    store_url: str,
) -> None:
    running = Running(stubborn=("stuck",))
    with LocalCluster(store_url, shutdown_timeout=5) as cluster:
        a = cluster.add(running.handler("a"), "a", handoff_timeout=0.5, release_backoff=600)
        cluster.client.submit_task(Task("stuck"))
        wait_for(lambda: running.on("a") == ["stuck"], 60, "a runs stuck")
        cluster.add(running.handler("b"), "b")
        cluster.client.submit_command("a", commands.stop_task("stuck"))
        # a's handler never returns, yet the claim moves to b once the handoff timeout passed.
        wait_for(lambda: cluster.client.get_task("stuck").owner == "b", 60, "b takes stuck")
        assert [t.id for t in a.tasks()] == []
        running.unblock.set()
        assert not cluster.errors


def test_claimable_count_is_read_with_the_counts_and_adds_up_to_the_work(store_url: str) -> None:
    """Issue 28: the balancers' share at claim time comes from the counts and the claimable
    count of one read, whose sum no claim changes (only submits and ends)."""
    with open_client(store_url) as client:
        client.submit_tasks(Task(f"w{i}") for i in range(7))
        later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        client.submit_task(Task("later", {"launch_at": later}))
    a = open_coordinator(store_url, node_id="a")
    b = open_coordinator(store_url, node_id="b")
    try:
        a.init(RecordingContext())
        b.init(RecordingContext())

        def picture() -> tuple[dict[str, int], int | None]:
            return a.active_task_count(), a.claimable_count()

        # the etcd store answers from its watch cache: wait until it has caught up
        wait_for(lambda: picture() == ({"a": 0, "b": 0}, 7), timeout=30)
        assert a.claim(Task("w0")) is not None
        assert len(b.claim_many([Task(f"w{i}") for i in range(1, 4)], 10)) == 3
        wait_for(lambda: picture() == ({"a": 1, "b": 3}, 3), timeout=30)
        counts, claimable = picture()
        assert sum(counts.values()) + (claimable or 0) == 7  # the launch-later task is not work yet
    finally:
        a.close()
        b.close()
