"""The group commit of handler outcomes (metafora.consumer.outcomes) and the consumer's hot path."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from metafora import Consumer, Task, TaskState, simple_handler
from metafora.consumer.outcomes import OutcomeWriter, Pending
from metafora.contracts.coordinator import Finish, Outcome
from metafora.coordinators.memory import MemoryCoordinator
from metafora.core.errors import ClaimLost, CoordinatorUnavailable, MetaforaError
from tests.helpers import Harness, RanIds, wait_until


class BatchRecorder(MemoryCoordinator):
    """A memory coordinator that records each finish_many batch, and can hold or fail one."""

    def __init__(self, base: MemoryCoordinator, *, unavailable: int = 0) -> None:
        super().__init__(base._store, base.node_id)
        self.batches: list[int] = []
        self.unavailable = unavailable
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        self.entered.set()
        assert self.gate.wait(30)
        with self.lock:
            self.batches.append(len(finishes))
            if self.unavailable > 0:
                self.unavailable -= 1
                raise CoordinatorUnavailable("store away")
        return super().finish_many(finishes)


class Results:
    """Collects settle() calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: dict[str, MetaforaError | None] = {}

    def settle(self, task_id: str) -> object:
        def settle(result: MetaforaError | None) -> None:
            with self.lock:
                self.got[task_id] = result
        return settle

    def count(self) -> int:
        with self.lock:
            return len(self.got)


def _claimed(harness: Harness, coord: MemoryCoordinator, n: int) -> list[Task]:
    harness.client.submit_tasks(Task(f"t{i:03d}") for i in range(n))
    got = coord.claim_many([Task(f"t{i:03d}") for i in range(n)], n)
    assert len(got) == n
    return got


def _writer_thread(writer: OutcomeWriter) -> threading.Thread:
    thread = threading.Thread(target=writer.run, name="test-outcomes", daemon=True)
    thread.start()
    return thread


def test_outcomes_queued_during_a_write_go_in_one_batch(harness: Harness) -> None:
    coord = BatchRecorder(harness.coordinator("a"))
    coord.init(harness_context())
    tasks = _claimed(harness, coord, 60)
    results = Results()
    writer = OutcomeWriter(coord, max_batch=50)
    thread = _writer_thread(writer)
    coord.gate.clear()
    writer.put(Pending(Finish(tasks[0], Outcome.DONE), results.settle(tasks[0].id)))  # type: ignore[arg-type]
    assert coord.entered.wait(10)
    for task in tasks[1:]:  # queue while the first write is held
        writer.put(Pending(Finish(task, Outcome.DONE), results.settle(task.id)))  # type: ignore[arg-type]
    assert writer.pending() == 60
    coord.gate.set()
    wait_until(lambda: results.count() == 60, message="every outcome settled")
    assert coord.batches == [1, 50, 9]  # bounded by max_batch
    assert set(results.got.values()) == {None}
    assert {i.state for i in harness.client.tasks()} == {TaskState.DONE}
    writer.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert not writer.put(Pending(Finish(tasks[0], Outcome.DONE), results.settle("late")))  # type: ignore[arg-type]


def test_refused_outcomes_are_settled_with_claim_lost(harness: Harness) -> None:
    coord = harness.coordinator("a")
    coord.init(harness_context())
    good, stale = _claimed(harness, coord, 2)
    coord.release(stale)
    results = Results()
    writer = OutcomeWriter(coord)
    thread = _writer_thread(writer)
    writer.put(Pending(Finish(stale, Outcome.DONE), results.settle("stale")))  # type: ignore[arg-type]
    writer.put(Pending(Finish(good, Outcome.FAIL, "ValueError: x"), results.settle("good")))  # type: ignore[arg-type]
    wait_until(lambda: results.count() == 2, message="both settled")
    assert isinstance(results.got["stale"], ClaimLost) and results.got["good"] is None
    assert harness.client.get_task(good.id).error == "ValueError: x"
    writer.stop()
    thread.join(10)


def test_unavailable_store_is_retried_with_back_off(harness: Harness) -> None:
    coord = BatchRecorder(harness.coordinator("a"), unavailable=3)
    coord.init(harness_context())
    (task,) = _claimed(harness, coord, 1)
    retries: list[tuple[int, float]] = []
    results = Results()
    writer = OutcomeWriter(coord, retry_start=0.01, retry_max=0.02,
                           on_retry=lambda n, exc, delay: retries.append((n, delay)))
    thread = _writer_thread(writer)
    writer.put(Pending(Finish(task, Outcome.DONE), results.settle(task.id)))  # type: ignore[arg-type]
    wait_until(lambda: results.count() == 1, message="written after the outage")
    assert results.got[task.id] is None
    assert retries == [(1, 0.01), (1, 0.02), (1, 0.02)]
    writer.stop()
    thread.join(10)


def test_stop_gives_up_on_an_unreachable_store(harness: Harness) -> None:
    coord = BatchRecorder(harness.coordinator("a"), unavailable=1_000_000)
    coord.init(harness_context())
    (task,) = _claimed(harness, coord, 1)
    results = Results()
    writer = OutcomeWriter(coord, retry_start=0.01, retry_max=0.05)
    thread = _writer_thread(writer)
    writer.put(Pending(Finish(task, Outcome.RELEASE), results.settle(task.id)))  # type: ignore[arg-type]
    wait_until(lambda: len(coord.batches) >= 2, message="a retry")
    writer.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(results.got[task.id], CoordinatorUnavailable)
    assert writer.pending() == 0


def harness_context() -> object:
    from metafora.testing import RecordingContext

    return RecordingContext()


def test_consumer_group_commits_outcomes(harness: Harness) -> None:
    coord = BatchRecorder(harness.coordinator("a"))
    go = threading.Event()
    ran = RanIds()

    def work(task: Task, stop: threading.Event) -> bool:
        assert go.wait(30)  # every handler ends at once: their outcomes meet in the queue
        return ran(task, stop)

    consumer = harness.start(Consumer(coord, simple_handler(work)))
    harness.client.submit_tasks(Task(f"g{i:03d}") for i in range(100))
    wait_until(lambda: len(consumer.tasks()) == 100, 30, "all 100 running")
    coord.gate.clear()
    go.set()
    assert coord.entered.wait(30)
    wait_until(lambda: len(ran.ids) == 100, 30, "every handler returned")
    coord.gate.set()
    wait_until(lambda: consumer.stats.counters()["done"] == 100, 30, "all recorded")
    assert sum(coord.batches) == 100 and max(coord.batches) > 1
    assert {i.state for i in harness.client.tasks()} == {TaskState.DONE}


class CountingConsumer(Consumer):
    """Counts the offers its claim pipeline walks (deferred ones walked again included)."""

    walked = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        offer = self._offers.offer  # the claim pipeline lives in the consumer's offer router

        def counting(*tasks: Task, **how: bool) -> None:
            self.walked += len(tasks)
            offer(*tasks, **how)

        self._offers.offer = counting  # type: ignore[method-assign]


def test_deferred_offers_are_not_rewalked_per_finished_task(harness: Harness) -> None:
    n = 300
    ran = RanIds()
    harness.client.submit_tasks(Task(f"d{i:03d}") for i in range(n))  # one backlog, one scan
    consumer = harness.start(CountingConsumer(harness.coordinator("a"), simple_handler(ran),
                                              max_tasks=2))
    wait_until(lambda: consumer.stats.counters()["done"] == n, 60, "every task done")
    assert sorted(ran.ids) == [f"d{i:03d}" for i in range(n)]
    # Each offer is walked a few times (offered, deferred, re-offered with a few others per
    # free slot, deferred again while the slots fill first);
    # re-walking every deferred offer after each finished task would be ~n*n/2 (45,000).
    assert consumer.walked < 10 * n


# -- outcomes a claim takes along (finish_and_claim, issue 26) ---------------------------


def test_a_claim_takes_queued_outcomes_and_hands_back_what_it_could_not_write(
        harness: Harness) -> None:
    coord = BatchRecorder(harness.coordinator("a"))
    coord.init(harness_context())
    one, two, three = _claimed(harness, coord, 3)
    results = Results()
    writer = OutcomeWriter(coord)
    for task in (one, two, three):
        writer.put(Pending(Finish(task, Outcome.DONE), results.settle(task.id)))  # type: ignore[arg-type]
    taken = writer.take(2)
    assert [p.finish.task.id for p in taken] == [one.id, two.id]
    assert writer.pending() == 3  # taken ones count until settled or given back
    coord.done(one)  # the claim's request wrote the first; the second met an outage
    writer.written(taken, [None, CoordinatorUnavailable("away")])
    assert results.got == {one.id: None}
    thread = _writer_thread(writer)  # the writer writes what came back, first
    wait_until(lambda: results.count() == 3, message="the rest written by the writer")
    assert coord.batches == [2] and set(results.got.values()) == {None}
    writer.stop()
    thread.join(10)
    assert not thread.is_alive()


def test_stop_waits_for_outcomes_a_claim_took(harness: Harness) -> None:
    coord = harness.coordinator("a")
    coord.init(harness_context())
    (task,) = _claimed(harness, coord, 1)
    results = Results()
    writer = OutcomeWriter(coord)
    writer.put(Pending(Finish(task, Outcome.DONE), results.settle(task.id)))  # type: ignore[arg-type]
    taken = writer.take(10)
    thread = _writer_thread(writer)
    writer.stop()
    assert writer.take(10) == []  # nothing more is taken once stopping
    thread.join(0.3)
    assert thread.is_alive(), "the writer left while a claim held an outcome"
    writer.give_back(taken)  # the claim failed: the writer writes it before it leaves
    thread.join(10)
    assert not thread.is_alive() and results.got == {task.id: None}
    assert harness.client.get_task(task.id).state is TaskState.DONE


def test_an_outcome_waits_for_a_due_claim_at_most_linger(harness: Harness) -> None:
    coord = BatchRecorder(harness.coordinator("a"))
    coord.init(harness_context())
    first, second = _claimed(harness, coord, 2)
    results = Results()
    writer = OutcomeWriter(coord)
    writer.linger = 0.5
    writer.claim_soon = lambda: True
    thread = _writer_thread(writer)
    writer.put(Pending(Finish(first, Outcome.DONE), results.settle(first.id)))  # type: ignore[arg-type]
    taken = writer.take(10)  # the due claim: the writer left it there
    assert [p.finish.task.id for p in taken] == [first.id]
    writer.written(taken, [None])
    writer.put(Pending(Finish(second, Outcome.DONE), results.settle(second.id)))  # type: ignore[arg-type]
    # No claim came for it: the writer writes it once its linger is up.
    wait_until(lambda: results.count() == 2, message="written after the linger")
    assert coord.batches == [1]
    writer.stop()
    thread.join(10)
