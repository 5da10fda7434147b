"""Issue 49: streams reading a SQLJobLog, with the coordinator in the same SQL store or on
etcd (the log on a SQL URL of its own, as gates' items are): every job once and in the
stored progress, appends in the application's transaction picked up by the log's push
(the stream's fallback poll is an hour), a rolled-back append never run."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine

from metafora import Consumer, Task, open_client, open_coordinator
from metafora.streams import Job, JobContext, SQLJobLog, stream_handler
from metafora.testing import wait_for
from tests.conformance.test_submit_in_transaction import sqlalchemy_url

pytestmark = pytest.mark.integration


class _Run:
    """One consumer running a stream over the log ``name`` on ``log_url``; records the jobs."""

    def __init__(self, coord_url: str, log_url: str, name: str) -> None:
        self.log_url, self.name = log_url, name
        self.seen: list[str] = []
        self.lock = threading.Lock()
        handler = stream_handler(lambda task: SQLJobLog(log_url, task.props["log"]), self.work,
                                 max_processing=4, max_search_ahead=16, poll_every=3600.0)
        self.consumer = Consumer(open_coordinator(coord_url, node_id="n1"), handler)
        self.thread = threading.Thread(target=self.consumer.run, daemon=True)
        self.client = open_client(coord_url)

    def work(self, job: Job, ctx: JobContext) -> None:
        with self.lock:
            self.seen.append(job.id)

    def processed(self) -> int:
        return self.client.stream(self.name).processed

    def close(self) -> None:
        self.consumer.shutdown(timeout=30)
        self.thread.join(30)
        self.client.close()


@pytest.fixture(params=["same SQL store", "etcd coordinator"])
def run(request: pytest.FixtureRequest, sql_url: str) -> Iterator[_Run]:
    coord_url = sql_url if request.param == "same SQL store" else request.getfixturevalue("etcd_url")
    made = _Run(coord_url, sql_url, f"log-{uuid.uuid4().hex[:6]}")
    try:
        yield made
    finally:
        made.close()


def test_a_stream_over_a_job_log_runs_every_job_and_wakes_on_appends(run: _Run) -> None:
    log = SQLJobLog(run.log_url, run.name)
    engine = create_engine(sqlalchemy_url(run.log_url))
    try:
        log.append([(f"first/{i}", i) for i in range(20)])
        run.client.submit_task(Task(run.name, {"log": run.name}))
        run.thread.start()
        wait_for(lambda: run.processed() == 19, timeout=30, what="the first 20 jobs")
        # An append in the application's transaction: the stream, idle with its fallback
        # poll an hour away, hears of it at the commit; a rolled-back one never runs.
        with engine.connect() as conn:
            log.append([("rolled back", 0)], conn=conn)
            conn.rollback()
        with engine.begin() as conn:
            assert log.append([("second/0", 0), ("first/3", 3), ("second/1", 1)], conn=conn) == [20, 3, 21]
        wait_for(lambda: run.processed() == 21, timeout=30, what="the appended jobs, woken by the push")
        with run.lock:
            seen = list(run.seen)
        assert sorted(seen) == sorted([f"first/{i}" for i in range(20)] + ["second/0", "second/1"])
        assert "rolled back" not in seen
        info = run.client.stream(run.name)
        assert (info.processed, info.failing) == (21, None)
    finally:
        log.close()
        engine.dispose()
