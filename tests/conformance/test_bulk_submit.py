"""Issue 11 item 6: ``Client.submit_tasks`` on every store — batched, all-or-nothing per batch."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from metafora import Task, TaskState, open_client, simple_handler
from metafora.core.errors import ConfigError, InvalidProps, TaskExists
from metafora.testing import LocalCluster, wait_for
from tests.helpers import RanIds

N = 1200  # more than two SQL batches (500) and many etcd txns (32 tasks each)


def _ids(n: int) -> list[str]:
    return [f"b-{i:04d}" for i in range(n)]


def test_submit_tasks_adds_every_task_with_its_props(store_url: str) -> None:
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    with open_client(store_url) as client:
        client.submit_tasks(Task(i, {"n": k, "tags": ["x"]}) for k, i in enumerate(_ids(N)))
        client.submit_tasks([Task("later", {"launch_at": later})])
        client.submit_tasks([])
        infos = client.tasks()
        assert [i.id for i in infos] == sorted([*_ids(N), "later"])
        assert all(i.state is TaskState.PENDING for i in infos)
        assert client.get_task("b-0777").props == {"n": 777, "tags": ["x"]}
        assert client.get_task("later").props["launch_at"] == later


def test_a_batch_with_an_existing_id_adds_nothing_and_names_it(store_url: str) -> None:
    with open_client(store_url) as client:
        client.submit_task(Task("b-0700", {"old": True}))
        client.submit_task(Task("b-1100"))
        with pytest.raises(TaskExists, match="'b-0700'") as info:
            client.submit_tasks(Task(i, {"new": True}) for i in _ids(N))
        exc = info.value
        assert exc.ids[0] == "b-0700" and set(exc.ids) <= {"b-0700", "b-1100"}  # its batch's ids
        # The batches before the refused one are in, the refused one added nothing.
        added = exc.submitted
        assert 0 <= added <= 700 and f"{added} of the {N}" in str(exc)
        assert sorted(i.id for i in client.tasks()) == sorted([*_ids(N)[:added], "b-0700", "b-1100"])
        assert client.get_task("b-0700").props == {"old": True}


def test_ids_repeated_in_the_input_are_refused_before_anything_is_written(store_url: str) -> None:
    with open_client(store_url) as client:
        with pytest.raises(TaskExists, match=r"'dup'.*more than once") as info:
            client.submit_tasks([Task("a"), Task("dup"), Task("b"), Task("dup")])
        assert info.value.ids == ("dup",) and info.value.submitted == 0
        past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
        with pytest.raises(InvalidProps, match=r"'never' \(item 2\)"):
            client.submit_tasks([Task("a"), Task("never", {"expires_at": past})])
        with pytest.raises(ConfigError, match="item 2"):
            client.submit_tasks([Task("a"), "b"])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="iterable of Task"):
            client.submit_tasks(Task("a"))  # type: ignore[arg-type]
        assert client.tasks() == []


def test_bulk_submitted_tasks_are_run_by_a_consumer(store_url: str) -> None:
    ran = RanIds()
    with LocalCluster(store_url) as cluster:
        cluster.add(simple_handler(ran), "bulk-runner")
        cluster.client.submit_tasks(Task(i) for i in _ids(600))
        wait_for(lambda: len(cluster.client.tasks("done")) == 600, 120, "600 bulk tasks done")
        assert sorted(ran.ids) == _ids(600) and not cluster.errors


def test_large_props_are_split_into_requests_the_store_accepts(store_url: str) -> None:
    big = "x" * 100_000  # 40 x 100 kB: one etcd txn would exceed its 1.5 MiB request limit
    with open_client(store_url) as client:
        client.submit_tasks(Task(f"big-{i:02d}", {"blob": big}) for i in range(40))
        assert len(client.tasks()) == 40 and client.get_task("big-39").props == {"blob": big}
