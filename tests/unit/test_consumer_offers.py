"""The consumer's offer routing on its own (metafora.consumer.offers), on a real memory store.

The router is driven directly, without a Consumer's loop: ``start`` records the tasks it was
asked to start (and enters them as running, as the launcher would), ``post`` records the
events it sent the loop. Time is a FakeClock.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest

from metafora import Task, open_client, open_coordinator, simple_handler
from metafora.consumer.capacity import Capacity
from metafora.consumer.context import PartsContext
from metafora.consumer.events import Event, Signal
from metafora.consumer.offers import (
    DEFER_AFTER,
    DEFER_FOR,
    DEFER_LOSS,
    FRESH_CHUNK,
    FRESH_LOSS,
    Ignores,
    OfferRouter,
    Placement,
)
from metafora.consumer.options import ConsumerOptions
from metafora.consumer.running import NodeLog, Running
from metafora.contracts.balancer import Balancer, BalancerContext
from metafora.contracts.coordinator import Coordinator, CoordinatorContext
from metafora.coordinators.memory import drop_store
from metafora.testing import FakeClock

_names = itertools.count()


class _Context(CoordinatorContext):
    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels

    def lost(self, task: Task) -> None:
        pass

    @property
    def labels(self) -> dict[str, str]:
        return self._labels


class Refusing(Balancer):
    """Refuses the ids in ``refuse`` (each until ``until``), approves everything else."""

    def __init__(self) -> None:
        self.refuse: dict[str, datetime | None] = {}
        self.asked: list[str] = []

    def init(self, ctx: BalancerContext) -> None:
        pass

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        self.asked.append(task.id)
        if task.id in self.refuse:
            return False, self.refuse.pop(task.id)
        return True, None

    def balance(self) -> list[str]:
        return []


class Rig:
    """A router on node ``a`` of a fresh memory store, and what it did."""

    def __init__(self, clock: FakeClock, url: str, **options: Any) -> None:
        self.clock = clock
        self.url = url
        self.client = open_client(url, clock=clock)
        labels = options.pop("labels", {})
        self.coord = open_coordinator(url, node_id="a", clock=clock)
        self.coord.init(_Context(labels))
        self.balancer = Refusing()
        self.started: list[str] = []
        self.posted: list[Event] = []
        opts = ConsumerOptions(labels=labels, **options)
        ctx = PartsContext(self.coord, opts, NodeLog(logging.getLogger("test"), {"node": "a"}),
                           self.posted.append, clock=clock, rng=random.Random(7))
        self.running, self.lock, self.stats = ctx.running, ctx.lock, ctx.stats
        # Every started task stands for a thread handler.
        capacity = Capacity(max_tasks=opts.max_tasks, thread_cap=opts.thread_cap,
                            busy_threads=lambda: len(self.running), monotonic=clock.monotonic,
                            log=ctx.log)
        self.router = OfferRouter(ctx, self.balancer, capacity=capacity)
        self.router.starts_with(self._start)

    def _start(self, task: Task) -> None:
        self.started.append(task.id)
        handler = simple_handler(lambda t, stop: True)(task)
        self.running[task.id] = Running(task, handler, self.clock.now())

    def submit(self, *tasks: Task) -> list[Task]:
        self.client.submit_tasks(tasks)
        return list(tasks)

    def other_node(self, node: str = "b", labels: dict[str, str] | None = None) -> Coordinator:
        coord = open_coordinator(self.url, node_id=node, clock=self.clock)
        coord.init(_Context(labels or {}))
        return coord


@pytest.fixture
def rig_of() -> Iterator[Any]:
    made: list[Rig] = []

    def make(**options: Any) -> Rig:
        rig = Rig(FakeClock(), f"memory://offers-{next(_names)}", **options)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.coord.close()
        drop_store(rig.url.removeprefix("memory://"))


def test_offers_go_highest_priority_first_and_wait_past_max_tasks(rig_of: Any) -> None:
    rig = rig_of(max_tasks=2)
    offers = rig.submit(Task("low", priority=-1), Task("mid"), Task("top", priority=5),
                        Task("high", priority=3))
    rig.router.arrange(offers)
    assert [t.id for t in offers] == ["top", "high", "mid", "low"]
    rig.router.offer(*offers)
    assert rig.started == ["top", "high"]
    assert len(rig.router.deferred) == 2
    del rig.running["top"]  # a handler ended: its slot is free
    rig.router.retry_deferred()
    assert rig.started == ["top", "high", "mid"]
    assert len(rig.router.deferred) == 1


def test_a_frozen_router_defers_every_offer_until_unfrozen(rig_of: Any) -> None:
    rig = rig_of()
    rig.router.frozen = True
    rig.router.offer(*rig.submit(Task("t1"), Task("t2")))
    assert rig.started == [] and len(rig.router.deferred) == 2
    rig.router.retry_deferred()
    assert rig.started == []
    rig.router.frozen = False
    rig.router.redo_deferred()
    assert sorted(rig.started) == ["t1", "t2"]


def test_a_refused_offer_is_ignored_until_its_deadline_then_tried_again(rig_of: Any) -> None:
    rig = rig_of()
    (task,) = rig.submit(Task("t"))
    rig.balancer.refuse["t"] = rig.clock.now() + timedelta(seconds=5)
    rig.router.offer(task)
    assert rig.started == [] and "t" in rig.router.ignores
    rig.router.offer(task)  # offered again while ignored: the balancer is not asked
    assert rig.balancer.asked == ["t"]
    rig.clock.advance(4.9)
    rig.router.expire_ignores(rig.clock.monotonic())
    assert rig.started == []
    rig.clock.advance(0.1)
    rig.router.expire_ignores(rig.clock.monotonic())
    assert rig.started == ["t"]


def test_a_refusal_without_a_deadline_waits_refuse_retry(rig_of: Any) -> None:
    rig = rig_of(refuse_retry=3.0)
    (task,) = rig.submit(Task("t"))
    rig.balancer.refuse["t"] = None
    rig.router.offer(task)
    entry = rig.router.ignores.get("t")
    assert entry is not None and entry[0] == pytest.approx(rig.clock.monotonic() + 3.0)
    assert rig.router.next_due() == pytest.approx(rig.clock.monotonic() + 3.0)


def test_an_offer_whose_selector_this_node_does_not_match_is_left_alone(rig_of: Any) -> None:
    rig = rig_of(labels={"zone": "eu"})
    rig.router.offer(*rig.submit(Task("gpu", selector={"gpu": "1"}), Task("eu", selector={"zone": "eu"})))
    assert rig.started == ["eu"]
    assert "gpu" not in rig.router.ignores and not rig.router.deferred
    assert rig.balancer.asked == ["eu"]


def test_release_back_off_doubles_per_release_up_to_the_max(rig_of: Any) -> None:
    rig = rig_of(release_backoff=1.0, release_backoff_max=4.0)
    task = Task("t")
    waits = []
    for _ in range(4):
        with rig.lock:
            rig.router.back_off(task)
        entry = rig.router.ignores.get("t")
        assert entry is not None
        waits.append(entry[0] - rig.clock.monotonic())
    for wait, base in zip(waits, (1.0, 2.0, 4.0, 4.0), strict=True):
        assert base * 0.8 <= wait <= base * 1.2  # jittered by +-20%
    with rig.lock:
        rig.router.forget_releases("t")
        rig.router.back_off(task)
    entry = rig.router.ignores.get("t")
    assert entry is not None and entry[0] - rig.clock.monotonic() <= 1.2  # from the start again


def test_a_node_leaving_forgives_refusals_but_not_release_back_offs(rig_of: Any) -> None:
    rig = rig_of(release_backoff=10.0)
    refused, released = rig.submit(Task("refused"), Task("released"))
    rig.balancer.refuse["refused"] = rig.clock.now() + timedelta(seconds=60)
    rig.router.offer(refused)
    with rig.lock:
        rig.router.back_off(released)
    now = rig.clock.monotonic()
    rig.router.forgive_refusals(now)
    assert rig.router.next_due() == now
    rig.router.expire_ignores(now)
    assert rig.started == ["refused"]
    assert "released" in rig.router.ignores


def test_claims_lost_to_a_race_are_counted(rig_of: Any) -> None:
    rig = rig_of()
    taken, free = rig.submit(Task("taken", priority=2), Task("free", priority=1))
    other = rig.other_node()
    try:
        assert other.claim(taken) is not None
        rig.router.offer(taken, free)  # one claim_many of both, limit 2: one won
        assert rig.started == ["free"]
        assert rig.stats.counters()["races_lost"] == 1
        assert not rig.router.deferred
    finally:
        other.close()


def test_offers_past_a_claim_that_filled_the_slots_are_deferred_again(rig_of: Any) -> None:
    rig = rig_of(max_tasks=1)
    first, second = rig.submit(Task("first", priority=1), Task("second"))
    rig.router.offer(first, second)  # both approved (no slot used yet), claimed with limit 1
    assert rig.started == ["first"]
    assert [t.id for t in rig.router.deferred.take(None)] == ["second"]  # maybe not tried
    assert Signal.ROOM not in rig.posted  # the node is full: no room to retry in


def test_a_claim_leaving_slots_free_while_offers_wait_signals_room(rig_of: Any) -> None:
    rig = rig_of(max_tasks=2)
    (taken,) = rig.submit(Task("taken"))
    rig.router.deferred.put(Task("waiting"))
    other = rig.other_node()
    try:
        assert other.claim(taken) is not None
        rig.router.offer(taken)
        assert rig.started == [] and rig.posted == [Signal.ROOM]
    finally:
        other.close()


def test_ignores_keep_the_newest_offer_and_pop_in_deadline_order() -> None:
    ignores = Ignores()
    ignores.put(Task("b"), 2.0)
    ignores.put(Task("a"), 1.0)
    ignores.put(Task("a"), 3.0)  # a newer deadline replaces the older one
    ignores.keep_offer(Task("b", priority=4))
    assert ignores.next_due() == 2.0
    assert [(t.id, t.priority) for t in ignores.pop_due(2.5)] == [("b", 4)]
    assert ignores.next_due() == 3.0 and len(ignores) == 1
    assert [t.id for t in ignores.pop_due(3.0)] == ["a"] and ignores.next_due() is None


def test_spread_holds_a_task_back_while_this_node_runs_one_of_its_group(rig_of: Any) -> None:
    rig = rig_of(placement_wait=2.0)
    placement = Placement(rig.coord, ConsumerOptions(placement_wait=2.0), rig.clock)
    task = Task("s2", spread="g")
    assert placement.hold_back(task, [], {"g": 1}) == pytest.approx(2.0)
    assert placement.hold_back(task, [], {"g": 2}) == pytest.approx(4.0)  # more running: longer
    rig.clock.advance(4.0)
    assert placement.hold_back(task, [], {"g": 2}) is None  # offered again: nobody took it
    assert placement.hold_back(Task("alone", spread="h"), [], {"g": 2}) is None
    # Another task of the group approved in this wave: wait refuse_retry only.
    assert placement.hold_back(Task("s3", spread="g"), [Task("s1", spread="g")], None) == 1.0


def test_prefer_holds_back_only_while_a_live_node_has_the_labels(rig_of: Any) -> None:
    rig = rig_of(placement_wait=2.0)
    placement = Placement(rig.coord, ConsumerOptions(placement_wait=2.0), rig.clock)
    assert placement.hold_back(Task("p1", prefer={"gpu": "1"}), [], None) is None  # none has it
    other = rig.other_node("gpu-node", {"gpu": "1"})
    try:
        rig.clock.advance(6.0)  # the node labels are cached for 5 s
        assert placement.hold_back(Task("p2", prefer={"gpu": "1"}), [], None) == pytest.approx(2.0)
    finally:
        other.close()
    off = Placement(rig.coord, ConsumerOptions(placement_wait=0.0), rig.clock)
    assert off.hold_back(Task("p3", prefer={"gpu": "1"}), [], None) is None


def test_spare_offers_follow_the_share_lost_to_other_nodes(rig_of: Any) -> None:
    """Uncontended, a claim for 2 free slots tries 3 offers, not 8 (each spare one is taken
    from the waiting offers, judged and put back); offers lost to another node bring the
    spares back, up to OVERFETCH per slot."""
    from metafora.consumer.offers import OVERFETCH

    rig = rig_of(max_tasks=2)
    assert rig.router.spares.offers_for(2) == 2 * OVERFETCH  # at first: assume contention
    tasks = rig.submit(*(Task(f"t{i:02d}") for i in range(40)))
    for task in tasks:
        rig.router.deferred.put(task)
    for _ in range(15):  # claim two, finish them, again: nothing is lost
        rig.router.retry_deferred()
        rig.running.clear()
    assert len(rig.started) == 30
    assert rig.router.spares.offers_for(2) == 3
    other = rig.other_node()
    try:
        waiting = rig.router.deferred.take(None)
        for task in waiting:
            other.claim(task)  # another node took every waiting offer
            rig.router.deferred.put(task)
        rig.router.retry_deferred()  # all lost
        assert rig.router.spares.offers_for(2) > 3
    finally:
        other.close()


def test_no_claim_is_due_while_every_slot_is_taken(rig_of: Any) -> None:
    """Offers waiting for a slot are a claim due only while a slot is free: the outcome writer
    leaves a finished task's outcome to a due claim, and a full node would make it wait for
    nothing (until the writer's own 1 s wake-up)."""
    rig = rig_of(max_tasks=1)
    first, second = rig.submit(Task("first", priority=1), Task("second"))
    rig.router.offer(first, second)
    assert rig.started == ["first"] and len(rig.router.deferred) == 1
    assert not rig.router.claim_soon()  # the only slot is taken
    del rig.running["first"]  # its handler ended: the slot is free, the waiting offer is due
    assert rig.router.claim_soon()
    rig.router.freeze(True)
    assert not rig.router.claim_soon()


def test_a_long_offer_list_is_narrowed_chunk_by_chunk_as_it_is_walked(rig_of: Any) -> None:
    """Offers that waited (refused until a cold start ended, say) are re-read a chunk at a
    time as the walk reaches them: tasks another node took while this node walked the chunks
    before are not tried (a read of the whole list up front would have called them open)."""
    rig = rig_of()
    tasks = rig.submit(*(Task(f"t{i:04d}") for i in range(3 * FRESH_CHUNK)))
    other = rig.other_node()
    taken_meanwhile = tasks[FRESH_CHUNK:2 * FRESH_CHUNK]
    asked = rig.balancer.can_claim

    def can_claim(task: Task) -> tuple[bool, datetime | None]:
        if task.id == tasks[0].id:  # while the first chunk is walked, another node claims
            assert len(other.claim_many(taken_meanwhile, len(taken_meanwhile))) == FRESH_CHUNK
        return asked(task)

    rig.balancer.can_claim = can_claim  # type: ignore[method-assign]
    rig.router.spares.loss = 0.0  # whatever the share of races lost
    try:
        rig.router.offer(*tasks, waited=True)
        assert len(rig.started) == 2 * FRESH_CHUNK
        assert not set(rig.started) & {t.id for t in taken_meanwhile}
        assert rig.stats.counters()["races_lost"] == 0  # none of them was tried
    finally:
        other.close()


def test_without_lost_races_fresh_offers_are_not_read_again(rig_of: Any) -> None:
    """Offers straight from the watch cost no read while claims win: a lost race is then
    cheaper than a read per chunk."""
    rig = rig_of()
    tasks = rig.submit(*(Task(f"t{i:04d}") for i in range(2 * FRESH_CHUNK)))
    reads: list[int] = []
    claimable = rig.coord.claimable  # type: ignore[attr-defined]
    rig.coord.claimable = lambda ts: reads.append(len(ts)) or claimable(ts)  # type: ignore[attr-defined]
    rig.router.spares.loss = 0.0
    rig.router.offer(*tasks)
    assert reads == [] and len(rig.started) == 2 * FRESH_CHUNK
    rig.router.spares.loss = FRESH_LOSS
    more = rig.submit(*(Task(f"u{i:04d}") for i in range(FRESH_CHUNK)))
    rig.router.offer(*more)
    assert reads == [FRESH_CHUNK]


def test_a_full_node_defers_a_long_list_without_reading_it(rig_of: Any) -> None:
    """With every slot taken an offer is only deferred: narrowing its chunk would be a read
    for nothing (a start-up backlog of 20,000 cost a node 40 reads while its slots were
    full). The deferred offers are narrowed when they come back, once a slot is free."""
    rig = rig_of(max_tasks=2)
    tasks = rig.submit(*(Task(f"t{i:04d}") for i in range(2 * FRESH_CHUNK + 2)))
    reads: list[int] = []
    claimable = rig.coord.claimable  # type: ignore[attr-defined]
    rig.coord.claimable = lambda ts: reads.append(len(ts)) or claimable(ts)  # type: ignore[attr-defined]
    rig.router.spares.loss = 1.0  # claims losing races: a chunk with room is read first
    rig.router.offer(*tasks[:2], waited=True)
    assert len(rig.started) == 2 and reads == []  # a short list is not read
    rig.router.offer(*tasks[2:])
    rig.router.offer(*tasks[2:], waited=True)
    assert reads == [] and len(rig.router.deferred) == 2 * FRESH_CHUNK
    for task_id in rig.started:  # the handlers ended: room again
        del rig.running[task_id]
    rig.router.offer(*tasks[2:2 + FRESH_CHUNK], waited=True)
    assert reads == [FRESH_CHUNK]


def test_while_most_claims_lose_a_long_fresh_list_is_put_off_then_tried_narrowed(rig_of: Any) -> None:
    """A node losing most races (walking a backlog right behind another) puts a long fresh
    offer list off for a moment instead of trying it; when it comes back, what others took
    meanwhile is not tried and the rest is claimed. A short list is tried at once."""
    rig = rig_of()
    tasks = rig.submit(*(Task(f"t{i:04d}") for i in range(2 * FRESH_CHUNK)))
    rig.router.spares.loss, rig.router.spares.noted = DEFER_LOSS, DEFER_AFTER
    rig.router.offer(*tasks)
    assert rig.started == [] and rig.stats.counters()["claims"] == 0
    assert len(rig.router.ignores) == 2 * FRESH_CHUNK
    due = rig.router.next_due()
    assert due is not None and DEFER_FOR[0] <= due - rig.clock.monotonic() <= DEFER_FOR[1]
    other = rig.other_node()
    try:
        taken = tasks[:FRESH_CHUNK]
        assert len(other.claim_many(taken, len(taken))) == FRESH_CHUNK
        rig.clock.advance(DEFER_FOR[1])
        rig.router.expire_ignores(rig.clock.monotonic())
        assert sorted(rig.started) == [t.id for t in tasks[FRESH_CHUNK:]]
        assert rig.stats.counters()["races_lost"] == 0  # the taken ones were never tried
        short = rig.submit(*(Task(f"s{i:03d}") for i in range(FRESH_CHUNK - 1)))
        rig.router.spares.loss = 1.0
        rig.router.offer(*short)
        assert len(rig.started) == 2 * FRESH_CHUNK - 1  # a short list: tried at once
    finally:
        other.close()


def test_the_share_of_lost_claims_is_trusted_only_after_a_few_claims(rig_of: Any) -> None:
    """It starts at 1.0 (assume contention): a first long list is tried, not put off."""
    rig = rig_of()
    tasks = rig.submit(*(Task(f"t{i:04d}") for i in range(FRESH_CHUNK)))
    assert rig.router.spares.loss == 1.0 and not rig.router.spares.contested()
    rig.router.offer(*tasks)
    assert len(rig.started) == FRESH_CHUNK
