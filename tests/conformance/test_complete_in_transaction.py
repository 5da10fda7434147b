"""Issue 50: completion inside the application's transaction (River's ``JobCompleteTx``).

``Client.complete_task(task, conn=...)`` on SQLite and PostgreSQL (a SQLAlchemy Connection or
Session, or a psycopg Connection) with a business row beside the task in the same
transaction: a commit makes both exist and wins over whatever the handler returns after it (the
handler is not run again); a rollback leaves neither, and the claim and its handler as they
were; a stale token raises ClaimLost and writes nothing. The state machine's
``cmds.checkpoint(cursor, conn=)`` and ``cmds.complete(conn=)`` likewise. etcd and memory: a
ConfigError.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from metafora import Task, open_async_client, open_client, open_coordinator, simple_handler
from metafora.contracts.coordinator import Finish, Outcome, coordinator_of
from metafora.core.errors import ClaimCompleted, ClaimLost, ConfigError
from metafora.statemachine import Message, State, get_state
from metafora.statemachine.store import state_store_for
from metafora.testing import LocalCluster, RecordingContext, wait_for
from tests.conformance.test_submit_in_transaction import KINDS, App, conninfo, sqlalchemy_url
from tests.helpers import start_stateful


@pytest.fixture(params=KINDS, ids=["-".join(k) for k in KINDS])
def app(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> Iterator[App]:
    store, kind = request.param
    made = App(metafora_store_url(store), kind)
    yield made
    made.close()


class Boom(Exception):
    pass


@pytest.mark.parametrize("ending", ["done", "release", "raise"])
def test_a_committed_completion_wins_over_what_the_handler_returns_after_it(app: App, ending: str) -> None:
    runs: list[int] = []
    seen: dict[str, Any] = {}
    with LocalCluster(app.url) as cluster:
        client = cluster.client

        def work(task: Task, stop: object) -> bool:
            runs.append(task.token)
            with app.txn() as (conn, add_order):
                add_order(task.id)
                client.complete_task(task, conn=conn)
                seen["in_txn"] = client.get_task(task.id).state.value  # not committed yet
            seen["after"] = client.get_task(task.id).state.value
            try:  # the node's own outcome for the token now writes nothing, and says why
                coordinator_of(task).fail(task, "too late")  # type: ignore[union-attr]
            except ClaimCompleted as exc:
                seen["late_fail"] = type(exc).__name__
            if ending == "raise":
                raise Boom("after the commit")
            return ending == "done"

        consumer = cluster.add(simple_handler(work), "runner")
        client.submit_task(Task("ship-1"))
        cluster.wait_for_state("ship-1", "done", 30)
        wait_for(lambda: consumer.stats.done == 1, 30, "the owner settled its outcome")
        assert consumer.stats.failed == 0 and consumer.stats.releases == 0
        assert consumer.stats.lost == 0
        assert seen == {"in_txn": "claimed", "after": "done", "late_fail": "ClaimCompleted"}
        info = client.get_task("ship-1")
        assert info.state.value == "done" and info.error is None and info.owner is None
        assert app.orders() == ["ship-1"]
        assert len(runs) == 1  # never run again


def test_a_rolled_back_completion_leaves_the_claim_and_its_handler_running(app: App) -> None:
    runs: list[int] = []
    seen: dict[str, Any] = {}
    with LocalCluster(app.url) as cluster:
        client = cluster.client

        def work(task: Task, stop: object) -> bool:
            runs.append(task.token)
            with pytest.raises(Boom), app.txn() as (conn, add_order):
                add_order(task.id)
                client.complete_task(task, conn=conn)
                raise Boom
            info = client.get_task(task.id)
            seen.update(state=info.state.value, token=info.token, owner=info.owner)
            return True  # the handler goes on and ends the task itself

        consumer = cluster.add(simple_handler(work), "runner")
        client.submit_task(Task("ship-2"))
        cluster.wait_for_state("ship-2", "done", 30)
        wait_for(lambda: consumer.stats.done == 1, 30, "the handler's own done")
        assert seen == {"state": "claimed", "token": runs[0], "owner": "runner"}
        assert app.orders() == []
        assert len(runs) == 1


def test_a_stale_token_raises_claim_lost_and_writes_nothing(app: App) -> None:
    seen: dict[str, Any] = {}
    claimed: list[Task] = []
    with LocalCluster(app.url) as cluster:
        client = cluster.client

        def work(task: Task, stop: object) -> bool:
            claimed.append(task)
            stale = Task(task.id, token=task.token + 1_000_000)
            try:
                with app.txn() as (conn, add_order):
                    add_order(task.id)
                    client.complete_task(stale, conn=conn)
            except ClaimLost as exc:
                seen["lost"] = str(exc)
            seen["state"] = client.get_task(task.id).state.value
            return True

        cluster.add(simple_handler(work), "runner")
        client.submit_task(Task("ship-3"))
        cluster.wait_for_state("ship-3", "done", 30)
        assert "ship-3" in seen["lost"] and seen["state"] == "claimed"
        # The claim is over (done by its handler): its token no longer completes anything.
        with pytest.raises(ClaimLost), app.txn() as (conn, add_order):
            add_order("late")
            client.complete_task(claimed[0], conn=conn)
        with pytest.raises(ClaimLost), app.txn() as (conn, _add):
            client.complete_task(Task("never-claimed"), conn=conn)  # token 0
        assert app.orders() == []


def test_stateful_checkpoint_and_complete_in_the_application_transaction(app: App) -> None:
    calls: list[str | None] = []

    def step(task: Task, cmds: Any) -> Message:
        calls.append(cmds.cursor)
        if len(calls) == 1:
            with app.txn() as (conn, add_order):
                add_order("a")
                cmds.checkpoint("1", conn=conn)
            with pytest.raises(Boom), app.txn() as (conn, add_order):
                add_order("b")
                cmds.checkpoint("2", conn=conn)
                raise Boom  # rolled back: the cursor stays at 1
            return Message.run()
        with app.txn() as (conn, add_order):
            add_order("c")
            cmds.complete(conn=conn)
        return Message.release()  # moot: the completion committed

    with LocalCluster(app.url) as cluster:
        consumer = start_stateful(cluster, step, "runner")
        cluster.client.submit_task(Task("flow"))
        cluster.wait_for_state("flow", "done", 30)
        wait_for(lambda: consumer.stats.done == 1, 30, "the owner settled its outcome")
        assert consumer.stats.releases == 0 and consumer.stats.failed == 0
        state = get_state(cluster.client, "flow")
        assert state is not None and state.code.value == "completed" and state.cursor == "1"
        assert calls == [None, "1"]
        assert app.orders() == ["a", "c"]


@pytest.mark.parametrize("store", ["memory", "etcd"])
def test_stores_without_shared_transactions_refuse_with_a_config_error(
        store: str, metafora_store_url: Callable[[str], str]) -> None:
    url = metafora_store_url(store)
    with LocalCluster(url) as cluster:
        with pytest.raises(ConfigError, match=r"complete_task.*SQL store"):
            cluster.client.complete_task(Task("t", token=1), conn=object())
        states = state_store_for(cluster.client)
        with pytest.raises(ConfigError, match=r"checkpoint\(cursor, conn=\.\.\.\) needs a SQL store"):
            states.store_in(Task("t", token=1), State(), object())


ASYNC_KINDS = [("sqlite", "connection"), ("postgresql", "session"), ("postgresql", "psycopg")]


@pytest.mark.parametrize(("store", "kind"), ASYNC_KINDS, ids=["-".join(k) for k in ASYNC_KINDS])
def test_the_async_client_completes_in_the_applications_async_transaction(
        store: str, kind: str, metafora_store_url: Callable[[str], str]) -> None:
    url = metafora_store_url(store)
    app = App(url, "connection")  # the table, and reading it back
    sa_url = sqlalchemy_url(url).replace("sqlite:", "sqlite+aiosqlite:", 1)
    insert = f"INSERT INTO {app.table} (id) VALUES "
    seen: dict[str, Any] = {}

    @asynccontextmanager
    async def txn() -> AsyncIterator[tuple[Any, Callable[[str], Awaitable[Any]]]]:
        if kind == "psycopg":
            pconn = await psycopg.AsyncConnection.connect(conninfo(url))
            async with pconn, pconn.transaction():
                yield pconn, lambda oid: pconn.execute(insert + "(%s)", (oid,))  # type: ignore[arg-type]
            return
        engine = create_async_engine(sa_url)
        try:
            if kind == "session":
                async with AsyncSession(engine) as session, session.begin():
                    yield session, lambda oid: session.execute(text(insert + "(:id)"), {"id": oid})
            else:
                async with engine.begin() as conn:
                    yield conn, lambda oid: conn.execute(text(insert + "(:id)"), {"id": oid})
        finally:
            await engine.dispose()

    try:
        with LocalCluster(url) as cluster:
            async def work(task: Task, stop: object) -> bool:
                async with open_async_client(url) as client:
                    with pytest.raises(ClaimLost):
                        async with txn() as (conn, add_order):
                            await add_order("stale")
                            await client.complete_task(Task(task.id, token=task.token + 10**6), conn=conn)
                    async with txn() as (conn, add_order):
                        await add_order(task.id)
                        await client.complete_task(task, conn=conn)
                seen["after"] = cluster.client.get_task(task.id).state.value
                return False  # moot: the completion committed

            consumer = cluster.add(simple_handler(work), "runner")
            cluster.client.submit_task(Task("ship-a"))
            cluster.wait_for_state("ship-a", "done", 30)
            wait_for(lambda: consumer.stats.done == 1, 30, "the owner settled its outcome")
            assert consumer.stats.releases == 0 and consumer.stats.failed == 0
            assert seen == {"after": "done"}
            assert app.orders() == ["ship-a"]
    finally:
        app.close()


def test_complete_task_takes_a_claimed_task(metafora_store_url: Callable[[str], str]) -> None:
    app = App(metafora_store_url("sqlite"), "connection")
    try:
        with LocalCluster(app.url) as cluster, app.txn() as (conn, _add):
            with pytest.raises(ConfigError, match="claimed Task"):
                cluster.client.complete_task("t1", conn=conn)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="conn= takes"):
                cluster.client.complete_task(Task("t1", token=3), conn=object())
    finally:
        app.close()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_outcomes_of_completed_claims_are_answered_in_the_batch(
        store: str, metafora_store_url: Callable[[str], str]) -> None:
    """Coordinator level: a group commit holding outcomes of claims completed in the
    application's transaction answers them ClaimCompleted (a ClaimLost: nothing written), and
    writes the others. A claim its node already recorded done is answered the same way: the
    store cannot tell the two apart, and either way the claim ended done."""
    app = App(metafora_store_url(store), "connection")
    with ExitStack() as stack:
        stack.callback(app.close)
        client = stack.enter_context(open_client(app.url))
        coord = open_coordinator(app.url, node_id="a")
        coord.init(RecordingContext())
        stack.callback(coord.close)
        ids = ["d", "r", "f", "plain", "twice"]
        client.submit_tasks([Task(i) for i in ids])
        claimed = {t.id: t for t in coord.claim_many([Task(i) for i in ids], len(ids))}
        assert sorted(claimed) == sorted(ids)
        with app.txn() as (conn, add_order):
            for task_id in ("d", "r", "f"):
                add_order(task_id)
                client.complete_task(claimed[task_id], conn=conn)
        coord.done(claimed["twice"])
        results = coord.finish_many([
            Finish(claimed["d"], Outcome.DONE), Finish(claimed["r"], Outcome.RELEASE),
            Finish(claimed["f"], Outcome.FAIL, "late"), Finish(claimed["plain"], Outcome.DONE),
            Finish(claimed["twice"], Outcome.DONE),
        ])
        assert [type(r).__name__ for r in results] == [
            "ClaimCompleted", "ClaimCompleted", "ClaimCompleted", "NoneType", "ClaimCompleted"]
        assert all(isinstance(r, ClaimLost) for r in results if r is not None)
        states = {i.id: (i.state.value, i.error) for i in client.tasks()}
        assert states == dict.fromkeys(ids, ("done", None))
        with pytest.raises(ClaimCompleted):
            coord.release(claimed["r"])
        assert app.orders() == ["d", "f", "r"]
