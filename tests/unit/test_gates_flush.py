"""The gates' group commit of item results (no store: the write is a recording function)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from metafora.errors import ClaimLost
from metafora.statemachine.gates import ItemStatus, Outcome
from metafora.statemachine.gates.flush import ResultFlusher


def _done(item_id: int) -> Outcome:
    return Outcome(item_id, ItemStatus.COMPLETE, 0, 1)


class Writes:
    """Records the background writes; ``fail`` makes the next one raise."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []
        self.wrote = threading.Event()
        self.fail: Exception | None = None
        self.stopped = threading.Event()

    def __call__(self, gate: int, results: Sequence[Outcome]) -> None:
        if self.fail is not None:
            raise self.fail
        self.batches.append((gate, [o.item_id for o in results]))
        self.wrote.set()


def test_results_waiting_an_interval_are_written_by_the_background_thread() -> None:
    writes = Writes()
    flusher = ResultFlusher(writes, 0.01, "test-flush", writes.stopped.set)
    try:
        flusher.add(4, _done(1))
        flusher.add(4, _done(2))
        assert writes.wrote.wait(30), "no background write"
        assert writes.batches[0][0] == 4
        assert sorted(i for _, ids in writes.batches for i in ids) == [1, 2]
        assert flusher.pending == 0
    finally:
        flusher.close()


def test_the_owners_commit_takes_every_waiting_result_once() -> None:
    writes = Writes()
    flusher = ResultFlusher(writes, 3600.0, "test-flush", writes.stopped.set)  # never due
    try:
        flusher.add(0, _done(1))
        flusher.add(0, _done(2))
        seen = flusher.commit(lambda gate, results: (gate, [o.item_id for o in results]))
        assert seen == (0, [1, 2])
        assert flusher.commit(lambda gate, results: list(results)) == []
        assert writes.batches == []
    finally:
        flusher.close()


def test_a_failed_background_write_stops_the_owner_and_is_raised_by_its_next_commit() -> None:
    writes = Writes()
    writes.fail = ClaimLost("partition 'p' is no longer held with token 3")
    flusher = ResultFlusher(writes, 0.01, "test-flush", writes.stopped.set)
    try:
        flusher.add(0, _done(1))
        assert writes.stopped.wait(30), "the owner was not told to stop"
        flusher.add(0, _done(2))
        with pytest.raises(ClaimLost):
            flusher.commit(lambda gate, results: list(results))
        assert isinstance(flusher.error, ClaimLost)
    finally:
        flusher.close()
