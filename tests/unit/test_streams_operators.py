"""What operators do to streams, against races and scale: a check never resumes a stream,
a listing reads the streams and not every task."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metafora import Consumer, Task, open_coordinator
from metafora.statemachine import StateCode, get_state
from metafora.statemachine.machine import Message
from metafora.streams import Job, JobContext, ops, stream_handler
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs, wait_failing


@pytest.fixture(params=["memory", "sqlite"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    """A LocalCluster on the memory store, then on a SQLite file."""
    url = None if request.param == "memory" else f"sqlite:///{tmp_path}/metafora.db"
    with LocalCluster(url, shutdown_timeout=5.0) as c:
        yield c


def test_a_check_racing_the_pause_on_a_failing_job_does_not_resume_the_stream(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # check_stream reads the stream as runnable and not failing; before it sends, the
    # stream pauses on a failing job. The command it sends must not resume the stream
    # (a `run` did: the failing job got fresh attempts behind the operator's back).
    caplog.set_level(logging.INFO, logger="metafora.statemachine")
    attempts: list[int] = []
    gate = threading.Event()

    def work(job: Job, ctx: JobContext) -> None:
        if job.index == 2:
            attempts.append(ctx.attempt)
            gate.wait(30)
            raise RuntimeError("job 2 fails")

    coord = open_coordinator(cluster.url, node_id="a")
    cluster.start(Consumer(coord, stream_handler(
        lambda t: ListJobs(list(range(5))), work, max_processing=1, max_search_ahead=5,
        retry_delay=0.0, max_attempts=1, flush_every=0.01)))
    cluster.client.submit_task(Task("s1"))
    wait_for(lambda: attempts, 10.0, "job 2 to run")
    read_state = ops._state

    def read_then_fail(client: Any, task_id: str) -> Any:
        state = read_state(client, task_id)  # runnable, not failing
        monkeypatch.setattr(ops, "_state", read_state)
        gate.set()
        wait_failing(cluster.client, "s1")  # the stream pauses, failing, meanwhile
        return state

    monkeypatch.setattr(ops, "_state", read_then_fail)
    assert cluster.client.check_stream("s1") is True

    def ignored() -> bool:
        return any("ignoring check in state paused" in r.getMessage() for r in caplog.records)

    wait_for(lambda: ignored() or len(attempts) > 1, 10.0, "the check to be taken")
    assert attempts == [1]  # job 2 was not run again
    assert ignored()
    state = get_state(cluster.client, "s1")
    assert state is not None and state.code is StateCode.PAUSED
    failing = cluster.client.stream("s1").failing
    assert failing is not None and failing.index == 2


def test_a_node_that_does_not_know_a_command_kind_drops_it_and_takes_the_next(
        cluster: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    # Wire compatibility of `check`: a node older than it decodes it as an unknown kind; the
    # channel drops it with a warning and delivers the command behind it (no crash, no stall).
    from metafora.statemachine.store import commands_for

    cluster.client.submit_task(Task("t1"))
    channel = commands_for(cluster.client)
    channel.inject_raw("t1", '{"message": "check-from-the-future"}')  # type: ignore[attr-defined]
    channel.send("t1", Message.pause())
    with caplog.at_level(logging.WARNING, logger="metafora.statemachine"):
        assert channel.receive("t1", 0.0) == Message.pause()
    assert any("unknown message 'check-from-the-future'" in r.getMessage() for r in caplog.records)
    assert channel.pending("t1") == 0
