"""The gate handler under real Consumers on SQLite and PostgreSQL: fan-in order, gate jumps,
waiting for items, manual gates, failures and retries, spawning, task commands, handover."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest

from metafora import Consumer, Task, TaskState, gates, open_coordinator
from metafora.gates import Item, ItemStatus, ItemStore, NewItem, PermanentError, Response
from metafora.statemachine import ErrorPolicy, Message, StateCode, get_state, send_task_command
from metafora.testing import LocalCluster
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

QUICK_POLICY = ErrorPolicy(max_errors=3, base_delay=0.05, max_delay=0.1, jitter=0.0)


class Event(NamedTuple):
    kind: str
    partition: str
    gate: int
    id: int
    t: float


@dataclass
class Recorder:
    """What a processor saw, in order, from every thread."""

    events: list[Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, item: Item) -> None:
        with self.lock:
            self.events.append(Event(kind, item.partition, item.gate, item.id, time.monotonic()))

    def ids(self, kind: str = "start") -> list[int]:
        with self.lock:
            return [e.id for e in self.events if e.kind == kind]


@pytest.fixture
def items(sql_url: str) -> Iterator[ItemStore]:
    store = ItemStore(sql_url)
    try:
        yield store
    finally:
        store.close()


def _consumer(cluster: LocalCluster, items: ItemStore, processor: Any, node: str = "n1",
              **options: Any) -> Consumer:
    coord = open_coordinator(cluster.url, node_id=node)
    options.setdefault("error_handler", gates.gate_error_handler(items, QUICK_POLICY))
    handler = gates.handler_func(processor, coord, items, **options)
    return cluster.start(Consumer(coord, handler, release_backoff=0.05))


def _state_code(url: str, task_id: str) -> StateCode | None:
    state = get_state(url, task_id)
    return None if state is None else state.code


def test_gate_one_never_starts_before_every_gate_zero_item_is_complete(
        sql_url: str, items: ItemStore) -> None:
    rec = Recorder()
    violations: list[str] = []

    def step(item: Item) -> Response:
        rec.add("start", item)
        if item.gate == 0:
            threading.Event().wait(0.002)  # pacing the fake work, not synchronisation
            rec.add("end", item)
            return Response(gate=0, done=True, data=item.data.upper())
        done = items.list(item.partition, gate=0, status=ItemStatus.COMPLETE)
        if len(done) != 40:
            violations.append(f"{item.partition}: gate 1 started with {len(done)} of 40 complete")
        rec.add("end", item)
        return Response(gate=1, done=True, data=b",".join(sorted(i.data for i in done)[:3]))

    partitions = ["job-a", "job-b", "job-c"]
    for p in partitions:
        items.add(p, [NewItem(0, f"{p}-{n:02d}") for n in range(40)] + [NewItem(1, b"rank")])
    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, gates.callable_processor(step, concurrency=4), batch_size=7)
        for p in partitions:
            cluster.client.submit_task(Task(p))
        for p in partitions:
            cluster.wait_for_state(p, TaskState.DONE, timeout=60)
        assert not cluster.errors
    assert violations == []
    starts = rec.ids("start")
    assert len(starts) == len(set(starts)) == 3 * 41  # each item exactly once
    for p in partitions:  # and by the processor's own clock
        ends = [e.t for e in rec.events if e.partition == p and e.gate == 0 and e.kind == "end"]
        (rank_start,) = [e.t for e in rec.events if e.partition == p and e.gate == 1 and e.kind == "start"]
        assert len(ends) == 40 and rank_start > max(ends)
    for p in partitions:
        info = items.info(p)
        assert info.status is gates.PartitionStatus.COMPLETED and info.total("complete") == 41
        assert items.list(p, gate=1)[0].data == f"{p.upper()}-00,{p.upper()}-01,{p.upper()}-02".encode()
        state = get_state(sql_url, p)
        assert state is not None and state.code is StateCode.COMPLETED and state.cursor == "1"


def test_the_gate_jumps_straight_to_the_next_gate_with_work(sql_url: str, items: ItemStore) -> None:
    cursors: list[str | None] = []

    def step(item: Item) -> Response:
        state = get_state(sql_url, item.partition)
        cursors.append(None if state is None else state.cursor)
        return Response(gate=item.gate, done=True)

    items.add("p", [NewItem(0, b"a"), NewItem(1000, b"b"), NewItem(1000000, b"c")])
    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, step)
        cluster.client.submit_task(Task("p"))
        cluster.wait_for_state("p", TaskState.DONE, timeout=30)
    # One checkpoint per gate that has work (the gate saved as the cursor), none in between.
    assert cursors == [None, "1000", "1000000"]


def _add(url: str, partition: str, new: list[NewItem]) -> None:
    with ItemStore(url) as store:
        store.add(partition, new)


def _add_from_another_process(url: str, partition: str, new: list[NewItem]) -> None:
    proc = multiprocessing.get_context("spawn").Process(target=_add, args=(url, partition, new),
                                                        daemon=True)
    proc.start()
    try:
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)


@pytest.mark.timing
def test_without_auto_close_the_partition_waits_and_new_items_wake_it(sql_url: str) -> None:
    rec = Recorder()

    def step(item: Item) -> Response:
        rec.add("start", item)
        return Response(gate=item.gate, done=True)

    # The owner's store never polls within this test: only a notification can wake it.
    owner_items = ItemStore(sql_url, poll_interval=600)
    adder = ItemStore(sql_url)
    try:
        adder.add("p", [NewItem(0, b"first")])
        with LocalCluster(sql_url) as cluster:
            _consumer(cluster, owner_items, step, auto_close=False, command_interval=600)
            cluster.client.submit_task(Task("p"))
            wait_until(lambda: len(rec.ids()) == 1, 30, "the first item")
            wait_until(lambda: adder.info("p").total("complete") == 1, 60, "its result")
            began = time.monotonic()
            new = [NewItem(0, b"second"), NewItem(3, b"later")]
            if sql_url.startswith("postgresql"):
                _add_from_another_process(sql_url, "p", new)  # NOTIFY reaches the owner
            else:
                adder.add("p", new)  # SQLite has no push between processes: in-process news
            # Far below the owner's 600 s poll (only a notification explains it), generous for
            # a busy machine (spawning the adding process alone can take seconds).
            wait_until(lambda: len(rec.ids()) == 3, 120, "the added items")
            assert time.monotonic() - began < 120
            assert cluster.client.get_task("p").state is TaskState.CLAIMED  # still open, waiting
            info = adder.info("p")
            assert (info.gate, info.status) == (3, gates.PartitionStatus.OPEN)
    finally:
        owner_items.close()
        adder.close()


def test_manual_checkpoint_leaves_the_gate_to_the_operator(sql_url: str, items: ItemStore) -> None:
    rec = Recorder()

    def step(item: Item) -> Response:
        rec.add("start", item)
        return Response(gate=item.gate, done=True)

    items.add("p", [NewItem(0, b"a"), NewItem(0, b"b"), NewItem(1, b"c")])
    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, step, manual_checkpoint=True)
        cluster.client.submit_task(Task("p"))
        wait_until(lambda: items.info("p").total("complete") == 2, 30, "gate 0")
        info = items.info("p")
        assert info.gate == 0 and info.counts[1] == {ItemStatus.AVAILABLE: 1}
        moved_at = time.monotonic()
        assert items.set_gate("p", 1) == 0
        cluster.wait_for_state("p", TaskState.DONE, timeout=30)
    assert [e.gate for e in rec.events] == [0, 0, 1]
    assert rec.events[-1].t > moved_at  # gate 1 ran only once the operator moved the gate
    state = get_state(sql_url, "p")
    assert state is not None and state.cursor == "1"


def test_a_permanent_failure_fails_the_partition_until_retried(sql_url: str, items: ItemStore) -> None:
    broken = threading.Event()
    broken.set()

    def step(item: Item) -> Response:
        if item.data == b"bad" and broken.is_set():
            raise PermanentError("cannot parse this resume")
        return Response(gate=item.gate, done=True)

    ids = items.add("p", [NewItem(0, b"ok"), NewItem(0, b"bad"), NewItem(1, b"after")])
    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, step)
        cluster.client.submit_task(Task("p"))
        cluster.wait_for_state("p", TaskState.FAILED, timeout=30)
        info = cluster.client.get_task("p")
        assert info.error is not None and "cannot parse this resume" in info.error
        bad = items.get("p", ids[1])
        assert (bad.status, bad.permanent, bad.attempts) == (ItemStatus.FAILED, True, 1)
        assert "PermanentError: cannot parse this resume" in (bad.error or "")
        assert items.get("p", ids[2]).status is ItemStatus.AVAILABLE  # gate 1 never ran
        assert _state_code(sql_url, "p") is StateCode.FAILED

        broken.clear()  # the operator fixed the cause ...
        assert gates.retry_partition(items, "p", cluster.client) == 1  # ... and retries
        cluster.wait_for_state("p", TaskState.DONE, timeout=30)
    assert all(i.status is ItemStatus.COMPLETE for i in items.list("p"))
    assert items.get("p", ids[1]).attempts == 2
    assert _state_code(sql_url, "p") is StateCode.COMPLETED


def test_retryable_failures_are_retried_then_the_partition_retries_them(
        sql_url: str, items: ItemStore) -> None:
    calls: dict[int, int] = {}
    lock = threading.Lock()

    def step(item: Item) -> Response:
        with lock:
            calls[item.id] = calls.get(item.id, 0) + 1
            n = calls[item.id]
        if item.data == b"flaky" and n < 4:
            raise ConnectionError(f"upstream down (call {n})")
        return Response(gate=item.gate, done=True)

    ids = items.add("p", [NewItem(0, b"flaky"), NewItem(0, b"fine")])
    with LocalCluster(sql_url) as cluster:
        # 2 tries per round: round 1 fails (calls 1, 2), the partition faults and backs off,
        # round 2 fails (3) then succeeds (4).
        _consumer(cluster, items, step, max_attempts=2, retry_delay=0.01)
        cluster.client.submit_task(Task("p"))
        cluster.wait_for_state("p", TaskState.DONE, timeout=30)
    flaky = items.get("p", ids[0])
    assert (flaky.status, flaky.attempts, flaky.error) == (ItemStatus.COMPLETE, 4, None)
    assert calls == {ids[0]: 4, ids[1]: 1}
    state = get_state(sql_url, "p")
    assert state is not None and state.code is StateCode.COMPLETED
    assert len(state.errors) == 1 and "ItemsFailed" in state.errors[0].text


def test_retries_exhausted_fail_the_partition(sql_url: str, items: ItemStore) -> None:
    def step(item: Item) -> Response:
        raise TimeoutError("always slow")

    (item_id,) = items.add("p", [NewItem(0, b"x")])
    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, step, max_attempts=2, retry_delay=0.0)
        cluster.client.submit_task(Task("p"))
        cluster.wait_for_state("p", TaskState.FAILED, timeout=30)
    item = items.get("p", item_id)
    # QUICK_POLICY: three errors fail the partition; each round tried the item twice.
    assert (item.status, item.permanent, item.attempts) == (ItemStatus.FAILED, False, 6)
    assert item.error == "TimeoutError: always slow"


def test_processor_answers_move_spawn_and_refuse(sql_url: str, items: ItemStore) -> None:
    def step(item: Item) -> Response:
        if item.data == b"fan-out":
            return Response(gate=0, done=True, spawn=[NewItem(2, f"child-{n}") for n in range(3)])
        if item.data == b"two-steps":
            return Response(gate=2, done=False, data=b"step-2")  # moves on, still to do
        if item.data == b"backwards":
            return Response(gate=0, done=True)  # refused below gate 2
        return Response(gate=item.gate, done=True, data=item.data + b"!")

    items.add("ok", [NewItem(0, b"fan-out"), NewItem(0, b"two-steps")])
    items.add("bad", [NewItem(2, b"backwards")])
    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, step)
        cluster.client.submit_task(Task("ok"))
        cluster.client.submit_task(Task("bad"))
        cluster.wait_for_state("ok", TaskState.DONE, timeout=30)
        cluster.wait_for_state("bad", TaskState.FAILED, timeout=30)
    done = items.list("ok", gate=2)
    assert sorted(i.data for i in done) == [b"child-0!", b"child-1!", b"child-2!", b"step-2!"]
    (refused,) = items.list("bad")
    assert refused.status is ItemStatus.FAILED and refused.permanent
    assert "below the current gate 2" in (refused.error or "")


def test_task_commands_reach_a_working_and_a_waiting_partition(sql_url: str, items: ItemStore) -> None:
    rec = Recorder()

    def step(item: Item) -> Response:
        rec.add("start", item)
        return Response(gate=item.gate, done=True)

    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, step, auto_close=False, command_interval=0.05)
        items.add("p", [NewItem(0, b"a")])
        cluster.client.submit_task(Task("p"))
        wait_until(lambda: len(rec.ids()) == 1, 30, "the first item")
        send_task_command(sql_url, "p", Message.pause())
        wait_until(lambda: _state_code(sql_url, "p") is StateCode.PAUSED, 30, "paused")
        items.add("p", [NewItem(0, b"b")])
        wait_until(lambda: items.info("p").total("available") == 1, 5, "the add")
        assert len(rec.ids()) == 1  # paused: nothing runs
        send_task_command(sql_url, "p", Message.run())
        wait_until(lambda: len(rec.ids()) == 2, 30, "work after resume")
        send_task_command(sql_url, "p", Message.kill())
        cluster.wait_for_state("p", TaskState.DONE, timeout=30)
    assert _state_code(sql_url, "p") is StateCode.KILLED


def test_a_partition_moved_by_a_graceful_handover_does_not_rerun_completed_items(
        sql_url: str, items: ItemStore) -> None:
    rec = Recorder()
    tokens: dict[int, set[int]] = {}
    first_node_busy = threading.Event()

    def processor_for(node: str) -> Callable[[Item], Response]:
        def step(item: Item) -> Response:
            rec.add(node, item)
            if node == "a" and len(rec.ids("a")) >= 20:
                first_node_busy.set()
            threading.Event().wait(0.005)  # pacing the fake work, not synchronisation
            return Response(gate=item.gate, done=True)
        return step

    items.add("p", [NewItem(0, f"{n}") for n in range(80)])
    with LocalCluster(sql_url, shutdown_timeout=20) as cluster:
        a = _consumer(cluster, items, processor_for("a"), node="a", batch_size=5)
        cluster.client.submit_task(Task("p"))
        assert first_node_busy.wait(30)
        _consumer(cluster, items, processor_for("b"), node="b", batch_size=5)
        cluster.stop(a)  # graceful: finishes its in-flight items, writes them, releases
        cluster.wait_for_state("p", TaskState.DONE, timeout=60)
    by_a, by_b = set(rec.ids("a")), set(rec.ids("b"))
    assert by_a and by_b and not by_a & by_b, "an item ran on both nodes"
    assert len(by_a) + len(by_b) == 80
    for item in items.list("p"):
        assert item.status is ItemStatus.COMPLETE
        tokens.setdefault(item.token, set()).add(item.id)
    # Each claim wrote exactly the items its node processed.
    assert sorted(tokens.values(), key=min) == sorted([by_a, by_b], key=min)
    # a's release gave back the items of its batch it never started: no attempt counted.
    assert {i.attempts for i in items.list("p")} == {1}


def test_a_finished_item_is_written_within_the_flush_interval_while_its_batch_is_in_work(
        sql_url: str, items: ItemStore) -> None:
    slow_item_may_end = threading.Event()

    def step(item: Item) -> Response:
        if item.data == b"slow":
            slow_item_may_end.wait(60)
        return Response(gate=item.gate, done=True)

    fast, _, later = items.add("p", [NewItem(0, b"fast"), NewItem(0, b"slow"), NewItem(0, b"later")])
    with LocalCluster(sql_url) as cluster:
        _consumer(cluster, items, step, flush_interval=0.05)  # batch_size 100: one batch
        cluster.client.submit_task(Task("p"))
        try:
            wait_until(lambda: items.get("p", fast).status is ItemStatus.COMPLETE, 30,
                       "the fast item's result, written while the slow one runs")
            assert items.get("p", later).status is ItemStatus.AVAILABLE  # the batch is in work
        finally:
            slow_item_may_end.set()
        cluster.wait_for_state("p", TaskState.DONE, timeout=30)
    assert {i.attempts for i in items.list("p")} == {1}


def test_items_apart_from_the_coordinator_are_fenced_by_token(sqlite_url: str) -> None:
    """A non-SQL coordinator (here memory://) with items in SQL: token fencing only."""
    items = ItemStore(sqlite_url)
    try:
        items.add("p", [NewItem(0, b"a"), NewItem(1, b"b")])
        with LocalCluster() as cluster:
            handler = gates.handler_func(lambda i: Response(gate=i.gate, done=True), None, items,
                                         **_memory_stores(cluster))
            assert not handler.claim_fence
            cluster.add(handler)
            cluster.client.submit_task(Task("p"))
            cluster.wait_for_state("p", TaskState.DONE, timeout=30)
        info = items.info("p")
        assert info.status is gates.PartitionStatus.COMPLETED and info.token > 0
    finally:
        items.close()


def _memory_stores(cluster: LocalCluster) -> dict[str, Any]:
    from metafora.statemachine import commands_for, state_store_for

    return {"state_store": state_store_for(cluster.client), "task_commands": commands_for(cluster.client)}


def test_an_etcd_coordinator_with_items_in_their_own_sql_store(request: pytest.FixtureRequest,
                                                               sqlite_url: str) -> None:
    """The partition is an etcd task; its items live in SQL, token-fenced; state in etcd."""
    etcd_url = request.getfixturevalue("etcd_url")
    items = ItemStore(sqlite_url)
    try:
        items.add("p", [NewItem(0, f"{n}") for n in range(20)] + [NewItem(4, b"last")])
        with LocalCluster(etcd_url) as cluster:
            coord = open_coordinator(etcd_url, node_id="n1")
            handler = gates.handler_func(lambda i: Response(gate=i.gate, done=True), coord, items)
            assert not handler.claim_fence
            cluster.start(Consumer(coord, handler))
            cluster.client.submit_task(Task("p"))
            cluster.wait_for_state("p", TaskState.DONE, timeout=30)
            token = cluster.client.get_task("p").token
        info = items.info("p")
        assert (info.status, info.gate, info.token) == (gates.PartitionStatus.COMPLETED, 4, token)
        assert _state_code(etcd_url, "p") is StateCode.COMPLETED
    finally:
        items.close()
