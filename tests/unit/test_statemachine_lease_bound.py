"""LeaseBound (unit): the deadline a fenced store call gets, and when a failure is a loss."""

from __future__ import annotations

import uuid

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.coordinators.memory import drop_store
from metafora.core.errors import ClaimLost, CoordinatorUnavailable, StoreError
from metafora.statemachine.store import LeaseBound, lease_bound_of

TASK = Task("t1", token=7)


class Left:
    """A time_left source the test moves by hand."""

    def __init__(self, value: float | None) -> None:
        self.value = value
        self.asked: list[Task] = []

    def __call__(self, task: Task) -> float | None:
        self.asked.append(task)
        return self.value


def test_the_call_gets_the_time_left_as_its_timeout() -> None:
    bound = LeaseBound(Left(1.25))
    assert bound.call(TASK, "state write", lambda timeout: timeout) == 1.25
    assert LeaseBound().call(TASK, "state write", lambda timeout: timeout) is None  # unbounded


def test_no_time_left_is_refused_as_lost_without_calling_the_store() -> None:
    calls: list[float | None] = []
    with pytest.raises(ClaimLost, match="has run out; state write refused"):
        LeaseBound(Left(0.0)).call(TASK, "state write", calls.append)
    assert calls == []


@pytest.mark.parametrize("error", [CoordinatorUnavailable("timed out"), StoreError("canceled")])
def test_a_failure_after_the_lease_ran_out_is_a_loss(error: Exception) -> None:
    left = Left(0.5)

    def hangs_then_fails(timeout: float | None) -> None:
        left.value = 0.0  # the store answered only once the lease was over
        raise error

    with pytest.raises(ClaimLost, match="did not finish before the lease") as caught:
        LeaseBound(left).call(TASK, "item results", hangs_then_fails)
    assert caught.value.__cause__ is error


def test_a_failure_with_time_left_stays_retryable() -> None:
    def fails(timeout: float | None) -> None:
        raise CoordinatorUnavailable("connection reset")

    with pytest.raises(CoordinatorUnavailable):
        LeaseBound(Left(5.0)).call(TASK, "state write", fails)


def test_clients_are_unbounded_and_memory_coordinators_bound_nothing() -> None:
    name = f"lease-bound-{uuid.uuid4().hex[:8]}"
    coord = open_coordinator(f"memory://{name}", node_id="a")
    client = open_client(f"memory://{name}")
    try:
        assert lease_bound_of(client).left(TASK) is None
        assert coord.claim_time_left(TASK) is None
        assert lease_bound_of(coord).left(TASK) is None
    finally:
        coord.close()
        client.close()
        drop_store(f"{name}/metafora")
