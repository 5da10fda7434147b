"""A listing of streams reads the stored states, not every task: its cost follows the
streams (and other state-machine tasks), not the plain tasks beside them (SQLite, counted
in SQL statements)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from metafora import Task
from metafora.coordinators.sql.shared import database_of
from metafora.statemachine import state_store_for
from metafora.streams import stream_handler
from metafora.streams.ops import stream_rows
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs

_LATER = "2999-01-01T00:00:00Z"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(f"sqlite:///{tmp_path}/metafora.db", shutdown_timeout=5.0) as c:
        yield c


def test_listing_three_streams_among_a_thousand_plain_tasks_reads_a_few_rows(
        cluster: LocalCluster) -> None:
    cluster.add(stream_handler(lambda t: ListJobs([0]), lambda job, ctx: None,
                               poll_every=3600.0, flush_every=0.01), "a")
    for task_id in ("m-1", "m-2", "z-1"):
        cluster.client.submit_task(Task(task_id))
    cluster.client.submit_tasks([Task(f"p-{i:04}", {"launch_at": _LATER}) for i in range(1000)])
    for task_id in ("m-1", "m-2", "z-1"):
        wait_for(lambda t=task_id: cluster.client.stream(t).processed >= 0, 15.0,  # type: ignore[misc]
                 f"stream {task_id} done")
    # A state machine task that is not a stream, and a damaged state: read, left out.
    store: Any = state_store_for(cluster.client)
    cluster.client.submit_tasks([Task("n-1", {"launch_at": _LATER}),
                                 Task("n-2", {"launch_at": _LATER})])
    store.put_raw("n-1", 1, '{"state": "paused", "cursor": "42"}')
    store.put_raw("n-2", 1, "{damaged")

    engine = database_of(cluster.client).engine
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        rows = stream_rows(cluster.client)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert [r.id for r in rows] == ["m-1", "m-2", "z-1"]
    # One page of states, one task read per stream (was: 6 task pages + 1,005 state reads).
    assert len(statements) <= 1 + 3 + 2, statements
