"""Issue 50 point 3: Metafora's ResourceReporter (``used() -> (used, total)`` and a name),
the ResourceBalancer releasing oldest-first until below ``release_limit`` in one balance, and
``RunningTask.handler``."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest

from metafora import Task
from metafora.balancers import CpuReporter, MemoryReporter, ResourceBalancer, ResourceReporter
from metafora.balancers.resource import release_count
from metafora.contracts.balancer import BalancerContext, ClusterState, RunningTask
from metafora.contracts.handler import Handler
from metafora.testing import FakeClock, LocalCluster, wait_for

T0 = datetime(2030, 1, 1, 12, 0, 0).astimezone()


class Counts(ClusterState):
    def node_task_count(self) -> dict[str, int]:
        return {"me": 0}


class Used(ResourceReporter):
    """Metafora's form: (used, total) in the resource's unit, and a name."""

    def __init__(self, used: float, total: float) -> None:
        self.value: tuple[object, object] = (used, total)

    def used(self) -> tuple[float, float]:
        return self.value  # type: ignore[return-value]

    def __str__(self) -> str:
        return "slots"


class Percent(ResourceReporter):
    """The older form: a percentage only."""

    def __init__(self, value: float) -> None:
        self.value = value

    def percent(self) -> float:
        return self.value


def balancer_over(reporter: ResourceReporter, tasks: list[RunningTask],
                  claim: int = 50, release: int = 80) -> ResourceBalancer:
    balancer = ResourceBalancer(reporter, claim, release, max_claim_delay=0)
    balancer.init(BalancerContext("me", Counts(), lambda: list(tasks), FakeClock()))
    return balancer


def running(n: int, stopped: tuple[int, ...] = ()) -> list[RunningTask]:
    """``n`` tasks, given newest first so the balancer must sort them by start."""
    out = [RunningTask(Task(f"t{i}"), T0 + timedelta(minutes=i),
                       T0 + timedelta(hours=1) if i in stopped else None) for i in range(n)]
    return list(reversed(out))


def test_used_and_total_is_the_reporters_form_and_str_names_it() -> None:
    reporter = Used(30, 40)
    assert reporter.used() == (30, 40)
    assert reporter.percent() == pytest.approx(75.0)  # the percent form follows from it
    assert str(reporter) == "slots"
    assert Percent(42.0).used() == (42.0, 100.0)  # and the other way round
    assert str(Percent(1.0)) == "Percent"


def test_a_reporter_must_implement_one_of_the_two() -> None:
    with pytest.raises(TypeError, match="used"):
        class Nothing(ResourceReporter):
            pass
    with pytest.raises(TypeError, match="interface"):
        ResourceReporter()


def test_psutil_reporters_answer_used_and_total() -> None:
    for reporter in (CpuReporter(), MemoryReporter()):
        used, total = reporter.used()
        assert total > 0 and 0 <= used <= total
        assert 0.0 <= reporter.percent() <= 100.0
    assert str(CpuReporter()) == "cpu percent"
    assert str(MemoryReporter()) == "memory bytes"


def test_one_balance_releases_oldest_first_until_below_the_release_limit() -> None:
    # 95 % over 10 tasks: each is taken to use 9.5 %; two bring it to 76 % < 80 %.
    tasks = running(10)
    assert balancer_over(Used(950, 1000), tasks).balance() == ["t0", "t1"]
    assert balancer_over(Percent(95.0), tasks).balance() == ["t0", "t1"]
    # 100 % over 4 tasks with a 10 % limit: all four (25 % each).
    assert balancer_over(Used(4, 4), running(4), claim=5, release=10).balance() == [
        "t0", "t1", "t2", "t3"]


def test_stopping_tasks_count_in_the_estimate_but_are_not_released_again() -> None:
    # 100 % over 5 tasks (20 % each), the oldest already stopping: 3 more to get under 50 %.
    tasks = running(5, stopped=(0,))
    assert balancer_over(Used(100, 100), tasks, claim=40, release=50).balance() == [
        "t1", "t2", "t3"]


def test_at_or_below_the_limit_nothing_is_released() -> None:
    assert balancer_over(Used(80, 100), running(3)).balance() == []
    assert balancer_over(Used(10, 100), running(3)).balance() == []


@pytest.mark.parametrize("answer", [(1, 0), (1, -5), ("1", 2), (float("nan"), 1), None])
def test_a_bad_used_answer_releases_nothing_and_claims(answer: object,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    reporter = Used(0, 1)
    reporter.value = answer  # type: ignore[assignment]
    balancer = balancer_over(reporter, running(3))
    assert balancer.balance() == []
    assert balancer.can_claim(Task("x")) == (True, None)
    assert any("reporter" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("usage", "limit", "running_", "candidates", "expected"), [
    (95, 80, 10, 10, 2), (81, 80, 10, 10, 1), (100, 10, 4, 4, 4), (100, 10, 4, 2, 2),
    (80, 80, 3, 3, 0), (100, 99, 1, 1, 1),
])
def test_release_count(usage: float, limit: float, running_: int, candidates: int,
                       expected: int) -> None:
    assert release_count(usage, limit, running_, candidates) == expected


class Blocking(Handler):
    def __init__(self, task: Task, made: list[Blocking]) -> None:
        self.task = task
        self.stopping = threading.Event()
        made.append(self)

    def run(self) -> bool:
        self.stopping.wait(60)
        return False

    def stop(self) -> None:
        self.stopping.set()


def test_running_task_carries_its_handler() -> None:
    made: list[Blocking] = []
    with LocalCluster() as cluster:
        node = cluster.add(lambda task: Blocking(task, made), "n1")
        cluster.client.submit_task(Task("t"))
        wait_for(lambda: len(node.tasks()) == 1, 30, "the task runs")
        [rt] = node.tasks()
        assert rt.handler is made[0]  # the Handler instance running the task
        assert isinstance(rt.handler, Blocking) and rt.handler.task.id == "t"
    assert RunningTask(Task("u"), T0).handler is None  # balancer tests need none
