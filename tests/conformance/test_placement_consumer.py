"""Placement and priorities end to end on every store: consumers with labels, a full node."""

from __future__ import annotations

import threading

from metafora import Task, TaskState, simple_handler
from metafora.consumer import Consumer
from metafora.testing import LocalCluster, wait_for


class Runs:
    """A handler recording (task, node) in start order; tasks named ``hold*`` block until
    :meth:`let_go`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[tuple[str, str]] = []
        self.gate = threading.Event()

    def handler(self, node: str) -> object:
        def work(task: Task, stop: threading.Event) -> bool:
            with self.lock:
                self.runs.append((task.id, node))
            if task.id.startswith("hold"):
                self.gate.wait(120)
                self.gate.clear()
            return True

        return simple_handler(work)

    def let_go(self) -> None:
        self.gate.set()

    def order(self) -> list[str]:
        with self.lock:
            return [t for t, _ in self.runs]

    def node_of(self) -> dict[str, str]:
        with self.lock:
            return dict(self.runs)


def _deferred(consumer: Consumer) -> int:
    return len(consumer._offers.deferred)  # offers met while the node was full


def test_only_nodes_whose_labels_match_run_a_task(store_url: str) -> None:
    runs = Runs()
    with LocalCluster(store_url) as cluster:
        cluster.add(runs.handler("cpu"), "cpu", labels={"gpu": "0", "zone": "eu"})
        cluster.add(runs.handler("gpu"), "gpu", labels={"gpu": "1", "zone": "eu"})
        cluster.add(runs.handler("bare"), "bare")
        nodes = {n.id: dict(n.labels) for n in cluster.client.node_infos()}
        assert nodes == {"bare": {}, "cpu": {"gpu": "0", "zone": "eu"},
                         "gpu": {"gpu": "1", "zone": "eu"}}
        cluster.client.submit_tasks([Task(f"g{i}", selector={"gpu": "1"}) for i in range(8)]
                                    + [Task(f"e{i}", selector={"zone": "eu"}) for i in range(8)]
                                    + [Task(f"p{i}") for i in range(8)])
        wait_for(lambda: len(cluster.client.tasks("done")) == 24, 60, "24 tasks done")
        where = runs.node_of()
        assert {where[f"g{i}"] for i in range(8)} == {"gpu"}
        assert {where[f"e{i}"] for i in range(8)} <= {"gpu", "cpu"}
        assert len(runs.order()) == 24  # each ran once
        assert not cluster.errors


def test_a_full_node_claims_the_highest_priority_first_and_never_preempts(store_url: str) -> None:
    runs = Runs()
    with LocalCluster(store_url) as cluster:
        node = cluster.add(runs.handler("n"), "n", max_tasks=1)
        cluster.client.submit_task(Task("hold-low", priority=-5))
        wait_for(lambda: runs.order() == ["hold-low"], 30, "hold-low running")
        # Submitted while the node is full, lowest first: the urgent one comes last.
        cluster.client.submit_tasks([Task("a-low"), Task("b-mid", priority=3),
                                     Task("c-low"), Task("z-urgent", priority=100)])
        wait_for(lambda: _deferred(node) == 4, 30, "the four offers deferred")
        # Priority does not pre-empt: the running low task keeps its slot.
        assert cluster.client.get_task("hold-low").state is TaskState.CLAIMED
        assert cluster.client.get_task("z-urgent").state is TaskState.PENDING
        runs.let_go()
        wait_for(lambda: len(cluster.client.tasks("done")) == 5, 60, "five tasks done")
        order = runs.order()
        assert order[:3] == ["hold-low", "z-urgent", "b-mid"]
        assert sorted(order[3:]) == ["a-low", "c-low"]
        assert not cluster.errors


def _owners(cluster: LocalCluster, ids: list[str]) -> list[str | None]:
    return [cluster.client.get_task(i).owner for i in ids]


def _blocking(runs: Runs, node: str) -> object:
    def work(task: Task, stop: threading.Event) -> bool:
        with runs.lock:
            runs.runs.append((task.id, node))
        stop.wait(120)
        return False

    return simple_handler(work)


def test_a_spread_group_goes_to_distinct_nodes_first(store_url: str) -> None:
    runs = Runs()
    with LocalCluster(store_url) as cluster:
        # A node already running a task of the group would wait an hour: only a node
        # running none of the group may take the second one.
        for name in ("a", "b"):
            cluster.add(_blocking(runs, name), name, placement_wait=3600, refuse_retry=0.2)
        cluster.client.submit_tasks([Task("s1", spread="shard"), Task("s2", spread="shard")])
        wait_for(lambda: None not in _owners(cluster, ["s1", "s2"]), 60, "both claimed")
        assert sorted(_owners(cluster, ["s1", "s2"])) == ["a", "b"]  # type: ignore[type-var]
        assert not cluster.errors


def test_a_spread_group_larger_than_the_cluster_still_runs(store_url: str) -> None:
    runs = Runs()
    with LocalCluster(store_url) as cluster:
        for name in ("a", "b"):
            cluster.add(_blocking(runs, name), name, placement_wait=0.5, refuse_retry=0.2)
        ids = ["g1", "g2", "g3"]
        cluster.client.submit_tasks([Task(i, spread="shard") for i in ids])
        wait_for(lambda: None not in _owners(cluster, ids), 60, "all three claimed")
        assert set(_owners(cluster, ids)) == {"a", "b"}
        assert not cluster.errors


def test_prefer_goes_to_the_preferred_node_and_falls_back_when_none_is_live(store_url: str) -> None:
    runs = Runs()
    with LocalCluster(store_url) as cluster:
        cluster.add(runs.handler("us"), "us", labels={"zone": "us"}, placement_wait=3600)
        cluster.add(runs.handler("eu"), "eu", labels={"zone": "eu"}, placement_wait=3600)
        cluster.client.submit_tasks([Task(f"p{i}", prefer={"zone": "eu"}) for i in range(4)])
        wait_for(lambda: len(cluster.client.tasks("done")) == 4, 60, "four tasks done")
        assert set(runs.node_of().values()) == {"eu"}
        # No live node has zone=mars: the preference cannot be met and holds nothing back
        # (with an hour's placement_wait, a held-back task would never run in this test).
        cluster.client.submit_task(Task("mars", prefer={"zone": "mars"}))
        cluster.wait_for_state("mars", TaskState.DONE, 60)
        assert not cluster.errors


def test_fair_balancer_balances_among_the_nodes_that_can_run_the_tasks(store_url: str) -> None:
    from metafora.balancers import FairBalancer
    from metafora.contracts.balancer import BalancerContext
    from metafora.core import commands

    runs = Runs()
    with LocalCluster(store_url) as cluster:
        fair1, fair2 = FairBalancer(1.2, claim_delay=30), FairBalancer(1.2)
        g1 = cluster.add(_blocking(runs, "g1"), "g1", fair1, labels={"gpu": "1"},
                         balance_every=3600)
        cluster.client.submit_tasks([Task(f"t{i}", selector={"gpu": "1"}) for i in range(6)])
        wait_for(lambda: len(g1.tasks()) == 6, 60, "g1 runs all six")
        g2 = cluster.add(_blocking(runs, "g2"), "g2", fair2, labels={"gpu": "1"},
                         balance_every=3600)
        cpu = cluster.add(_blocking(runs, "cpu"), "cpu", FairBalancer(1.2), balance_every=3600)
        cluster.client.submit_command("g1", commands.balance())
        # Peers of these tasks: g1 and g2 (share 3 each: g2, under-loaded, is filled to it).
        # Counting the CPU node too would have given g1 and g2 two each.
        wait_for(lambda: len(g2.tasks()) == 3, 60, "g2 took three")
        assert len(g1.tasks()) == 3 and cpu.tasks() == []
        wait_for(lambda: cluster.client.node_task_count() == {"g1": 3, "g2": 3, "cpu": 0}, 30,
                 "the store's counts settled")
        # The balancers read the counts the nodes published (a quarter second behind at most).
        wait_for(lambda: g1._coord.active_task_count() == {"g1": 3, "g2": 3, "cpu": 0}, 30,
                 "the published counts settled")
        # Nothing moves back or on (no ping-pong): neither balancer would release a task now.
        # (g1's claim_delay window would make it answer [] anyway: ask a fresh balancer.)
        assert fair2.balance() == []
        again = FairBalancer(1.2)
        again.init(BalancerContext("g1", g1._coord, g1.tasks, count_source=lambda: len(g1.tasks())))
        assert again.balance() == []
        assert not cluster.errors
