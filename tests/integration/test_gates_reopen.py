"""Issue 50 point 4: reopening a finished partition (Go Feed's reopen) under real consumers,
on SQLite and PostgreSQL: done items stay done and are not processed again, items added with
the reopen or after it are, the gate is recomputed, and the task is pending again."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import inspect

from metafora import Consumer, Task, TaskState, open_coordinator
from metafora.cli import EXIT_OK, EXIT_REFUSED, cli
from metafora.core.errors import InvalidTaskState
from metafora.gates import (
    Item,
    ItemResult,
    ItemStatus,
    ItemStore,
    NewItem,
    PartitionClosed,
    PartitionStatus,
    Response,
    handler_func,
    reopen_partition,
)
from metafora.statemachine import StateCode, get_state, send_task_command
from metafora.statemachine.machine import Message
from metafora.testing import LocalCluster

pytestmark = pytest.mark.integration


class Seen:
    """Every item the processor got, in order (data as text)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: list[str] = []

    def __call__(self, item: Item) -> Response:
        with self.lock:
            self.data.append(item.data.decode())
        return Response(gate=item.gate, done=True)

    def all(self) -> list[str]:
        with self.lock:
            return sorted(self.data)


@pytest.fixture
def items(sql_url: str) -> Iterator[ItemStore]:
    store = ItemStore(sql_url)
    try:
        yield store
    finally:
        store.close()


def _start(cluster: LocalCluster, items: ItemStore, processor: Any) -> Consumer:
    coord = open_coordinator(cluster.url, node_id="n1")
    return cluster.start(Consumer(coord, handler_func(processor, coord, items, poll_interval=0.1),
                                  release_backoff=0.05))


def _finish(items: ItemStore, seen: Seen, cluster: LocalCluster) -> None:
    items.add("p", [NewItem(0, b"a0"), NewItem(0, b"b0"), NewItem(2, b"c2")])
    cluster.client.submit_task(Task("p"))
    cluster.wait_for_state("p", TaskState.DONE, timeout=60)
    assert seen.all() == ["a0", "b0", "c2"]
    assert items.info("p").status is PartitionStatus.COMPLETED
    with pytest.raises(PartitionClosed, match="reopen"):
        items.add("p", [NewItem(2, b"late")])


def test_reopen_with_items_runs_only_the_new_ones(sql_url: str, items: ItemStore) -> None:
    seen = Seen()
    with LocalCluster(sql_url) as cluster:
        _start(cluster, items, seen)
        _finish(items, seen, cluster)
        gate = items.reopen_partition("p", cluster.client, items=[NewItem(1, b"d1")])
        assert gate == 1  # the lowest gate with work: the new item's
        cluster.wait_for_state("p", TaskState.DONE, timeout=60)
        assert seen.all() == ["a0", "b0", "c2", "d1"]  # done items were not processed again
        info = items.info("p")
        assert info.status is PartitionStatus.COMPLETED and info.total(ItemStatus.COMPLETE) == 4
        state = get_state(cluster.client, "p")
        assert state is not None and state.code is StateCode.COMPLETED
        assert not cluster.errors


def test_items_added_after_a_reopen_are_processed(sql_url: str, items: ItemStore) -> None:
    seen = Seen()
    with LocalCluster(sql_url) as cluster:
        node = _start(cluster, items, seen)
        _finish(items, seen, cluster)
        cluster.stop(node)  # so the reopened partition waits for the items added next
        assert reopen_partition(items, "p", cluster.client) == 0  # no work left: gate 0
        assert cluster.client.get_task("p").state is TaskState.PENDING
        assert items.info("p").status is PartitionStatus.OPEN
        items.add("p", [NewItem(0, b"e0"), NewItem(3, b"f3")])  # any gate is accepted again
        _start(cluster, items, seen)
        cluster.wait_for_state("p", TaskState.DONE, timeout=60)
        assert seen.all() == ["a0", "b0", "c2", "e0", "f3"]
        assert items.info("p").status is PartitionStatus.COMPLETED
        assert not cluster.errors


def test_only_a_completed_partition_is_reopened(sql_url: str, items: ItemStore) -> None:
    with LocalCluster(sql_url) as cluster:
        items.add("k", [NewItem(0, b"x")])
        cluster.client.submit_task(Task("k"))
        send_task_command(cluster.client, "k", Message.kill())
        coord = open_coordinator(cluster.url, node_id="n1")
        cluster.start(Consumer(coord, handler_func(Seen(), coord, items, poll_interval=0.1)))
        cluster.wait_for_state("k", TaskState.DONE, timeout=60)  # killed before any item
        with pytest.raises(InvalidTaskState, match="killed"):
            reopen_partition(items, "k", cluster.client)
        assert items.info("k").status is PartitionStatus.OPEN  # nothing written


def test_metafora_partition_reopen(sql_url: str, items: ItemStore) -> None:
    seen = Seen()
    with LocalCluster(sql_url) as cluster:
        node = _start(cluster, items, seen)
        _finish(items, seen, cluster)
        cluster.stop(node)
        result = CliRunner().invoke(cli, ["--url", sql_url, "partition", "reopen", "p",
                                          "--gate", "1", "--data", "g1"])
        assert result.exit_code == EXIT_OK, result.output
        assert "partition p: open at gate 1, 1 item(s) added; task is pending" in result.output
        missing = CliRunner().invoke(cli, ["--url", sql_url, "partition", "reopen", "nope"])
        assert missing.exit_code == EXIT_REFUSED and "Traceback" not in missing.output
        _start(cluster, items, seen)
        cluster.wait_for_state("p", TaskState.DONE, timeout=60)
        assert seen.all() == ["a0", "b0", "c2", "g1"]


def test_the_item_stores_own_reopen_finds_the_task_beside_the_items(
        sql_url: str, items: ItemStore) -> None:
    seen = Seen()
    with LocalCluster(sql_url) as cluster:
        node = _start(cluster, items, seen)
        _finish(items, seen, cluster)
        cluster.stop(node)
        assert items.reopen_partition("p", items=[NewItem(0, b"h0")]) == 0  # no client given
        assert cluster.client.get_task("p").state is TaskState.PENDING
        _start(cluster, items, seen)
        cluster.wait_for_state("p", TaskState.DONE, timeout=60)
        assert seen.all() == ["a0", "b0", "c2", "h0"]


def test_items_of_their_own_database_reopen_the_partition_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/items.db"  # as an etcd coordinator's items: no tasks here
    with ItemStore(url) as store:
        store.add("p", [NewItem(0, b"x")])
        lease = store.lease(Task("p", token=5))
        lease.take_over()
        lease.finish(0, [ItemResult(1, ItemStatus.COMPLETE, 0, 1)])
        assert lease.advance(0, move=True, close=True).kind == "completed"
        assert store.reopen_partition("p") == 0
        assert store.info("p").status is PartitionStatus.OPEN
        with store.read() as conn:
            assert not inspect(conn).has_table("metafora_tasks")  # no coordinator tables made
