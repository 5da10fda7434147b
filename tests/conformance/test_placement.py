"""Placement labels, selectors and priorities (docs/placement.md), checked against every store."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.core.task import placement_reason
from metafora.testing import RecordingContext
from tests.helpers import wait_until


class Cluster:
    """Coordinators (already init'ed, with labels) and a client on one store."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stack = ExitStack()
        self.client: Client = self.stack.enter_context(open_client(url))

    def node(self, node_id: str, labels: dict[str, str] | None = None) -> Coordinator:
        coord = open_coordinator(self.url, node_id=node_id)
        coord.init(RecordingContext(labels=labels))
        self.stack.callback(coord.close)
        return coord


@pytest.fixture
def cluster(store_url: str) -> Iterator[Cluster]:
    c = Cluster(store_url)
    with c.stack:
        yield c


def test_selector_and_priority_are_stored_and_returned(cluster: Cluster) -> None:
    cluster.client.submit_task(Task("gpu", {"n": 1}, selector={"gpu": "1", "zone": "eu"}, priority=7))
    cluster.client.submit_tasks([Task("low", priority=-3), Task("plain")])
    gpu = cluster.client.get_task("gpu")
    assert (dict(gpu.selector), gpu.priority) == ({"gpu": "1", "zone": "eu"}, 7)
    assert gpu.task().selector == {"gpu": "1", "zone": "eu"} and gpu.task().priority == 7
    infos = {i.id: i for i in cluster.client.tasks()}
    assert (dict(infos["low"].selector), infos["low"].priority) == ({}, -3)
    assert (dict(infos["plain"].selector), infos["plain"].priority) == ({}, 0)
    assert infos["gpu"].to_dict()["selector"] == {"gpu": "1", "zone": "eu"}
    page = cluster.client.task_page(prefix="g")
    assert [(p.id, p.priority) for p in page] == [("gpu", 7)]


def test_soft_placement_is_stored_and_returned(cluster: Cluster) -> None:
    cluster.client.submit_task(Task("soft", prefer={"zone": "eu"}, spread="shards"))
    cluster.client.submit_tasks([Task("bulk", prefer={"ssd": "yes"}), Task("none")])
    info = cluster.client.get_task("soft")
    assert (dict(info.prefer), info.spread) == ({"zone": "eu"}, "shards")
    infos = {i.id: i for i in cluster.client.tasks()}
    assert (dict(infos["bulk"].prefer), infos["bulk"].spread) == ({"ssd": "yes"}, None)
    assert (dict(infos["none"].prefer), infos["none"].spread) == ({}, None)
    node = cluster.node("n")
    got = node.claim(Task("soft"))
    assert got is not None and (dict(got.prefer), got.spread) == ({"zone": "eu"}, "shards")


def test_labels_are_published_with_the_registration(cluster: Cluster) -> None:
    cluster.node("n1", {"zone": "eu", "gpu": "1"})
    cluster.node("n2")
    nodes = {n.id: n for n in cluster.client.node_infos()}
    assert dict(nodes["n1"].labels) == {"gpu": "1", "zone": "eu"}
    assert dict(nodes["n2"].labels) == {}


def test_claim_refuses_a_task_whose_selector_the_node_does_not_match(cluster: Cluster) -> None:
    plain = cluster.node("plain")
    cpu = cluster.node("cpu", {"gpu": "0", "zone": "eu"})
    gpu = cluster.node("gpu", {"gpu": "1", "zone": "eu", "rack": "r7"})
    cluster.client.submit_task(Task("t", selector={"gpu": "1", "zone": "eu"}))
    cluster.client.submit_task(Task("u"))
    # A direct claim cannot bypass placement, whatever selector the caller's Task carries.
    assert plain.claim(Task("t")) is None
    assert cpu.claim(Task("t", selector={"gpu": "0"})) is None
    assert [t.id for t in cpu.claim_many([Task("t"), Task("u")], 2)] == ["u"]
    got = gpu.claim(Task("t"))
    assert got is not None and got.selector == {"gpu": "1", "zone": "eu"}
    assert cluster.client.get_task("t").owner == "gpu"
    gpu.release(got)
    # etcd's claim_many may skip it until its watch cache saw the release: retry until then.
    many = wait_until(lambda: gpu.claim_many([Task("t")], 1), 30, "a claim of t after its release")
    assert [t.id for t in many] == ["t"] and many[0].selector == {"gpu": "1", "zone": "eu"}


def test_watch_offers_selector_and_priority_highest_first(cluster: Cluster) -> None:
    node = cluster.node("n", {"gpu": "1"})
    cluster.client.submit_tasks([Task("p0"), Task("p5", priority=5), Task("m2", priority=-2),
                                 Task("p9", priority=9, selector={"gpu": "1"})])
    offers: queue.Queue[Task] = queue.Queue()
    watcher = threading.Thread(target=node.watch, args=(offers,), daemon=True)
    watcher.start()
    seen: dict[str, Task] = {}
    while len(seen) < 4:
        task = offers.get(timeout=30)
        seen.setdefault(task.id, task)
    assert list(seen) == ["p9", "p5", "p0", "m2"]
    assert seen["p9"].selector == {"gpu": "1"} and seen["p9"].priority == 9
    node.close()
    watcher.join(10)


def test_no_live_node_matches_is_reported(cluster: Cluster) -> None:
    cluster.node("cpu", {"gpu": "0"})
    cluster.client.submit_task(Task("t", selector={"gpu": "1"}))
    labels = [n.labels for n in cluster.client.node_infos()]
    info = cluster.client.get_task("t")
    assert placement_reason(info.selector, labels) == "no live node matches gpu=1"
    cluster.node("gpu", {"gpu": "1"})
    labels = [n.labels for n in cluster.client.node_infos()]
    assert placement_reason(info.selector, labels) is None
