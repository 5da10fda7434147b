"""Unit tests for metafora.balancers: Dumb, Fair, Resource (+ psutil reporters), Sleep.

Time is a FakeClock throughout: waits inside balancers are measured by advancing it,
never by sleeping.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import TypeVar

import pytest

import metafora.balancers as balancers_pkg
from metafora.balancers import (
    CpuReporter,
    DumbBalancer,
    FairBalancer,
    MemoryReporter,
    ResourceBalancer,
    ResourceReporter,
    SleepBalancer,
)
from metafora.contracts.balancer import Balancer, BalancerContext, ClusterState, RunningTask
from metafora.core.errors import ConfigError
from metafora.core.task import Task
from metafora.testing import FakeClock

B = TypeVar("B", bound=Balancer)

ME = "me"
T0 = datetime(2030, 1, 1, 12, 0, 0).astimezone()
JOIN = 5.0  # real seconds a helper thread may take to finish once released (never a hang)


# -- helpers ---------------------------------------------------------------------------


class FakeCluster(ClusterState):
    """A ClusterState whose counts the test sets; counts its calls."""

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts = dict(counts or {})
        self.calls = 0

    def node_task_count(self) -> dict[str, int]:
        self.calls += 1
        return dict(self.counts)


class FakeReporter(ResourceReporter):
    """A ResourceReporter returning whatever the test sets (or raising it)."""

    def __init__(self, value: object = 0.0) -> None:
        self.value = value

    def percent(self) -> float:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value  # type: ignore[return-value]


def running(
    n: int, *, prefix: str = "t", stopped: Iterable[int] = (), start: int = 0
) -> list[RunningTask]:
    """``n`` running tasks, oldest first (a minute apart); indexes in ``stopped`` are stopping."""
    stopping = set(stopped)
    out = []
    for i in range(n):
        started = T0 + timedelta(minutes=start + i)
        out.append(
            RunningTask(
                Task(f"{prefix}{i}"),
                started=started,
                stopped=started + timedelta(hours=1) if i in stopping else None,
            )
        )
    return out


class Node:
    """One node's view: its running tasks, the cluster's counts, a fake clock, a context."""

    def __init__(
        self,
        others: dict[str, int] | None = None,
        tasks: list[RunningTask] | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        self.clock = clock or FakeClock()
        self.tasks = list(tasks or [])
        self.cluster = FakeCluster({ME: 0, **(others or {})})
        self.ctx = BalancerContext(
            node_id=ME,
            cluster_state=self.cluster,
            task_source=lambda: list(self.tasks),
            clock=self.clock,
        )

    def init(self, balancer: B) -> B:
        balancer.init(self.ctx)
        return balancer


class Call:
    """Runs ``fn`` in a thread and keeps its result (for balancers that wait on the clock)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self._fn = fn
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> object:
        self.thread.join(JOIN)
        assert not self.thread.is_alive(), "call did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def task(name: str = "new") -> Task:
    return Task(name)


# -- the package -----------------------------------------------------------------------


def test_package_exports() -> None:
    assert set(balancers_pkg.__all__) == {
        "DumbBalancer",
        "FairBalancer",
        "ResourceBalancer",
        "SleepBalancer",
        "ResourceReporter",
        "CpuReporter",
        "MemoryReporter",
    }
    for name in balancers_pkg.__all__:
        assert getattr(balancers_pkg, name).__doc__


@pytest.mark.parametrize(
    "make",
    [
        DumbBalancer,
        FairBalancer,
        SleepBalancer,
        lambda: ResourceBalancer(FakeReporter(), 50, 80),
    ],
)
def test_every_balancer_is_a_balancer_and_needs_init(make: Callable[[], Balancer]) -> None:
    balancer = make()
    assert isinstance(balancer, Balancer)
    with pytest.raises(RuntimeError, match=r"can_claim\(\) called before init"):
        balancer.can_claim(task())
    with pytest.raises(RuntimeError, match=r"balance\(\) called before init"):
        balancer.balance()
    assert repr(balancer).startswith(type(balancer).__name__)


# -- DumbBalancer ----------------------------------------------------------------------


def test_dumb_claims_everything_releases_nothing() -> None:
    node = Node({"a": 0}, running(50))
    balancer = node.init(DumbBalancer())
    assert balancer.can_claim(task()) == (True, None)
    assert balancer.balance() == []
    assert node.cluster.calls == 0  # needs nothing from the store


# -- SleepBalancer ---------------------------------------------------------------------


def test_sleep_delay_is_per_task_times_running() -> None:
    balancer = SleepBalancer()
    assert balancer.per_task == pytest.approx(0.030)
    assert balancer.delay(0) == 0.0
    assert balancer.delay(10) == pytest.approx(0.3)
    assert SleepBalancer(timedelta(milliseconds=5)).delay(4) == pytest.approx(0.02)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "30ms", True])
def test_sleep_rejects_bad_per_task(bad: object) -> None:
    with pytest.raises(ConfigError, match="per_task"):
        SleepBalancer(bad)  # type: ignore[arg-type]


def test_sleep_with_no_tasks_claims_at_once() -> None:
    node = Node(tasks=[])
    balancer = node.init(SleepBalancer())
    assert balancer.can_claim(task()) == (True, None)
    assert node.clock.waiters() == 0


def test_sleep_waits_30ms_per_running_task_on_the_clock() -> None:
    node = Node(tasks=running(4))  # 4 x 30 ms = 120 ms
    balancer = node.init(SleepBalancer())
    call = Call(lambda: balancer.can_claim(task()))
    assert node.clock.wait_for_waiters(1)
    node.clock.advance(0.100)
    assert not call.done()
    node.clock.advance(0.021)
    assert call.join() == (True, None)
    assert balancer.balance() == []


def test_sleep_uses_the_clock_given_over_the_contexts() -> None:
    mine = FakeClock()
    node = Node(tasks=running(1))
    balancer = node.init(SleepBalancer(clock=mine))
    call = Call(lambda: balancer.can_claim(task()))
    assert mine.wait_for_waiters(1)
    assert node.clock.waiters() == 0
    mine.advance(0.030)
    assert call.join() == (True, None)


# -- FairBalancer: configuration and arithmetic ---------------------------------------


@pytest.mark.parametrize("bad", [0.99, 0.0, -1.0, float("nan"), float("inf"), "1.2", True])
def test_fair_threshold_below_one_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="threshold"):
        FairBalancer(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["claim_delay", "refuse_for", "counts_ttl"])
def test_fair_rejects_negative_durations(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        FairBalancer(**{name: -1.0})  # type: ignore[arg-type]


def test_fair_threshold_one_is_allowed() -> None:
    assert FairBalancer(1).threshold == 1.0


def test_fair_average_and_desired_count() -> None:
    fair = FairBalancer(1.2)
    assert fair.average({}) == 0.0
    assert fair.average({"a": 10, "b": 0, "c": 2}) == 4.0
    assert fair.desired_count({"a": 10, "b": 0, "c": 2}) == 5  # ceil(4.8)
    assert fair.desired_count({"a": 3, "b": 3}) == 4  # ceil(3.6)
    assert fair.desired_count({"a": 0, "b": 0}) == 0
    # float noise: 1.1 * 10 is 11.000000000000002 and must not round up to 12
    assert FairBalancer(1.1).desired_count({"a": 20, "b": 0}) == 11
    # threshold 1: never below ceil(average)
    assert FairBalancer(1.0).desired_count({"a": 4, "b": 1}) == 3


def test_fair_overloaded_is_strictly_above_threshold_times_average() -> None:
    fair = FairBalancer(1.5)
    assert not fair.overloaded("a", {"a": 6, "b": 2})  # avg 4, limit 6
    assert fair.overloaded("a", {"a": 7, "b": 1})  # avg 4, 7 > 6
    assert not fair.overloaded("a", {"a": 100})  # alone: never
    assert not fair.overloaded("a", {"a": 0, "b": 0})
    assert fair.overloaded("a", {"a": 1, "b": 0})


# -- FairBalancer: balance ------------------------------------------------------------


def test_fair_releases_down_to_threshold_times_average() -> None:
    node = Node({"a": 0, "b": 0}, running(12))  # avg 4, target ceil(4.8) = 5
    balancer = node.init(FairBalancer(1.2, both_sides=False, rng=random.Random(1)))
    released = balancer.balance()
    assert len(released) == 7
    assert len(set(released)) == 7
    assert set(released) <= {rt.id for rt in node.tasks}


def test_fair_within_threshold_releases_nothing() -> None:
    node = Node({"a": 4, "b": 4}, running(5))  # avg 4.33, limit 5.2
    balancer = node.init(FairBalancer(1.2))
    assert balancer.balance() == []
    assert balancer.refusing_until is None


def test_fair_above_threshold_but_at_its_ceiling_releases_nothing() -> None:
    node = Node({"a": 1}, running(3))  # avg 2, limit 2.4 < 3, but ceil(2.4) = 3
    balancer = node.init(FairBalancer(1.2))
    assert balancer.balance() == []
    assert balancer.refusing_until is None  # nothing released: claims are not blocked


def test_fair_choice_is_random_and_reproducible_with_a_seeded_rng() -> None:
    def release(seed: int) -> list[str]:
        node = Node({"a": 0, "b": 0, "c": 0}, running(20))
        return node.init(FairBalancer(1.2, rng=random.Random(seed))).balance()

    first = release(42)
    assert first == release(42)
    expected_pool = running(20)
    assert first == [rt.id for rt in random.Random(42).sample(expected_pool, len(first))]
    assert len({tuple(release(seed)) for seed in range(10)}) > 1  # not always the same tasks


def test_fair_never_releases_below_the_average() -> None:
    gen = random.Random(2024)
    for _ in range(500):
        threshold = gen.choice([1.0, 1.05, 1.2, 1.5, 2.0, 3.3])
        others = {f"n{i}": gen.randrange(0, 40) for i in range(gen.randrange(1, 6))}
        own = gen.randrange(0, 120)
        node = Node(others, running(own))
        # Metafora's rule alone (issue 28's "both sides" releases below threshold x average
        # when another node is under-loaded: test_fair_both_sides_* in test_shares.py)
        balancer = node.init(FairBalancer(threshold, rng=random.Random(gen.random()),
                                          both_sides=False))
        released = balancer.balance()
        counts = {**others, ME: own}
        avg = sum(counts.values()) / len(counts)
        left = own - len(released)
        assert len(set(released)) == len(released)
        if released:
            assert own > threshold * avg
            assert left >= avg, (threshold, counts, released)
            assert left == math.ceil(threshold * avg - 1e-9)
        else:
            assert own <= math.ceil(threshold * avg - 1e-9)


def test_fair_does_not_release_or_count_stopping_tasks() -> None:
    tasks = running(10, stopped=[0, 1, 2])
    node = Node({"a": 0, "b": 0}, tasks)  # holds 10: avg 3.33, target 4; 7 will stay
    balancer = node.init(FairBalancer(1.2, rng=random.Random(3)))
    released = balancer.balance()
    assert len(released) == 3
    assert not set(released) & {"t0", "t1", "t2"}


def test_fair_with_every_task_stopping_releases_nothing() -> None:
    node = Node({"a": 0}, running(6, stopped=range(6)))
    assert node.init(FairBalancer()).balance() == []


def test_fair_uses_its_local_count_over_the_stores() -> None:
    node = Node({"a": 2}, running(10))
    node.cluster.counts[ME] = 2  # the store lags behind this node's own view
    # Metafora's rule alone: with both sides, "a" (2 of a share of 6) is under-loaded and
    # this node gives one more (test_fair_both_sides_fills_a_node_left_under_by_the_old_rule).
    released = node.init(FairBalancer(1.2, rng=random.Random(0), both_sides=False)).balance()
    assert len(released) == 10 - math.ceil(1.2 * 6)


def test_fair_counts_this_node_when_the_store_omits_it() -> None:
    node = Node({"a": 0}, running(4))
    del node.cluster.counts[ME]
    balancer = node.init(FairBalancer(1.0, rng=random.Random(0)))
    assert len(balancer.balance()) == 2  # {me: 4, a: 0}: avg 2


def test_fair_single_node_never_releases_or_refuses() -> None:
    node = Node({}, running(500))
    balancer = node.init(FairBalancer(1.0))
    assert balancer.balance() == []
    assert balancer.can_claim(task()) == (True, None)
    node.cluster.counts.clear()  # a store that does not list this node at all
    assert balancer.can_claim(task()) == (True, None)


# -- FairBalancer: claims --------------------------------------------------------------


def test_fair_refuses_claims_for_claim_delay_after_a_release() -> None:
    node = Node({"a": 0}, running(10))
    balancer = node.init(FairBalancer(1.2, claim_delay=10, counts_ttl=0, both_sides=False,
                                      rng=random.Random(5)))
    released = balancer.balance()
    assert len(released) == 4  # avg 5, target 6
    node.tasks = [rt for rt in node.tasks if rt.id not in released]
    node.cluster.counts.update({ME: 6})  # the released tasks wait in the store

    until = node.clock.now() + timedelta(seconds=10)
    assert balancer.refusing_until == until
    assert balancer.can_claim(task("t3")) == (False, until)  # even a task it just released

    node.clock.advance(9.9)
    assert balancer.can_claim(task()) == (False, until)
    # counts are in flux (released tasks pending): no second release in the window
    node.cluster.counts.update({"a": 0})
    assert balancer.balance() == []

    node.clock.advance(0.1)
    node.cluster.counts.update({"a": 4})  # the other node took them: 6 vs 4, avg 5
    assert balancer.can_claim(task()) == (True, None)
    assert balancer.balance() == []


def test_fair_window_is_claim_delay_as_timedelta() -> None:
    node = Node({"a": 0}, running(4))
    balancer = node.init(FairBalancer(1.0, claim_delay=timedelta(minutes=2)))
    assert balancer.balance()
    assert balancer.refusing_until == node.clock.now() + timedelta(minutes=2)


def test_fair_refuses_while_above_threshold_and_claims_on_a_second_offer() -> None:
    node = Node({"a": 1}, running(5))  # avg 3, limit 3.6 < 5
    balancer = node.init(FairBalancer(1.2, refuse_for=2.0))
    until = node.clock.now() + timedelta(seconds=2)
    assert balancer.can_claim(task("x")) == (False, until)
    node.clock.advance(1)
    assert balancer.can_claim(task("x")) == (False, until)  # offered early: same deadline
    assert balancer.can_claim(task("y"))[0] is False  # another task gets its own refusal
    node.clock.advance(1)
    # still here after its ignore: no lighter node took it, so this node does
    assert balancer.can_claim(task("x")) == (True, None)
    assert balancer.can_claim(task("x"))[0] is False  # a fresh offer starts over


def test_fair_claims_when_at_or_below_its_share() -> None:
    node = Node({"a": 3, "b": 2}, running(3))  # avg 2.67, limit 3.2
    balancer = node.init(FairBalancer(1.2))
    assert balancer.can_claim(task()) == (True, None)


def test_fair_empty_cluster_claims() -> None:
    node = Node({"a": 0, "b": 0, "c": 0}, [])
    balancer = node.init(FairBalancer(1.2))
    assert balancer.can_claim(task()) == (True, None)
    assert balancer.balance() == []


@pytest.mark.parametrize("threshold", [1.0, 1.2, 1.5])
def test_fair_spread_stays_within_threshold_when_nodes_race(threshold: float) -> None:
    # two nodes offered the same tasks, x always first: x stops at its share, y gets the rest
    clock = FakeClock()
    cluster: dict[str, list[RunningTask]] = {"x": [], "y": []}

    class Shared(ClusterState):
        def node_task_count(self) -> dict[str, int]:
            return {n: len(ts) for n, ts in cluster.items()}

    def source(name: str) -> Callable[[], list[RunningTask]]:
        return lambda: list(cluster[name])

    fairs = {}
    for name in cluster:
        fair = FairBalancer(threshold, counts_ttl=0, refuse_for=1)
        fair.init(BalancerContext(name, Shared(), source(name), clock))
        fairs[name] = fair
    for i in range(40):
        t = task(f"job{i}")
        for name in ("x", "y"):  # x always sees the offer first
            if fairs[name].can_claim(t)[0]:
                cluster[name].append(RunningTask(t, clock.now()))
                break
    held = len(cluster["x"]), len(cluster["y"])
    assert sum(held) == 40
    assert max(held) <= math.ceil(threshold * 20)
    assert held[1] >= 40 - math.ceil(threshold * 20)
    assert fairs["x"].balance() == [] and fairs["y"].balance() == []


def test_fair_can_claim_reuses_counts_for_counts_ttl() -> None:
    node = Node({"a": 5}, running(2))
    balancer = node.init(FairBalancer(counts_ttl=1.0))
    balancer.can_claim(task())
    balancer.can_claim(task())
    assert node.cluster.calls == 1
    node.clock.advance(1.0)
    balancer.can_claim(task())
    assert node.cluster.calls == 2
    balancer.balance()  # always fresh
    assert node.cluster.calls == 3


def test_fair_store_errors_propagate() -> None:
    class Down(ClusterState):
        def node_task_count(self) -> dict[str, int]:
            raise ConnectionError("store down")

    balancer = FairBalancer()
    held = running(2)  # a node holding nothing has nothing to release: it reads nothing
    balancer.init(BalancerContext(ME, Down(), lambda: held, FakeClock(T0 + timedelta(hours=1))))
    with pytest.raises(ConnectionError):
        balancer.balance()
    with pytest.raises(ConnectionError):
        balancer.can_claim(task())


def test_fair_init_resets_the_window() -> None:
    node = Node({"a": 0}, running(4))
    balancer = node.init(FairBalancer(1.0))
    assert balancer.balance()
    assert balancer.refusing_until is not None
    node.init(balancer)
    assert balancer.refusing_until is None


# -- ResourceBalancer ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claim", "release", "named"),
    [
        (0, 50, "claim_limit"),
        (-5, 50, "claim_limit"),
        (1, 101, "release_limit"),
        (50, 50, "claim_limit"),
        (60, 50, "claim_limit"),
        (10.5, 50, "claim_limit"),
        (True, 50, "claim_limit"),
        ("10", 50, "claim_limit"),
        (10, None, "release_limit"),
    ],
)
def test_resource_limits_are_validated(claim: object, release: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        ResourceBalancer(FakeReporter(), claim, release)  # type: ignore[arg-type]
    assert repr(claim) in str(info.value) or repr(release) in str(info.value)


def test_resource_limits_accepted_at_the_edges() -> None:
    balancer = ResourceBalancer(FakeReporter(), 1, 100)
    assert (balancer.claim_limit, balancer.release_limit) == (1, 100)
    assert ResourceBalancer(FakeReporter(), 99, 100).claim_limit == 99


def test_resource_needs_a_reporter() -> None:
    with pytest.raises(ConfigError, match="reporter"):
        ResourceBalancer(lambda: 3.0, 50, 80)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["max_claim_delay", "refuse_for"])
def test_resource_rejects_negative_durations(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        ResourceBalancer(FakeReporter(), 50, 80, **{name: -1})  # type: ignore[arg-type]


@pytest.mark.parametrize("usage", [50.0, 50, 79.9, 100.0])
def test_resource_refuses_at_or_above_claim_limit(usage: float) -> None:
    node = Node(tasks=running(3))
    balancer = node.init(ResourceBalancer(FakeReporter(usage), 50, 80, refuse_for=7))
    assert balancer.can_claim(task()) == (False, node.clock.now() + timedelta(seconds=7))
    assert node.clock.waiters() == 0  # refusing does not wait


def test_resource_claim_delay_is_proportional_to_usage() -> None:
    balancer = ResourceBalancer(FakeReporter(), 80, 90, max_claim_delay=0.5)
    assert balancer.claim_delay(0.0) == 0.0
    assert balancer.claim_delay(20.0) == pytest.approx(0.125)
    assert balancer.claim_delay(40.0) == pytest.approx(0.25)
    assert balancer.claim_delay(80.0) == pytest.approx(0.5)
    assert balancer.claim_delay(200.0) == pytest.approx(0.5)  # clamped
    assert balancer.claim_delay(-3.0) == 0.0


def test_resource_idle_node_claims_at_once() -> None:
    node = Node()
    balancer = node.init(ResourceBalancer(FakeReporter(0.0), 50, 80))
    assert balancer.can_claim(task()) == (True, None)
    assert node.clock.waiters() == 0


def test_resource_claim_waits_on_the_clock_in_proportion_to_usage() -> None:
    node = Node()
    balancer = node.init(ResourceBalancer(FakeReporter(40.0), 80, 90, max_claim_delay=0.5))
    call = Call(lambda: balancer.can_claim(task()))
    assert node.clock.wait_for_waiters(1)
    start = node.clock.monotonic()
    node.clock.advance(0.2)
    assert not call.done()
    node.clock.advance(0.05)
    assert call.join() == (True, None)
    assert node.clock.monotonic() - start == pytest.approx(0.25)


def test_resource_lighter_node_wins_the_race() -> None:
    clock = FakeClock()
    light = Node(clock=clock).init(ResourceBalancer(FakeReporter(10.0), 80, 90))
    heavy = Node(clock=clock).init(ResourceBalancer(FakeReporter(60.0), 80, 90))
    finished: list[str] = []
    lock = threading.Lock()

    def offer(name: str, balancer: Balancer) -> Callable[[], object]:
        def run() -> object:
            result = balancer.can_claim(task())
            with lock:
                finished.append(name)
            return result

        return run

    calls = [Call(offer("heavy", heavy)), Call(offer("light", light))]
    assert clock.wait_for_waiters(2)
    clock.advance(0.1)  # light waits 0.0625 s, heavy 0.375 s
    calls[1].join()
    assert finished == ["light"]
    assert not calls[0].done()
    clock.advance(0.3)
    calls[0].join()
    assert finished == ["light", "heavy"]


def test_resource_releases_nothing_at_or_below_release_limit() -> None:
    node = Node(tasks=running(5))
    reporter = FakeReporter(80.0)
    balancer = node.init(ResourceBalancer(reporter, 50, 80))
    assert balancer.balance() == []
    reporter.value = 10.0
    assert balancer.balance() == []


def test_resource_releases_the_oldest_running_task_first() -> None:
    tasks = running(3, prefix="new", start=100) + running(3, prefix="old", stopped=[0])
    node = Node(tasks=tasks)  # not in age order; old0 is already stopping
    balancer = node.init(ResourceBalancer(FakeReporter(95.0), 50, 80))
    assert balancer.balance() == ["old1"]
    node.tasks = [rt for rt in node.tasks if rt.id != "old1"]
    assert balancer.balance() == ["old2"]
    node.tasks = [rt for rt in node.tasks if rt.id != "old2"]
    assert balancer.balance() == ["new0"]


def test_resource_with_every_task_stopping_releases_nothing() -> None:
    node = Node(tasks=running(2, stopped=[0, 1]))
    assert node.init(ResourceBalancer(FakeReporter(100.0), 50, 80)).balance() == []


def test_resource_usage_is_clamped_to_0_100() -> None:
    node = Node(tasks=running(1))
    reporter = FakeReporter(150.0)
    balancer = node.init(ResourceBalancer(reporter, 98, 99))
    assert balancer.balance() == ["t0"]
    reporter.value = -20.0
    assert balancer.can_claim(task()) == (True, None)
    assert node.clock.waiters() == 0


@pytest.mark.parametrize("value", [RuntimeError("meter broke"), float("nan"), "80%", None])
def test_resource_failing_reporter_claims_and_releases_nothing(
    value: object, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tasks=running(3))
    balancer = node.init(ResourceBalancer(FakeReporter(value), 50, 80))
    with caplog.at_level(logging.WARNING, logger="metafora.balancers.resource"):
        assert balancer.can_claim(task()) == (True, None)
        assert balancer.balance() == []
    assert any("reporter" in r.getMessage() for r in caplog.records)
    assert all(r.levelno == logging.WARNING for r in caplog.records)


# -- psutil reporters ------------------------------------------------------------------


def test_cpu_reporter_reports_a_percentage() -> None:
    reporter = CpuReporter()
    for _ in range(3):
        value = reporter.percent()
        assert isinstance(value, float)
        assert 0.0 <= value <= 100.0


def test_memory_reporter_reports_a_percentage() -> None:
    value = MemoryReporter().percent()
    assert isinstance(value, float)
    assert 0.0 < value <= 100.0


def test_resource_balancer_with_real_reporters() -> None:
    node = Node(tasks=running(1))
    for reporter in (CpuReporter(), MemoryReporter()):
        balancer = node.init(ResourceBalancer(reporter, 99, 100, max_claim_delay=0))
        claim, until = balancer.can_claim(task())
        assert claim or until is not None
        assert balancer.balance() == []  # usage is never above 100


# -- membership: leaving nodes and orphans (issue 15 item 4) --------------------------------


class LeavingCluster(FakeCluster):
    """A FakeCluster where some nodes announced they are leaving."""

    def __init__(self, counts: dict[str, int], leaving: set[str]) -> None:
        super().__init__(counts)
        self.leaving = leaving

    def active_task_count(self) -> dict[str, int]:
        return {n: c for n, c in self.node_task_count().items() if n not in self.leaving}


def test_fair_does_not_average_over_a_leaving_node_issue_92() -> None:
    node = Node({}, running(5))
    node.cluster = LeavingCluster({ME: 5, "node2": 1}, {"node2"})
    node.ctx.cluster_state = node.cluster
    balancer = node.init(FairBalancer(1.2, counts_ttl=0, both_sides=False))
    assert balancer.balance() == []  # alone among the active nodes: keeps its 5
    node.cluster.leaving.clear()  # before: avg 3, 5 > 3.6, one released
    assert len(balancer.balance()) == 1


def test_fair_default_active_counts_are_the_node_counts() -> None:
    cluster = FakeCluster({"a": 2})
    assert cluster.active_task_count() == {"a": 2}


def test_fair_a_node_leaving_ends_the_refusal_after_a_release() -> None:
    node = Node({"a": 0}, running(10))
    balancer = node.init(FairBalancer(1.2, claim_delay=600, counts_ttl=0, rng=random.Random(5)))
    released = balancer.balance()
    node.tasks = [rt for rt in node.tasks if rt.id not in released]
    node.cluster.counts.update({ME: 6, "a": 4})
    assert balancer.can_claim(task())[0] is False  # refusing for claim_delay
    balancer.nodes_changed(left=False)  # a join changes nothing here
    assert balancer.can_claim(task())[0] is False
    del node.cluster.counts["a"]  # a left: its tasks are orphans
    balancer.nodes_changed(left=True)
    assert balancer.refusing_until is None
    assert balancer.can_claim(task("orphan")) == (True, None)


def test_fair_a_node_joining_lets_the_next_balance_release_within_claim_delay() -> None:
    node = Node({"a": 0}, running(10))
    balancer = node.init(FairBalancer(1.2, claim_delay=600, counts_ttl=0, both_sides=False,
                                      rng=random.Random(5)))
    released = balancer.balance()  # 10 vs 0: down to 6
    assert len(released) == 4
    node.tasks = [rt for rt in node.tasks if rt.id not in released]
    node.cluster.counts.update({ME: 6, "a": 4, "b": 0})  # b joined: average 3.33, target 4
    assert balancer.balance() == []  # within claim_delay: no second release...
    balancer.nodes_changed(left=False)
    second = balancer.balance()  # ...unless a node joined since
    assert len(second) == 2
    assert balancer.can_claim(task())[0] is False  # and it refuses claims again
    node.tasks = [rt for rt in node.tasks if rt.id not in second]
    assert balancer.balance() == []  # the join is used once


# -- placement: FairBalancer weighs a task against the nodes that could run it -------------


class LabelledCluster(FakeCluster):
    """A FakeCluster that also answers node_labels (and counts those calls)."""

    def __init__(self, counts: dict[str, int], labels: dict[str, dict[str, str]]) -> None:
        super().__init__(counts)
        self.labels = labels
        self.label_calls = 0

    def node_labels(self) -> dict[str, dict[str, str]]:
        self.label_calls += 1
        return {n: dict(v) for n, v in self.labels.items()}


def placed(counts: dict[str, int], labels: dict[str, dict[str, str]],
           tasks: list[RunningTask]) -> tuple[FairBalancer, LabelledCluster]:
    cluster = LabelledCluster({ME: len(tasks), **counts}, labels)
    fair = FairBalancer(1.2, counts_ttl=0, both_sides=False, rng=random.Random(3))
    fair.init(BalancerContext(ME, cluster, lambda: list(tasks), FakeClock()))
    return fair, cluster


def gpu_tasks(n: int, prefix: str = "g") -> list[RunningTask]:
    return [RunningTask(Task(f"{prefix}{i}", selector={"gpu": "1"}), T0) for i in range(n)]


def test_fair_can_claim_compares_only_with_nodes_that_match_the_selector() -> None:
    labels = {ME: {"gpu": "1"}, "cpu1": {"gpu": "0"}, "cpu2": {}}
    fair, cluster = placed({"cpu1": 0, "cpu2": 0}, labels, gpu_tasks(6))
    # The CPU nodes cannot run it: this node is the only peer, so it never refuses.
    assert fair.can_claim(Task("g-new", selector={"gpu": "1"})) == (True, None)
    # A plain task is weighed against every node: 6 > 1.2 * 2, refused on its first offer.
    assert fair.can_claim(Task("plain"))[0] is False
    assert cluster.label_calls == 1  # labels are read only for a task with a selector


def test_fair_never_releases_a_task_no_other_node_could_run() -> None:
    labels = {ME: {"gpu": "1"}, "cpu1": {"gpu": "0"}, "cpu2": {"gpu": "0"}}
    fair, _ = placed({"cpu1": 0, "cpu2": 0}, labels, gpu_tasks(6))
    assert fair.balance() == []
    assert fair.refusing_until is None


def test_fair_releases_tasks_only_down_to_the_share_among_their_peers() -> None:
    labels = {ME: {"gpu": "1"}, "gpu2": {"gpu": "1"}, "cpu1": {}, "cpu2": {}}
    tasks = gpu_tasks(6) + running(2, prefix="p")
    fair, _ = placed({"gpu2": 0, "cpu1": 2, "cpu2": 2}, labels, tasks)
    released = sorted(fair.balance())
    # Plain tasks first, against every node (average 3, down to ceil(3.6) = 4): both go.
    # Then the GPU tasks against their peers {me: 6, gpu2: 0} (average 3): down to 4 again.
    assert released[:2] == ["g" + released[0][1:], "g" + released[1][1:]]
    assert [r for r in released if r.startswith("p")] == ["p0", "p1"]
    assert len([r for r in released if r.startswith("g")]) == 2


def test_fair_placement_keeps_zero_ping_pong() -> None:
    # Two GPU nodes and two CPU nodes; after the heavy GPU node releases, the taker is not
    # above the threshold of its own peers, so nothing moves back.
    labels = {ME: {"gpu": "1"}, "gpu2": {"gpu": "1"}, "cpu1": {}, "cpu2": {}}
    mine = gpu_tasks(10)
    fair, _ = placed({"gpu2": 0, "cpu1": 0, "cpu2": 0}, labels, mine)
    released = set(fair.balance())
    kept = [rt for rt in mine if rt.id not in released]
    taken = [rt for rt in mine if rt.id in released]
    other, _ = placed({"gpu2": len(kept), "cpu1": 0, "cpu2": 0},
                      {**labels, ME: {"gpu": "1"}, "gpu2": {"gpu": "1"}}, taken)
    assert released and other.balance() == []
    again, _ = placed({"gpu2": len(taken), "cpu1": 0, "cpu2": 0}, labels, kept)
    assert again.balance() == []
