"""Streams of indexed jobs on every store: the watermark in the store's fenced state, pushed
checks (no polling: the fallback poll is an hour), the failing pause and its retry, a move
that resumes at processed + 1, and the node's lag gauge."""

from __future__ import annotations

import asyncio
import threading

from metafora import Task, TaskState
from metafora.core.errors import ClaimLost
from metafora.statemachine import state_store_for
from metafora.statemachine.machine import State
from metafora.streams import Job, JobContext, StreamInfo, stream_handler
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs, Recorder, wait_failing

_HOUR = 3600.0


def _processed(cluster: LocalCluster, task_id: str, index: int) -> StreamInfo:
    return wait_for(lambda: (i := cluster.client.stream(task_id)).processed >= index and i,
                    30.0, f"stream {task_id} to process {index}")


def test_a_stream_runs_every_job_and_a_check_wakes_it(store_url: str) -> None:
    items = list(range(40))
    source = ListJobs(items)
    rec = Recorder(max_processing=4, max_search_ahead=8)

    async def work(job: Job, ctx: JobContext) -> None:
        rec.begin(job.index)
        await asyncio.sleep(0.001 * (job.index % 3))
        rec.end(job.index)

    with LocalCluster(store_url) as cluster:
        handler = stream_handler(lambda t: source, work, max_processing=4, max_search_ahead=8,
                                 poll_every=_HOUR, flush_every=0.02)
        node = cluster.add(handler, "a")
        cluster.client.submit_task(Task("s1"))
        info = _processed(cluster, "s1", 39)
        assert info.failing is None and info.head == 39
        items.extend(range(40, 45))  # the source cannot push; nothing polls within the test
        assert cluster.client.check_stream("s1") is True
        _processed(cluster, "s1", 44)
        assert sorted(rec.ends) == list(range(45)) and not rec.violations
        assert handler.lags() == {"s1": 0}
        assert node.tasks()[0].task.id == "s1"
        assert cluster.client.get_task("s1").state is TaskState.CLAIMED  # a stream never ends


def test_the_watermark_is_fenced_by_the_claim_token(store_url: str) -> None:
    with LocalCluster(store_url) as cluster:
        cluster.add(stream_handler(lambda t: ListJobs(list(range(10))), lambda job, ctx: None,
                                   poll_every=_HOUR, flush_every=0.01), "a")
        cluster.client.submit_task(Task("s1"))
        _processed(cluster, "s1", 9)
        token = cluster.client.get_task("s1").token
        assert token is not None
        zombie = Task("s1").with_token(token - 1) if token > 1 else Task("s1").with_token(0)
        stale = State(cursor='{"failing":null,"head":99,"in_flight":0,"processed":99,'
                             '"start":0,"stream":1}')
        store = state_store_for(cluster.client)
        try:
            store.store(zombie, stale)
        except ClaimLost:
            pass
        else:  # pragma: no cover - the store let a stale token write
            raise AssertionError("a write under a stale token was accepted")
        assert cluster.client.stream("s1").processed == 9


def test_failing_then_retry_then_a_move(store_url: str) -> None:
    broken = threading.Event()
    broken.set()
    rec = Recorder(max_processing=2, max_search_ahead=4)
    work = rec.sync_work(fail=lambda job, ctx: job.index == 6 and broken.is_set())
    with LocalCluster(store_url) as cluster:
        first = cluster.add(stream_handler(lambda t: ListJobs(list(range(12))), work,
                                           max_processing=2, max_search_ahead=4,
                                           retry_delay=0.0, max_attempts=2, flush_every=0.01,
                                           poll_every=_HOUR), "a")
        cluster.client.submit_task(Task("s1"))
        failing = wait_failing(cluster.client, "s1")
        assert (failing.index, failing.attempts) == (6, 2)
        assert cluster.client.stream("s1").processed == 5
        cluster.stop(first)  # a paused stream moves paused: the next owner waits for retry
        moved = list(rec.ends)
        cluster.add(stream_handler(lambda t: ListJobs(list(range(12))), work, max_processing=2,
                                   max_search_ahead=4, flush_every=0.01, poll_every=_HOUR), "b")
        wait_for(lambda: cluster.client.get_task("s1").owner == "b", 30.0, "b to own s1")
        assert cluster.client.stream("s1").failing is not None
        broken.clear()
        cluster.client.retry_stream("s1")
        _processed(cluster, "s1", 11)
        rerun = rec.ends[len(moved):]
        assert min(rerun) == 6  # at processed + 1, nothing below it again
        assert set(rec.ends) == set(range(12))


def test_the_async_client_sees_and_checks_a_stream(store_url: str) -> None:
    from metafora import open_async_client

    items = list(range(5))
    with LocalCluster(store_url) as cluster:
        cluster.add(stream_handler(lambda t: ListJobs(items), lambda job, ctx: None,
                                   poll_every=_HOUR, flush_every=0.01), "a")
        cluster.client.submit_task(Task("s1"))
        _processed(cluster, "s1", 4)
        items.extend([5, 6])

        async def look() -> tuple[StreamInfo, bool]:
            async with open_async_client(store_url) as client:
                return await client.stream("s1"), await client.check_stream("s1")

        info, sent = asyncio.run(look())
        assert info.processed == 4 and sent is True
        _processed(cluster, "s1", 6)
