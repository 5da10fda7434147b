"""A run's time reaches the balancer (RecentRuns) when its handler returns, not when the
consumer's loop drains its Finished event: at a cold start of short tasks that event waits
behind thousands of refused offers, and the short-task verdict with it."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

import pytest

from metafora import Task, open_coordinator, simple_handler
from metafora.consumer.capacity import Capacity
from metafora.consumer.context import PartsContext
from metafora.consumer.events import Event, Finished
from metafora.consumer.finishing import Finisher
from metafora.consumer.options import ConsumerOptions
from metafora.consumer.running import NodeLog, Running
from metafora.contracts.balancer import RecentRuns
from metafora.coordinators.memory import drop_store
from metafora.testing import FakeClock


@pytest.fixture
def parts() -> Iterator[tuple[FakeClock, Finisher, RecentRuns, list[Event]]]:
    clock = FakeClock()
    coord = open_coordinator("memory://finish-runs", node_id="a", clock=clock)
    posted: list[Event] = []
    opts = ConsumerOptions()
    ctx = PartsContext(coord, opts, NodeLog(logging.getLogger("test"), {"node": "a"}),
                       posted.append, clock=clock, rng=random.Random(7))
    capacity = Capacity(max_tasks=opts.max_tasks, thread_cap=opts.thread_cap,
                        busy_threads=lambda: 0, monotonic=clock.monotonic, log=ctx.log)
    runs = RecentRuns(clock=clock)
    finisher = Finisher(ctx, capacity=capacity, back_off=lambda task: None,
                        forget_releases=lambda task_id: None, ran=runs.add)
    try:
        yield clock, finisher, runs, posted
    finally:
        drop_store("finish-runs")


def _entry(clock: FakeClock, task_id: str) -> Running:
    task = Task(task_id)
    return Running(task, simple_handler(lambda t, stop: True)(task), clock.now())


def test_a_run_is_told_when_its_handler_returns(
        parts: tuple[FakeClock, Finisher, RecentRuns, list[Event]]) -> None:
    clock, finisher, runs, posted = parts
    assert runs.latest() is None
    entry = _entry(clock, "t1")
    clock.advance(0.25)
    write = finisher.finish(entry, True, None, None)
    assert write is not None  # the outcome is not written yet: no Finished event either
    assert not any(isinstance(e, Finished) for e in posted)
    assert runs.recent(10.0) == (1, 0.25)
    assert runs.latest() == clock.monotonic()


def test_a_stopped_run_tells_nothing(
        parts: tuple[FakeClock, Finisher, RecentRuns, list[Event]]) -> None:
    clock, finisher, runs, _posted = parts
    entry = _entry(clock, "t2")
    entry.stopped = clock.now()  # released by this node: says nothing of how long tasks run
    clock.advance(0.25)
    finisher.finish(entry, True, None, None)
    assert runs.recent(10.0) == (0, None) and runs.latest() is None
