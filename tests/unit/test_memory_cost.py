"""The in-memory store's cost follows work: a claim or a watch round does not rebuild every row.

Users' tests run thousands of tasks through ``memory://``; before, every claim swept every
row through a full ``Task`` (launch and expiry times parsed from props each time) and every
watch round walked them all, so 5,000 tasks ran at 25 a second.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.contracts.coordinator import Coordinator, CoordinatorContext
from metafora.coordinators.memory import store as memory_store
from metafora.coordinators.memory.store import drop_store
from metafora.testing import FakeClock

ROWS = 20_000


def _watching(url: str) -> tuple[Coordinator, queue.Queue[Task]]:
    """Node n1 on ``url``, its watch offering into a queue (closing the node ends it)."""
    coord = open_coordinator(url, "n1")
    offers: queue.Queue[Task] = queue.Queue()
    coord.init(_context())
    threading.Thread(target=coord.watch, args=(offers,), daemon=True).start()
    return coord, offers


def test_claims_and_watch_rounds_do_not_rebuild_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "memory-cost"
    drop_store(name)
    url = f"memory://{name}"
    with open_client(url) as client:
        client.submit_tasks([Task(f"t{i:05d}") for i in range(ROWS)])
        built = [0]
        real = memory_store.Row.task

        def counted(row: memory_store.Row) -> Task:
            built[0] += 1
            return real(row)

        monkeypatch.setattr(memory_store.Row, "task", counted)
        coord, offers = _watching(url)
        try:
            first = [offers.get(timeout=30) for _ in range(ROWS)]  # the first round: every row
            claimed = coord.claim_many(first[:200], 200)
            assert len(claimed) == 200
            for task in claimed:
                coord.done(task)
            client.submit_tasks([Task("late")])
            assert offers.get(timeout=30).id == "late"  # a later round reads what is new
        finally:
            coord.close()
        # One Task per row for the first round, one per claim and offer after: not rows x claims.
        assert built[0] < 2 * ROWS, built[0]
        assert len(client.tasks(TaskState.DONE)) == 200
    drop_store(name)


def test_the_watch_forgets_offers_of_rows_no_longer_pending() -> None:
    """What the watch remembers to not offer a row twice is bounded by the rows still pending,
    not by every task it ever offered."""
    name = "memory-offered"
    drop_store(name)
    url = f"memory://{name}"
    with open_client(url) as client:
        coord, offers = _watching(url)
        try:
            for wave in range(10):  # 5,000 tasks offered, claimed and done, 500 at a time
                client.submit_tasks([Task(f"w{wave}-{i:03d}") for i in range(500)])
                got = [offers.get(timeout=30) for _ in range(500)]
                for task in coord.claim_many(got, 500):
                    coord.done(task)
            client.submit_tasks([Task("last")])
            assert offers.get(timeout=30).id == "last"
            assert coord._offered <= 2048, coord._offered  # type: ignore[attr-defined]
        finally:
            coord.close()
    drop_store(name)


def test_launch_and_expiry_times_still_apply() -> None:
    """Only rows with a launch or expiry time are swept, and they still are."""
    name = "memory-cost-times"
    drop_store(name)
    clock = FakeClock()
    url = f"memory://{name}"
    with open_client(url, clock=clock) as client:
        now = clock.now()
        client.submit_tasks([
            Task("later", {"launch_at": (now + timedelta(seconds=60)).isoformat()}),
            Task("gone", {"expires_at": (now + timedelta(seconds=30)).isoformat()}),
            Task("plain"),
        ])
        coord = open_coordinator(url, "n1", clock=clock)
        offers: queue.Queue[Task] = queue.Queue()
        try:
            coord.init(_context())
            threading.Thread(target=coord.watch, args=(offers,), daemon=True).start()
            assert {offers.get(timeout=30).id for _ in range(2)} == {"gone", "plain"}
            clock.advance(45)  # "gone" expires; "later" not due yet
            assert coord.claim_many([Task("gone")], 1) == []
            assert client.get_task("gone").state is TaskState.EXPIRED
            clock.advance(30)  # "later" is due: the watch offers it without any other change
            assert offers.get(timeout=30).id == "later"
        finally:
            coord.close()
    drop_store(name)


class _Context(CoordinatorContext):
    def lost(self, task: Task) -> None:
        pass


def _context() -> CoordinatorContext:
    return _Context()
