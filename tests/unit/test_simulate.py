"""The cluster simulation (benchmarks/simulate.py): a tiny run keeps the store's invariants.

Not balance quality (the benchmark reports that): no task held twice, every task held at the
end, moves counted, the same run for the same seed.
"""

from __future__ import annotations

import math
import random

from benchmarks import simulate
from benchmarks.sim_model import FREE, SimConfig, task_index
from benchmarks.sim_node import Cluster
from metafora.balancers import DumbBalancer, FairBalancer
from metafora.contracts.balancer import Balancer

TASKS = 500


def fair(rng: random.Random) -> Balancer:
    return FairBalancer(rng=rng)


def check(cluster: Cluster) -> None:
    """Every task has at most one owner, who runs it; counts, pool and starts agree."""
    store = cluster.store
    seen: set[int] = set()
    for number, node in cluster.nodes.items():
        held = set(node.running)
        assert not held & seen, "a task is held by two nodes"
        seen |= held
        assert all(store.owner[t] == number for t in held)
        assert store.held[number] == len(held)
    owned = {t for t in range(TASKS) if store.owner[t] != FREE}
    assert owned == seen, "the store and the nodes disagree on who holds what"
    assert sorted(store.pool) == sorted(t for t in range(TASKS) if store.owner[t] == FREE)
    assert all(store.pool[store.pos[t]] == t for t in store.pool)
    assert sum(store.starts) == store.total_starts
    assert sum(1 for s in store.starts if s) == store.started


def start(cluster: Cluster, nodes: int) -> list[str]:
    names = [f"n{i}" for i in range(nodes)]
    for name in names:
        cluster.start(name)
    return names


def test_cold_start_then_leave_keeps_every_task_held_once() -> None:
    cluster = Cluster(TASKS, SimConfig(), 7, fair)
    names = start(cluster, 5)
    assert not math.isnan(cluster.run_until(cluster.all_held, 60))
    check(cluster)
    assert cluster.store.started == TASKS
    moves = cluster.store.total_starts - cluster.store.started
    leaver = names[-1]
    held = cluster.counts()[leaver]
    assert held > 0
    cluster.stop(leaver)
    assert not math.isnan(cluster.run_until(
        lambda: not cluster.running(leaver) and cluster.all_held(), 60))
    check(cluster)
    assert leaver not in cluster.counts()
    assert sum(cluster.counts().values()) == TASKS
    # Every task the leaver held started again elsewhere: each is a move.
    assert cluster.store.total_starts - cluster.store.started >= moves + held
    cluster.run_for(30)  # balances after the leave move tasks, never lose one
    check(cluster)
    assert cluster.all_held()


def test_releases_are_written_back_and_backed_off() -> None:
    cluster = Cluster(TASKS, SimConfig(), 3, fair)
    start(cluster, 4)
    cluster.run_until(cluster.all_held, 60)
    cluster.start("joiner")  # the others release tasks for it
    cluster.run_for(20)
    check(cluster)
    store = cluster.store
    assert sum(store.releases) > 0 and sum(store.release_requests) > 0
    releaser = next(n for n in cluster.nodes.values() if n.released)
    assert all(store.owner[t] != releaser.node or t in releaser.running for t in releaser.released)
    assert cluster.counts()["joiner"] > 0


def test_the_balancer_sees_the_node_and_its_reads_are_counted() -> None:
    cluster = Cluster(TASKS, SimConfig(), 1, fair)
    start(cluster, 3)
    cluster.run_until(cluster.all_held, 60)
    node = next(iter(cluster.nodes.values()))
    ctx = node.balancer._ctx  # type: ignore[attr-defined]
    assert ctx.node_id == node.name
    assert ctx.task_count() == len(node.running) == len(ctx.tasks())
    assert ctx.claimable_count() == len(cluster.store.pool) == 0
    reads = cluster.store.count_reads[node.node]
    assert reads > 0
    ctx.cluster_state.active_task_count()
    assert cluster.store.count_reads[node.node] == reads + 1
    assert all(task_index(rt.id) in node.running for rt in ctx.tasks())


def test_the_same_seed_gives_the_same_run() -> None:
    def run(seed: int) -> tuple[dict[str, int], list[int]]:
        cluster = Cluster(TASKS, SimConfig(), seed, fair)
        start(cluster, 5)
        cluster.run_for(5)
        cluster.stop("n0")
        cluster.run_for(10)
        return cluster.counts(), list(cluster.store.starts)

    assert run(11) == run(11)


def test_dumb_balancer_claims_everything_without_moves() -> None:
    cluster = Cluster(TASKS, SimConfig(), 2, lambda rng: DumbBalancer())
    start(cluster, 5)
    cluster.run_for(10)
    check(cluster)
    assert cluster.all_held()
    assert cluster.store.total_starts == TASKS


def test_scenarios_report_moves_and_requests() -> None:
    cfg = SimConfig()
    data = simulate.cold_and_after(5, TASKS, cfg, 1, steady_s=5.0, rolling=2)
    assert set(data) == {"cold", "steady", "join", "leave", "rolling"}
    assert data["leave"]["moves_adopted"] >= data["leave"]["leaver_held"] > 0
    assert data["rolling"]["restarted"] == 2 and data["rolling"]["of"] == 5
    assert data["rolling"]["starts"] >= data["rolling"]["moves"] > 0
    for scenario in data.values():
        assert scenario["moves"] >= 0
        assert set(scenario["per_node_s"]) == {"claim_requests", "count_reads", "release_requests"}
    assert data["cold"]["claim_requests"] > 0 and data["cold"]["count_reads"] > 0
    late = simulate.late_starter(5, TASKS, cfg, 1)
    assert late["late_held"] > 0 and late["share"] == TASKS / 5


def test_the_report_renders_from_a_tiny_run() -> None:
    from dataclasses import asdict

    from benchmarks.sim_load import extrapolate

    cfg = SimConfig()
    data = simulate.cold_and_after(4, TASKS, cfg, 2, steady_s=2.0, rolling=1)
    data["late"] = simulate.late_starter(4, TASKS, cfg, 2)
    data["wall_s"] = 0.1
    load = extrapolate(data, 1.5)
    assert set(load) == {"cold", "steady", "join", "leave", "rolling", "late"}
    assert all(x["pg_requests_s"] > 0 for x in load.values())
    text = simulate.markdown({"seed": 2, "config": asdict(cfg), "balancer": "FairBalancer()",
                              "limit_s": simulate.LIMIT, "steady_s": 2.0,
                              "count_read_cost_ms": {"4x500": 1.5}, "results": {"4x500": data},
                              "load": {"4x500": load}})
    assert "| 4 x 500 |" in text and "| 4 x 500 | steady |" in text
