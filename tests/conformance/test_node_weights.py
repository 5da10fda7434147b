"""Weighted nodes (issue 28 part 4) on every store: a node publishes its weight with its
registration; ``node_weights()``, ``frozen_nodes()`` and ``NodeInfo.weight`` read it back, and a
balancer's count read answers the weights and frozen nodes that follow it with no second read.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from metafora import Task, open_client, open_coordinator, simple_handler
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.coordinators import members
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError
from metafora.testing import FakeClock, LocalCluster, RecordingContext, wait_for


class Cluster:
    """Coordinators (already init'ed, with weights) and a client on one store."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stack = ExitStack()
        self.client: Client = self.stack.enter_context(open_client(url))
        self.contexts: dict[str, RecordingContext] = {}

    def node(self, node_id: str, weight: float | None = None) -> Coordinator:
        coord = open_coordinator(self.url, node_id=node_id)
        ctx = RecordingContext() if weight is None else RecordingContext(weight=weight)
        coord.init(ctx)
        self.contexts[node_id] = ctx
        self.stack.callback(coord.close)
        return coord

    def why_not(self, viewer: Coordinator, seen: object) -> str:
        """What to say when ``viewer``'s view (``seen``) lacks a node: whether the store
        still lists every node as live, and which nodes lost their claims (a fence: the
        node's lease lapsed, so it really was gone for a moment)."""
        live = self.client.nodes()
        fenced = {node: [t.id for t in ctx.lost_tasks]
                  for node, ctx in self.contexts.items() if ctx.lost_tasks}
        return (f"the view {seen!r}; the store lists live nodes {live}; "
                f"claims lost by a fence: {fenced or 'none'}; the viewer's count now: "
                f"{viewer.active_task_count()!r}")


@pytest.fixture
def cluster(store_url: str) -> Iterator[Cluster]:
    c = Cluster(store_url)
    with c.stack:
        yield c


@contextmanager
def store_reads(coord: Coordinator) -> Iterator[list[str]]:
    """Record the requests ``coord`` sends its store meanwhile from this thread (its lease
    and watch threads keep talking to the store; memory sends nothing)."""
    sent: list[str] = []
    me = threading.current_thread()
    patched: list[tuple[Any, str]] = []

    def wrap(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is me:
                sent.append(name)
            return real(*args, **kwargs)

        setattr(owner, name, recorded)
        patched.append((owner, name))

    db, driver = getattr(coord, "_db", None), getattr(coord, "_driver", None)
    if db is not None:
        wrap(db, "execute")
    if driver is not None:
        wrap(driver, "range")
        wrap(driver, "txn")
    try:
        yield sent
    finally:
        for owner, name in patched:
            delattr(owner, name)


def test_weights_are_published_and_read_back(cluster: Cluster) -> None:
    a = cluster.node("a", 2.5)
    cluster.node("b")
    cluster.node("c", 0.5)
    expected = {"a": 2.5, "b": 1.0, "c": 0.5}
    assert cluster.client.node_weights() == expected
    assert {n.id: n.weight for n in cluster.client.node_infos()} == expected
    wait_for(lambda: a.node_weights() == expected, 30, "the coordinator sees every weight")
    assert cluster.client.frozen_nodes() == frozenset()
    assert a.frozen_nodes() == frozenset()


def test_frozen_nodes_follow_the_frozen_reports(cluster: Cluster) -> None:
    a = cluster.node("a")
    b = cluster.node("b", 3.0)
    b.report_frozen(True)
    assert cluster.client.frozen_nodes() == frozenset({"b"})
    wait_for(lambda: a.frozen_nodes() == frozenset({"b"}), 30, "a sees b frozen")
    assert {n.id: n.frozen for n in cluster.client.node_infos()}["b"] is True
    b.report_frozen(False)
    assert cluster.client.frozen_nodes() == frozenset()
    wait_for(lambda: a.frozen_nodes() == frozenset(), 30, "a sees b unfrozen")
    assert cluster.client.node_weights()["b"] == 3.0  # a new report keeps the weight


def test_the_count_read_answers_weights_and_frozen_nodes(cluster: Cluster,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A balancer asks ``active_task_count()``, then ``node_weights()`` and ``frozen_nodes()``:
    the last two come from the first's read, with no request of their own.

    What the read saw is kept for ``SEEN_MAX_AGE`` seconds, counted here on a fake clock that
    stands still: on the wall clock, a loaded machine took more than that between two lines of
    this test, and the asks read the store themselves (issue 53)."""
    monkeypatch.setattr(members, "SEEN_CLOCK", FakeClock().monotonic)
    a = cluster.node("a", 2.0)
    b = cluster.node("b")
    cluster.client.submit_task(Task("t"))
    assert b.claim(Task("t")) is not None
    b.report_frozen(True)
    wait_for(lambda: a.active_task_count() == {"a": 0, "b": 1} and a.frozen_nodes() == {"b"}, 30,
             "a sees b's claim and its frozen flag")
    a.active_task_count()
    with store_reads(a) as sent:
        weights, frozen = a.node_weights(), a.frozen_nodes()
    assert (weights, frozen) == ({"a": 2.0, "b": 1.0}, frozenset({"b"})), cluster.why_not(
        a, (weights, frozen))
    assert sent == []
    with store_reads(a) as sent:  # asked again without a count read: read, and right
        assert a.node_weights() == {"a": 2.0, "b": 1.0}
        assert a.frozen_nodes() == frozenset({"b"})
    assert len(sent) <= 1  # one read answers both (etcd's watch cache: none)


@pytest.mark.parametrize("weight", [0, -1, math.nan, math.inf, True, "2"])
def test_a_bad_weight_is_refused_before_registering(cluster: Cluster, weight: Any) -> None:
    coord = open_coordinator(cluster.url, node_id="bad")
    try:
        with pytest.raises(ConfigError, match="weight must be a positive number"):
            coord.init(RecordingContext(weight=weight))
    finally:
        coord.close()
    assert cluster.client.nodes() == []


def test_a_context_without_weight_weighs_one(cluster: Cluster) -> None:
    """A coordinator context written before weights existed (no ``weight``) still works."""

    class OldContext:  # duck-typed, as user code may be: only what it needed before
        labels: dict[str, str] = {}
        max_crashes = 5
        logger = RecordingContext().logger

        def lost(self, task: Task) -> None:
            return

        def renewed(self, seconds: float) -> None:
            return

    coord = open_coordinator(cluster.url, node_id="old")
    coord.init(OldContext())  # type: ignore[arg-type]
    try:
        assert cluster.client.node_weights() == {"old": 1.0}
    finally:
        coord.close()


def test_a_consumer_publishes_its_weight(store_url: str) -> None:
    def work(task: Task, stop: threading.Event) -> bool:
        return True

    with LocalCluster(store_url) as local:
        local.add(simple_handler(work), "heavy", weight=4.0)
        local.add(simple_handler(work), "light")
        assert {n.id: n.weight for n in local.client.node_infos()} == {"heavy": 4.0, "light": 1.0}
        assert local.client.node_weights() == {"heavy": 4.0, "light": 1.0}


def _v6_database(url: str, insert_node: Callable[[Any, str], None]) -> None:
    """A store as metafora's schema version 6 left it (the migrations of that release)."""
    from metafora.coordinators.sql.options import parse_config
    from metafora.coordinators.sql.schema import MIGRATIONS
    from metafora.coordinators.sql.store import Database

    db = Database(parse_config(parse_store_url(url), {}))
    try:
        with db.transaction() as conn:
            db.dialect.lock_schema(conn)
            conn.execute(text("CREATE TABLE metafora_schema (version INTEGER PRIMARY KEY,"
                              " description TEXT NOT NULL, applied_at TEXT NOT NULL)"))
            for number, (description, migration) in enumerate(MIGRATIONS[:6], start=1):
                migration(conn, db.dialect)
                conn.execute(text("INSERT INTO metafora_schema VALUES (:v, :d, '2030-01-01')"),
                             {"v": number, "d": description})
            insert_node(conn, db.config.namespace)
    finally:
        db.close()


def test_a_v6_sqlite_file_is_upgraded_and_its_nodes_weigh_one(tmp_path: Path) -> None:
    from metafora.coordinators.sql.schema import SCHEMA_VERSION, current_version

    url = f"sqlite:///{tmp_path}/v6.db"

    def old_node(conn: Any, ns: str) -> None:  # registered by a v6 node, live for 10 minutes
        soon = "strftime('%Y-%m-%d %H:%M:%f', 'now', '+600 seconds')"
        now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
        conn.execute(text(
            "INSERT INTO metafora_nodes (namespace, node_id, session, lease_until, started_at,"
            f" renewed_at, host, pid, task_count, frozen, labels) VALUES (:ns, 'old', 's6', {soon},"
            f" {now}, {now}, 'h', 1, 0, TRUE, NULL)"), {"ns": ns})

    _v6_database(url, old_node)
    with open_client(url) as client:
        infos = client.node_infos()  # the first use upgrades the schema
        assert [(n.id, n.weight, n.frozen) for n in infos] == [("old", 1.0, True)]
        coord = open_coordinator(url, node_id="new")
        coord.init(RecordingContext(weight=2.0))
        try:
            assert client.node_weights() == {"new": 2.0, "old": 1.0}
            assert coord.active_task_count() == {"new": 0, "old": 0}
            assert coord.node_weights() == {"new": 2.0, "old": 1.0}
            assert coord.frozen_nodes() == frozenset({"old"})
        finally:
            coord.close()
    from metafora.coordinators.sql.options import parse_config
    from metafora.coordinators.sql.store import Database

    db = Database(parse_config(parse_store_url(url), {}))
    try:
        with db.read() as conn:
            assert current_version(conn) == SCHEMA_VERSION >= 7
            described = conn.execute(text("SELECT description FROM metafora_schema"
                                          " WHERE version = 7")).scalar_one()
            assert "weight" in described
    finally:
        db.close()
