"""Issue 51 (the herd): what one watch round reads when a notification wakes every node.

- A quick round runs the launched / unheld scans only when its clock read says a launch time
  or a hold ended since the last round; a task whose launch time passes is still offered then.
- PostgreSQL: a bulk submit's batch of 500 rows (one notification, a full page) is read in one
  page: the ready scan stops at the highest ready value the round's clock read saw, instead of
  reading an empty page after it; every row of a larger submit is still offered.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from metafora import Task
from metafora.coordinators.sql.watch import Watch
from metafora.testing import wait_for
from tests.integration.test_sql_coordinator import Nodes, next_offer


class Reads:
    """The watch's reads (statement name, rows) in order: what a round cost."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, int]] = []

    def add(self, name: str, rows: int) -> None:
        with self.lock:
            self.seen.append((name, rows))

    def names(self) -> list[str]:
        with self.lock:
            return [name for name, _ in self.seen]

    def since(self, start: int) -> list[tuple[str, int]]:
        with self.lock:
            return list(self.seen[start:])


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    rec = Reads()
    query, state = Watch._query, Watch._round

    def recorded_query(self: Watch, name: str, params: dict[str, Any]) -> Sequence[Any]:
        rows = query(self, name, params)
        rec.add(name, len(rows))
        return rows

    def recorded_round(self: Watch) -> float:
        rec.add("round", 0)
        return state(self)

    monkeypatch.setattr(Watch, "_query", recorded_query)
    monkeypatch.setattr(Watch, "_round", recorded_round)
    return rec


@pytest.fixture
def nodes(sql_url: str) -> Iterator[Nodes]:
    n = Nodes(sql_url)
    with n.stack:
        yield n


def _drain(offers: queue.Queue[Task], ids: set[str], timeout: float) -> None:
    """Wait until every id of ``ids`` was offered (each at least once)."""
    left = set(ids)
    while left:
        left.discard(offers.get(timeout=timeout).id)


def test_quick_rounds_scan_launched_and_unheld_only_when_something_fell_due(
        nodes: Nodes, reads: Reads) -> None:
    a = nodes.node("a")
    offers = nodes.watch(a)
    for i in range(10):  # each a round on PostgreSQL; SQLite's poll gives several meanwhile
        nodes.client.submit_task(Task(f"t{i}"))
        next_offer(offers, f"t{i}", 10)
    before = reads.names()
    assert before.count("round") >= 3
    assert "scan_launched" not in before and "scan_unheld" not in before
    start = len(reads.seen)
    launch = datetime.now(UTC) + timedelta(seconds=1.5)
    nodes.client.submit_task(Task("later", {"launch_at": launch.isoformat()}))
    next_offer(offers, "later", 15)
    # Offered by the round whose clock read saw its launch time pass (the ready scan, which
    # had skipped it, or the launched scan; that round runs the launched scan too).
    wait_for(lambda: ("scan_launched", 1) in reads.since(start), 10, "the launched scan")
    assert reads.names()[start:].count("scan_launched") == 1


def test_a_bulk_batch_is_read_in_one_page_and_every_row_is_offered(
        postgres_url: str, reads: Reads) -> None:
    nodes = Nodes(postgres_url)
    with nodes.stack:
        a = nodes.node("a")
        offers = nodes.watch(a)
        nodes.client.submit_task(Task("warm"))
        next_offer(offers, "warm", 10)
        start = len(reads.seen)
        nodes.client.submit_tasks(Task(f"b{i:03d}") for i in range(500))  # one batch, one NOTIFY
        _drain(offers, {f"b{i:03d}" for i in range(500)}, 15)
        seen = reads.since(start)
        page = seen.index(("scan_ready", 500))
        # The next statement of that round is not another page of the ready scan.
        assert seen[page + 1:page + 2] != [("scan_ready", 0)], seen
        nodes.client.submit_tasks(Task(f"c{i:04d}") for i in range(1_700))  # four batches
        _drain(offers, {f"c{i:04d}" for i in range(1_700)}, 30)
