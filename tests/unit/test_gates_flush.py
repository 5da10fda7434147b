"""The gates' group commit of item results (no store: the write is a recording function)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from metafora.core.errors import ClaimLost
from metafora.gates import ItemResult, ItemStatus
from metafora.gates.flush import ResultFlusher
from tests.helpers import wait_until


def _done(item_id: int) -> ItemResult:
    return ItemResult(item_id, ItemStatus.COMPLETE, 0, 1)


class Writes:
    """Records the background writes; ``fail`` makes the next one raise."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []
        self.wrote = threading.Event()
        self.fail: Exception | None = None
        self.stopped = threading.Event()

    def __call__(self, gate: int, results: Sequence[ItemResult]) -> None:
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


def test_a_result_after_a_stream_or_after_idling_is_still_written_within_the_interval() -> None:
    """While results keep coming the thread ticks at the interval instead of being woken per
    result; once idle it waits untimed and the next result wakes it: both are written."""
    writes = Writes()
    flusher = ResultFlusher(writes, 0.01, "test-flush", writes.stopped.set)
    try:
        for n in range(50):  # a fast processor: the owner's commits take every result
            flusher.add(0, _done(n))
            flusher.commit(lambda gate, results: None)
        flusher.add(0, _done(100))  # then the owner stops committing
        assert writes.wrote.wait(30), "no background write after a stream"
        assert writes.batches == [(0, [100])]
        wait_until(lambda: flusher._untimed, 30, "the flusher to idle")
        writes.wrote.clear()
        flusher.add(0, _done(101))
        assert writes.wrote.wait(30), "no background write after idling"
        assert writes.batches == [(0, [100]), (0, [101])]
    finally:
        flusher.close()
