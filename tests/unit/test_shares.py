"""Unit tests for metafora.balancers.shares (fair shares, evenness, the release plan) and for
what FairBalancer does with them: both-sides releases, hysteresis, weights, the claim limit.

Time is a FakeClock throughout; nothing sleeps.
"""

from __future__ import annotations

import math
import random
from datetime import datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metafora.balancers import FairBalancer
from metafora.balancers.shares import (
    Member,
    Standing,
    capped_shares,
    ceil_share,
    check_band,
    check_threshold,
    exact_shares,
    fair_share,
    peers,
    release_plan,
    shares,
    standings,
)
from metafora.contracts.balancer import (
    BalancerContext,
    ClusterState,
    RecentRuns,
    RunningTask,
    SelectorKey,
    selector_key,
)
from metafora.core.errors import ConfigError
from metafora.core.node import check_weight
from metafora.core.task import Task
from metafora.testing import FakeClock

ME = "me"
CLOCK_START = datetime(2030, 1, 1, 12, 0, 0).astimezone()


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 0, 0.0, -0.5, float("nan"), float("inf"), "2", True, None])
def test_a_weight_must_be_a_positive_number(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"weight must be a positive number, got "):
        check_weight(bad)
    with pytest.raises(ConfigError, match="weight"):
        Member("a", 1, bad)  # type: ignore[arg-type]


def test_the_weight_error_names_the_value() -> None:
    with pytest.raises(ConfigError) as info:
        check_weight(-1)
    assert str(info.value) == "weight must be a positive number, got -1"


def test_the_threshold_error_says_it_is_a_ratio() -> None:
    with pytest.raises(ConfigError) as info:
        FairBalancer(120)
    assert str(info.value) == ("FairBalancer threshold must be a number from 1.0 to 10 (a ratio "
                               "to the fair share: 1.2 is 20 % above it), got 120")
    assert FairBalancer(10).threshold == 10.0 and FairBalancer(1).threshold == 1.0


def test_good_weights_are_floats() -> None:
    assert check_weight(2) == 2.0 and isinstance(check_weight(2), float)
    assert check_weight(0.25) == 0.25


@pytest.mark.parametrize("bad", [0.99, 0, -1, float("nan"), float("inf"), "1.2", True, 10.5, 120])
def test_a_threshold_must_be_a_ratio_from_1_to_10(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"threshold must be a number from 1\.0 to 10 "):
        check_threshold(bad)
    with pytest.raises(ConfigError, match="threshold"):
        FairBalancer(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2, float("nan"), "0.1", True])
def test_a_band_is_in_0_1(bad: object) -> None:
    with pytest.raises(ConfigError, match="band"):
        check_band(bad)
    with pytest.raises(ConfigError, match="band"):
        FairBalancer(band=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "bad"), [("slack", -1), ("slack", 0.5), ("slack", True),
                                           ("max_releases", 0), ("max_releases", 2.0),
                                           ("min_age", -1)])
def test_fair_rejects_bad_counts(name: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=name):
        FairBalancer(**{name: bad})  # type: ignore[arg-type]


def test_member_held_is_a_non_negative_integer() -> None:
    with pytest.raises(ConfigError, match="held"):
        Member("a", -1)
    with pytest.raises(ConfigError, match="slack"):
        fair_share("a", [Member("a", 0)], slack=-1)
    with pytest.raises(ConfigError, match="claimable"):
        standings([Member("a", 0)], claimable=-3)


# -- shares ---------------------------------------------------------------------------------


def test_unweighted_shares_are_the_ceiling_of_total_over_nodes() -> None:
    assert shares(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 4, "c": 4}
    assert shares(9, {"a": 1, "b": 1, "c": 1}) == {"a": 3, "b": 3, "c": 3}
    assert shares(0, {"a": 1, "b": 1}) == {"a": 0, "b": 0}
    assert shares(1, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}  # nobody at 0


def test_weighted_shares_are_proportional_and_rounded_up() -> None:
    assert exact_shares(10, {"a": 3, "b": 1}) == {"a": 7.5, "b": 2.5}
    assert shares(10, {"a": 3, "b": 1}) == {"a": 8, "b": 3}
    assert shares(100, {"big": 4, "small": 0.01}) == {"big": 100, "small": 1}
    assert ceil_share(11.000000000000002) == 11  # float noise does not round up
    with pytest.raises(ConfigError, match="weight"):
        shares(3, {"a": 0})


@given(st.integers(0, 10_000),
       st.dictionaries(st.text(min_size=1, max_size=3),
                       st.floats(0.01, 100, allow_nan=False), min_size=1, max_size=12))
@settings(max_examples=300, deadline=None)
def test_shares_cover_the_total_and_overshoot_by_less_than_one_each(
    total: int, weights: dict[str, float]
) -> None:
    got = shares(total, weights)
    exact = exact_shares(total, weights)
    assert sum(got.values()) >= total
    for node, share in got.items():
        assert -1e-6 <= share - exact[node] < 1  # float noise is forgiven, not rounded up
        assert share >= 1 or total == 0
    for a, wa in weights.items():
        for b, wb in weights.items():
            if wa >= wb:
                assert got[a] >= got[b]  # a heavier node never gets less


def test_peers_leave_out_frozen_and_leaving_nodes_and_match_selectors() -> None:
    members = [
        Member("gpu", 1, labels={"gpu": "1"}),
        Member("cpu", 1, labels={}),
        Member("new", 0),  # labels unknown: may run anything
        Member("frozen", 5, labels={"gpu": "1"}, active=False),
    ]
    assert [m.node_id for m in peers(members)] == ["gpu", "cpu", "new"]
    assert [m.node_id for m in peers(members, {"gpu": "1"})] == ["gpu", "new"]


def test_fair_share_counts_held_plus_claimable_over_the_active_peers() -> None:
    members = [Member("a", 10), Member("b", 0), Member("c", 2), Member("d", 7, active=False)]
    # (10 + 0 + 2 + 18 claimable) / 3 active nodes; d's 7 do not count, nor d
    assert fair_share("b", members, 18) == 10
    assert fair_share("b", members, 18, slack=2) == 12
    assert fair_share("d", members, 18) == 0  # frozen or leaving: no share
    assert fair_share("zz", members, 18) == 0  # not a member


def test_fair_share_of_a_selector_is_among_its_peers() -> None:
    members = [Member("g1", 2, labels={"gpu": "1"}), Member("g2", 0, labels={"gpu": "1"}),
               Member("c1", 20, labels={})]
    assert fair_share("g2", members, 4, selector={"gpu": "1"}) == 3  # (2 + 0 + 4) / 2
    assert fair_share("c1", members, 4, selector={"gpu": "1"}) == 0
    assert fair_share("g2", members, 4) == 9  # plain work: ceil(26 / 3)


def test_weighted_fair_share() -> None:
    members = [Member("big", 0, weight=3), Member("small", 0, weight=1)]
    assert fair_share("big", members, 100) == 75
    assert fair_share("small", members, 100) == 25
    assert fair_share("small", members, 1) == 1  # any work: a share of at least one


# -- standings ------------------------------------------------------------------------------


def test_even_is_within_the_band_or_one_task() -> None:
    assert Standing("a", 110, 100).even(0.1) and Standing("a", 90, 100).even(0.1)
    assert not Standing("a", 111, 100).even(0.1) and not Standing("a", 89, 100).even(0.1)
    assert Standing("a", 2, 3).even(0.0) and Standing("a", 4, 3).even(0.0)  # +-1 task
    assert not Standing("a", 1, 3).even(0.1)
    assert Standing("a", 3, 3.5).share == 4
    assert Standing("a", 3, 3.5).deficit == 1 and Standing("a", 6, 3.5).surplus == 2
    assert Standing("a", 90, 100).even_floor(0.1) == 90
    assert Standing("a", 0, 3).even_floor(0.1) == 2


def test_under_and_overloaded_against_the_threshold() -> None:
    assert Standing("a", 27, 100).under(1.2)
    assert not Standing("a", 85, 100).under(1.2)  # 85 * 1.2 > 100
    assert not Standing("a", 2, 3).under(1.2)  # within one task: even
    assert Standing("a", 121, 100).overloaded(1.2)
    assert not Standing("a", 120, 100).overloaded(1.2)
    assert Standing("a", 12, 4).ceiling(1.2) == 5


# -- the release plan -----------------------------------------------------------------------


def plan_of(held: dict[str, int], threshold: float = 1.2, **kw: object) -> dict[str, int]:
    group = standings([Member(node, n) for node, n in held.items()])
    return dict(release_plan(group, threshold=threshold, **kw).releases)  # type: ignore[arg-type]


def test_issue_28_three_nodes_at_the_threshold_fill_the_one_at_27_percent() -> None:
    held = {"a": 120, "b": 120, "c": 120, "d": 113, "e": 27}
    plan = plan_of(held)
    assert plan == {"a": 20, "b": 20, "c": 20, "d": 13}
    assert sum(plan.values()) == 73  # e ends at its share, 100: no more moves than that
    assert plan_of({"a": 120, "b": 120, "c": 120, "d": 113, "e": 27}, both_sides=False) == {}


def test_the_old_rule_still_releases_an_overloaded_node() -> None:
    assert plan_of({"me": 12, "a": 0, "b": 0}) == {"me": 8}  # a and b filled to their 4
    assert plan_of({"me": 6, "a": 0}) == {"me": 3}  # a filled to its 3


def test_nodes_within_one_task_of_their_share_are_filled() -> None:
    assert plan_of({"a": 4, "b": 4, "c": 2}) == {"a": 1}  # exact 3.33: c needs one


def test_the_steady_state_moves_nothing() -> None:
    assert plan_of({"a": 105, "b": 95, "c": 100}) == {}
    assert plan_of({"a": 3, "b": 4}) == {}
    assert plan_of({"alone": 500}) == {}
    assert plan_of({}) == {}


def test_a_plan_is_bounded_per_node() -> None:
    plan = plan_of({"a": 1000, "b": 0}, max_releases=100)
    assert plan == {"a": 100}


def simulate(held: dict[str, int], weights: dict[str, float], threshold: float,
             band: float) -> tuple[dict[str, int], dict[str, int]]:
    """One balance of every node, then the released tasks claimed as FairBalancer's claim
    rule would: under-loaded nodes up to even first, then nodes below their share."""
    members = [Member(n, h, weights[n]) for n, h in held.items()]
    group = standings(members)
    plan = release_plan(group, threshold=threshold, band=band)
    after = {n: h - plan.for_node(n) for n, h in held.items()}
    pool = sum(plan.releases.values())
    for s in sorted(group, key=lambda s: s.node_id):
        if s.node_id in plan.under:
            take = min(pool, max(0, s.even_floor(band) - after[s.node_id]))
            after[s.node_id] += take
            pool -= take
    for s in sorted(group, key=lambda s: s.node_id):
        take = min(pool, max(0, s.share - after[s.node_id]))
        after[s.node_id] += take
        pool -= take
    assert pool == 0  # the shares add up to at least the work: every released task is taken
    return dict(plan.releases), after


@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0])),
                min_size=2, max_size=8),
       st.sampled_from([1.0, 1.1, 1.2, 1.5, 2.0]), st.sampled_from([0.0, 0.05, 0.1, 0.25]))
@settings(max_examples=400, deadline=None)
def test_one_round_of_moves_ends_even_and_the_next_plan_moves_nothing(
    nodes: list[tuple[int, float]], threshold: float, band: float
) -> None:
    held = {f"n{i}": h for i, (h, _) in enumerate(nodes)}
    weights = {f"n{i}": w for i, (_, w) in enumerate(nodes)}
    first, after = simulate(held, weights, threshold, band)
    group = standings([Member(n, h, weights[n]) for n, h in after.items()])
    assert not [s for s in group if s.under(threshold, band)]
    again = release_plan(group, threshold=threshold, band=band)
    assert dict(again.releases) == {}, (held, first, after)  # no ping-pong
    exact = {s.node_id: s for s in standings([Member(n, h, weights[n]) for n, h in held.items()])}
    for node, n in first.items():
        assert held[node] - n >= math.floor(exact[node].exact + 1e-9)  # never below the share


# -- FairBalancer with shares ---------------------------------------------------------------


class Cluster(ClusterState):
    """Counts, weights, frozen nodes and labels the test sets; counts its reads."""

    def __init__(self, counts: dict[str, int], weights: dict[str, float] | None = None,
                 frozen: frozenset[str] = frozenset()) -> None:
        self.counts = counts
        self.weights = dict(weights or {})
        self.frozen = frozen
        self.claimable: int | None = None  # the store's claimable count (None: not told)
        self.capacities: dict[str, int] = {}
        self.reads = {"counts": 0, "weights": 0, "frozen": 0}

    def node_task_count(self) -> dict[str, int]:
        self.reads["counts"] += 1
        return dict(self.counts)

    def node_weights(self) -> dict[str, float]:
        self.reads["weights"] += 1
        return dict(self.weights)

    def frozen_nodes(self) -> frozenset[str]:
        self.reads["frozen"] += 1
        return self.frozen

    def claimable_count(self) -> int | None:
        return self.claimable

    def node_capacities(self) -> dict[str, int]:
        return dict(self.capacities)


def held_tasks(n: int, started: datetime = CLOCK_START, prefix: str = "t") -> list[RunningTask]:
    return [RunningTask(Task(f"{prefix}{i}"), started) for i in range(n)]


def fair(cluster: Cluster, tasks: list[RunningTask], claimable: int | None = None,
         clock: FakeClock | None = None, **kw: object) -> FairBalancer:
    balancer = FairBalancer(rng=random.Random(7), **kw)  # type: ignore[arg-type]
    source = None if claimable is None else (lambda: claimable)
    balancer.init(BalancerContext(ME, cluster, lambda: list(tasks), clock or FakeClock(),
                                  claimable_source=source))
    return balancer


def test_fair_both_sides_fills_a_node_left_under_by_the_old_rule() -> None:
    # {me: 10, a: 2}: share 6; the old rule stops at 8 (1.2 x 6) and leaves a at 4 of 6.
    assert len(fair(Cluster({"a": 2}), held_tasks(10)).balance()) == 4


def test_fair_both_sides_releases_below_threshold_times_average() -> None:
    # issue 28: [120, 120, 120, 113, 27]; this node holds one of the 120s
    cluster = Cluster({"b": 120, "c": 120, "d": 113, "e": 27})
    expected = plan_of({"b": 120, "c": 120, "d": 113, "e": 27, ME: 120})[ME]
    balancer = fair(cluster, held_tasks(120))
    out = balancer.balance()
    assert len(out) == expected == 20
    assert balancer.refusing_until is not None
    assert fair(cluster, held_tasks(120), threshold=1.2, both_sides=False).balance() == []


def test_fair_hysteresis_within_the_band_moves_nothing() -> None:
    assert fair(Cluster({"a": 95, "b": 92}), held_tasks(108)).balance() == []
    assert fair(Cluster({"a": 3, "b": 4}), held_tasks(4)).balance() == []


def test_fair_releases_are_bounded_per_balance() -> None:
    balancer = fair(Cluster({"a": 0}), held_tasks(100), max_releases=10)
    assert len(balancer.balance()) == 10
    assert balancer.max_releases == 10


def test_fair_does_not_release_a_task_started_moments_ago() -> None:
    clock = FakeClock()
    young = held_tasks(6, started=clock.now(), prefix="y")
    old = held_tasks(4, started=clock.now() - timedelta(seconds=30), prefix="o")
    balancer = fair(Cluster({"a": 0}), young + old, clock=clock)  # 10 | 0: four to release
    released = balancer.balance()
    assert sorted(released) == ["o0", "o1", "o2", "o3"]  # the young ones stay (for now)
    clock.advance(1.0)
    later = fair(Cluster({"a": 4}), young, clock=clock)
    assert later.balance() == []  # 6 vs 4: even


def test_fair_weights_set_the_shares_and_are_read_with_the_counts() -> None:
    cluster = Cluster({"small": 0}, weights={ME: 3.0, "small": 1.0})
    balancer = fair(cluster, held_tasks(40))
    # exact shares 30 | 10: down to 36 (1.2 x 30), then 6 more so that small holds its 10
    assert len(balancer.balance()) == 10
    assert cluster.reads["weights"] == 1 and cluster.reads["counts"] == 1
    cluster.weights = {}
    assert len(fair(cluster, held_tasks(40)).balance()) == 20  # unweighted: 20 | 20


def test_fair_frozen_nodes_do_not_count() -> None:
    cluster = Cluster({"frozen": 0, "a": 10}, frozen=frozenset({"frozen"}))
    assert fair(cluster, held_tasks(10)).balance() == []  # 10 | 10; the frozen 0 is not under
    cluster.frozen = frozenset()
    assert fair(cluster, held_tasks(10)).balance()  # counted: it would be filled


def test_fair_can_claim_up_to_its_share_when_the_consumer_says_what_is_claimable() -> None:
    # 3 nodes, nothing held, 30 claimable: share 10, slack 1
    tasks: list[RunningTask] = []
    claimable = {"n": 30}
    cluster = Cluster({"a": 0, "b": 0})
    balancer = FairBalancer(counts_ttl=0)
    balancer.init(BalancerContext(ME, cluster, lambda: list(tasks), FakeClock(),
                                  claimable_source=lambda: claimable["n"]))
    taken = 0
    for i in range(30):
        if not balancer.can_claim(Task(f"t{i}"))[0]:
            break
        tasks.append(RunningTask(Task(f"t{i}"), CLOCK_START))
        claimable["n"] -= 1
        taken += 1
    # its share of 10 and no further while the others hold nothing yet (under-loaded): the
    # rest, what they miss, stays pending for them
    assert taken == 10
    assert balancer.share() == 10
    cluster.counts.update({"a": 10, "b": 9})  # b within one task of 10: even, slack again
    claimable["n"] = 1
    tasks.pop()  # this node at 9
    assert balancer.can_claim(Task("eleventh")) == (True, None)


def test_fair_gives_no_slack_while_a_peer_is_under_loaded() -> None:
    tasks = held_tasks(7)
    # work 7 + 7 + 0 held, 7 pending: share 7; b holds 0 of 7 (under-loaded), so this node,
    # at its share, leaves the task to b rather than take its slack
    assert fair(Cluster({"a": 7, "b": 0}), tasks, claimable=7).can_claim(Task("x"))[0] is False
    # b holds 6 of 7: even, yet below its share; while no more is claimable than b misses,
    # this node leaves it the task rather than take its slack (a race's spread of two or
    # three the band would call even); with more claimable than b misses, it claims
    assert fair(Cluster({"a": 7, "b": 6}), tasks, claimable=1).can_claim(Task("x"))[0] is False
    assert fair(Cluster({"a": 7, "b": 6}), tasks, claimable=2).can_claim(Task("x")) == (True, None)
    assert fair(Cluster({"a": 7, "b": 6}), tasks + held_tasks(1, prefix="u"),
                claimable=1).can_claim(Task("x"))[0] is False


def test_fair_leaves_the_task_above_its_share_to_a_peer_below_it_after_a_race() -> None:
    # issue 49: 100 streams on 4 nodes, claimed at once, ended 26/25/23/26 (the slack of
    # the three fastest), within the band: the balancer then moved nothing
    race = Cluster({"a": 25, "b": 25, "c": 23})
    assert fair(race, held_tasks(25), claimable=2).can_claim(Task("x"))[0] is False
    # c at its share too: nobody below it to wait for, the slack is taken (101 tasks)
    assert fair(Cluster({"a": 25, "b": 25, "c": 25}), held_tasks(25),
                claimable=1).can_claim(Task("x")) == (True, None)


def test_fair_can_claim_counts_weights_for_the_share() -> None:
    cluster = Cluster({"light": 2}, weights={ME: 4, "light": 1})
    tasks = held_tasks(7)
    # work 2 + 7 + 3 = 12: this node's share ceil(9.6) = 10 (+1 slack), light's 2.4 (even)
    assert fair(cluster, tasks, claimable=3).can_claim(Task("x")) == (True, None)
    tasks += held_tasks(3, prefix="u")
    assert fair(cluster, tasks, claimable=0).can_claim(Task("x")) == (True, None)  # the slack
    assert fair(cluster, tasks, claimable=0, slack=0).can_claim(Task("x"))[0] is False


def test_fair_leaves_offers_to_an_under_loaded_peer_unless_under_loaded_itself() -> None:
    # work 30 over 3 nodes, exact share 10 each; b holds 2 (under-loaded)
    cluster = Cluster({"a": 10, "b": 2})
    # this node holds 9: even (within one task), so it leaves the task to b, however far
    # it is from its share plus slack, while what is claimable is no more than b misses
    # (work 28, exact 9.33: b misses 7)
    assert fair(cluster, held_tasks(9), claimable=7).can_claim(Task("x"))[0] is False
    # more claimable than b misses (work 30: b misses 8, 9 claimable): taking one takes
    # nothing from b (a cold start used to stop every node but the slowest at the band's edge)
    assert fair(Cluster({"a": 10, "b": 2}), held_tasks(9), claimable=9).can_claim(Task("x"))[0]
    # this node holds 5: under-loaded itself, so it claims too (up to its share, no slack)
    assert fair(cluster, held_tasks(5), claimable=13).can_claim(Task("x")) == (True, None)


def test_fair_can_claim_reads_one_snapshot_per_counts_ttl() -> None:
    cluster = Cluster({"a": 3}, weights={"a": 2})
    clock = FakeClock()
    # work 3 + 3 + 4 = 10, this node's share 10/3: at 3 it is near its share
    balancer = fair(cluster, held_tasks(3), claimable=4, clock=clock, counts_ttl=1.0)
    for i in range(20):
        balancer.can_claim(Task(f"t{i}"))
    assert cluster.reads == {"counts": 1, "weights": 1, "frozen": 1}
    clock.advance(1.0)
    balancer.can_claim(Task("x"))
    assert cluster.reads == {"counts": 2, "weights": 2, "frozen": 2}


def test_fair_far_below_its_share_a_node_claims_on_the_cached_counts() -> None:
    """Under 3/4 of its share a node claims whatever a fresh read would say: it reads the
    counts (O(tasks held) in SQL) once per ten counts_ttl, and each ttl again near its share."""
    cluster = Cluster({"a": 50, "b": 50, ME: 0})
    cluster.claimable = 200  # work 300: a share of 100 each
    clock = FakeClock()
    tasks: list[RunningTask] = []
    balancer = fair(cluster, tasks, clock=clock, counts_ttl=1.0, warmup=0)

    def claim(n: int) -> None:
        for _ in range(n):
            assert balancer.can_claim(Task(f"t{len(tasks)}")) == (True, None)
            tasks.append(RunningTask(Task(f"t{len(tasks)}"), CLOCK_START))

    claim(70)
    clock.advance(9.0)
    claim(1)  # 9 s, nine ttls, at 70 of a share of 100: on the first read
    assert cluster.reads["counts"] == 1
    clock.advance(1.0)
    claim(1)  # ten ttls old: read again, whatever it shows
    assert cluster.reads["counts"] == 2
    claim(3)  # 72, 73, 74: still under 75
    assert cluster.reads["counts"] == 2
    for expected in (2, 2, 3, 3, 4):  # at 75: a read per counts_ttl, as any node near its share
        balancer.can_claim(Task("near"))
        assert cluster.reads["counts"] == expected
        clock.advance(0.5)
    balancer.nodes_changed(left=False)  # a join drops the snapshot: read at once
    balancer.can_claim(Task("after-join"))
    assert cluster.reads["counts"] == 5


def test_fair_a_bad_published_weight_counts_as_one() -> None:
    cluster = Cluster({"a": 0}, weights={"a": float("nan"), ME: -2})  # type: ignore[dict-item]
    assert len(fair(cluster, held_tasks(10)).balance()) == 5  # 10 | 0 unweighted: 5 | 5


def test_fair_repr_names_the_new_settings() -> None:
    text = repr(FairBalancer(band=0.2, slack=0, max_releases=None))
    assert "band=0.2" in text and "slack=0" in text and "max_releases=None" in text


# -- the store's claimable count, the cold-start wait, refusals while a peer has room -------


def test_fair_share_from_the_stores_counts_does_not_grow_with_this_nodes_claims() -> None:
    # counts and claimable read together: 0 + 0 + 0 held, 30 claimable -> share 10 each
    cluster = Cluster({"a": 0, "b": 0, ME: 0})
    cluster.claimable = 30
    tasks: list[RunningTask] = []
    balancer = fair(cluster, tasks, warmup=0)
    taken = 0
    for i in range(30):  # the snapshot is not re-read meanwhile (counts_ttl): work stays 30
        if not balancer.can_claim(Task(f"t{i}"))[0]:
            break
        tasks.append(RunningTask(Task(f"t{i}"), CLOCK_START))
        taken += 1
    assert taken == 10  # its share; the other 20 are what a and b miss, left to them
    tasks.pop()
    cluster.counts.update({"a": 10, "b": 10, ME: 9})
    cluster.claimable = 1
    balancer.nodes_changed(left=False)  # forget the snapshot
    assert balancer.can_claim(Task("tenth")) == (True, None)


def test_fair_cold_start_waits_for_peers_then_claims_its_share() -> None:
    clock = FakeClock()
    cluster = Cluster({ME: 0})
    cluster.claimable = 500
    tasks: list[RunningTask] = []
    balancer = fair(cluster, tasks, clock=clock, warmup=3.0, counts_ttl=0)
    # The probe first: 1/200 of the work (2 tasks) while the membership settles.
    assert balancer.can_claim(Task("p0")) == (True, None)
    tasks.extend(held_tasks(2, prefix="p"))
    cluster.claimable = 498
    ok, until = balancer.can_claim(Task("t0"))
    assert ok is False and until == clock.now() + timedelta(seconds=3)
    clock.advance(1.0)
    cluster.counts.update({"b": 0, "c": 0, "d": 0, "e": 0})  # the others register meanwhile
    ok, until = balancer.can_claim(Task("t0"))
    assert ok is False and until == clock.now() + timedelta(seconds=3)  # a change: 3 s again
    clock.advance(2.0)
    assert balancer.can_claim(Task("t0"))[0] is False  # still 1 s of quiet to go
    clock.advance(1.0)
    assert balancer.can_claim(Task("t0")) == (True, None)  # held still 3 s: five counted
    assert balancer.share() == 100


def test_fair_cold_start_never_waits_more_than_four_warmups() -> None:
    clock = FakeClock(CLOCK_START)
    cluster = Cluster({ME: 0})
    cluster.claimable = 1000
    tasks = held_tasks(5)  # its probe is held
    balancer = fair(cluster, tasks, clock=clock, warmup=3.0, counts_ttl=0)
    for i in range(5):  # a node registers every 2.5 s: the membership never holds still
        assert balancer.can_claim(Task("t"))[0] is False
        cluster.counts[f"n{i}"] = 0
        clock.advance(2.5)
    assert clock.now() - CLOCK_START >= timedelta(seconds=12)
    assert balancer.can_claim(Task("t")) == (True, None)


def _cold_with_runs() -> tuple[FakeClock, Cluster, list[RunningTask], RecentRuns, FairBalancer]:
    """A FairBalancer at a cold start (2 nodes, 20,000 claimable, warmup 3 s) fed run times."""
    clock = FakeClock(CLOCK_START)
    cluster = Cluster({ME: 0, "b": 0})
    cluster.claimable = 20_000
    tasks: list[RunningTask] = []
    runs = RecentRuns(clock=clock)
    balancer = FairBalancer(rng=random.Random(7), warmup=3.0)
    balancer.init(BalancerContext(ME, cluster, lambda: list(tasks), clock, runs=runs))
    return clock, cluster, tasks, runs, balancer


def test_fair_short_tasks_claim_every_offer_and_release_nothing() -> None:
    clock, cluster, tasks, runs, balancer = _cold_with_runs()
    held = 0
    while balancer.can_claim(Task("p"))[0]:  # the cold start's probe
        held += 1
        tasks.append(RunningTask(Task(f"p{held}"), clock.now()))
    assert held == 100
    assert balancer.can_claim(Task("t"))[0] is False  # long tasks would wait here
    reads = cluster.reads["counts"]
    for _ in range(8):  # the probe's runs end quickly: short tasks
        runs.add(0.01)
    clock.advance(0.5)
    assert balancer.can_claim(Task("t")) == (True, None)  # no wait, no share check
    tasks.extend(held_tasks(500, started=clock.now(), prefix="x"))  # far above its share
    assert balancer.balance() == []
    assert cluster.reads["counts"] == reads  # and no store read
    # Runs that last: the share rules again (after the window of ten short_run).
    cluster.claimable = 0  # the backlog is gone: 600 held, a share of 300
    clock.advance(11.0)
    runs.add(30.0)
    clock.advance(1.0)
    assert balancer.balance() != []


def test_fair_lifts_its_refusals_once_the_tasks_turn_out_short() -> None:
    """Offers refused during the cold start (until its end, seconds away) are given back the
    moment the probe's runs show short tasks, once; long runs lift nothing."""
    clock, _cluster, tasks, runs, balancer = _cold_with_runs()
    assert balancer.refusals_lifted() is False  # nothing refused yet
    while balancer.can_claim(Task("p"))[0]:  # the probe
        tasks.append(RunningTask(Task(f"p{len(tasks)}"), clock.now()))
    ok, until = balancer.can_claim(Task("t"))
    assert ok is False and until is not None and until > clock.now()
    for _ in range(4):
        runs.add(0.01)  # too few runs to tell: no verdict kept, the next run may decide
    assert balancer.refusals_lifted() is False
    for _ in range(8):
        runs.add(30.0)  # long runs: the refusals stand
    assert balancer.refusals_lifted() is False
    clock.advance(0.5)
    for _ in range(16):
        runs.add(0.01)  # the probe's runs end at once: short tasks
    assert balancer.refusals_lifted() is True
    assert balancer.refusals_lifted() is False  # once
    assert balancer.can_claim(Task("t")) == (True, None)


def test_fair_short_tasks_need_most_of_what_runs_to_be_young() -> None:
    clock = FakeClock(CLOCK_START)
    cluster = Cluster({ME: 0, "b": 0})
    cluster.claimable = 0
    old = held_tasks(40)  # started at CLOCK_START
    runs = RecentRuns(clock=clock)
    balancer = FairBalancer(rng=random.Random(7), warmup=0)
    balancer.init(BalancerContext(ME, cluster, lambda: list(old), clock, runs=runs))
    clock.advance(60.0)
    for _ in range(10):
        runs.add(0.01)  # a few quick failures beside long tasks
    assert len(balancer.balance()) > 0  # still balances its long tasks


def test_fair_cold_start_does_not_wait_for_a_small_backlog_or_a_running_cluster() -> None:
    small = Cluster({ME: 0, "b": 0})
    small.claimable = 5
    assert fair(small, [], warmup=3.0).can_claim(Task("t")) == (True, None)
    running = Cluster({ME: 0, "b": 40})  # work is held already: this node joins, no cold start
    running.claimable = 400
    assert fair(running, [], warmup=3.0).can_claim(Task("t")) == (True, None)
    backlog = Cluster({ME: 0, "b": 0})
    backlog.claimable = 400
    assert fair(backlog, [], warmup=0).can_claim(Task("t")) == (True, None)  # turned off
    assert fair(backlog, [], warmup=3.0, warmup_backlog=0).can_claim(Task("t")) == (True, None)


def test_fair_refusal_waits_longer_while_a_lighter_peer_has_room_but_not_forever() -> None:
    clock = FakeClock()
    cluster = Cluster({ME: 11, "b": 9})  # b is even, below its share of 10: it has room
    cluster.claimable = 0
    balancer = fair(cluster, held_tasks(11), clock=clock, warmup=0, counts_ttl=0)
    began = clock.now()
    refusals = 0
    for _ in range(50):
        ok, until = balancer.can_claim(Task("x"))
        if ok:
            break
        refusals += 1
        assert until is not None
        clock.advance((until - clock.now()).total_seconds())
    assert ok is True  # taken in the end: b may be full or unable to run it
    assert 3 <= refusals <= 5  # 1 + 1 + 2 + 2 s: judged again at least every 2 s
    assert clock.now() - began >= timedelta(seconds=5)


@pytest.mark.parametrize(("name", "bad"), [("warmup", -1), ("warmup", "3"),
                                           ("warmup_backlog", -1), ("warmup_backlog", 1.5)])
def test_fair_rejects_bad_warmup_settings(name: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=name):
        FairBalancer(**{name: bad})  # type: ignore[arg-type]


def test_fair_balance_counts_claimable_work_and_releases_nothing_it_would_fill() -> None:
    # a 36, c 28, 56 claimable (work 120, exact 40 each): c fills from the pending tasks
    cluster = Cluster({"c": 28, "b": 0})
    cluster.claimable = 56
    assert fair(cluster, held_tasks(36), warmup=0).balance() == []
    # nothing claimable: b and c are under-loaded and this node gives back its surplus
    cluster.claimable = 0
    assert len(fair(cluster, held_tasks(36), warmup=0).balance()) > 0


def test_release_plan_takes_claimable_work_before_releases() -> None:
    group = [Standing("a", 40, 30.0), Standing("b", 40, 30.0), Standing("c", 10, 30.0)]
    assert release_plan(group, threshold=1.5, claimable=0).releases  # c needs 20
    assert release_plan(group, threshold=1.5, claimable=20).releases == {}


def test_fair_an_old_refusal_does_not_make_a_released_task_claimable_above_the_share() -> None:
    clock = FakeClock()
    cluster = Cluster({ME: 11, "b": 9})
    cluster.claimable = 0
    balancer = fair(cluster, held_tasks(11), clock=clock, warmup=0, counts_ttl=0)
    assert balancer.can_claim(Task("x"))[0] is False  # refused once (a cold start, say)
    clock.advance(60.0)  # claimed elsewhere meanwhile; released and offered again now
    ok, until = balancer.can_claim(Task("x"))
    assert ok is False and until == clock.now() + timedelta(seconds=1)  # a new refusal


# -- capacities ------------------------------------------------------------------------------


def test_a_capacity_caps_the_share_and_the_rest_is_shared_by_the_others() -> None:
    group = [Member("small", 2, capacity=2), Member("a", 10), Member("b", 8, weight=2.0)]
    exact = capped_shares(30, group)
    assert exact == {"small": 2.0, "a": pytest.approx(28 / 3), "b": pytest.approx(56 / 3)}
    # a capacity above the share does not bind
    assert capped_shares(30, [Member("x", 0, capacity=20), Member("y", 0)]) == {"x": 15, "y": 15}
    # water-filling goes on while caps bind: 30 over 3 is 10 > 4, then 26 over 2 is 13 > 12
    assert capped_shares(30, [Member("p", 0, capacity=4), Member("q", 0, capacity=12),
                              Member("r", 0)]) == {"p": 4, "q": 12, "r": 14}
    # nobody has room for all of it: what is left is nobody's share
    assert capped_shares(10, [Member("p", 0, capacity=1), Member("q", 0, capacity=2)]) == {
        "p": 1, "q": 2}


def test_a_full_node_is_not_under_loaded_and_nobody_releases_for_it() -> None:
    capped = standings([Member("small", 2, capacity=2), Member("big", 18)])
    assert {s.node_id: s.exact for s in capped} == {"small": 2, "big": 18}
    assert release_plan(capped, threshold=1.2).releases == {}
    uncapped = standings([Member("small", 2), Member("big", 18)])
    assert release_plan(uncapped, threshold=1.2).releases == {"big": 8}  # what used to move


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_capacity_is_a_non_negative_integer(bad: object) -> None:
    with pytest.raises(ConfigError, match="capacity must be a non-negative integer"):
        Member("n", 0, capacity=bad)  # type: ignore[arg-type]


def test_fair_leaves_a_full_node_out_of_releases_and_claims() -> None:
    cluster = Cluster({"small": 2})
    cluster.capacities = {"small": 2}
    assert fair(cluster, held_tasks(18), min_age=0).balance() == []
    cluster.capacities = {}
    assert len(fair(cluster, held_tasks(18), min_age=0).balance()) == 8
    # at claim time a full peer is not the lighter one to leave work for
    cluster.capacities = {"small": 2}
    cluster.claimable = 10
    assert fair(cluster, held_tasks(18), counts_ttl=0).can_claim(Task("next"))[0]
    cluster.capacities = {}  # 30 of work over two: a share of 15, and 18 held already
    assert not fair(cluster, held_tasks(18), counts_ttl=0).can_claim(Task("next"))[0]


class Published(Cluster):
    """A store that keeps published counts beside the claims (as SQL does)."""

    publishes_counts = True

    def __init__(self, exact: dict[str, int], published: dict[str, int]) -> None:
        super().__init__(exact)
        self.published = published
        self.published_reads = 0

    def published_task_count(self) -> dict[str, int]:
        self.published_reads += 1
        return dict(self.published)


def test_fair_balance_reads_the_claims_only_when_the_published_counts_ask_for_it() -> None:
    # Even on the published counts: one cheap read, no count of the claims.
    even = Published({ME: 20, "b": 20}, {ME: 20, "b": 20})
    even.claimable = 0
    assert fair(even, held_tasks(20), warmup=0).balance() == []
    assert (even.published_reads, even.reads["counts"]) == (1, 0)
    # A newcomer on the published counts: the exact counts decide what moves.
    joined = Published({ME: 30, "b": 30, "c": 0}, {ME: 30, "b": 30, "c": 0})
    joined.claimable = 0
    assert len(fair(joined, held_tasks(30), warmup=0).balance()) == 10
    assert (joined.published_reads, joined.reads["counts"]) == (1, 1)
    # Published counts a moment late (b has taken tasks since): the claims say even.
    late = Published({ME: 30, "b": 30, "c": 30}, {ME: 30, "b": 30, "c": 0})
    late.claimable = 0
    assert fair(late, held_tasks(30), warmup=0).balance() == []
    assert late.reads["counts"] == 1


def test_fair_balance_reads_the_labels_once_when_it_reads_the_claims_too() -> None:
    class Labelled(Published):
        def __init__(self) -> None:
            super().__init__({ME: 30, "b": 30, "c": 0}, {ME: 30, "b": 30, "c": 0})
            self.label_reads = 0

        def node_labels(self) -> dict[str, dict[str, str]]:
            self.label_reads += 1
            return {ME: {"zone": "a"}, "b": {"zone": "a"}, "c": {"zone": "a"}}

    joined = Labelled()
    joined.claimable = 0
    held = held_tasks(30)
    held = [RunningTask(Task(rt.task.id, selector={"zone": "a"}), rt.started) for rt in held]
    assert len(fair(joined, held, warmup=0).balance()) == 10
    assert (joined.published_reads, joined.reads["counts"], joined.label_reads) == (1, 1, 1)


# -- balance decides "nothing to release" on the counts alone -----------------------------


class Tallied(Published):
    """Published counts, node labels (reads counted) for the tests of the held selectors."""

    def __init__(self, exact: dict[str, int], published: dict[str, int] | None = None,
                 labels: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__(exact, dict(exact) if published is None else published)
        self.labels = labels or {}
        self.label_reads = 0
        self.claimable = 0

    def node_labels(self) -> dict[str, dict[str, str]]:
        self.label_reads += 1
        return {node: dict(labels) for node, labels in self.labels.items()}


class Held:
    """This node's tasks as the consumer hands them to its balancer: the list (each build
    counted), their count and, when ``tallied``, the selectors they have."""

    def __init__(self, tasks: list[RunningTask], *, approved: int = 0, tallied: bool = True) -> None:
        self.tasks = tasks
        self.approved = approved  # offers approved, not yet claimed: counted, not listed
        self.tallied = tallied
        self.builds = 0

    def build(self) -> list[RunningTask]:
        self.builds += 1
        return list(self.tasks)

    def selectors(self) -> frozenset[SelectorKey]:
        return frozenset(selector_key(rt.task.selector) for rt in self.tasks)

    def balancer(self, cluster: ClusterState, clock: FakeClock, seed: int = 7,
                 **kw: object) -> FairBalancer:
        balancer = FairBalancer(rng=random.Random(seed), **kw)  # type: ignore[arg-type]
        balancer.init(BalancerContext(
            ME, cluster, self.build, clock, count_source=lambda: len(self.tasks) + self.approved,
            selector_source=self.selectors if self.tallied else None))
        return balancer


def with_selector(tasks: list[RunningTask], selector: dict[str, str]) -> list[RunningTask]:
    return [RunningTask(Task(rt.id, selector=selector), rt.started, rt.stopped) for rt in tasks]


def test_fair_balance_on_an_even_cluster_builds_no_list_of_the_tasks() -> None:
    clock = FakeClock(CLOCK_START + timedelta(hours=1))
    # Even on the published counts: one read of them, no claims counted, no list built.
    even = Tallied({ME: 20, "b": 20})
    held = Held(held_tasks(20))
    balancer = held.balancer(even, clock)
    for _ in range(3):  # balance after balance (one a period)
        assert balancer.balance() == []
        clock.advance(60)
    assert (held.builds, even.published_reads, even.reads["counts"]) == (0, 3, 0)
    # A store without published counts: the exact counts say so, still no list.
    exact = Cluster({ME: 20, "b": 21})
    held = Held(held_tasks(20))
    assert held.balancer(exact, clock).balance() == []
    assert (held.builds, exact.reads["counts"]) == (0, 1)
    # Tasks with a selector, even among their peers: the labels read once, no list.
    labels = {ME: {"gpu": "1"}, "g2": {"gpu": "1"}, "c1": {}}
    placed = Tallied({ME: 10, "g2": 10, "c1": 0}, labels=labels)
    held = Held(with_selector(held_tasks(10), {"gpu": "1"}))
    assert held.balancer(placed, clock).balance() == []
    assert (held.builds, placed.reads["counts"], placed.label_reads) == (0, 0, 1)
    # Nothing held: nothing read at all.
    idle = Tallied({ME: 0, "b": 20})
    held = Held([])
    assert held.balancer(idle, clock).balance() == []
    assert (held.builds, idle.published_reads, idle.reads["counts"]) == (0, 0, 0)
    # A context that does not tally selectors (one built before held_selectors): the list.
    held = Held(held_tasks(20), tallied=False)
    assert held.balancer(Tallied({ME: 20, "b": 20}), clock).balance() == []
    assert held.builds == 1


def test_fair_balance_with_something_to_release_builds_the_list_once_and_releases_as_before() -> None:
    clock = FakeClock(CLOCK_START + timedelta(hours=1))
    joined = Tallied({ME: 30, "b": 30, "c": 0})
    held = Held(held_tasks(30))
    released = held.balancer(joined, clock).balance()
    before = Held(held_tasks(30), tallied=False).balancer(Tallied({ME: 30, "b": 30, "c": 0}), clock)
    assert released == before.balance() and len(released) == 10
    assert (held.builds, joined.published_reads, joined.reads["counts"]) == (1, 1, 1)


def test_fair_balance_releases_tasks_above_their_share_among_their_peers_alone() -> None:
    # This node is at its share of the whole cluster (10 of 40 over four) but its tasks run
    # only on the GPU nodes, where it holds 10 of 14: it gives 3 back to g2 (down to 7, the
    # threshold's edge). The whole cluster's plan alone would have released none of them.
    counts = {ME: 10, "g2": 4, "c1": 12, "c2": 14}
    assert plan_of(counts, threshold=1.1).get(ME, 0) == 0
    assert plan_of({ME: 10, "g2": 4}, threshold=1.1)[ME] == 3
    labels = {ME: {"gpu": "1"}, "g2": {"gpu": "1"}, "c1": {}, "c2": {}}
    clock = FakeClock(CLOCK_START + timedelta(hours=1))
    gpu = with_selector(held_tasks(10), {"gpu": "1"})
    cluster = Tallied(counts, labels=labels)
    held = Held(gpu)
    released = held.balancer(cluster, clock, threshold=1.1).balance()
    before = Held(gpu, tallied=False).balancer(Tallied(counts, labels=labels), clock, threshold=1.1)
    assert len(released) == 3 and released == before.balance()
    assert held.builds == 1 and cluster.label_reads == 1
    # Plain tasks beside them, even against the whole cluster: the GPU group still decides.
    mixed = Held(gpu + held_tasks(2, prefix="p"))
    counts = {ME: 12, "g2": 4, "c1": 16, "c2": 16}
    assert plan_of(counts, threshold=1.1).get(ME, 0) == 0
    released = mixed.balancer(Tallied(counts, labels=labels), clock, threshold=1.1).balance()
    before = Held(mixed.tasks, tallied=False).balancer(Tallied(counts, labels=labels), clock,
                                                       threshold=1.1)
    assert released and released == before.balance()
    assert all(task_id.startswith("t") for task_id in released)  # only GPU tasks move


_SELECTORS = [{}, {}, {"gpu": "1"}, {"zone": "a"}, {"gpu": "1", "zone": "a"}]


@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([0, 0, 0, -5, 5]),
                          st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from(_SELECTORS),
                          st.sampled_from([False, False, False, True])),
                min_size=0, max_size=5),
       st.booleans(),
       st.lists(st.tuples(st.integers(0, 3 * len(_SELECTORS)),  # most: my_labels, as selector
                          st.sampled_from(["old"] * 6 + ["young", "stopping"])),
                max_size=40),
       st.sampled_from([0, 0, 0, 1, 3]), st.sampled_from([None, 0, 5, 30]),
       st.sampled_from([1.1, 1.2, 1.5]), st.booleans(), st.sampled_from([None, 1, 3, 1000]),
       st.sampled_from(_SELECTORS[1:]), st.integers(0, 2**16))
@settings(max_examples=300, deadline=None)
def test_fair_balance_releases_the_same_tasks_with_or_without_the_held_selectors(
    others: list[tuple[int, int, float, dict[str, str], bool]], labelled_light: bool,
    mine: list[tuple[int, str]], approved: int, claimable: int | None, threshold: float,
    both_sides: bool, max_releases: int | None, my_labels: dict[str, str], seed: int,
) -> None:
    # Without held_selectors the balance is what it was before them (it builds the list of
    # tasks first): the same counts must release the same tasks, whatever they are.
    # ``labelled_light``: the nodes with labels hold less, so that a selector's peers are
    # often uneven where the whole cluster is not (the case a whole-cluster check misses).
    clock = FakeClock(CLOCK_START + timedelta(hours=1))
    now = clock.now()
    tasks = []
    for i, (which, age) in enumerate(mine):
        started = now - timedelta(seconds=0.5) if age == "young" else CLOCK_START
        stopped = now if age == "stopping" else None
        selector = _SELECTORS[which] if which < len(_SELECTORS) else my_labels
        tasks.append(RunningTask(Task(f"t{i}", selector=selector), started, stopped))
    exact = {ME: len(tasks) + approved}
    published = dict(exact)
    labels = {ME: my_labels}
    frozen = set()
    for i, (drawn, late, _, node_labels, is_frozen) in enumerate(others):
        count = drawn // 4 if labelled_light and node_labels else drawn
        exact[f"n{i}"] = count
        published[f"n{i}"] = max(0, count + late)  # published a moment late
        labels[f"n{i}"] = node_labels
        if is_frozen:
            frozen.add(f"n{i}")
    weights = {f"n{i}": weight for i, (_, _, weight, _, _) in enumerate(others)}

    def cluster() -> Tallied:
        made = Tallied(exact, published, labels)
        made.weights, made.frozen, made.claimable = weights, frozenset(frozen), claimable
        return made

    kw = {"threshold": threshold, "both_sides": both_sides, "max_releases": max_releases}
    now_held = Held(tasks, approved=approved)
    tallied = now_held.balancer(cluster(), clock, seed, **kw)
    before = Held(tasks, approved=approved, tallied=False).balancer(cluster(), clock, seed, **kw)
    released = tallied.balance()
    assert released == before.balance()
    assert tallied.refusing_until == before.refusing_until
    assert now_held.builds <= 1 and (now_held.builds == 1 or released == [])
