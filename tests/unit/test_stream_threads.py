"""The threads of streams: idle streams hold none (one elastic pool per bound handler,
threads end when idle); a source's calls stay serialised on the shared pool."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from metafora import Consumer, Task, open_coordinator
from metafora.streams import Job, Jobs, stream_handler
from metafora.streams.threads import ElasticPool, Strand
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs


@pytest.fixture(params=["memory", "sqlite"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    url = None if request.param == "memory" else f"sqlite:///{tmp_path}/metafora.db"
    with LocalCluster(url, shutdown_timeout=5.0) as c:
        yield c


def _stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("metafora-stream")]


class Exclusive(ListJobs):
    """A source that is not thread-safe: it records two of its calls overlapping."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.inside = 0
        self.overlaps = 0
        self.guard = threading.Lock()

    def _enter(self) -> None:
        with self.guard:
            self.inside += 1
            if self.inside > 1:
                self.overlaps += 1

    def _leave(self) -> None:
        with self.guard:
            self.inside -= 1

    def head(self) -> int:
        self._enter()
        try:
            return super().head()
        finally:
            self._leave()

    def at_index(self, index: int) -> Job | None:
        self._enter()
        try:
            return super().at_index(index)
        finally:
            self._leave()


def test_idle_streams_hold_no_thread(cluster: LocalCluster) -> None:
    # 6 streams x max_processing=4 held 6 source threads and up to 24 work threads for as
    # long as they ran, idle or not; now the handler's pool threads end once idle.
    sources: dict[str, Exclusive] = {}

    def jobs(task: Task) -> Jobs:
        sources[task.id] = Exclusive(list(range(8)))
        return sources[task.id]

    handler = stream_handler(jobs, lambda job, ctx: None, max_processing=4,
                             poll_every=3600.0, flush_every=0.01)
    handler.thread_idle = 0.05
    coord = open_coordinator(cluster.url, node_id="a")
    cluster.start(Consumer(coord, handler))
    ids = [f"s{i}" for i in range(6)]
    for task_id in ids:
        cluster.client.submit_task(Task(task_id))
    for task_id in ids:
        wait_for(lambda t=task_id: cluster.client.stream(t).processed >= 7, 15.0,  # type: ignore[misc]
                 f"stream {task_id} caught up")
    wait_for(lambda: not _stream_threads(), 10.0, "the idle streams' threads to end")
    assert all(s.overlaps == 0 for s in sources.values())
    # Woken again, an idle stream gets a thread back for its source and its jobs.
    sources["s3"].append(8, 9)
    assert cluster.client.check_stream("s3") is True
    wait_for(lambda: cluster.client.stream("s3").processed >= 9, 15.0,
             "the checked stream to run its new jobs")


def test_a_strand_runs_its_calls_one_at_a_time_in_order() -> None:
    pool = ElasticPool("test-strand", idle=0.05)
    strand = Strand(pool)
    inside = threading.Lock()
    order: list[int] = []
    release = threading.Event()

    def call(i: int) -> int:
        assert inside.acquire(blocking=False), "two calls of one strand overlap"
        try:
            if i == 0:
                release.wait(10)
            order.append(i)
            return i
        finally:
            inside.release()

    futures = [strand.submit(call, i) for i in range(20)]
    other = pool.submit(lambda: "beside")  # another stream's call does not wait behind it
    assert other.result(10) == "beside"
    release.set()
    assert [f.result(10) for f in futures] == list(range(20))
    assert order == list(range(20))
    wait_for(lambda: pool.threads == 0, 10.0, "the pool's threads to end")


def test_a_queued_call_cancelled_never_runs_and_errors_reach_the_future() -> None:
    pool = ElasticPool("test-cancel", idle=0.05)
    strand = Strand(pool)
    gate = threading.Event()
    ran: list[str] = []
    first = strand.submit(gate.wait, 10)
    queued: Future[None] = strand.submit(ran.append, "queued")
    assert queued.cancel()
    failing = strand.submit(lambda: 1 // 0)
    gate.set()
    assert first.result(10) is True
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    assert ran == [] and queued.cancelled()
