"""``finish_and_claim`` on the SQL stores: the outcomes of finished tasks and the claim of the
next batch in one request (PostgreSQL: one statement; SQLite: one transaction), fenced as
``finish_many`` and ``claim_many`` are on their own (issue 26)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from metafora import Task, TaskState
from metafora.contracts.coordinator import Finish, Outcome
from metafora.core.errors import ClaimLost
from tests.integration.test_sql_coordinator import Nodes


@pytest.fixture
def nodes(sql_url: str) -> Iterator[Nodes]:
    n = Nodes(sql_url)
    with n.stack:
        yield n


def _past(url: str) -> str:
    if url.startswith("sqlite"):
        return "strftime('%Y-%m-%d %H:%M:%f', 'now', '-3600 seconds')"
    return "now() - interval '1 hour'"


def _submit(nodes: Nodes, *ids: str) -> None:
    for task_id in ids:
        nodes.client.submit_task(Task(task_id, {"n": task_id}))


def _state(nodes: Nodes, task_id: str) -> tuple[Any, ...]:
    info = nodes.client.get_task(task_id)
    return info.state, info.owner, info.token


def test_outcomes_and_the_next_claim_in_one_request(nodes: Nodes) -> None:
    a = nodes.node("a")
    _submit(nodes, "d1", "d2", "f", "r", "n1", "n2", "n3")
    d1, d2, f, r = a.claim_many([Task(i) for i in ("d1", "d2", "f", "r")], 4)
    results, claimed = a.finish_and_claim(
        [Finish(d1, Outcome.DONE), Finish(f, Outcome.FAIL, "ValueError: boom"),
         Finish(d2, Outcome.DONE), Finish(r, Outcome.RELEASE), Finish(d1, Outcome.DONE)],
        [Task("n1"), Task("n2"), Task("d1"), Task("n3")], 2)
    assert results[:4] == [None, None, None, None]
    assert isinstance(results[4], ClaimLost)  # the second outcome of one claim
    assert [t.id for t in claimed] == ["n1", "n2"]
    assert claimed[0].props == {"n": "n1"} and claimed[1].token > claimed[0].token > r.token
    assert nodes.client.get_task("d1").state is TaskState.DONE
    assert nodes.client.get_task("d2").state is TaskState.DONE
    assert nodes.client.get_task("f").error == "ValueError: boom"
    assert _state(nodes, "r")[:2] == (TaskState.PENDING, None)
    assert _state(nodes, "n3")[:2] == (TaskState.PENDING, None)
    assert {t.id for t in a._held()} == {"n1", "n2"}
    # Outcomes alone, a claim alone.
    assert a.finish_and_claim([Finish(claimed[0], Outcome.DONE)], [], 5) == ([None], [])
    results, again = a.finish_and_claim([], [Task("n3")], 1)
    assert results == [] and [t.id for t in again] == ["n3"]


def _sent(coord: Any, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each claim this node sends reaches the store with done outcomes in it."""
    sent: list[bool] = []
    claims = coord._claims
    original = claims._claim_rows

    def spy(cur: Any, ids: list[str], limit: int, params: dict[str, Any],
            done_rows: str | None, groups: Any) -> Any:
        sent.append(done_rows is not None)
        return original(cur, ids, limit, params, done_rows, groups)

    monkeypatch.setattr(claims, "_claim_rows", spy)
    return sent


def test_a_zombies_fused_outcome_and_claim_are_refused_whole(
        nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose lease ended in the store (a paused process that has not noticed yet) and
    whose claim another node took over: its outcome is refused (the token moved on) and its
    claim takes nothing (its lease is not live), in the same request; nothing is written."""
    a, b = nodes.node("a"), nodes.node("b")
    _submit(nodes, "t", "u")
    held = a.claim(Task("t"))
    assert held is not None
    a._pause_heartbeat()
    nodes.raw(f"UPDATE metafora_nodes SET lease_until = {_past(nodes.url)} WHERE node_id = 'a'")
    stolen = b.claim(Task("t"))
    assert stolen is not None and stolen.token > held.token
    sent = _sent(a, monkeypatch)
    results, claimed = a.finish_and_claim([Finish(held, Outcome.DONE)], [Task("u")], 1)
    # The store refused it (the node's own view still calls its lease live): PostgreSQL in
    # the one fused statement, SQLite in the one transaction.
    assert sent == [nodes.url.startswith("postgresql")]
    assert isinstance(results[0], ClaimLost)
    assert claimed == []
    assert _state(nodes, "t") == (TaskState.CLAIMED, "b", stolen.token)
    assert _state(nodes, "u")[:2] == (TaskState.PENDING, None)
    # The live owner finishes and claims in one request as usual.
    results, claimed = b.finish_and_claim([Finish(stolen, Outcome.DONE)], [Task("u")], 1)
    assert results == [None] and [t.id for t in claimed] == ["u"]
    assert _state(nodes, "t")[0] is TaskState.DONE


def test_a_bulk_submit_refreshes_the_statistics_the_claims_are_planned_on(
        nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    from metafora.coordinators.sql.client import ANALYZE_AFTER, SQLClient

    client = nodes.client
    assert isinstance(client, SQLClient)
    calls: list[int] = []
    original = SQLClient._analyze
    monkeypatch.setattr(SQLClient, "_analyze", lambda self: (calls.append(1), original(self)))
    client.submit_tasks(Task(f"s{i:05d}") for i in range(ANALYZE_AFTER - 1))
    assert calls == []
    client.submit_tasks(Task(f"b{i:05d}") for i in range(ANALYZE_AFTER))
    assert calls == [1]  # and it ran (PostgreSQL) or was skipped (SQLite) without an error
    if nodes.url.startswith("postgresql"):
        (row,) = nodes.raw("SELECT reltuples FROM pg_class WHERE oid = 'metafora_tasks'::regclass")
        assert row[0] >= 2 * ANALYZE_AFTER - 1
