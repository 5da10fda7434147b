"""metafora.contracts.balancer: the Balancer interface's defaults and the context a balancer gets."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from metafora.contracts.balancer import Balancer, BalancerContext, ClusterState, RunningTask, selector_key
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.task import Task
from metafora.testing import FakeClock

STARTED = datetime(2030, 1, 1, tzinfo=UTC)


class Counts(ClusterState):
    """A cluster state that only knows task counts (the minimum a store must give)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def node_task_count(self) -> dict[str, int]:
        return dict(self.counts)


class Claims(Balancer):
    """The smallest balancer: claims everything, releases nothing."""

    def init(self, ctx: BalancerContext) -> None:
        self.ctx = ctx

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        return True, None

    def balance(self) -> list[str]:
        return []


def test_a_running_task_is_known_by_its_tasks_id() -> None:
    running = RunningTask(Task("t1", {"x": 1}, 4), STARTED)
    assert running.id == "t1" and running.stopped is None


def test_a_cluster_state_by_default_counts_every_live_node_and_knows_no_labels() -> None:
    state = Counts({"a": 2, "b": 0})
    assert state.active_task_count() == {"a": 2, "b": 0}
    assert state.node_labels() == {}


def test_the_context_lists_the_running_tasks_and_counts_them() -> None:
    running = [RunningTask(Task("t1"), STARTED), RunningTask(Task("t2"), STARTED)]
    ctx = BalancerContext("n1", Counts({}), lambda: list(running))
    assert [r.id for r in ctx.tasks()] == ["t1", "t2"]
    assert ctx.task_count() == 2
    assert ctx.clock is SYSTEM_CLOCK


def test_the_context_counts_without_building_the_list_when_it_can() -> None:
    built: list[int] = []

    def tasks() -> list[RunningTask]:
        built.append(1)
        return []

    clock = FakeClock()
    ctx = BalancerContext("n1", Counts({}), tasks, clock, count_source=lambda: 5000)
    assert ctx.task_count() == 5000 and built == []
    assert ctx.clock is clock


def test_the_context_says_which_selectors_its_tasks_have_only_when_its_source_does() -> None:
    running = [RunningTask(Task("t1", selector={"zone": "a", "gpu": "1"}), STARTED)]
    assert BalancerContext("n1", Counts({}), lambda: list(running)).held_selectors() is None
    tally = [selector_key({"zone": "a", "gpu": "1"}), selector_key({})]
    ctx = BalancerContext("n1", Counts({}), lambda: list(running), selector_source=lambda: tally)
    assert ctx.held_selectors() == {(("gpu", "1"), ("zone", "a")), ()}


def test_a_balancer_needs_init_can_claim_and_balance_and_may_skip_nodes_changed() -> None:
    balancer = Claims()
    balancer.init(BalancerContext("n1", Counts({"n1": 0}), list))
    assert balancer.can_claim(Task("t")) == (True, None)
    assert balancer.nodes_changed(left=True) is None  # optional: the default does nothing

    class Partial(Balancer):
        def init(self, ctx: BalancerContext) -> None:
            pass

    with pytest.raises(TypeError, match="balance"):
        Partial()  # type: ignore[abstract]
