"""The consumer's deferred offers: highest priority first, oldest first within one, O(taken)."""

from __future__ import annotations

from metafora.consumer.offers import Deferred as _Deferred
from metafora.core.task import Task


def test_take_goes_by_priority_then_age() -> None:
    deferred = _Deferred()
    for task in (Task("a"), Task("b", priority=5), Task("c"), Task("d", priority=5), Task("e", priority=-1)):
        deferred.put(task)
    assert [t.id for t in deferred.take(3)] == ["b", "d", "a"]
    assert len(deferred) == 2
    assert [t.id for t in deferred.take(None)] == ["c", "e"]
    assert not deferred


def test_put_replaces_a_newer_offer_unless_told_not_to() -> None:
    deferred = _Deferred()
    deferred.put(Task("a", {"v": 1}))
    deferred.put(Task("a", {"v": 2}, priority=3))  # a newer offer moves it to its new priority
    deferred.put(Task("a", {"v": 3}), replace=False)  # kept as it is
    assert len(deferred) == 1
    (task,) = deferred.take(5)
    assert task.props == {"v": 2} and task.priority == 3
