"""Cluster-wide limits per task group (docs/limits.md), checked against every store."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from metafora import Task, TaskState, simple_handler
from metafora.contracts.coordinator import Coordinator
from metafora.core.errors import ClaimLost, ConfigError, InvalidProps, LimitNotFound
from metafora.core.limits import Limit, Rate
from metafora.features.waiting import pending_reasons
from metafora.testing import LocalCluster, wait_for
from tests.conformance.test_coordinator import Cluster, _opened
from tests.helpers import wait_until


@pytest.fixture
def cluster(store_url: str) -> Iterator[Cluster]:
    yield from _opened(store_url)


def _kill(coord: Coordinator) -> None:
    """End ``coord``'s lease in the store as a crash would (no release of its claims)."""
    kind = type(coord).__name__
    if kind == "MemoryCoordinator":
        coord.expire_lease()  # type: ignore[attr-defined]
    elif kind == "SQLCoordinator":
        from sqlalchemy import text

        db = coord._db  # type: ignore[attr-defined]
        past = "now() - interval '1 hour'" if db.config.kind == "postgresql" else \
            "strftime('%Y-%m-%d %H:%M:%f', 'now', '-3600 seconds')"
        with db.write() as conn:
            conn.execute(text(f"UPDATE metafora_nodes SET lease_until = {past}"
                              " WHERE namespace = :ns AND node_id = :node"),
                         {"ns": db.config.namespace, "node": coord.node_id})
    elif kind == "EtcdCoordinator":
        coord._driver.revoke(coord._state.lease_id)  # type: ignore[attr-defined]
    else:  # pragma: no cover
        raise AssertionError(kind)


def _running(cluster: Cluster, group: str) -> int:
    return cluster.client.group_usage()[group].running


def test_limit_set_list_delete_and_bad_input(cluster: Cluster) -> None:
    c = cluster.client
    assert c.limits() == []
    assert c.set_limit("tenant:42", max=5) == Limit("tenant:42", 5)
    c.set_limit("api", rate="100/1m")
    c.set_limit("both", max=2, rate="3/1s")
    c.set_limit("tenant:42", max=6)  # replaced
    assert c.limits() == [Limit("api", None, Rate(100, 60)), Limit("both", 2, Rate(3, 1)),
                          Limit("tenant:42", 6)]
    c.delete_limit("api")
    assert [lim.group for lim in c.limits()] == ["both", "tenant:42"]
    with pytest.raises(LimitNotFound, match="nope"):
        c.delete_limit("nope")
    for bad in ({"max": 0}, {"max": -1}, {}, {"rate": "ten/1m"}, {"rate": "5/1y"},
                {"rate": "0/1s"}, {"max": True}):
        with pytest.raises(ConfigError):
            c.set_limit("g", **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidProps):
        c.set_limit("bad\x01group", max=1)
    with pytest.raises(InvalidProps):
        c.set_limit("x" * 300, max=1)


def test_group_is_stored_and_listed(cluster: Cluster) -> None:
    cluster.client.submit_task(Task("a", group="tenant:42"))
    cluster.client.submit_tasks([Task("b", group="tenant:42"), Task("c")])
    infos = {i.id: i for i in cluster.client.tasks()}
    assert infos["a"].group == infos["b"].group == "tenant:42" and infos["c"].group is None
    node = cluster.node("n")
    got = node.claim(Task("a"))
    assert got is not None and got.group == "tenant:42"
    with pytest.raises(InvalidProps):
        Task("t", group=" padded")


def test_a_group_at_its_limit_refuses_claims_until_a_slot_frees(cluster: Cluster) -> None:
    cluster.client.set_limit("g", max=2)
    tasks = [Task(f"t{i}", group="g") for i in range(5)]
    cluster.client.submit_tasks([*tasks, Task("free"), Task("other", group="h")])
    a, b = cluster.node("a"), cluster.node("b")
    won = a.claim_many(tasks, 5)
    assert len(won) == 2
    assert b.claim_many(tasks, 5) == [] and b.claim(tasks[4]) is None
    usage = cluster.client.group_usage()["g"]
    assert (usage.running, usage.full()) == (2, "group g at its limit (2/2)")
    # No head-of-line blocking: other groups and ungrouped tasks go on.
    assert {t.id for t in b.claim_many([*tasks, Task("free"), Task("other", group="h")], 10)} \
        == {"free", "other"}
    a.done(won[0])
    again = b.claim_many(tasks, 5)
    assert len(again) == 1
    a.release(won[1])
    assert len(b.claim_many(tasks, 5)) == 1
    assert _running(cluster, "g") == 2
    b.fail(again[0], "boom")
    assert len(a.claim_many(tasks, 5)) == 1 and _running(cluster, "g") == 2


def test_a_killed_nodes_slots_return_with_its_lease(cluster: Cluster) -> None:
    cluster.client.set_limit("g", max=2)
    tasks = [Task(f"t{i}", group="g") for i in range(4)]
    cluster.client.submit_tasks(tasks)
    dead, live = cluster.node("dead"), cluster.node("live")
    assert len(dead.claim_many(tasks, 4)) == 2
    assert live.claim_many(tasks, 4) == []
    _kill(dead)
    got: list[Task] = []
    wait_until(lambda: bool(got.extend(live.claim_many(tasks, 4)) or len(got) >= 2),
               timeout=30, message="the dead node's slots came back")
    # A claim the live node lost meanwhile (its own lease lapsing on a loaded machine) gave its
    # slot back with it, so it may have made more claims than the limit, never held more (CI
    # once saw three claims made here; the running count is the limit's own check).
    lost = [t.id for t in cluster.contexts["live"].lost_tasks]
    assert len(got) - len(lost) == 2 and _running(cluster, "g") == 2, (got, lost)


def test_deleting_or_raising_a_limit_lets_waiting_tasks_in(cluster: Cluster) -> None:
    cluster.client.set_limit("g", max=1)
    tasks = [Task(f"t{i}", group="g") for i in range(3)]
    cluster.client.submit_tasks(tasks)
    node = cluster.node("n")
    assert len(node.claim_many(tasks, 3)) == 1
    cluster.client.set_limit("g", max=2)
    assert len(node.claim_many(tasks, 3)) == 1
    cluster.client.delete_limit("g")
    assert len(node.claim_many(tasks, 3)) == 1


def test_concurrent_claims_never_exceed_the_limit(cluster: Cluster) -> None:
    """Three nodes claim, finish and release at random (seeded, bounded), and each is killed once
    midway (its lease ended in the store as a crash would; a fresh node takes its place): at no
    point does the store hold more live claims of the group than its limit. For the check to
    mean something, claims are won before and after the kills, and at the end a fresh node fills
    the group exactly to its limit."""
    limit = 3
    cluster.client.set_limit("g", max=limit)
    rng = random.Random(20270)
    tasks = [Task(f"t{i:03d}", group="g" if i % 4 else None) for i in range(60)]
    cluster.client.submit_tasks(tasks)
    names = [f"n{i}" for i in range(3)]
    nodes = {name: cluster.node(name) for name in names}
    held: dict[str, list[Task]] = {name: [] for name in names}
    lock = threading.Lock()
    violations: list[int] = []
    errors: list[BaseException] = []
    won_grouped = {"before": 0, "after": 0}
    lost: list[str] = []  # ClaimLost: only a killed node's done/release may meet it
    kills: list[str] = []
    stop = threading.Event()

    def watcher() -> None:
        while not stop.is_set():
            running = _running(cluster, "g")
            if running > limit:
                violations.append(running)

    def worker(name: str, seed: int) -> None:
        local = random.Random(seed)
        coord = nodes[name]
        killed = False
        try:
            for step in range(30):
                if step == 12:  # the crash: the old node's claims die with its lease
                    _kill(coord)
                    with lock:
                        kills.append(name)
                        stale, held[name] = held[name], []
                    for task in stale:  # the dead node's late outcomes are refused or ignored
                        try:
                            coord.done(task)
                        except ClaimLost:
                            lost.append(task.id)
                    coord = cluster.node(f"{name}-restarted")
                    killed = True
                offers = local.sample(tasks, 12)
                won = coord.claim_many(offers, local.randint(1, 4))
                with lock:
                    held[name].extend(won)
                    won_grouped["after" if killed else "before"] += sum(1 for t in won if t.group)
                    mine = [t for t in held[name] if t.group]
                    if len(mine) > limit:
                        violations.append(len(mine))
                for task in list(held[name]):
                    if local.random() < 0.4:
                        (coord.done if local.random() < 0.5 else coord.release)(task)
                        with lock:
                            held[name].remove(task)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    seeds = [rng.randrange(1 << 30) for _ in names]
    checker = threading.Thread(target=watcher, daemon=True)
    checker.start()
    threads = [threading.Thread(target=worker, args=(n, s)) for n, s in zip(names, seeds, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    checker.join(30)
    assert not errors, errors
    assert not violations, violations
    assert sorted(kills) == names
    claimed = [i for i in cluster.client.tasks() if i.state is TaskState.CLAIMED and i.group]
    assert len(claimed) <= limit
    # The guard had something to guard: grouped claims were won on both sides of the kills (a
    # claim_many that always raised or never won fails here), and the limit binds: a fresh node
    # offered every unfinished grouped task wins exactly the room left under it.
    assert won_grouped["before"] >= limit and won_grouped["after"] >= limit, won_grouped
    states = {i.id: i.state for i in cluster.client.tasks()}
    unfinished = [t for t in tasks if t.group and states[t.id] not in (TaskState.DONE, TaskState.FAILED)]
    room = limit - _running(cluster, "g")
    assert len(unfinished) > room, (len(unfinished), room)
    assert len(cluster.node("filler").claim_many(unfinished, len(unfinished))) == room
    assert _running(cluster, "g") == limit


def test_a_rate_limit_is_never_exceeded_in_any_window(cluster: Cluster) -> None:
    count, window = 3, 1.0
    cluster.client.set_limit("api", rate=f"{count}/1s")
    tasks = [Task(f"r{i:02d}", group="api") for i in range(8)]
    cluster.client.submit_tasks(tasks)
    nodes = [cluster.node("a"), cluster.node("b")]
    grants: list[tuple[float, float, int]] = []  # (asked, answered, token) per claim
    lock = threading.Lock()
    deadline = time.monotonic() + 60
    paced = threading.Event()  # never set: an interruptible pause between polls

    def worker(coord: Coordinator) -> None:
        while time.monotonic() < deadline:
            with lock:
                if len(grants) >= len(tasks):
                    return
            asked = time.monotonic()
            won = coord.claim_many(tasks, 2)
            answered = time.monotonic()
            with lock:
                grants.extend((asked, answered, t.token) for t in won)
            for task in won:
                coord.done(task)
            if not won:
                paced.wait(0.02)  # pacing a poll of the store (the rate refuses), not a sync

    threads = [threading.Thread(target=worker, args=(c,)) for c in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(grants) == len(tasks)
    grants.sort(key=lambda g: g[2])  # tokens: the order the store granted them in
    for i in range(len(grants) - count):
        first, last = grants[i], grants[i + count]
        # count + 1 grants span a whole window: the last was answered >= window after the
        # first was asked (clock slack of 20 ms between the store and this process).
        assert last[1] - first[0] >= window - 0.02, (i, grants)


def test_tasks_waiting_on_a_full_group_do_not_block_others(store_url: str) -> None:
    release = threading.Event()
    started: list[str] = []

    def work(task: Task, stop: threading.Event) -> bool:
        started.append(task.id)
        if task.group == "slow":
            release.wait(60)
        return True

    with LocalCluster(store_url) as cluster:
        cluster.client.set_limit("slow", max=1)
        cluster.add(simple_handler(work), "c")
        cluster.client.submit_tasks([Task(f"s{i}", group="slow", priority=10) for i in range(5)])
        cluster.client.submit_tasks([Task(f"f{i}") for i in range(10)]
                                    + [Task(f"o{i}", group="other") for i in range(5)])
        try:
            wait_for(lambda: len(cluster.client.tasks(TaskState.DONE)) >= 15, 60,
                     "other tasks ran while the slow group was full")
            assert sum(1 for s in started if s.startswith("s")) == 1
            reasons = pending_reasons(cluster.client, cluster.client.tasks(TaskState.PENDING))
            assert set(reasons.values()) == {"waiting: group slow at its limit (1/1)"}
            release.set()
            wait_for(lambda: len(cluster.client.tasks(TaskState.DONE)) == 20, 60,
                     "the slow group drained one at a time")
        finally:
            release.set()
        assert not cluster.errors
