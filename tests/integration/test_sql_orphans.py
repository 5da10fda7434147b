"""Issue 16 item 3: claimed rows written around metafora are recovered on SQLite and PostgreSQL.

A row ``state='claimed'`` whose owner is NULL (and claimed_at NULL, as a partial manual
repair leaves it) or names a node that never registered is written by hand; a consumer
started afterwards sees it released and runs it.
"""

from __future__ import annotations

from sqlalchemy import text

from metafora import TaskState, simple_handler
from metafora.coordinators.sql.options import parse_config
from metafora.coordinators.sql.store import Database
from metafora.core.config import parse_store_url
from metafora.testing import LocalCluster, wait_for
from tests.helpers import RanIds


def _write_claimed_rows(url: str, rows: list[tuple[str, str | None]]) -> None:
    db = Database(parse_config(parse_store_url(url), {}))
    now = "'2030-01-01 00:00:00.000'" if db.config.kind == "sqlite" else "now()"
    try:
        with db.transaction() as conn:
            for task_id, owner in rows:
                conn.execute(text(
                    "INSERT INTO metafora_tasks (namespace, id, props, state, owner, token, ready,"
                    f" created_at, updated_at) VALUES (:ns, :id, '{{}}', 'claimed', :owner, 7, 0,"
                    f" {now}, {now})"), {"ns": db.config.namespace, "id": task_id, "owner": owner})
    finally:
        db.close()


def test_claimed_rows_with_no_live_owner_are_released_and_run(sql_url: str) -> None:
    ran = RanIds()
    with LocalCluster(sql_url) as cluster:
        cluster.client.tasks()  # creates the schema
        _write_claimed_rows(sql_url, [("no-owner", None), ("ghost-owner", "never-registered")])
        assert {i.id: i.state for i in cluster.client.tasks()} == {
            "no-owner": TaskState.CLAIMED, "ghost-owner": TaskState.CLAIMED}
        cluster.add(simple_handler(ran), "rescuer", coordinator_options={"poll_interval": 0.2})
        wait_for(lambda: len(cluster.client.tasks("done")) == 2, 60, "both rows run to done")
        assert sorted(ran.ids) == ["ghost-owner", "no-owner"]
        for task_id in ("no-owner", "ghost-owner"):
            info = cluster.client.get_task(task_id)
            assert info.token != 7 and info.attempts == 1 and info.owner is None
