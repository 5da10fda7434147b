"""``Coordinator.finish_many`` (group-committed outcomes), checked against every store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator, Finish, Outcome
from metafora.core.errors import ClaimLost
from metafora.testing import RecordingContext


class _Store:
    def __init__(self, url: str, stack: ExitStack) -> None:
        self.url, self.stack = url, stack
        self.client: Client = stack.enter_context(open_client(url))

    def node(self, node_id: str) -> Coordinator:
        coord = open_coordinator(self.url, node_id=node_id)
        coord.init(RecordingContext())
        self.stack.callback(coord.close)
        return coord

    def claimed(self, coord: Coordinator, *ids: str) -> list[Task]:
        for task_id in ids:
            self.client.submit_task(Task(task_id, {"n": task_id}))
        got = coord.claim_many([Task(i) for i in ids], len(ids))
        assert [t.id for t in got] == list(ids)
        return got


@pytest.fixture
def store(store_url: str) -> Iterator[_Store]:
    with ExitStack() as stack:
        yield _Store(store_url, stack)


def test_mixed_outcomes_in_one_batch(store: _Store) -> None:
    a = store.node("a")
    d1, d2, r, f = store.claimed(a, "d1", "d2", "r", "f")
    results = a.finish_many([
        Finish(d1, Outcome.DONE), Finish(r, Outcome.RELEASE),
        Finish(f, Outcome.FAIL, "ValueError: boom"), Finish(d2, Outcome.DONE),
    ])
    assert results == [None, None, None, None]
    infos = {i.id: i for i in store.client.tasks()}
    assert infos["d1"].state is TaskState.DONE and infos["d1"].finished_at is not None
    assert infos["d2"].state is TaskState.DONE
    assert infos["r"].state is TaskState.PENDING and infos["r"].owner is None
    assert infos["f"].state is TaskState.FAILED and infos["f"].error == "ValueError: boom"
    # The released task is claimable again, with a newer token; the finished ones are not.
    again = a.claim_many([Task("r"), Task("d1"), Task("f")], 3)
    assert [t.id for t in again] == ["r"] and again[0].token > r.token


def test_stale_token_refused_while_the_others_are_written(store: _Store) -> None:
    a, b = store.node("a"), store.node("b")
    (old,) = store.claimed(a, "t")
    a.release(old)
    new = b.claim(Task("t"))
    assert new is not None
    (mine,) = store.claimed(a, "u")
    results = a.finish_many([Finish(old, Outcome.DONE), Finish(mine, Outcome.DONE),
                             Finish(old, Outcome.FAIL, "zombie")])
    assert isinstance(results[0], ClaimLost) and isinstance(results[2], ClaimLost)
    assert results[1] is None
    assert store.client.get_task("u").state is TaskState.DONE
    t = store.client.get_task("t")
    assert (t.state, t.owner, t.token) == (TaskState.CLAIMED, "b", new.token)
    # Right token, wrong owner: refused too.
    (refused,) = a.finish_many([Finish(new, Outcome.RELEASE)])
    assert isinstance(refused, ClaimLost)
    assert b.finish_many([Finish(new, Outcome.DONE)]) == [None]


def test_empty_batch(store: _Store) -> None:
    a = store.node("a")
    assert a.finish_many([]) == []


def test_a_task_finished_twice(store: _Store) -> None:
    a = store.node("a")
    x, y = store.claimed(a, "x", "y")
    assert a.finish_many([Finish(x, Outcome.DONE)]) == [None]
    results = a.finish_many([Finish(x, Outcome.DONE), Finish(y, Outcome.DONE),
                             Finish(y, Outcome.DONE)])
    assert isinstance(results[0], ClaimLost)
    assert results[1] is None
    assert isinstance(results[2], ClaimLost)  # the same claim twice in one batch: once
    with pytest.raises(ClaimLost):
        a.done(y)
    assert {i.state for i in store.client.tasks()} == {TaskState.DONE}


def test_many_outcomes_in_one_call(store: _Store) -> None:
    a = store.node("a")
    ids = [f"m{i:04d}" for i in range(150)]
    store.client.submit_tasks(Task(i) for i in ids)
    claimed: list[Task] = []
    for start in range(0, len(ids), 16):  # etcd: bursts within its txn limit
        claimed += a.claim_many([Task(i) for i in ids[start:start + 16]], 16)
    assert len(claimed) == len(ids)
    outcomes = [Finish(t, Outcome.DONE if n % 3 else Outcome.RELEASE)
                for n, t in enumerate(claimed)]
    assert a.finish_many(outcomes) == [None] * len(ids)
    states = {i.id: i.state for i in store.client.tasks()}
    assert sum(s is TaskState.DONE for s in states.values()) == 100
    assert sum(s is TaskState.PENDING for s in states.values()) == 50
