"""The gates' item store on real SQLite and PostgreSQL: adding (own and caller's
transaction), refusals, the fenced partition lease (zombie writes refused, in both fencing
modes), gate jumps, operator moves and retries, schema versioning, wake-ups."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from metafora import Task, gates, open_client, open_coordinator
from metafora.contracts.coordinator import Coordinator
from metafora.core.errors import ClaimLost, ConfigError, StoreError
from metafora.gates import (
    GateMoveRefused,
    Item,
    ItemBelowGate,
    ItemResult,
    ItemStatus,
    ItemStore,
    NewItem,
    PartitionClosed,
    PartitionStatus,
)
from metafora.testing import RecordingContext
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def items(sql_url: str) -> Iterator[ItemStore]:
    store = ItemStore(sql_url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def coords(sql_url: str) -> Iterator[dict[str, Coordinator]]:
    opened: dict[str, Coordinator] = {}
    try:
        yield opened
    finally:
        for coord in opened.values():
            coord.close()


def _node(url: str, coords: dict[str, Coordinator], node_id: str, **options: object) -> Coordinator:
    coord = open_coordinator(url, node_id=node_id, **options)
    coord.init(RecordingContext())
    coords[node_id] = coord
    return coord


def _sa_url(url: str) -> str:
    """A SQLAlchemy URL for the caller's own engine (the test plays a user's application)."""
    base = url.split("?", 1)[0]
    if base.startswith("postgresql://"):
        return "postgresql+psycopg://" + base[len("postgresql://"):]
    return base


def _done(item_id: int, gate: int, data: bytes | None = None) -> ItemResult:
    return ItemResult(item_id, ItemStatus.COMPLETE, gate, 1, data=data)


# -- adding and reading ------------------------------------------------------------------


def test_add_lists_in_order_with_counts_and_refuses_below_the_gate(items: ItemStore) -> None:
    ids = items.add("p1", [NewItem(0, b"a"), NewItem(0, "b"), NewItem(2, b"\xff\x00")])
    assert ids == sorted(ids) and len(set(ids)) == 3
    listed = items.list("p1")
    assert [(i.id, i.gate, i.status, i.data) for i in listed] == [
        (ids[0], 0, ItemStatus.AVAILABLE, b"a"), (ids[1], 0, ItemStatus.AVAILABLE, b"b"),
        (ids[2], 2, ItemStatus.AVAILABLE, b"\xff\x00")]
    assert [i.id for i in items.list("p1", gate=2)] == [ids[2]]
    assert items.list("p1", status="complete") == []
    assert [i.id for i in items.list("p1", limit=1, after=ids[0])] == [ids[1]]
    assert items.get("p1", ids[1]).text == "b"
    info = items.info("p1")
    assert (info.gate, info.status, info.total(), info.total("available")) == (0, PartitionStatus.OPEN, 3, 3)
    assert items.list("nobody") == [] and not items.info("nobody").exists
    with pytest.raises(gates.ItemNotFound):
        items.get("p1", 10**9)

    items.set_gate("p1", 0)
    items.add("p2", [NewItem(3, b"x")])
    items.set_gate("p2", 3)
    with pytest.raises(ItemBelowGate, match="current gate is 3"):
        items.add("p2", [NewItem(3, b"ok"), NewItem(1, b"stranded")])
    assert [i.data for i in items.list("p2")] == [b"x"]  # nothing of the refused batch


def test_add_inside_the_callers_transaction(items: ItemStore, sql_url: str) -> None:
    engine = create_engine(_sa_url(sql_url))
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS app_jobs (id TEXT PRIMARY KEY)"))
        job = f"job-{uuid.uuid4().hex[:6]}"
        with engine.begin() as conn:  # business data and its items commit together
            conn.execute(text("INSERT INTO app_jobs (id) VALUES (:id)"), {"id": job})
            ids = items.add(job, [NewItem(0, b"r1"), NewItem(1, b"rank")], conn=conn)
        assert [i.id for i in items.list(job)] == ids
        with pytest.raises(RuntimeError), engine.begin() as conn:  # ... or roll back together
            items.add(job, [NewItem(0, b"lost")], conn=conn)
            raise RuntimeError("the application failed after adding")
        assert len(items.list(job)) == 2
    finally:
        engine.dispose()


def test_values_are_validated_before_the_store_is_touched() -> None:
    with pytest.raises(gates.GateError):
        NewItem(-1, b"x")
    with pytest.raises(gates.GateError):
        NewItem(0, 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="items live in SQL"):
        ItemStore("etcd://127.0.0.1:2379/ns")
    with pytest.raises(ConfigError):
        ItemStore("sqlite:///x.db?bogus=1")


def test_a_newer_schema_is_refused(items: ItemStore, sql_url: str) -> None:
    items.info("p")  # creates the tables
    with items.transaction() as conn:
        conn.execute(text("INSERT INTO metafora_gates_schema (version, description, applied_at)"
                          " VALUES (99, 'from the future', '2030-01-01')"))
    fresh = ItemStore(sql_url)
    try:
        with pytest.raises(StoreError, match="newer than this metafora"):
            fresh.info("p")
    finally:
        with items.transaction() as conn:
            conn.execute(text("DELETE FROM metafora_gates_schema WHERE version = 99"))
        fresh.close()


# -- the fenced lease -----------------------------------------------------------------------


def test_gate_jumps_to_the_lowest_gate_with_work_and_completes(items: ItemStore) -> None:
    items.add("p", [NewItem(0, b"a"), NewItem(5, b"b"), NewItem(9, b"c")])
    lease = items.lease(Task("p", token=7))
    assert lease.take_over() == (0, PartitionStatus.OPEN)
    batch = lease.take(0, 10)
    assert [i.data for i in batch] == [b"a"]
    assert lease.finish(0, [_done(batch[0].id, 0, b"A")]) == 1
    assert lease.advance(0, move=True, close=True) == gates.Advance("moved", 5)  # not 1, 2, 3, 4
    (b,) = lease.take(5, 10)
    lease.finish(5, [ItemResult(b.id, ItemStatus.AVAILABLE, 9, 1, data=b"B",
                             spawn=(NewItem(7, b"spawned"),))])
    assert lease.advance(5, move=True, close=True) == gates.Advance("moved", 7)
    assert lease.advance(7, move=False, close=True) == gates.Advance("work", 7)
    (s,) = lease.take(7, 10)
    lease.finish(7, [_done(s.id, 7)])
    assert lease.advance(7, move=False, close=True) == gates.Advance("waiting", 7)
    assert lease.advance(7, move=True, close=True) == gates.Advance("moved", 9)
    rest = lease.take(9, 10)
    assert sorted(i.data for i in rest) == [b"B", b"c"]
    lease.finish(9, [_done(i.id, 9) for i in rest])
    assert lease.advance(9, move=True, close=False) == gates.Advance("idle", 9)
    assert lease.advance(9, move=True, close=True) == gates.Advance("completed", 9)
    info = items.info("p")
    assert info.status is PartitionStatus.COMPLETED and info.total("complete") == info.total() == 4
    assert items.get("p", batch[0].id).data == b"A"
    with pytest.raises(PartitionClosed):
        items.add("p", [NewItem(9, b"late")])


def test_finishing_twice_writes_nothing_twice(items: ItemStore) -> None:
    """A retry of ``finish`` after a commit whose answer was lost must not spawn again."""
    (parent,) = items.add("p", [NewItem(0, b"parent")])
    lease = items.lease(Task("p", token=1))
    lease.take_over()
    result = [ItemResult(parent, ItemStatus.COMPLETE, 0, 1, spawn=(NewItem(1, b"a"), NewItem(2, b"b")))]
    assert lease.finish(0, result) == 1
    assert lease.finish(0, result) == 0
    assert sorted(i.data for i in items.list("p")) == [b"a", b"b", b"parent"]


def test_a_stale_token_is_shut_out_by_a_newer_claim(items: ItemStore) -> None:
    """Token fencing (items apart from the coordinator, e.g. etcd): the partition row keeps
    the highest token that opened it; every write of an older one is refused."""
    ids = items.add("p", [NewItem(0, f"i{n}") for n in range(4)])
    zombie = items.lease(Task("p", token=3))
    zombie.take_over()
    taken = zombie.take(0, 2)
    owner = items.lease(Task("p", token=4))
    owner.take_over()
    with pytest.raises(ClaimLost):
        zombie.finish(0, [_done(i.id, 0, b"zombie") for i in taken])
    with pytest.raises(ClaimLost):
        zombie.take(0, 10)
    with pytest.raises(ClaimLost):  # its fence comes last: the results before it roll back
        zombie.take(0, 10, [_done(i.id, 0, b"zombie") for i in taken])
    with pytest.raises(ClaimLost):
        zombie.advance(0, move=True, close=True)
    with pytest.raises(ClaimLost):
        zombie.reopen_failed(0)
    with pytest.raises(ClaimLost):
        zombie.take_over()  # an older token can never take the partition back
    assert all(i.status is ItemStatus.AVAILABLE and i.data.startswith(b"i") for i in items.list("p"))
    assert owner.finish(0, [_done(ids[0], 0)]) == 1
    assert items.get("p", ids[0]).token == 4


def test_a_zombie_owner_cannot_write_items_after_its_claim_moved(
        sql_url: str, items: ItemStore, coords: dict[str, Coordinator]) -> None:
    """Same database as the SQL coordinator: writes are fenced by the coordinator's claim."""
    a, b = _node(sql_url, coords, "a"), _node(sql_url, coords, "b")
    with open_client(sql_url) as client:
        client.submit_task(Task("p"))
    items.add("p", [NewItem(0, f"i{n}") for n in range(3)] + [NewItem(1, b"next")])
    old = a.claim(Task("p"))
    assert old is not None
    zombie = items.lease(old, "a", claim_fence=True)
    zombie.take_over()
    first = zombie.take(0, 10)
    a.release(old)  # ... or its lease expired: the claim moves on
    new = b.claim(Task("p"))
    assert new is not None and new.token > old.token
    # Even before the new owner touches the items, the old claim's writes are refused.
    with pytest.raises(ClaimLost):
        zombie.finish(0, [_done(i.id, 0, b"zombie") for i in first])
    with pytest.raises(ClaimLost):
        zombie.advance(0, move=True, close=True)
    with pytest.raises(ClaimLost):
        zombie.state()
    owner = items.lease(new, "b", claim_fence=True)
    assert owner.take_over() == (0, PartitionStatus.OPEN)
    # The zombie took the items and wrote nothing: they are orphans, taken one at a time.
    for _ in range(3):
        (orphan,) = owner.take(0, 10)
        assert owner.finish(0, [_done(orphan.id, 0)]) == 1
    assert owner.take(0, 10) == []
    assert owner.advance(0, move=True, close=True).kind == "moved"
    done = items.list("p", status="complete")
    assert [(i.data, i.attempts) for i in done] == [(b"i0", 2), (b"i1", 2), (b"i2", 2)]


def test_a_claim_whose_lease_expired_is_refused_before_anyone_reclaims(
        sql_url: str, items: ItemStore, coords: dict[str, Coordinator]) -> None:
    a = _node(sql_url, coords, "a", lease_ttl=1)
    with open_client(sql_url) as client:
        client.submit_task(Task("p"))
    items.add("p", [NewItem(0, b"x")])
    claimed = a.claim(Task("p"))
    assert claimed is not None
    lease = items.lease(claimed, "a", claim_fence=True)
    lease.take_over()
    (item,) = lease.take(0, 1)
    a._pause_heartbeat()  # type: ignore[attr-defined]  # a stalled node: its lease runs out

    def refused() -> bool:
        try:
            lease.state()
        except ClaimLost:
            return True
        return False

    wait_until(refused, 60, "the expired lease to fence the claim")
    with pytest.raises(ClaimLost):
        lease.finish(0, [_done(item.id, 0)])
    assert items.get("p", item.id).status is ItemStatus.AVAILABLE


# -- attempts recorded when taken; orphans and poison items ---------------------------------


def _taken(items: ItemStore, partition: str) -> dict[int, tuple[int, int]]:
    """``{item id: (taken, deaths)}`` as stored (columns the Item value does not carry)."""
    with items.read() as conn:
        rows = conn.execute(text("SELECT id, taken, deaths FROM metafora_items WHERE partition_id = :p"),
                            {"p": partition}).fetchall()
    return {int(r[0]): (int(r[1]), int(r[2])) for r in rows}


def test_a_batch_is_recorded_when_taken_and_a_dead_claims_items_count_an_attempt(
        items: ItemStore) -> None:
    ids = items.add("p", [NewItem(0, f"i{n}") for n in range(5)])
    lease = items.lease(Task("p", token=1))
    lease.take_over()
    assert [i.id for i in lease.take(0, 3)] == ids[:3]
    # The next take writes the results of the last batch in the same transaction.
    assert [i.id for i in lease.take(0, 3, [_done(i, 0) for i in ids[:3]])] == ids[3:]
    assert [items.get("p", i).status for i in ids[:3]] == [ItemStatus.COMPLETE] * 3
    assert [items.get("p", i).attempts for i in ids] == [1, 1, 1, 0, 0]
    # ... and the claim dies with ids[3] and ids[4] taken: the next claim counts their attempt.
    owner = items.lease(Task("p", token=2))
    owner.take_over()
    assert [items.get("p", i).attempts for i in ids] == [1, 1, 1, 1, 1]
    assert [_taken(items, "p")[i] for i in ids] == [(0, 0)] * 3 + [(1, 0)] * 2
    (orphan,) = owner.take(0, 10)  # orphans: one at a time
    assert (orphan.id, orphan.attempts) == (ids[3], 1)
    assert _taken(items, "p")[ids[3]] == (2, 1)


def test_a_clean_release_leaves_no_orphans(items: ItemStore) -> None:
    ids = items.add("p", [NewItem(0, f"i{n}") for n in range(4)])
    lease = items.lease(Task("p", token=1))
    lease.take_over()
    assert len(lease.take(0, 4)) == 4
    assert lease.finish(0, [_done(ids[0], 0)], release=True) == 1  # stopped after one item
    owner = items.lease(Task("p", token=2))
    owner.take_over()
    assert [i.id for i in owner.take(0, 10)] == ids[1:]  # one batch: not orphans
    assert [items.get("p", i).attempts for i in ids] == [1, 0, 0, 0]
    # ... this owner dies; the next takes an orphan on its own, and stops before starting it.
    third = items.lease(Task("p", token=3))
    third.take_over()
    (orphan,) = third.take(0, 10)
    assert _taken(items, "p")[orphan.id] == (2, 1)
    assert third.finish(0, [], release=True) == 0
    assert _taken(items, "p")[orphan.id] == (1, 0)  # an orphan again, this claim not counted
    assert [items.get("p", i).attempts for i in ids] == [1, 1, 1, 1]


def test_a_dead_claims_items_are_taken_one_at_a_time_and_a_poison_item_fails(items: ItemStore) -> None:
    ids = items.add("p", [NewItem(0, f"i{n}") for n in range(3)])
    poison = ids[1]
    dead = items.lease(Task("p", token=1))
    dead.take_over()
    assert len(dead.take(0, 10)) == 3  # ... and the process dies while processing ids[1]
    token = 1
    for claim in range(2, 5):  # each claim: the orphans, one at a time, until the poison kills it
        token = claim
        owner = items.lease(Task("p", token=token))
        owner.take_over()
        results: list[ItemResult] = []
        while True:
            taken = owner.take(0, 10, results, max_deaths=3)
            if [i.status for i in taken] == [ItemStatus.FAILED]:
                break
            (item,) = taken  # on its own
            if item.id == poison:
                break  # the process dies again
            results = [_done(item.id, 0)]
        if taken[0].status is ItemStatus.FAILED:
            break
        assert _taken(items, "p")[poison] == (2, claim - 1)
    # Died with its claim 3 times in a row (a batch, then twice on its own): failed for good.
    assert token == 4 and taken[0].id == poison
    failed = items.get("p", poison)
    assert (failed.status, failed.permanent, failed.attempts) == (ItemStatus.FAILED, True, 3)
    assert failed.error is not None and "process died while processing" in failed.error
    assert [items.get("p", i).status for i in (ids[0], ids[2])] == [ItemStatus.COMPLETE] * 2
    assert [items.get("p", i).attempts for i in (ids[0], ids[2])] == [2, 2]
    # The operator's retry starts the count over.
    assert items.retry("p") == 1
    assert _taken(items, "p")[poison] == (0, 0)


# -- operators ------------------------------------------------------------------------------


def test_set_gate_refuses_to_strand_items_unless_forced(items: ItemStore) -> None:
    items.add("p", [NewItem(0, b"a"), NewItem(2, b"b")])
    with pytest.raises(GateMoveRefused, match="1 item"):
        items.set_gate("p", 1)
    assert items.set_gate("p", 2, force=True) == 0
    assert items.info("p").gate == 2
    with pytest.raises(gates.GateError):
        items.set_gate("p", -3)


def test_retry_makes_failed_items_available_again(items: ItemStore) -> None:
    ids = items.add("p", [NewItem(0, b"a"), NewItem(0, b"b")])
    lease = items.lease(Task("p", token=1))
    lease.take_over()
    lease.finish(0, [ItemResult(ids[0], ItemStatus.FAILED, 0, 3, error="boom", permanent=True),
                     ItemResult(ids[1], ItemStatus.FAILED, 0, 3, error="flaky")])
    assert items.failures("p") == (2, 1)
    assert lease.reopen_failed(0) == 1  # the owner's retry: retryable ones only
    assert items.get("p", ids[1]).status is ItemStatus.AVAILABLE
    assert items.retry("p") == 1  # the operator's: everything failed
    item = items.get("p", ids[0])
    assert (item.status, item.error, item.permanent, item.attempts) == (ItemStatus.AVAILABLE, None, False, 3)


def _add_from_another_process(url: str, partition: str) -> None:
    with ItemStore(url) as store:
        store.add(partition, [NewItem(0, b"from afar")])


def test_additions_wake_a_waiting_owner(sql_url: str, items: ItemStore) -> None:
    """An owner waiting for items is woken when they are added, retried or its gate moved:
    by any store object of this process at once, and on PostgreSQL by other processes too
    (NOTIFY; SQLite has no push and its owners poll)."""
    woke = threading.Event()
    unsubscribe = items.subscribe("p", woke)
    assert items.wait_listening(10)
    other = ItemStore(sql_url)
    try:
        if sql_url.startswith("sqlite"):  # no NOTIFY echo: nothing else can set the event
            other.add("elsewhere", [NewItem(0, b"x")])
            other.retry("p")  # nothing failed: no news
            assert not woke.is_set()
        other.add("p", [NewItem(0, b"x")])
        assert woke.wait(10)
        woke.clear()
        other.set_gate("p", 0)
        assert woke.wait(10)
        if sql_url.startswith("postgresql"):
            # Nothing in this process touches "q": only the child's NOTIFY can wake it.
            from_afar = threading.Event()
            unsubscribe_q = items.subscribe("q", from_afar)
            proc = SPAWN.Process(target=_add_from_another_process, args=(sql_url, "q"), daemon=True)
            proc.start()
            try:
                assert from_afar.wait(60), "no NOTIFY from the other process"
                proc.join(60)
                assert proc.exitcode == 0
            finally:
                unsubscribe_q()
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join(10)
    finally:
        unsubscribe()
        other.close()


def _lock_waits(url: str) -> int:
    """Backends of the test database waiting for a row lock."""
    engine = create_engine(_sa_url(url))
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'")).scalar_one())
    finally:
        engine.dispose()


def test_deleting_a_partition_while_its_owner_writes_results_cannot_deadlock(postgres_url: str) -> None:
    """One lock order (items, then the partition row) for the owner and for delete: a delete
    that meets an owner half-way through writing results waits for it, and both finish."""
    with ItemStore(postgres_url) as store:
        ids = store.add("p", [NewItem(0, f"i{n}") for n in range(6)])
        lease = store.lease(Task("p", token=1))
        lease.take_over()
        first = lease.take(0, 3)
        wrote, go_on = threading.Event(), threading.Event()
        real_write = lease._write

        def write_then_pause(tx: object, gate: int, outcomes: object) -> int:
            written = real_write(tx, gate, outcomes)  # type: ignore[arg-type]
            wrote.set()  # its item rows are locked now; the partition row comes last
            assert go_on.wait(30)
            return written

        lease._write = write_then_pause  # type: ignore[method-assign]
        taken: list[list[Item]] = []
        owner = threading.Thread(target=lambda: taken.append(
            lease.take(0, 3, [_done(i.id, 0) for i in first])), daemon=True)
        owner.start()
        assert wrote.wait(30)
        deleted: list[int] = []
        deleter = threading.Thread(target=lambda: deleted.append(store.delete("p")), daemon=True)
        deleter.start()
        wait_until(lambda: _lock_waits(postgres_url) >= 1, 30, "the delete to wait for the owner")
        go_on.set()
        owner.join(30)
        deleter.join(30)
        assert not owner.is_alive() and not deleter.is_alive()
        assert [i.id for i in taken[0]] == ids[3:]  # the owner committed first ...
        assert deleted == [6] and store.list("p") == []  # ... then every item went


def test_delete_partitions_takes_the_named_ones_in_one_call(items: ItemStore) -> None:
    """What pruning calls when the tasks live elsewhere: items and gate records of the named
    partitions that have any (an absent one is no error), the others untouched."""
    for name in ("a", "b", "keep"):
        items.add(name, [NewItem(gate=0, data=b"x"), NewItem(gate=2, data=b"y")])
    assert items.delete_partitions(["a", "b", "never-had-items", "a"]) == 4
    assert items.list("a") == [] and items.list("b") == []
    assert not items.info("a").exists
    assert len(items.list("keep")) == 2
    assert items.delete_partitions([]) == 0
    # More partitions than one statement takes.
    many = [f"p{n:04d}" for n in range(1200)]
    for name in many[::100]:
        items.add(name, [NewItem(gate=0, data=b"z")])
    assert items.delete_partitions(many) == 12
    assert all(items.list(name) == [] for name in many[::100])
