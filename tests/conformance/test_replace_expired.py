"""Issue 52, finding 7 and part of 11, on every store: ``if_exists="replace"`` never revives a
pending task past its ``expires_at`` (etcd did: the task became claimable again with the new
expiry), reading a task writes nothing (etcd's ``get_task`` wrote the expired state: a
dashboard GET was a write), and a replace keeps the task's limit group (docs/limits.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from metafora import Task, TaskState, open_client
from metafora.testing import wait_for


def test_replace_does_not_revive_an_expired_task(store_url: str) -> None:
    with open_client(store_url) as client:
        client.tasks()  # the schema first: the expiry is two seconds after the submit
        expiry = datetime.now(UTC) + timedelta(seconds=2)
        later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        client.submit_task(Task("exp", {"v": 1, "expires_at": expiry.isoformat()}))
        # Nothing reads the task meanwhile (on etcd, before, a read wrote the expired state).
        wait_for(lambda: datetime.now(UTC) > expiry + timedelta(milliseconds=100), 10.0, "the expiry")
        assert client.submit_task(Task("exp", {"v": 2, "expires_at": later}), if_exists="replace") is False
        info = client.get_task("exp")
        assert info.state is TaskState.EXPIRED and info.props["v"] == 1  # before (etcd): pending, v 2
        assert client.submit_tasks([Task("exp", {"v": 3})], if_exists="replace") == 0
        assert client.get_task("exp").props["v"] == 1


def test_reading_an_expired_task_writes_nothing_on_etcd(metafora_store_url: object) -> None:
    from metafora.coordinators.etcd.queries import read_task

    url = metafora_store_url("etcd")  # type: ignore[operator]
    with open_client(url) as client:
        client.tasks()
        soon = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
        client.submit_task(Task("exp", {"expires_at": soon}))
        wait_for(lambda: client.get_task("exp").state is TaskState.EXPIRED, 10.0, "the expiry")
        assert [i.state for i in client.tasks()] == [TaskState.EXPIRED]
        assert [i.state for i in client.task_page()] == [TaskState.EXPIRED]  # type: ignore[attr-defined]
        rec = read_task(client._driver, client._keys, "exp")  # type: ignore[attr-defined]
        assert rec.state is None  # before: get_task wrote the expired state
        assert client.purge() == 1  # a verb that changes tasks expires it, then prunes it
        assert client.tasks() == []


def test_replace_keeps_the_limit_group(store_url: str) -> None:
    with open_client(store_url) as client:
        client.submit_task(Task("g", {"v": 1}, group="reports"))
        assert client.submit_task(Task("g", {"v": 2}, group="other"), if_exists="replace") is True
        info = client.get_task("g")
        assert info.props == {"v": 2} and info.group == "reports"  # before: "other"
        assert client.submit_tasks([Task("g", {"v": 3})], if_exists="replace") == 1
        assert client.get_task("g").group == "reports"
