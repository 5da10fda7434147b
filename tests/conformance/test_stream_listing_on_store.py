"""Listing streams on every store: only tasks that have a state-machine state are read
(``StateStore.page``), in id order, paged by ``after`` and ``limit``, filtered by ``prefix``."""

from __future__ import annotations

from metafora import Task
from metafora.statemachine import state_store_for
from metafora.streams import stream_handler
from metafora.streams.ops import stream_rows
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs

_LATER = "2999-01-01T00:00:00Z"  # plain tasks that no node claims while the test runs


def test_streams_are_listed_from_the_stored_states_only(store_url: str) -> None:
    with LocalCluster(store_url) as cluster:
        cluster.add(stream_handler(lambda t: ListJobs([0, 1]), lambda job, ctx: None,
                                   poll_every=3600.0, flush_every=0.01), "a")
        streams = ["s-1", "s-2", "s-3", "t-1"]
        for task_id in streams:
            cluster.client.submit_task(Task(task_id))
        cluster.client.submit_tasks([Task(f"p-{i}", {"launch_at": _LATER}) for i in range(5)])
        for task_id in streams:
            wait_for(lambda t=task_id: cluster.client.stream(t).processed >= 1, 30.0,  # type: ignore[misc]
                     f"stream {task_id} done")
        store = state_store_for(cluster.client)
        page = store.page(limit=10)
        assert page is not None and [task_id for task_id, _ in page] == streams  # no plain task
        assert [i for i, _ in store.page(prefix="s-", after="s-1", limit=1) or []] == ["s-2"]

        rows = stream_rows(cluster.client)
        assert [r.id for r in rows] == streams
        assert all(r.owner == "a" and r.task_state == "claimed" and r.state == "runnable"
                   and r.info.processed == 1 for r in rows)
        assert [r.id for r in stream_rows(cluster.client, prefix="s-", after="s-1")] == ["s-2", "s-3"]
        assert [r.id for r in stream_rows(cluster.client, limit=2)] == ["s-1", "s-2"]
        cluster.client.delete_task("t-1")
        assert [r.id for r in stream_rows(cluster.client, prefix="t")] == []
