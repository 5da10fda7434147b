"""The SQL coordinator on real SQLite files and a real PostgreSQL (no mocks).

Every test runs on both stores (``sql_url``), except the PostgreSQL-only ones. Waits poll
with a deadline or block on events; nothing sleeps to synchronise.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from sqlalchemy import text

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.contracts.client import Client
from metafora.coordinators.sql import SQLClient, SQLCoordinator
from metafora.coordinators.sql.options import parse_config
from metafora.coordinators.sql.store import Database
from metafora.core import commands
from metafora.core.config import parse_store_url
from metafora.core.errors import ClaimLost, NodeExists
from metafora.testing import RecordingContext, wait_for


class TimedContext(RecordingContext):
    """Records when (monotonic) each lost() call happened."""

    def __init__(self) -> None:
        super().__init__()
        self.lost_at: list[float] = []

    def lost(self, task: Task) -> None:
        self.lost_at.append(time.monotonic())
        super().lost(task)


class Nodes:
    """Opens and inits coordinators on one store; closes everything at the end."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stack = ExitStack()
        self.client: Client = self.stack.enter_context(open_client(url))
        self.ctx: dict[str, TimedContext] = {}

    def node(self, node_id: str, **options: Any) -> SQLCoordinator:
        coord = open_coordinator(self.url, node_id=node_id, **options)
        assert isinstance(coord, SQLCoordinator)
        self.stack.callback(coord.close)
        ctx = self.ctx[node_id] = TimedContext()
        coord.init(ctx)
        return coord

    def watch(self, coord: SQLCoordinator) -> queue.Queue[Task]:
        offers: queue.Queue[Task] = queue.Queue()
        thread = threading.Thread(target=coord.watch, args=(offers,), daemon=True)
        thread.start()
        self.stack.callback(thread.join, 10)
        self.stack.callback(coord.close)
        return offers

    def raw(self, sql: str, **params: Any) -> list[Any]:
        """Run SQL directly on the store (for fault injection and schema checks)."""
        db = Database(parse_config(parse_store_url(self.url), {}))
        try:
            with db.transaction() as conn:
                result = conn.execute(text(sql), params)
                return list(result.fetchall()) if result.returns_rows else []
        finally:
            db.close()


@pytest.fixture
def nodes(sql_url: str) -> Iterator[Nodes]:
    n = Nodes(sql_url)
    with n.stack:
        yield n


def next_offer(offers: queue.Queue[Task], want: str, timeout: float) -> Task:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"task {want!r} was not offered within {timeout}s")
        try:
            task = offers.get(timeout=left)
        except queue.Empty:
            continue
        if task.id == want:
            return task


def test_claim_race_between_threads_has_exactly_one_winner(nodes: Nodes) -> None:
    coords = [nodes.node("a"), nodes.node("b")]
    ids = [f"r{i:03d}" for i in range(150)]
    for task_id in ids:
        nodes.client.submit_task(Task(task_id))
    wins: dict[str, list[tuple[str, int]]] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(len(coords))

    def race(coord: SQLCoordinator) -> None:
        barrier.wait(10)
        for task_id in ids:
            got = coord.claim(Task(task_id))
            if got is not None:
                with lock:
                    wins.setdefault(task_id, []).append((coord.node_id, got.token))

    threads = [threading.Thread(target=race, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(wins) == ids
    assert all(len(w) == 1 for w in wins.values()), {k: v for k, v in wins.items() if len(v) > 1}
    counts = nodes.client.node_task_count()
    assert sum(counts.values()) == len(ids)
    tokens = [w[0][1] for w in wins.values()]
    assert len(set(tokens)) == len(tokens)  # one store-wide counter


def test_tokens_strictly_increase_across_nodes_and_resubmits(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    seen: list[int] = []
    for round_ in range(3):
        nodes.client.submit_task(Task("t", {"round": round_}))
        for i in range(10):
            coord = a if i % 2 else b
            got = coord.claim(Task("t"))
            assert got is not None and got.props == {"round": round_}
            seen.append(got.token)
            assert nodes.client.get_task("t").token == got.token
            coord.release(got)
        nodes.client.delete_task("t")
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_fenced_writes_refuse_stale_tokens(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    nodes.client.submit_task(Task("t"))
    old = a.claim(Task("t"))
    assert old is not None
    a.release(old)
    new = b.claim(Task("t"))
    assert new is not None and new.token > old.token
    for write in (a.done, a.release, b.release):
        with pytest.raises(ClaimLost):
            write(old)
    with pytest.raises(ClaimLost):
        a.fail(old, "zombie")
    with pytest.raises(ClaimLost):
        a.done(new)  # the right token, but not the owner
    forged = Task("t", {}, new.token + 1)
    with pytest.raises(ClaimLost):
        b.done(forged)
    info = nodes.client.get_task("t")
    assert (info.state, info.owner, info.token) == (TaskState.CLAIMED, "b", new.token)
    b.done(new)
    with pytest.raises(ClaimLost):
        b.done(new)


@pytest.mark.timing
def test_stalled_owner_self_fences_before_anyone_can_claim(nodes: Nodes) -> None:
    ttl = 1
    a = nodes.node("a", lease_ttl=ttl)
    b = nodes.node("b", lease_ttl=ttl)
    nodes.client.submit_task(Task("t"))
    held = a.claim(Task("t"))
    assert held is not None
    paused_at = time.monotonic()
    a._pause_heartbeat()
    stolen = wait_for(lambda: b.claim(Task("t")), 10, "b to claim the stalled node's task")
    stolen_at = time.monotonic()
    ctx = nodes.ctx["a"]
    assert [t.id for t in ctx.lost_tasks] == ["t"], "the stalled owner was not told"
    assert ctx.lost_at[0] < stolen_at, "another node claimed before the owner fenced itself"
    # Within lease_ttl + one renewal interval (ttl / 3), with as much again for a loaded machine.
    assert stolen_at - paused_at < 3 * ttl
    assert stolen.token > held.token
    with pytest.raises(ClaimLost):
        a.done(held)
    assert a.claim(Task("t")) is None
    # The stalled node comes back: it re-registers and claims again.
    a._resume_heartbeat()
    nodes.client.submit_task(Task("u"))
    assert wait_for(lambda: a.claim(Task("u")), 10, "a to claim again after re-registering")
    assert sorted(nodes.client.nodes()) == ["a", "b"]


def test_crashed_owner_tasks_are_offered_after_lease_expiry(nodes: Nodes) -> None:
    a = nodes.node("a", lease_ttl=1)
    # Only the crashed owner needs a short lease. With lease_ttl=1 the claimer too self-fenced
    # whenever its heartbeat thread was late by a third of a second on a loaded machine, and its
    # one claim was refused as the product must (seen in a full run at load 4 on 2 cores).
    b = nodes.node("b", lease_ttl=10)
    nodes.client.submit_task(Task("t", {"x": 1}))
    offers = nodes.watch(b)
    first = next_offer(offers, "t", 10)
    held = a.claim(first)
    assert held is not None
    a._pause_heartbeat()  # as if the process froze
    # The offer after the 1 s lease, within a deadline generous for a busy machine. An offer of
    # "t" queued while it was still pending (the first scan and the next round's ready scan may
    # both offer it, and a busy machine delivers the second after a's claim) is not that one:
    # its claim is refused while a's lease lasts, and the offer after the expiry must follow.
    deadline = time.monotonic() + 30
    got = None
    while got is None:
        offered = next_offer(offers, "t", max(0.1, deadline - time.monotonic()))
        assert offered.props == {"x": 1}
        got = b.claim(offered)
    assert got.token > held.token


def test_deleting_a_running_task_tells_its_owner_promptly(nodes: Nodes) -> None:
    a = nodes.node("a", lease_ttl=60)  # renewals every 20 s: the prompt check must find it
    nodes.client.submit_task(Task("victim"))
    nodes.client.submit_task(Task("bystander"))
    victim, bystander = a.claim(Task("victim")), a.claim(Task("bystander"))
    assert victim is not None and bystander is not None
    nodes.client.delete_task("victim")
    ctx = nodes.ctx["a"]
    assert ctx.lost_event.wait(10), "owner was not told its task was deleted"
    assert [t.id for t in ctx.lost_tasks] == ["victim"]
    assert [t.id for t in a._held()] == ["bystander"]
    with pytest.raises(ClaimLost):
        a.done(victim)
    a.done(bystander)


@pytest.mark.timing
def test_watch_is_woken_by_a_submit(nodes: Nodes) -> None:
    # A long safety poll: only the push path (NOTIFY; SQLite's data_version) explains a
    # prompt offer.
    a = nodes.node("a", poll_interval=60)
    offers = nodes.watch(a)
    nodes.client.submit_task(Task("warm-up"))
    next_offer(offers, "warm-up", 10)
    started = time.monotonic()
    nodes.client.submit_task(Task("pushed", {"n": 7}))
    task = next_offer(offers, "pushed", 10)
    latency = time.monotonic() - started
    assert task.props == {"n": 7} and task.token == 0
    assert latency < 60 / 10, f"submit reached the watch after {latency:.3f}s"  # not the 60 s poll
    # A release wakes it too.
    claimed = a.claim(task)
    assert claimed is not None
    a.release(claimed)
    assert next_offer(offers, "pushed", 10).id == "pushed"


_SILENT_ROW = (  # pending, with a fresh ready value, and no NOTIFY
    "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, created_at,"
    " updated_at) VALUES (:ns, :id, '{}', 'pending', 0, nextval('metafora_token_seq'),"
    " now(), now())"
)


def _watched_with_a_long_poll(stack: ExitStack, url: str) -> tuple[Nodes, queue.Queue[Task]]:
    """Node "a" watching with a minute's safety poll (only pushes and quick checks explain a
    prompt offer), its first offer seen."""
    nodes = Nodes(url)
    stack.enter_context(nodes.stack)
    offers = nodes.watch(nodes.node("a", poll_interval=60))
    nodes.client.submit_task(Task("warm-up"))
    next_offer(offers, "warm-up", 10)
    return nodes, offers


def test_a_stream_of_notifications_does_not_starve_the_ready_scan(postgres_url: str) -> None:
    # A notified round offers the notified tasks and puts the rest of its quick check off a
    # little (so it does not slow the claim down): under a steady stream of notifications
    # that check must still run, or a pending row nobody notified would wait for the full
    # scan (poll_interval 60 here: a minute).
    with ExitStack() as stack:
        nodes, offers = _watched_with_a_long_poll(stack, postgres_url)
        stop = threading.Event()

        def stream() -> None:
            for i in range(20_000):
                if stop.is_set():
                    return
                nodes.client.submit_task(Task(f"noise-{i}"))

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        stack.callback(streamer.join, 30)
        stack.callback(stop.set)
        wait_for(lambda: offers.qsize() > 5, 10, "notified offers to flow")
        ns = parse_store_url(postgres_url).query.get("namespace", "metafora")
        nodes.raw(_SILENT_ROW, ns=ns, id="silent")
        assert next_offer(offers, "silent", 20).id == "silent"
        assert streamer.is_alive(), "the stream ended before the silent row was offered"


def test_a_ready_value_committed_behind_later_ones_is_still_offered(postgres_url: str) -> None:
    # PostgreSQL hands out ready values in one order and commits in another: a row that took
    # its value first but commits after the ready scan read a later row is behind the scan's
    # position. It is offered when the stretch settles, not after the full scan (a minute).
    with ExitStack() as stack:
        nodes, offers = _watched_with_a_long_poll(stack, postgres_url)
        ns = parse_store_url(postgres_url).query.get("namespace", "metafora")
        db = Database(parse_config(parse_store_url(postgres_url), {}))
        stack.callback(db.close)
        with db.transaction() as conn:
            conn.execute(text(_SILENT_ROW), {"ns": ns, "id": "late"})  # its value comes first
            nodes.raw(_SILENT_ROW, ns=ns, id="early")  # a higher value, committed first
            nodes.client.submit_task(Task("wake-up"))  # a quick check runs...
            next_offer(offers, "early", 10)  # ...and its ready scan passes the late value
        assert next_offer(offers, "late", 20).id == "late"


def test_watch_offers_in_bounded_batches_and_returns_on_close(nodes: Nodes) -> None:
    a = nodes.node("a")
    ids = [f"b{i:04d}" for i in range(1100)]  # more than two batches
    for task_id in ids:
        nodes.client.submit_task(Task(task_id))
    offered: list[str] = []
    done = threading.Event()

    def sink(task: Task) -> None:
        offered.append(task.id)
        if len(set(offered)) >= len(ids):
            done.set()

    thread = threading.Thread(target=a.watch, args=(sink,), daemon=True)
    thread.start()
    assert done.wait(30), f"only {len(set(offered))} of {len(ids)} offered"
    first = offered[: len(ids)]
    start = ids.index(first[0])  # the initial offer is in id order, from a random place on
    assert first == ids[start:] + ids[:start]
    a.close()
    thread.join(10)
    assert not thread.is_alive()


def test_commands_are_fifo_and_malformed_ones_are_dropped(
    nodes: Nodes, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    ns = parse_store_url(nodes.url).query.get("namespace", "metafora")
    nodes.client.submit_command("a", commands.freeze())
    for body in ("{not json", '{"command": "explode", "parameters": {}}'):
        nodes.raw(
            "INSERT INTO metafora_commands (namespace, node_id, body, created_at)"
            " VALUES (:ns, 'a', :body, '2030-01-01 00:00:00.000')",
            ns=ns, body=body,
        )
    nodes.client.submit_command("a", commands.stop_task("t1"))
    nodes.client.submit_command("b", commands.balance())
    with caplog.at_level(logging.WARNING, logger="metafora.coordinators.sql"):
        got = [a.command(timeout=5), a.command(timeout=5)]
    assert got == [commands.freeze(), commands.stop_task("t1")]
    assert sum("malformed command" in r.getMessage() for r in caplog.records) == 2
    assert a.command(timeout=0.05) is None
    assert b.command(timeout=5) == commands.balance()
    left = nodes.raw("SELECT count(*) FROM metafora_commands WHERE namespace = :ns", ns=ns)
    assert left[0][0] == 0  # each command is deleted when taken


def test_command_waits_for_a_late_arrival(nodes: Nodes) -> None:
    a = nodes.node("a", poll_interval=60)
    got: list[object] = []
    arrived = threading.Event()

    def reader() -> None:
        got.append(a.command(timeout=20))
        arrived.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    nodes.client.submit_command("a", commands.balance())
    assert arrived.wait(10)
    assert got == [commands.balance()]
    thread.join(5)


def test_close_returns_command_and_watch_and_releases_claims(nodes: Nodes) -> None:
    a = nodes.node("a")
    nodes.client.submit_task(Task("t"))
    assert a.claim(Task("t")) is not None
    waiting = threading.Event()
    results: list[object] = []

    def blocked_command() -> None:
        waiting.set()
        results.append(a.command(timeout=None))

    thread = threading.Thread(target=blocked_command, daemon=True)
    thread.start()
    assert waiting.wait(5)
    a.close()
    thread.join(10)
    assert results == [None]
    info = nodes.client.get_task("t")
    assert (info.state, info.owner) == (TaskState.PENDING, None)
    assert nodes.client.nodes() == []


def test_live_node_id_is_refused_and_a_closed_one_comes_back(nodes: Nodes) -> None:
    nodes.node("a")
    with pytest.raises(NodeExists):
        nodes.node("a")
    assert nodes.client.nodes() == ["a"]


def test_schema_is_created_once_and_versioned(nodes: Nodes) -> None:
    from metafora.coordinators.sql import SCHEMA_VERSION

    nodes.client.tasks()  # first use creates it
    rows = nodes.raw("SELECT version, description FROM metafora_schema ORDER BY version")
    # Row 0 is the store's id row (issue 52: how conn= is checked to be on this database).
    assert [r[0] for r in rows] == [0, *range(1, SCHEMA_VERSION + 1)]
    assert str(rows[0][1]).startswith("id ")
    # Many handles racing to create it on a fresh store: one migration, no errors.
    again = [open_client(nodes.url) for _ in range(4)]
    errors: list[BaseException] = []

    def use(client: Client) -> None:
        try:
            client.tasks()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=use, args=(c,)) for c in again]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in again:
        c.close()
    assert errors == []
    assert len(nodes.raw("SELECT version FROM metafora_schema")) == SCHEMA_VERSION + 1  # + the id row


def test_client_listing_and_purge(nodes: Nodes) -> None:
    a = nodes.node("a")
    for name in ("d", "f", "p", "x"):
        nodes.client.submit_task(Task(name, {"name": name}))
    d, f = a.claim(Task("d")), a.claim(Task("f"))
    assert d is not None and f is not None
    a.done(d)
    a.fail(f, RuntimeError("boom"))
    assert a.claim(Task("x")) is not None
    by_state = {s.value: [i.id for i in nodes.client.tasks(s)] for s in TaskState}
    assert by_state == {"pending": ["p"], "claimed": ["x"], "done": ["d"], "failed": ["f"],
                        "expired": []}
    info = nodes.client.get_task("f")
    assert info.error == "RuntimeError: boom" and info.finished_at is not None
    assert info.attempts == 1 and info.created_at is not None
    assert nodes.client.node_task_count() == {"a": 1}
    assert nodes.client.purge() == 2
    assert [i.id for i in nodes.client.tasks()] == ["p", "x"]
    assert isinstance(nodes.client, SQLClient)


def test_expired_tasks_are_swept_and_can_be_retried(nodes: Nodes) -> None:
    from datetime import UTC, datetime, timedelta

    a = nodes.node("a")
    # An expires_at already past is refused at submit: expire it soon instead.
    soon = datetime.now(UTC) + timedelta(seconds=0.5)
    nodes.client.submit_task(Task("old", {"expires_at": soon.isoformat()}))
    nodes.client.submit_task(Task("fresh"))
    wait_for(lambda: nodes.client.get_task("old").state is TaskState.EXPIRED, 10,
             "old shows expired before any sweep")
    assert [i.id for i in nodes.client.tasks("expired")] == ["old"]
    assert [i.id for i in nodes.client.tasks("pending")] == ["fresh"]
    offers = nodes.watch(a)
    assert next_offer(offers, "fresh", 10).id == "fresh"
    ns = parse_store_url(nodes.url).query.get("namespace", "metafora")
    stored = nodes.raw("SELECT state FROM metafora_tasks WHERE namespace = :ns AND id = 'old'",
                       ns=ns)
    assert stored[0][0] == "expired"  # the watch moved it
    assert a.claim(Task("old")) is None
    nodes.client.retry_task("old")
    info = nodes.client.get_task("old")
    assert info.state is TaskState.EXPIRED  # still past its expires_at: expires again


def test_a_task_with_corrupt_stored_props_does_not_stop_the_watch(
    nodes: Nodes, caplog: pytest.LogCaptureFixture
) -> None:
    a = nodes.node("a")
    ns = parse_store_url(nodes.url).query.get("namespace", "metafora")
    nodes.raw(
        "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, created_at,"
        " updated_at) VALUES (:ns, 'broken', '{not json', 'pending', 0, 0,"
        " '2030-01-01 00:00:00.000', '2030-01-01 00:00:00.000')"
        if nodes.url.startswith("sqlite") else
        "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, created_at,"
        " updated_at) VALUES (:ns, 'broken', '{not json', 'pending', 0, 0, now(), now())",
        ns=ns,
    )
    nodes.client.submit_task(Task("good"))
    with caplog.at_level(logging.WARNING, logger="metafora.coordinators.sql"):
        offers = nodes.watch(a)
        assert next_offer(offers, "good", 10).id == "good"
        # The scan offers from a random place: the broken row may come after the good one.
        wait_for(lambda: any("broken" in r.getMessage() for r in caplog.records), 10,
                 "the broken row to be logged")
    # It can never run: failed with the reason (retryable once fixed), not pending forever.
    failed = wait_for(lambda: nodes.client.tasks("failed"), 10, "the broken task to be failed")
    assert [i.id for i in failed] == ["broken"] and failed[0].props == {}
    assert failed[0].error is not None and "invalid" in failed[0].error
    assert a.claim(Task("broken")) is None


def test_a_claim_the_node_does_not_track_is_released_by_its_heartbeat(nodes: Nodes) -> None:
    a = nodes.node("a", lease_ttl=3)
    nodes.client.submit_task(Task("mine"))
    nodes.client.submit_task(Task("stray"))
    assert a.claim(Task("mine")) is not None
    # As if a claim's reply was lost: the store says 'a' holds 'stray', 'a' does not know.
    ns = parse_store_url(nodes.url).query.get("namespace", "metafora")
    nodes.raw("UPDATE metafora_tasks SET state = 'claimed', owner = 'a', token = 999999"
              " WHERE namespace = :ns AND id = 'stray'", ns=ns)
    wait_for(lambda: nodes.client.get_task("stray").state is TaskState.PENDING, 10,
             "the untracked claim to be released")
    assert [t.id for t in a._held()] == ["mine"]
    assert nodes.client.get_task("mine").owner == "a"
    assert nodes.ctx["a"].lost_tasks == []


def test_claim_many_is_one_statement_in_offered_order_with_distinct_tokens(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    for i in range(6):
        nodes.client.submit_task(Task(f"m{i}", {"i": i}))
    taken = b.claim(Task("m2"))
    assert taken is not None
    offered = [Task(f"m{i}") for i in (5, 2, 0, 4, 3, 1)] + [Task("absent")]
    got = a.claim_many(offered, 3)
    assert [t.id for t in got] == ["m5", "m0", "m4"]  # m2 is b's; order as offered; limit 3
    assert [t.props["i"] for t in got] == [5, 0, 4]
    tokens = [t.token for t in got] + [taken.token]
    assert len(set(tokens)) == len(tokens)  # each claim its own token, on SQLite too
    assert all(nodes.client.get_task(t.id).token == t.token for t in got)
    assert a.seen_taken(Task("m5")) and not a.seen_taken(Task("m3"))
    again = a.claim_many(offered, 10)  # held ones are skipped without a round trip
    assert [t.id for t in again] == ["m3", "m1"]
    assert nodes.client.node_task_count() == {"a": 5, "b": 1}
    for task in got + again:
        a.done(task)


def test_node_infos_frozen_and_renewal_hook(nodes: Nodes) -> None:
    renewals: list[float] = []

    class Ctx(TimedContext):
        def renewed(self, seconds: float) -> None:
            renewals.append(seconds)

    a = open_coordinator(nodes.url, node_id="a", lease_ttl=1)
    assert isinstance(a, SQLCoordinator)
    nodes.stack.callback(a.close)
    a.init(Ctx())
    nodes.client.submit_task(Task("t"))
    assert a.claim(Task("t")) is not None
    infos = nodes.client.node_infos()
    assert [(i.id, i.tasks, i.frozen) for i in infos] == [("a", 1, None)]
    assert infos[0].pid == os.getpid() and infos[0].host and infos[0].started is not None
    a.report_frozen(True)
    assert nodes.client.node_infos()[0].frozen is True
    first_beat = nodes.client.node_infos()[0].heartbeat
    wait_for(lambda: len(renewals) >= 2, 10, "two renewals")
    assert all(0 <= s < 1 for s in renewals)
    later = nodes.client.node_infos()[0]
    assert later.heartbeat is not None and first_beat is not None and later.heartbeat > first_beat
    a.report_frozen(False)
    assert nodes.client.node_infos()[0].frozen is False


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store with no metafora tables at all (PostgreSQL: a database of its own)."""
    if request.param == "sqlite":
        yield str(request.getfixturevalue("sqlite_url"))
        return
    import uuid

    import psycopg

    server = str(request.getfixturevalue("postgres_server_url"))
    libpq = server.replace("postgresql+psycopg://", "postgresql://").split("?", 1)[0]
    name = f"metafora_up_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield libpq.rsplit("/", 1)[0] + f"/{name}?namespace=up"
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_schema_upgrades_from_version_one(empty_store_url: str) -> None:
    from metafora.coordinators.sql.schema import MIGRATIONS, SCHEMA_VERSION, current_version

    sql_url = empty_store_url

    db = Database(parse_config(parse_store_url(sql_url), {}))
    ns = db.config.namespace
    try:
        with db.transaction() as conn:  # a store created by the first release
            db.dialect.lock_schema(conn)
            conn.execute(text(
                "CREATE TABLE metafora_schema (version INTEGER PRIMARY KEY,"
                " description TEXT NOT NULL, applied_at {ts} NOT NULL)".format(**db.dialect.ddl_types())))
            MIGRATIONS[0][1](conn, db.dialect)
            conn.execute(text("INSERT INTO metafora_schema VALUES (1, 'v1', '2030-01-01')"
                              if db.config.kind == "sqlite" else
                              "INSERT INTO metafora_schema VALUES (1, 'v1', now())"))
            conn.execute(text(
                "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, created_at,"
                " updated_at) VALUES (:ns, 'old', '{\"k\": 1}', 'pending', 0, 0,"
                " '2030-01-01 00:00:00.000', '2030-01-01 00:00:00.000')"), {"ns": ns})
        with db.read() as conn:
            assert current_version(conn) == 1
    finally:
        db.close()
    with open_client(sql_url) as client:
        old = client.get_task("old")
        assert old.props == {"k": 1}  # data kept
        assert (old.priority, dict(old.selector)) == (0, {})  # v4 defaults for an old row
        coord = open_coordinator(sql_url, node_id="n")
        coord.init(RecordingContext(labels={"zone": "eu"}))
        coord.report_frozen(True)
        assert client.node_infos()[0].frozen is True  # the v2 column is there
        assert dict(client.node_infos()[0].labels) == {"zone": "eu"}  # and v4's
        got = coord.claim(Task("old"))
        assert got is not None and got.props == {"k": 1}
        coord.close()
    db = Database(parse_config(parse_store_url(sql_url), {}))
    try:
        with db.read() as conn:
            assert current_version(conn) == SCHEMA_VERSION >= 2
    finally:
        db.close()
