"""Rendezvous preference: one ranking on every node, held-back shares, priorities first."""

from __future__ import annotations

import collections

from metafora import Consumer, TaskState, simple_handler
from metafora.consumer.preference import Preference, preferred_node, weight
from metafora.core import commands
from metafora.core.task import Task
from tests.helpers import Harness, RanIds, wait_until

NODES = [f"n{i}" for i in range(5)]


def pref(node: str = "n0", nodes: list[str] = NODES, *, hold: float = 1.0, max_hold: float = 10.0,
         wave: int = 10) -> Preference:
    p = Preference(node, hold=hold, max_hold=max_hold, wave=wave)
    p.members(nodes)
    return p


def wave_of(n: int, priority: int = 0, prefix: str = "t") -> list[Task]:
    return [Task(f"{prefix}{i}", priority=priority) for i in range(n)]


def test_every_node_computes_the_same_ranking_and_shares_are_even() -> None:
    tasks = [f"t{i}" for i in range(10_000)]
    prefs = {n: pref(n) for n in NODES}
    owners = collections.Counter()
    for task_id in tasks:
        mine = [n for n, p in prefs.items() if p.mine(task_id)]
        assert mine == [preferred_node(task_id, NODES)]  # exactly one node ranks first
        owners[mine[0]] += 1
    assert all(1_700 < owners[n] < 2_300 for n in NODES), owners


def test_a_node_leaving_moves_only_its_own_share() -> None:
    tasks = [f"t{i}" for i in range(2_000)]
    before = {t: preferred_node(t, NODES) for t in tasks}
    after = {t: preferred_node(t, NODES[:-1]) for t in tasks}
    moved = [t for t in tasks if before[t] != after[t]]
    assert moved and all(before[t] == NODES[-1] for t in moved)


def test_weight_is_stable() -> None:
    # The same on every node and in every process (no salted str hash).
    assert weight("t1", "n1") == weight("t1", "n1") != weight("t1", "n2")


def test_a_wave_is_split_into_own_share_now_and_the_rest_held() -> None:
    p = pref()
    offers = wave_of(100)
    now = p.split(offers, 0.0)
    assert [t.id for t in now] == [t.id for t in offers if p.mine(t.id)]
    assert 5 < len(now) < 40 and len(p) == 100 - len(now)
    assert p.due(0.5, 1000) == []
    assert p.next_due() == 1.0
    due = p.due(1.0, 1000)
    assert sorted(t.id for t in due) == sorted(t.id for t in offers if not p.mine(t.id))
    assert len(p) == 0 and p.next_due() is None
    # Tried once without preference: a second wave with them does not hold them again.
    assert len(p.split(due + wave_of(20, prefix="u"), 2.0)) >= len(due)


def test_small_waves_a_lone_node_and_placement_are_not_held() -> None:
    p = pref(wave=10)
    assert p.split(wave_of(9), 0.0) == wave_of(9)  # not a wave
    alone = pref(nodes=["n0"])
    assert alone.split(wave_of(50), 0.0) == wave_of(50)
    placed = [Task(f"s{i}", selector={"zone": "eu"}) for i in range(20)]
    placed += [Task(f"p{i}", prefer={"gpu": "1"}) for i in range(20)]
    placed += [Task(f"g{i}", spread="g") for i in range(20)]
    assert p.split(placed, 0.0) == placed
    off = pref(hold=0.0)
    assert off.split(wave_of(50), 0.0) == wave_of(50)


def test_held_offers_wait_for_the_waves_to_stop_but_not_past_max_hold() -> None:
    p = pref(hold=1.0, max_hold=5.0)
    p.split(wave_of(50), 0.0)
    held = len(p)
    for t in (0.9, 1.8, 2.7, 3.6, 4.5):  # waves keep coming: not quiet
        p.split(wave_of(50, prefix=f"w{t}-"), t)
        assert not p.due(t + 0.05, 1000)
    assert len(p.due(5.0, 1000)) == held  # max_hold: the first wave's are tried anyway
    assert p.next_due() == 5.5  # the rest: 1 s after the last wave


def test_due_is_bounded_per_call() -> None:
    p = pref()
    p.split(wave_of(500), 0.0)
    held = len(p)
    first = p.due(1.0, 100)
    assert len(first) == 100 and len(p) == held - 100
    assert p.next_due() is not None and p.next_due() <= 1.0


def test_priorities_first_own_lower_priority_waits_behind_held_higher() -> None:
    p = pref()
    urgent = wave_of(30, priority=10, prefix="hi")
    low = wave_of(30, priority=0, prefix="lo")
    now = p.split(urgent + low, 0.0)
    # Its own urgent tasks go now; its own low ones wait behind the urgent ones held back.
    assert all(t.priority == 10 for t in now)
    assert any(p.mine(t.id) for t in low)
    due = p.due(1.0, 1000)
    assert [t.priority for t in due] == sorted((t.priority for t in due), reverse=True)
    assert {t.id for t in due} >= {t.id for t in low}
    # Nothing held: a later lower-priority wave is split as usual.
    assert p.split(wave_of(30, prefix="later"), 2.0)


def test_a_node_leaving_makes_everything_held_due() -> None:
    p = pref()
    p.split(wave_of(100), 0.0)
    held = len(p)
    p.members(NODES[:-1])
    assert p.next_due() == 0.0
    assert len(p.due(0.1, 1000)) == held
    # A node joining does not flush.
    p.split(wave_of(100, prefix="x"), 1.0)
    p.members([*NODES, "n9"])
    assert p.due(1.1, 1000) == []


def test_a_re_offered_held_task_goes_once() -> None:
    p = pref()
    offers = [t for t in wave_of(100) if not p.mine(t.id)]
    p.split(offers, 0.0)
    p.split(offers, 0.5)
    assert len(p) == 2 * len(offers)
    due = p.due(1.6, 1000)
    assert sorted(t.id for t in due) == sorted(t.id for t in offers)


def test_consumers_with_rendezvous_preference_run_a_wave_once_each(harness: Harness) -> None:
    """Three consumers with ``rendezvous_wait`` on: a bulk wave of 300 tasks runs, each once,
    including the shares held back for a node that is frozen (it never claims)."""

    ran = RanIds()
    nodes = [harness.start(Consumer(harness.coordinator(n), simple_handler(ran),
                                    rendezvous_wait=0.2)) for n in ("a", "b", "c")]
    harness.client.submit_command("c", commands.freeze())
    wait_until(lambda: nodes[2].frozen, message="c frozen")
    harness.client.submit_tasks(Task(f"w{i:03d}") for i in range(300))
    wait_until(lambda: len(harness.client.tasks("done")) == 300, 60, "every task done")
    assert sorted(ran.ids) == [f"w{i:03d}" for i in range(300)]
    assert all(i.state is TaskState.DONE for i in harness.client.tasks())
