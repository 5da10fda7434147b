"""The lanes that run a stream's jobs (metafora.streams.lanes) and the batched fetch
(``Jobs.at_range``), under real Consumers: a failing job among many short ones is retried
alone while the others complete, max_processing holds and is reached by jobs that wait, and
a source's ``at_range`` is checked as ``at_index`` is (or, where it raises, not used)."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from metafora import Consumer, Task, open_coordinator
from metafora.streams import Job, JobContext, StreamInfo, stream_handler
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs, Recorder


@pytest.fixture(params=["memory", "sqlite"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    url = None if request.param == "memory" else f"sqlite:///{tmp_path}/metafora.db"
    with LocalCluster(url, shutdown_timeout=5.0) as c:
        yield c


def _node(cluster: LocalCluster, handler: Any) -> Consumer:
    return cluster.start(Consumer(open_coordinator(cluster.url, node_id="a"), handler))


def _processed(cluster: LocalCluster, task_id: str, index: int) -> StreamInfo:
    return wait_for(lambda: (i := cluster.client.stream(task_id)).processed >= index and i,
                    15.0, f"stream {task_id} to process {index}")


@pytest.mark.parametrize("is_async", [False, True], ids=["def", "async"])
def test_a_failing_job_among_short_ones_is_retried_alone_and_the_rest_complete(
        cluster: LocalCluster, is_async: bool) -> None:
    rec = Recorder(max_processing=4, max_search_ahead=300)
    attempts: collections.Counter[int] = collections.Counter()

    def run(job: Job, ctx: JobContext) -> None:
        rec.begin(job.index)
        attempts[job.index] += 1
        ok = not (job.index == 150 and ctx.attempt < 3)
        rec.end(job.index, ok)
        if not ok:
            raise RuntimeError(f"job {job.index} fails (attempt {ctx.attempt})")

    async def async_run(job: Job, ctx: JobContext) -> None:
        run(job, ctx)

    _node(cluster, stream_handler(lambda t: ListJobs(list(range(600))),
                                  async_run if is_async else run, max_processing=4,
                                  max_search_ahead=300, retry_delay=0.01, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    info = _processed(cluster, "s1", 599)
    assert info.failing is None
    # Job 150 ran three times, alone; every other job once: none skipped, none re-run.
    assert attempts[150] == 3
    assert {i: n for i, n in attempts.items() if i != 150} == {i: 1 for i in range(600) if i != 150}
    assert not rec.violations  # max_processing and the window held at every start
    assert not cluster.errors


def _four_at_once(cluster: LocalCluster, rec: Recorder, work: Any) -> None:
    """12 jobs of ``work`` (max_attempts 1: a job that cannot meet its peers fails the
    stream) ran 4 at once, never more."""
    _node(cluster, stream_handler(lambda t: ListJobs(list(range(12))), work, max_processing=4,
                                  max_search_ahead=20, max_attempts=1, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    info = _processed(cluster, "s1", 11)
    assert info.failing is None
    assert max(n for _, n, _ in rec.starts) == 4
    assert not rec.violations


def test_thread_lanes_run_max_processing_waiting_jobs_at_once(cluster: LocalCluster) -> None:
    """Jobs that wait (here: for each other) get max_processing lanes, not one."""
    rec = Recorder(max_processing=4, max_search_ahead=20)
    meet = threading.Barrier(4, timeout=10)

    def work(job: Job, ctx: JobContext) -> None:
        rec.begin(job.index)
        meet.wait()  # broken (BrokenBarrierError) unless 4 jobs run side by side
        rec.end(job.index)

    _four_at_once(cluster, rec, work)


def test_async_lanes_run_max_processing_waiting_jobs_at_once(cluster: LocalCluster) -> None:
    rec = Recorder(max_processing=4, max_search_ahead=20)
    running: list[asyncio.Event] = []

    async def work(job: Job, ctx: JobContext) -> None:
        rec.begin(job.index)
        # Each group of four waits until all four run (a lane per job that waits).
        if not running or running[-1].is_set():
            running.append(asyncio.Event())
        group = running[-1]
        if sum(1 for _ in rec.running) == 4:
            group.set()
        await asyncio.wait_for(group.wait(), 10)
        rec.end(job.index)

    _four_at_once(cluster, rec, work)


class Ranged(ListJobs):
    """A ListJobs with its own ``at_range``: counts calls, may raise or shift one job."""

    def __init__(self, items: list[Any], *, raises: bool = False, shift: int | None = None) -> None:
        super().__init__(items)
        self.raises = raises
        self.shift = shift
        self.ranges = 0
        self.singles = 0

    def at_index(self, index: int) -> Job | None:
        self.singles += 1
        return super().at_index(index)

    def at_range(self, start: int, stop: int) -> Sequence[Job | None]:
        self.ranges += 1
        if self.raises:
            raise OSError("no range reads today")
        jobs = [ListJobs.at_index(self, i) for i in range(start, stop)]
        return [Job(i + 1, "shifted") if i == self.shift else job for i, job in zip(range(start, stop), jobs,
                                                                                     strict=True)]


def test_jobs_are_fetched_a_range_at_a_time(cluster: LocalCluster) -> None:
    source = Ranged(list(range(500)))
    _node(cluster, stream_handler(lambda t: source, lambda job, ctx: None, max_processing=4,
                                  max_search_ahead=100, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    _processed(cluster, "s1", 499)
    assert source.singles == 0 and source.ranges < 100  # not one call per job


def test_a_range_read_that_raises_falls_back_to_at_index(cluster: LocalCluster) -> None:
    source = Ranged(list(range(50)), raises=True)
    _node(cluster, stream_handler(lambda t: source, lambda job, ctx: None, max_processing=4,
                                  max_search_ahead=10, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    assert _processed(cluster, "s1", 49).failing is None
    assert source.singles >= 50


def test_a_job_of_another_index_from_at_range_fails_that_job(cluster: LocalCluster) -> None:
    source = Ranged(list(range(20)), shift=5)
    _node(cluster, stream_handler(lambda t: source, lambda job, ctx: None, max_processing=2,
                                  max_search_ahead=10, retry_delay=0.01, max_attempts=2,
                                  flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    info = wait_for(lambda: (i := cluster.client.stream("s1")).failing is not None and i, 15.0,
                    "the stream to fail on job 5")
    assert info.processed == 4
    assert info.failing is not None and info.failing.index == 5
    assert "at_index(5) returned the job of index 6" in info.failing.error


def test_thread_lanes_grow_for_jobs_queued_while_the_watch_timer_was_armed() -> None:
    """The queue emptied once, then refilled before the spawn timer fired: the lanes still
    grow to max_processing (a push during the timer armed no watch of its own, and the timer
    that saw the empty queue stopped watching: 2 of 8 ran until a job ended)."""
    from metafora.streams.lanes import Lanes
    from metafora.streams.threads import ElasticPool

    go = threading.Event()
    release = threading.Event()
    second_started = threading.Event()

    def work(job: Job, ctx: JobContext) -> None:
        if job.index == 0:
            go.wait(60)  # job 1 stays queued until push() armed the spawn timer
        if job.index == 1:
            second_started.set()
        if job.index > 0:
            release.wait(60)

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        ctx = JobContext(Task("s"), 1, threading.Event())
        lanes = Lanes(work, False, ElasticPool("lanes-test"), loop, lambda: None, ctx)
        lanes.limit = 8
        try:
            lanes.push([Job(0, "0"), Job(1, "1")])  # arms the spawn timer
            go.set()
            # The loop is held here (the timer cannot fire): the one lane ends job 0, takes
            # job 1 and so empties the queue.
            assert second_started.wait(30)
            lanes.push([Job(i, str(i)) for i in range(2, 12)])
            deadline = loop.time() + 30
            while lanes.executing < 8 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            return lanes.executing
        finally:
            go.set()
            release.set()
            lanes.abandon()

    assert asyncio.run(scenario()) == 8
