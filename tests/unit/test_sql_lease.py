"""The pure rule of the SQL lease's reconcile (:func:`metafora.coordinators.sql.lease.reconcile`):
which held claims vanished from the store, and which stored claims nobody here tracks. The
lease itself runs against real stores in tests/integration/test_sql_coordinator.py."""

from __future__ import annotations

from metafora.coordinators.sql.lease import reconcile
from metafora.core.task import Task


def held(*claims: tuple[str, int]) -> dict[str, Task]:
    return {task_id: Task(task_id, token=token) for task_id, token in claims}


def test_in_step_nothing_to_do() -> None:
    now = held(("a", 1), ("b", 2))
    assert reconcile({"a": 1, "b": 2}, now, set(), {"a": 1, "b": 2}) == ([], [])


def test_a_claim_gone_from_the_store_is_lost() -> None:
    now = held(("a", 1), ("b", 2))
    lost, orphans = reconcile({"a": 1, "b": 2}, now, set(), {"a": 1})
    assert [t.id for t in lost] == ["b"] and orphans == []


def test_a_claim_with_another_token_in_the_store_is_lost_and_the_stored_one_released() -> None:
    now = held(("a", 1))
    lost, orphans = reconcile({"a": 1}, now, set(), {"a": 5})
    assert [t.id for t in lost] == ["a"] and orphans == [("a", 5)]


def test_claims_in_flight_or_new_since_the_read_are_judged_next_time() -> None:
    now = held(("a", 1), ("b", 2))
    # b was claimed after the read (not in before); c is being claimed (busy)
    assert reconcile({"a": 1}, now, {"c"}, {"a": 1, "c": 3}) == ([], [])
    assert reconcile({"a": 1, "b": 2}, now, {"b"}, {"a": 1}) == ([], [])


def test_a_stored_claim_nobody_tracks_is_released() -> None:
    assert reconcile({}, {}, set(), {"x": 4}) == ([], [("x", 4)])
