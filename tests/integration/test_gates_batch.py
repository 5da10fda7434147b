"""Issue 50 point 4 on SQLite and PostgreSQL: a BatchProcessor gets the items taken in a
batch as one call (retried as a whole), and a node's /metrics counts the gate items by outcome
(``metafora_gate_items_total{outcome}``) with their processing time
(``metafora_gate_item_seconds``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metafora import Consumer, Task, TaskState, open_coordinator
from metafora.gates import (
    BatchProcessor,
    Item,
    ItemStatus,
    ItemStore,
    NewItem,
    PermanentError,
    ProcessingError,
    Response,
    handler_func,
)
from metafora.testing import LocalCluster
from tests.unit.test_http import get

pytestmark = pytest.mark.integration


class Batches(BatchProcessor):
    """Records each call's item data; the first call fails once (retryable), and an item
    whose data is b"bad" fails the call permanently."""

    def __init__(self, max_batch: int | None = None) -> None:
        self.max_batch = max_batch
        self.lock = threading.Lock()
        self.calls: list[list[str]] = []
        self.failed_once = False

    def process_batch(self, items: Sequence[Item]) -> list[Response]:
        with self.lock:
            self.calls.append([i.data.decode() for i in items])
            if not self.failed_once:
                self.failed_once = True
                raise ProcessingError("downstream busy")
        if any(i.data == b"bad" for i in items):
            raise PermanentError("bad item in batch")
        return [Response(gate=i.gate, done=True, data=i.data.upper()) for i in items]


@pytest.fixture
def items(sql_url: str) -> Iterator[ItemStore]:
    store = ItemStore(sql_url)
    try:
        yield store
    finally:
        store.close()


def _metrics(addr: str) -> dict[tuple[str, str], float]:
    status, body = get(addr, "/metrics")
    assert status == 200
    return {(s.name, s.labels.get("outcome", "")): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples
            if s.name.startswith("metafora_gate_item")}


def test_items_reach_a_batch_processor_as_batches_and_are_counted(
        sql_url: str, items: ItemStore) -> None:
    processor = Batches()
    items.add("p", [NewItem(0, f"i{n:02d}".encode()) for n in range(25)])
    with LocalCluster(sql_url) as cluster:
        coord = open_coordinator(cluster.url, node_id="n1")
        handler = handler_func(processor, coord, items, batch_size=10, retry_delay=0.01)
        node = cluster.start(Consumer(coord, handler, http_addr="127.0.0.1:0"))
        cluster.client.submit_task(Task("p"))
        cluster.wait_for_state("p", TaskState.DONE, timeout=60)
        assert node.http_address is not None
        seen = _metrics(node.http_address)
    first = [f"i{n:02d}" for n in range(10)]
    assert processor.calls[0] == processor.calls[1] == first  # failed once, retried whole
    assert [len(c) for c in processor.calls[1:]] == [10, 10, 5]
    assert sorted(d for c in processor.calls[1:] for d in c) == [f"i{n:02d}" for n in range(25)]
    done = items.list("p", status=ItemStatus.COMPLETE)
    assert len(done) == 25 and done[0].data == b"I00"
    assert seen[("metafora_gate_items_total", "done")] == 25
    assert seen[("metafora_gate_items_total", "retried")] == 10
    assert seen[("metafora_gate_items_total", "failed")] == 0
    assert seen[("metafora_gate_item_seconds_count", "")] == 25


def test_max_batch_splits_and_a_permanent_error_fails_its_call_only(
        sql_url: str, items: ItemStore) -> None:
    processor = Batches(max_batch=3)
    processor.failed_once = True  # no retry in this one
    items.add("q", [NewItem(0, b"a"), NewItem(0, b"b"), NewItem(0, b"c"),
                    NewItem(0, b"bad"), NewItem(0, b"e")])
    with LocalCluster(sql_url) as cluster:
        coord = open_coordinator(cluster.url, node_id="n1")
        handler = handler_func(processor, coord, items, batch_size=5, concurrency=2)
        node = cluster.start(Consumer(coord, handler, http_addr="127.0.0.1:0"))
        cluster.client.submit_task(Task("q"))
        cluster.wait_for_state("q", TaskState.FAILED, timeout=60)
        assert node.http_address is not None
        seen = _metrics(node.http_address)
    assert sorted(processor.calls[:2]) == [["a", "b", "c"], ["bad", "e"]]  # at most 3 a call
    assert {i.data for i in items.list("q", status=ItemStatus.COMPLETE)} == {b"A", b"B", b"C"}
    failed = items.list("q", status=ItemStatus.FAILED)
    assert {i.data for i in failed} == {b"bad", b"e"} and all(i.permanent for i in failed)
    assert seen[("metafora_gate_items_total", "failed")] == 2
    assert seen[("metafora_gate_items_total", "done")] == 3
