"""The stream handler under real Consumers on the memory store and a SQLite file: every job
once in order of the watermark, the window's bounds, retries and the failing pause, pushed
checks, moves that resume at processed + 1, and bad input (each a clear error on its stream)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metafora import Consumer, Task, TaskState, open_coordinator
from metafora.core.errors import ClaimLost, ConfigError, InvalidTaskState
from metafora.core.task import Task as TaskValue
from metafora.statemachine import StateCode, StateStore, get_state, state_store_for
from metafora.statemachine.machine import State
from metafora.streams import Job, JobContext, Jobs, StreamInfo, stream_handler
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs, Recorder


@pytest.fixture(params=["memory", "sqlite"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    """A LocalCluster on the memory store, then on a SQLite file."""
    url = None if request.param == "memory" else f"sqlite:///{tmp_path}/metafora.db"
    with LocalCluster(url, shutdown_timeout=5.0) as c:
        yield c


def _node(cluster: LocalCluster, handler: Any, node: str = "a", **options: Any) -> Consumer:
    coord = open_coordinator(cluster.url, node_id=node)
    return cluster.start(Consumer(coord, handler, **options))


def _processed(cluster: LocalCluster, task_id: str, index: int) -> StreamInfo:
    return wait_for(lambda: (i := cluster.client.stream(task_id)).processed >= index and i,
                    15.0, f"stream {task_id} to process {index}")


def test_every_job_once_within_the_window_sync(cluster: LocalCluster) -> None:
    rec = Recorder(max_processing=4, max_search_ahead=10)
    rng = random.Random(7)
    delays = [rng.random() * 0.002 for _ in range(300)]
    pace = threading.Event()  # never set: waiting on it paces a job (not synchronisation)

    def work(job: Job, ctx: JobContext) -> None:
        rec.begin(job.index)
        pace.wait(delays[job.index])
        rec.end(job.index)

    source = ListJobs(list(range(300)))
    _node(cluster, stream_handler(lambda t: source, work, max_processing=4, max_search_ahead=10,
                                  flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    info = _processed(cluster, "s1", 299)
    assert info == StreamInfo(299, 299, info.in_flight, None)
    assert sorted(rec.started()) == list(range(300))  # every job, once (nothing moved)
    assert not rec.violations
    assert max(n for _, n, _ in rec.starts) <= 4
    assert not cluster.errors


def test_every_job_once_within_the_window_async(cluster: LocalCluster) -> None:
    rec = Recorder(max_processing=8, max_search_ahead=8)
    rng = random.Random(3)

    async def work(job: Job, ctx: JobContext) -> None:
        rec.begin(job.index)
        await asyncio.sleep(rng.random() * 0.002)
        rec.end(job.index)

    _node(cluster, stream_handler(lambda t: ListJobs(list(range(200))), work, max_processing=8,
                                  max_search_ahead=8, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    _processed(cluster, "s1", 199)
    assert sorted(rec.started()) == list(range(200))
    assert not rec.violations
    assert any(n > 1 for _, n, _ in rec.starts)  # it did run jobs side by side


class CountingStates(StateStore):
    """The cluster's own state store, counting the stream's writes (a spy, not a stand-in)."""

    def __init__(self, inner: StateStore) -> None:
        self.inner = inner
        self.writes = 0

    def load(self, task: TaskValue) -> State:
        return self.inner.load(task)

    def load_stored(self, task: TaskValue) -> State | None:
        return self.inner.load_stored(task)

    def store(self, task: TaskValue, state: State) -> None:
        self.writes += 1
        self.inner.store(task, state)

    def get(self, task_id: str) -> State | None:
        return self.inner.get(task_id)


def test_the_watermark_is_written_in_batches_not_per_job(cluster: LocalCluster) -> None:
    from metafora.statemachine import commands_for

    coord = open_coordinator(cluster.url, node_id="a")
    states = CountingStates(state_store_for(coord))
    handler = stream_handler(lambda t: ListJobs(list(range(3000))), lambda job, ctx: None,
                             max_processing=16, max_search_ahead=256, flush_every=0.05,
                             state_store=states, task_commands=commands_for(coord))
    cluster.start(Consumer(coord, handler))
    cluster.client.submit_task(Task("s1"))
    _processed(cluster, "s1", 2999)
    # Without batching that is 3000 writes; with it, one per flush interval at most.
    assert states.writes < 300, states.writes


def test_a_failing_job_pauses_the_stream_until_retried(cluster: LocalCluster) -> None:
    rec = Recorder(max_processing=2, max_search_ahead=5)
    broken = threading.Event()
    broken.set()
    work = rec.sync_work(fail=lambda job, ctx: job.index == 3 and broken.is_set())
    _node(cluster, stream_handler(lambda t: ListJobs(list(range(20))), work, max_processing=2,
                                  max_search_ahead=5, retry_delay=0.01, max_attempts=3,
                                  flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    info = wait_for(lambda: (i := cluster.client.stream("s1")).failing is not None and i, 15.0,
                    "the stream to fail on job 3")
    assert info.processed == 2
    assert info.failing is not None
    assert (info.failing.index, info.failing.attempts) == (3, 3)
    assert "RuntimeError: job 3 fails" in info.failing.error
    assert max(rec.started()) <= 2 + 5  # the window held while job 3 was retried
    assert cluster.client.check_stream("s1") is False  # failing: no check, even while pausing
    wait_for(lambda: get_state(cluster.client, "s1").code is StateCode.PAUSED,  # type: ignore[union-attr]
             10.0, "paused")
    assert cluster.client.get_task("s1").state is TaskState.CLAIMED  # keeps its claim
    assert cluster.client.check_stream("s1") is False  # a check does not resume it

    broken.clear()
    cluster.client.retry_stream("s1")
    info = _processed(cluster, "s1", 19)
    assert info.failing is None
    assert rec.ends.count(3) == 1 and set(rec.ends) == set(range(20))
    with pytest.raises(InvalidTaskState, match="not failing"):
        cluster.client.retry_stream("s1")


def test_check_wakes_an_idle_stream_that_cannot_push(cluster: LocalCluster) -> None:
    items: list[int] = [0, 1]
    source = ListJobs(items)
    rec = Recorder(max_processing=2, max_search_ahead=10)
    _node(cluster, stream_handler(lambda t: source, rec.sync_work(), max_processing=2,
                                  max_search_ahead=10, poll_every=3600.0, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    _processed(cluster, "s1", 1)
    calls = source.head_calls
    items.extend([2, 3, 4])  # no push: only a check (or the hour's poll) would see them
    assert cluster.client.check_stream("s1") is True
    _processed(cluster, "s1", 4)
    assert source.head_calls > calls
    assert sorted(rec.ends) == [0, 1, 2, 3, 4]


def test_a_source_that_pushes_wakes_the_stream(cluster: LocalCluster) -> None:
    source = ListJobs([0], pushes=True)
    rec = Recorder(max_processing=2, max_search_ahead=10)
    _node(cluster, stream_handler(lambda t: source, rec.sync_work(), max_processing=2,
                                  max_search_ahead=10, poll_every=3600.0, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    _processed(cluster, "s1", 0)
    wait_for(lambda: source.wakes, 5.0, "the stream to listen")
    source.append(1, 2, 3)
    _processed(cluster, "s1", 3)


def test_a_moved_stream_resumes_after_its_processed_index(cluster: LocalCluster) -> None:
    rec = Recorder(max_processing=4, max_search_ahead=20)
    gate = threading.Event()
    first_work = rec.sync_work()

    def held(job: Job, ctx: JobContext) -> None:
        if job.index >= 20:  # held until after the stop: abandoned, they must run again
            gate.wait(30)
            raise RuntimeError("abandoned")
        first_work(job, ctx)

    first = _node(cluster, stream_handler(
        lambda t: ListJobs(list(range(100))), held, max_processing=4, max_search_ahead=20,
        flush_every=0.01, stop_grace=0.05), "a")
    slow: list[int] = []

    def second_work(job: Job, ctx: JobContext) -> None:
        slow.append(job.index)
        rec.begin(job.index)
        rec.end(job.index)

    cluster.client.submit_task(Task("s1", {"n": 100}))
    _processed(cluster, "s1", 19)
    cluster.stop(first)  # a graceful release: the progress is written before the claim goes
    kept = cluster.client.stream("s1").processed
    gate.set()
    _node(cluster, stream_handler(lambda t: ListJobs(list(range(100))), second_work,
                                  max_processing=4, max_search_ahead=20, flush_every=0.01), "b")
    _processed(cluster, "s1", 99)
    assert kept == 19
    assert slow and min(slow) == kept + 1  # at processed + 1, nothing below it again
    assert set(rec.ends) == set(range(100))


def test_stop_abandons_a_job_that_does_not_finish_within_the_grace(cluster: LocalCluster) -> None:
    hold = threading.Event()
    started = threading.Event()

    def work(job: Job, ctx: JobContext) -> None:
        if job.index == 2:
            started.set()
            hold.wait(30)

    node = _node(cluster, stream_handler(lambda t: ListJobs(list(range(5))), work,
                                         max_processing=2, max_search_ahead=4, flush_every=0.01,
                                         stop_grace=0.05))
    cluster.client.submit_task(Task("s1"))
    assert started.wait(10)
    _processed(cluster, "s1", 1)
    cluster.stop(node, timeout=10)  # returns: the stuck job was abandoned after the grace
    hold.set()
    info = cluster.client.stream("s1")
    assert info.processed == 1  # job 2 never finished here: it runs again on the next owner
    assert cluster.client.get_task("s1").state is TaskState.PENDING


# -- bad input: a clear error on the stream, the node and the other streams go on ----------


class WrongIndex(ListJobs):
    def at_index(self, index: int) -> Job | None:
        job = super().at_index(index)
        return None if job is None else Job(index + 1 if index == 4 else index, job.id)


def test_bad_sources_fail_their_stream_only(cluster: LocalCluster) -> None:
    def jobs(task: Task) -> Jobs:
        kind = task.props["kind"]  # a KeyError for a task without it
        if kind == "raises":
            raise RuntimeError("cannot open the source")
        if kind == "wrong":
            return WrongIndex(list(range(10)))
        if kind == "backwards":
            return ListJobs(list(range(10)), heads=[5, 2])
        if kind == "not-jobs":
            return "a string"  # type: ignore[return-value]
        return ListJobs(list(range(50)))

    from metafora.statemachine import ErrorPolicy

    done: list[int] = []
    handler = stream_handler(jobs, lambda job, ctx: done.append(job.index), max_processing=2,
                             max_search_ahead=4, retry_delay=0.0, max_attempts=2,
                             flush_every=0.01,
                             error_handler=ErrorPolicy(max_errors=2, base_delay=0.01, max_delay=0.01))
    _node(cluster, handler)
    for tid, props in [("raises", {"kind": "raises"}), ("wrong", {"kind": "wrong"}),
                       ("backwards", {"kind": "backwards"}), ("no-props", {}),
                       ("not-jobs", {"kind": "not-jobs"}), ("good", {"kind": "good"})]:
        cluster.client.submit_task(Task(tid, props))
    _processed(cluster, "good", 49)

    for tid, reason in [("raises", "RuntimeError: cannot open the source"),
                        ("no-props", "KeyError: 'kind'"),
                        ("not-jobs", "not a metafora.streams.Jobs")]:
        cluster.wait_for_state(tid, TaskState.DONE)  # the machine ended it: failed
        assert get_state(cluster.client, tid).code is StateCode.FAILED  # type: ignore[union-attr]
        failing = cluster.client.stream(tid).failing
        assert failing is not None and reason in failing.error, (tid, failing)

    wrong = wait_for(lambda: cluster.client.stream("wrong").failing, 10.0, "wrong to fail")
    assert wrong.index == 4 and "at_index(4) returned the job of index 5" in wrong.error
    assert cluster.client.stream("wrong").processed == 3
    back = wait_for(lambda: cluster.client.stream("backwards").failing, 10.0, "backwards to fail")
    assert "head() went backwards, from 5 to 2" in back.error
    assert not cluster.errors


@pytest.mark.parametrize(("options", "match"), [
    ({"max_processing": 8, "max_search_ahead": 4}, "max_search_ahead .4. must be at least"),
    ({"start": -1}, "start must be from 0"),
    ({"start": 1.5}, "start must be an integer"),
    ({"start": True}, "start must be an integer"),
    ({"max_processing": 0}, "max_processing must be from 1"),
    ({"poll_every": 0}, "poll_every must be in"),
    ({"flush_every": float("nan")}, "flush_every must be in"),
    ({"max_attempts": 0}, "max_attempts must be from 1"),
    ({"retry_delay": 2.0, "max_retry_delay": 1.0}, "max_retry_delay"),
])
def test_bad_options_are_refused_at_once(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        stream_handler(lambda t: ListJobs([]), lambda job, ctx: None, **options)


def test_bad_callables_are_refused_at_once() -> None:
    with pytest.raises(ConfigError, match="work must be callable"):
        stream_handler(lambda t: ListJobs([]), 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="jobs must be callable"):
        stream_handler(None, lambda job, ctx: None)  # type: ignore[arg-type]


def test_a_handler_without_a_store_says_so() -> None:
    handler = stream_handler(lambda t: ListJobs([]), lambda job, ctx: None)
    with pytest.raises(ConfigError, match="pass coordinator="):
        handler(Task("s1"))


def test_a_task_that_is_not_a_stream_is_refused_by_the_client(cluster: LocalCluster) -> None:
    from metafora.statemachine import Message, handler_func

    def other(task: Task, cmds: Any) -> Message:
        cmds.checkpoint("page 3")
        return Message.complete()

    coord = open_coordinator(cluster.url, node_id="x")
    cluster.start(Consumer(coord, handler_func(other, coord)))
    cluster.client.submit_task(Task("other"))
    cluster.wait_for_state("other", TaskState.DONE)
    with pytest.raises(InvalidTaskState, match="not a stream"):
        cluster.client.stream("other")
    with pytest.raises(InvalidTaskState, match="not a stream"):  # nothing sent to it either
        cluster.client.check_stream("other")
    with pytest.raises(InvalidTaskState, match="not a stream"):
        cluster.client.retry_stream("other")


def test_a_zombie_write_is_refused(cluster: LocalCluster) -> None:
    """The progress is the machine's fenced cursor: a write under an old token is refused."""
    _node(cluster, stream_handler(lambda t: ListJobs(list(range(5))), lambda job, ctx: None,
                                  flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    _processed(cluster, "s1", 4)
    store = state_store_for(cluster.client)
    token = cluster.client.get_task("s1").token
    assert token is not None
    with pytest.raises(ClaimLost):
        store.store(TaskValue("s1").with_token(token - 1), State(cursor='{"stream":1}'))
    assert cluster.client.stream("s1").processed == 4


def test_the_owner_publishes_the_summed_lag_on_metrics(cluster: LocalCluster) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    hold = threading.Event()

    def work(job: Job, ctx: JobContext) -> None:
        if job.index >= 3:
            hold.wait(30)

    handler = stream_handler(lambda t: ListJobs(list(range(10))), work, max_processing=2,
                             max_search_ahead=4, flush_every=0.01, stop_grace=0.0)
    node = _node(cluster, handler, http_addr="127.0.0.1:0")
    addr = wait_for(lambda: node.http_address, what="http server")
    for tid in ("s1", "s2"):
        cluster.client.submit_task(Task(tid))

    def lag() -> float | None:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "metafora_stream_lag":
                (sample,) = family.samples
                assert sample.labels == {"node": "a"}  # no per-stream label, by policy
                return sample.value
        return None

    try:
        # Each stream: jobs 0-2 done, 3 and 4 held; head 9 -> lag 7; two streams -> 14.
        wait_for(lambda: lag() == 14.0, 15.0, "the summed lag")
    finally:
        hold.set()
    wait_for(lambda: lag() == 0.0, 15.0, "no lag once done")


def test_a_stream_is_listed_from_its_first_run_even_if_it_cannot_start(
        cluster: LocalCluster) -> None:
    from metafora.statemachine import ErrorPolicy
    from metafora.streams.ops import stream_rows

    def jobs(task: Task) -> Jobs:
        if task.id == "broken":
            raise RuntimeError("no source for you")
        return ListJobs([])

    _node(cluster, stream_handler(jobs, lambda job, ctx: None, flush_every=0.01,
                                  error_handler=ErrorPolicy(max_errors=1)))
    cluster.client.submit_task(Task("empty"))
    cluster.client.submit_task(Task("broken"))
    cluster.wait_for_state("broken", TaskState.DONE)
    def listed() -> dict[str, Any] | None:
        rows = {r.id: r for r in stream_rows(cluster.client)}
        # the first write precedes the first look at the source (head None); the next names it
        empty = rows.get("empty")
        return rows if len(rows) == 2 and empty is not None and empty.info.head == -1 else None

    rows = wait_for(listed, 10.0, "both streams listed, the empty one with its head")
    assert rows["empty"].info == StreamInfo(-1, -1, 0, None)
    assert rows["broken"].state == "failed"
    failing = rows["broken"].info.failing
    assert failing is not None and "RuntimeError: no source for you" in failing.error


def test_one_handler_serves_two_consumers_each_on_its_own_coordinator(
        cluster: LocalCluster) -> None:
    items = list(range(30))
    handler = stream_handler(lambda t: ListJobs(items), lambda job, ctx: None,
                             flush_every=0.01, poll_every=3600.0)
    a = _node(cluster, handler, "a")
    b = _node(cluster, handler, "b")
    ids = [f"s{i}" for i in range(6)]
    for tid in ids:
        cluster.client.submit_task(Task(tid))
    for tid in ids:
        _processed(cluster, tid, 29)
    owners = {cluster.client.get_task(tid).owner for tid in ids}
    assert owners <= {"a", "b"}
    assert set(handler.lags()) == set(ids)  # the consumers' copies report to the handler
    cluster.stop(a)  # a's streams move to b, whose copy is bound to b's coordinator
    wait_for(lambda: all(cluster.client.get_task(t).owner == "b" for t in ids), 30.0, "moved")
    wait_for(lambda: {t.task.id for t in b.tasks()} == set(ids), 30.0, "b runs them all")
    items.append(30)
    for tid in ids:  # and they go on there: the new job is processed by b's copy
        assert cluster.client.check_stream(tid)
    for tid in ids:
        _processed(cluster, tid, 30)
    assert not cluster.errors


class FlakyHead(ListJobs):
    """head() raises on every call after the first (a source that went away)."""

    def head(self) -> int:
        if self.head_calls:
            raise ConnectionError("the source went away")
        return super().head()


class Holes(ListJobs):
    """at_index(2) is None although head() says it exists."""

    def at_index(self, index: int) -> Job | None:
        return None if index == 2 else super().at_index(index)


def test_a_failing_head_and_a_missing_job_pause_their_stream(cluster: LocalCluster) -> None:
    from tests.stream_kit import wait_failing

    def jobs(task: Task) -> Jobs:
        return FlakyHead(list(range(3))) if task.id == "flaky" else Holes(list(range(5)))

    _node(cluster, stream_handler(jobs, lambda job, ctx: None, retry_delay=0.0,
                                  max_attempts=2, flush_every=0.01))
    cluster.client.submit_task(Task("flaky"))
    cluster.client.submit_task(Task("holes"))
    flaky = wait_failing(cluster.client, "flaky")
    assert "head() failed: ConnectionError: the source went away" in flaky.error
    assert cluster.client.stream("flaky").processed == 2  # its jobs were done before
    holes = wait_failing(cluster.client, "holes")
    assert holes.index == 2 and "at_index(2) returned None, although head() is 4" in holes.error
    assert cluster.client.stream("holes").processed == 1


def test_a_retry_due_while_the_pool_is_full_does_not_spin_the_loop(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job 0 fails once; its next attempt falls due while 1 and 2 fill the pool: the stream
    waits for a free slot (a job's end wakes it), it does not turn with a zero timeout."""
    from metafora.streams import run as run_module

    turns = [0]
    original = run_module.StreamRun._wait

    async def counted(self: run_module.StreamRun) -> None:
        turns[0] += 1
        await original(self)

    monkeypatch.setattr(run_module.StreamRun, "_wait", counted)
    hold, pace = threading.Event(), threading.Event()  # pace is never set: it measures
    started: set[int] = set()

    def work(job: Job, ctx: JobContext) -> None:
        started.add(job.index)
        if job.index == 0 and ctx.attempt == 1:
            raise RuntimeError("once")
        if job.index in (1, 2):
            hold.wait(30)

    _node(cluster, stream_handler(lambda t: ListJobs(list(range(5))), work, max_processing=2,
                                  max_search_ahead=10, retry_delay=0.01, flush_every=0.01,
                                  poll_every=3600.0))
    cluster.client.submit_task(Task("s1"))
    try:
        wait_for(lambda: {1, 2} <= started, 10.0, "jobs 1 and 2 to hold the pool")
        pace.wait(0.1)  # job 0's retry is due by now (10 ms), with no slot for it
        before = turns[0]
        pace.wait(0.3)
        spun = turns[0] - before
    finally:
        hold.set()
    _processed(cluster, "s1", 4)
    assert spun < 10, f"{spun} turns in 0.3 s with a full pool and nothing to do"


def test_an_async_job_that_raises_cancelled_error_is_retried(cluster: LocalCluster) -> None:
    """CancelledError raised by the job itself (an inner cancellation that escaped) is a
    failure, retried; it used to be dropped like an abandoned job, stalling the watermark."""
    attempts: list[tuple[int, int]] = []

    async def work(job: Job, ctx: JobContext) -> None:
        attempts.append((job.index, ctx.attempt))
        if job.index == 1 and ctx.attempt == 1:
            raise asyncio.CancelledError()

    _node(cluster, stream_handler(lambda t: ListJobs(list(range(5))), work, max_processing=2,
                                  max_search_ahead=10, retry_delay=0.01, flush_every=0.01))
    cluster.client.submit_task(Task("s1"))
    info = _processed(cluster, "s1", 4)
    assert info.failing is None
    assert (1, 2) in attempts
    assert not cluster.errors


def test_a_dropped_consumers_copy_of_the_handler_is_not_kept(tmp_path: Path) -> None:
    """A Consumer runs a copy of the handler bound to its coordinator; once the consumer is
    gone the copy (and the stores it holds) must go too, not stay in the shared handler."""
    import gc
    import weakref

    handler = stream_handler(lambda t: ListJobs([]), lambda job, ctx: None)
    coord = open_coordinator(f"sqlite:///{tmp_path}/metafora.db", node_id="a")
    try:
        copy = handler.bind_coordinator(coord)
        assert copy is not handler
        gone = weakref.ref(copy)
        del copy
        gc.collect()
        assert gone() is None
        assert handler.lags() == {}
    finally:
        coord.close()



class Fetches(ListJobs):
    """A ListJobs recording the indexes asked of ``at_index``."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.fetched: list[int] = []

    def at_index(self, index: int) -> Job | None:
        self.fetched.append(index)
        return super().at_index(index)


def test_a_resumed_stream_counts_the_jobs_its_paused_run_abandoned(cluster: LocalCluster) -> None:
    """Paused by an operator while a job ignores the stop: the job is abandoned after the
    grace but its thread still runs it. Resumed on the same node, the stream must not fill
    its pool beside it (max_processing holds on the node); it starts once the thread ends."""
    from metafora.statemachine import Message, send_task_command

    hold = threading.Event()
    sources: list[Fetches] = []

    def jobs(task: Task) -> Jobs:
        sources.append(Fetches(list(range(4))))
        return sources[-1]

    def work(job: Job, ctx: JobContext) -> None:
        if job.index == 1 and len(sources) == 1:
            hold.wait(30)  # ignores ctx.stopping: abandoned by the pause, its thread runs on

    handler = stream_handler(jobs, work, max_processing=1, max_search_ahead=10,
                             flush_every=0.01, stop_grace=0.0)
    _node(cluster, handler)
    cluster.client.submit_task(Task("s1"))
    try:
        wait_for(lambda: sources and 1 in sources[0].fetched, 10.0, "job 1 to start")
        send_task_command(cluster.client, "s1", Message.pause())
        wait_for(lambda: get_state(cluster.client, "s1").code is StateCode.PAUSED,  # type: ignore[union-attr]
                 10.0, "paused")
        send_task_command(cluster.client, "s1", Message.run())
        # The resumed run's first turn is over (it decided what to start) once it reports
        # its lag: the abandoned job 1 still holds the only slot, so nothing was fetched.
        wait_for(lambda: len(sources) == 2 and "s1" in handler.lags(), 10.0, "the resumed run")
        assert sources[1].fetched == []
    finally:
        hold.set()
    _processed(cluster, "s1", 3)
    assert sources[1].fetched[0] == 1


def test_a_source_built_after_the_claim_was_lost_is_closed(tmp_path: Path) -> None:
    """The claim is lost while the jobs factory still runs (a slow source, e.g. its store
    is slow too): the run is cancelled; the source the factory then returns is closed."""
    built: list[ListJobs] = []
    entered, finish = threading.Event(), threading.Event()

    def jobs(task: Task) -> Jobs:
        entered.set()
        finish.wait(30)
        built.append(ListJobs([0, 1]))
        return built[-1]

    with LocalCluster(None, shutdown_timeout=5.0) as cluster:
        coord = open_coordinator(cluster.url, node_id="a")
        consumer = cluster.start(Consumer(coord, stream_handler(jobs, lambda job, ctx: None),
                                          release_backoff=60))
        cluster.client.submit_task(Task("s1"))
        try:
            assert entered.wait(10)
            assert [t.id for t in coord.expire_lease()] == ["s1"]  # type: ignore[attr-defined]
            wait_for(lambda: not consumer.tasks(), 10.0, "the run cancelled")
        finally:
            finish.set()
        wait_for(lambda: built and built[0].closed, 10.0, "the late source closed")
