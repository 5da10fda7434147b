"""The pure parts of :mod:`metafora.coordinators.etcd.outcomes`: judging what a lost first
attempt left, and group commit. The txns themselves run against a real etcd in
tests/conformance/test_finish_many_etcd.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from metafora.contracts.coordinator import Finish, Outcome
from metafora.coordinators.etcd.ops import KeyValue
from metafora.coordinators.etcd.outcomes import applied_before
from metafora.core.groupcommit import GroupCommit
from metafora.core.task import Task

TASK = Task("t", token=7)


def kv(value: bytes, mod: int = 1) -> list[KeyValue]:
    return [KeyValue(b"k", value, 1, mod, 1, 0)]


def test_a_done_was_applied_when_the_state_records_it_with_the_token() -> None:
    done = Finish(TASK, Outcome.DONE)
    assert applied_before(done, [kv(b'{"state": "done", "token": 7}'), [], []])
    assert not applied_before(done, [kv(b'{"state": "done", "token": 6}'), [], []])
    assert not applied_before(done, [kv(b'{"state": "failed", "token": 7}'), [], []])
    assert not applied_before(done, [[], [], []])
    fail = Finish(TASK, Outcome.FAIL, "boom")
    assert applied_before(fail, [kv(b'{"state": "failed", "token": 7}'), [], []])


def test_a_release_was_applied_when_the_claim_is_ours_and_nothing_else_is_there() -> None:
    release = Finish(TASK, Outcome.RELEASE)
    assert applied_before(release, [[], kv(b"{}", mod=7), []])
    assert not applied_before(release, [[], kv(b"{}", mod=8), []])  # claimed again since
    assert not applied_before(release, [[], kv(b"{}", mod=7), kv(b"n2")])  # owned again
    assert not applied_before(release, [kv(b"{}"), kv(b"{}", mod=7), []])  # finished


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        threading.Event().wait(0.005)


def test_items_queued_during_a_write_go_in_the_next_one() -> None:
    batches: list[list[int]] = []
    entered, release = threading.Event(), threading.Event()

    def write(items: list[int]) -> list[int]:
        batches.append(list(items))
        if len(batches) == 1:
            entered.set()
            assert release.wait(10)
        return [i * 10 for i in items]

    commit: GroupCommit[int, int] = GroupCommit(write, max_batch=2)
    results: dict[int, int] = {}

    def submit(item: int) -> None:
        results[item] = commit.submit(item)

    threads = [threading.Thread(target=submit, args=(1,))]
    threads[0].start()
    assert entered.wait(10)
    for item in (2, 3, 4):
        thread = threading.Thread(target=submit, args=(item,))
        threads.append(thread)
        thread.start()
    wait_for(lambda: commit.pending == 3, "three items queued behind the write")
    release.set()
    for thread in threads:
        thread.join(10)
    assert results == {1: 10, 2: 20, 3: 30, 4: 40}
    assert batches[0] == [1]
    assert sorted(i for b in batches[1:] for i in b) == [2, 3, 4]
    assert all(len(b) <= 2 for b in batches)  # max_batch


def test_a_failed_write_fails_every_item_of_its_batch() -> None:
    def write(items: list[int]) -> list[int]:
        raise ValueError("store down")

    commit: GroupCommit[int, int] = GroupCommit(write, max_batch=8)
    with pytest.raises(ValueError, match="store down"):
        commit.submit(1)
    with pytest.raises(ValueError):
        commit.submit(2)  # the next write fails too: nobody waits forever
