"""Submits on a SQL store: the duplicate modes and the application's own transaction.

The statements are the store's own (``submit`` and ``submit_many`` of
:mod:`~metafora.coordinators.sql.statements`) with the conflict clause each ``if_exists`` mode
needs, built once per store and mode: ``error`` and ``ignore`` keep ``ON CONFLICT DO NOTHING``,
``replace`` updates the existing row in the same statement only while it is pending and not
past its expiry, keeping its limit group (fixed at submit: docs/limits.md). The insert and
the decision are one statement, so concurrent submitters of one id never both add it.

:func:`submit_steps` is the work of a submit as a sequence of statements (a generator that
yields ``(clause, params)`` and is sent each statement's rows back): the sync path
(:func:`run_steps`, on a SQLAlchemy ``Connection``/``Session`` or a psycopg ``Connection``)
and the async client (:mod:`metafora.contracts.aio`) drive the same steps, so no SQL is written twice.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, TextClause, text

from metafora.coordinators.sql.appconn import async_app_conn, in_savepoint, is_session, sync_app_conn
from metafora.coordinators.sql.statements import BATCH
from metafora.coordinators.sql.store import Database, driver_errors, task_params, translate_error
from metafora.core import bulk
from metafora.core.errors import ConfigError, MetaforaError
from metafora.core.submitting import IfExists
from metafora.core.task import Task

__all__ = [
    "Steps",
    "SubmitStatements",
    "canonical",
    "check_conn",
    "drive_async",
    "left_steps",
    "psycopg_sql",
    "rows_of",
    "run_app_steps",
    "run_app_steps_async",
    "run_steps",
    "run_steps_async",
    "statements",
    "submit_steps",
    "translate",
]

BATCH_BYTES = 16 * 1024 * 1024
"""About how many bytes of ids and props one INSERT carries (as the client's own batches)."""

_NOTHING = " ON CONFLICT (namespace, id) DO NOTHING"
_REPLACE = (
    " ON CONFLICT (namespace, id) DO UPDATE SET props = excluded.props,"
    " launch_at = excluded.launch_at, expires_at = excluded.expires_at,"
    " selector = excluded.selector, priority = excluded.priority,"
    " placement = {placement}, ready = excluded.ready,"
    " updated_at = excluded.updated_at"
    " WHERE metafora_tasks.state = 'pending'"
    " AND (metafora_tasks.expires_at IS NULL OR metafora_tasks.expires_at > {now})"
)

# The new placement JSON with the stored limit group in it (fixed at submit: docs/limits.md);
# a NULL placement is no prefer, spread or group.
_KEEP_GROUP = {
    "postgresql": "(CASE WHEN metafora_tasks.grp IS NULL"
                  " THEN nullif((coalesce(excluded.placement::jsonb, '{{}}') - 'group')::text, '{{}}')"
                  " ELSE (coalesce(excluded.placement::jsonb, '{{}}')"
                  " || jsonb_build_object('group', metafora_tasks.grp))::text END)",
    "sqlite": "(CASE WHEN metafora_tasks.grp IS NULL"
              " THEN nullif(json_remove(coalesce(excluded.placement, '{{}}'), '$.group'), '{{}}')"
              " ELSE json_set(coalesce(excluded.placement, '{{}}'), '$.group', metafora_tasks.grp) END)",
}

R = TypeVar("R")
Steps = Generator[tuple[TextClause, dict[str, Any]], list[tuple[Any, ...]], R]
"""A submit as statements: yields ``(clause, params)``, is sent the rows, returns its result
(``Steps[int]``: the count)."""


class SubmitStatements:
    """The submit statements of one store, per ``if_exists`` mode (built once, cached)."""

    def __init__(self, db: Database) -> None:
        fragments = db.dialect.fragments()
        self._db = db
        self._conflict = {"error": _NOTHING, "ignore": _NOTHING,
                          "replace": _REPLACE.format(placement=_KEEP_GROUP[db.config.kind].format(),
                                                     **fragments)}
        self._one: dict[str, TextClause] = {}
        self._many: dict[tuple[str, int], TextClause] = {}
        self.bump = text("UPDATE metafora_counter SET value = :v WHERE name = 'token' AND value < :v")

    def _with(self, clause: TextClause, mode: IfExists) -> TextClause:
        if mode != "replace":
            return clause
        sql = clause.text
        if _NOTHING not in sql:
            raise AssertionError("the submit statement lost its ON CONFLICT clause: update submit.py")
        return text(sql.replace(_NOTHING, self._conflict[mode]))

    def one(self, mode: IfExists) -> TextClause:
        """The single-task INSERT (returns ``ready`` and the PostgreSQL wake-up) for ``mode``."""
        clause = self._one.get(mode)
        if clause is None:
            clause = self._one[mode] = self._with(self._db.sql["submit"], mode)
        return clause

    def many(self, mode: IfExists, rows: int) -> TextClause:
        """The multi-row INSERT of ``rows`` tasks (returns ``id, ready``) for ``mode``."""
        clause = self._many.get((mode, rows))
        if clause is None:
            clause = self._many[mode, rows] = self._with(self._db.sql.submit_many(rows), mode)
        return clause


_BUILT: weakref.WeakKeyDictionary[Database, SubmitStatements] = weakref.WeakKeyDictionary()


def statements(db: Database) -> SubmitStatements:
    """The submit statements of ``db`` (built on first use)."""
    found = _BUILT.get(db)
    if found is None:
        found = _BUILT[db] = SubmitStatements(db)
    return found


def _insert(db: Database, built: SubmitStatements, batch: Sequence[Task],
            mode: IfExists) -> Steps[dict[str, int]]:
    """One INSERT deciding every id of ``batch`` (``mode``): the ``ready`` of each id it added
    or replaced (a batch of one: the single-task statement, whose RETURNING sends the wake-up)."""
    ns = db.config.namespace
    if len(batch) == 1:
        rows = yield built.one(mode), {"ns": ns, **task_params(batch[0], db)}
        return {batch[0].id: int(rows[0][0])} if rows else {}
    params: dict[str, Any] = {"ns": ns}
    for n, task in enumerate(batch):
        params.update(task_params(task, db, f"_{n}"))
    rows = yield built.many(mode, len(batch)), params
    return {str(row[0]): int(row[1]) for row in rows}


def _wake(db: Database, built: SubmitStatements, batch: Sequence[Task], got: dict[str, int]) -> Steps[None]:
    """After ``batch`` added ``got``: SQLite's token counter moved past the ``ready`` values
    taken, and one wake-up for a PostgreSQL batch (delivered when the transaction commits)."""
    if got:
        if db.dialect.counter_in_row:
            yield built.bump, {"v": max(got.values())}
        if len(batch) > 1 and db.config.kind == "postgresql":
            yield db.sql["notify_batch"], {"ns": db.config.namespace, "ready": min(got.values())}


def canonical(tasks: Sequence[Task]) -> Sequence[Task]:
    """``tasks`` in id order: every write of several rows takes their locks in one order, so
    two concurrent submits or replaces of the same ids wait for each other instead of
    deadlocking (PostgreSQL found one in 6 of 17 racing replaces of batches in other orders).
    Within one call the tasks are made ready in id order."""
    ids = [task.id for task in tasks]
    return tasks if ids == sorted(ids) else sorted(tasks, key=lambda task: task.id)


def submit_steps(db: Database, tasks: Sequence[Task], mode: IfExists) -> Steps[int]:
    """Submit ``tasks`` (checked, ids distinct) in one transaction the caller holds.

    Per batch: one INSERT deciding every id (``mode``), SQLite's token counter moved past
    the ``ready`` values taken, and one wake-up (PostgreSQL: ``pg_notify``, delivered when the
    transaction commits; SQLite: the commit itself, seen by the consumers' ``data_version``
    check). ``"error"``: a batch with a taken id raises TaskExists; the transaction is then
    rolled back to before the call (metafora's own: the whole of it; the application's: its
    savepoint, :func:`~metafora.coordinators.sql.appconn.in_savepoint`), never undone by a
    DELETE that could reach a row another transaction wrote. Returns how many tasks were
    added or replaced.
    """
    built = statements(db)
    added = 0
    tasks = canonical(tasks)  # one transaction for every batch: one lock order for all of them
    for batch in bulk.batches(tasks, BATCH, BATCH_BYTES):
        got = yield from _insert(db, built, batch, mode)
        if mode == "error" and len(got) < len(batch):
            existing = [task.id for task in batch if task.id not in got]
            raise bulk.exists_error(existing, added, len(tasks), db.name)
        yield from _wake(db, built, batch, got)
        added += len(got)
    return added


def left_steps(db: Database, tasks: Sequence[Task], mode: IfExists) -> Steps[list[str]]:
    """Submit ``tasks`` (ids distinct) deciding each one alone: ``"error"`` and ``"ignore"``
    add the new ids, ``"replace"`` also replaces the pending ones. Returns the ids left as they
    were (the async client's group commit of single submits: each caller learns its own fate)."""
    built = statements(db)
    each: IfExists = "replace" if mode == "replace" else "ignore"
    left: list[str] = []
    for batch in bulk.batches(canonical(tasks), BATCH, BATCH_BYTES):
        got = yield from _insert(db, built, batch, each)
        yield from _wake(db, built, batch, got)
        left += [task.id for task in batch if task.id not in got]
    return left


def translate(exc: BaseException, db: Database) -> MetaforaError:
    """A metafora error for a driver error met in the application's transaction: a missing
    schema is said plainly (how to create it); others as the store's errors."""
    message = str(getattr(exc, "orig", None) or exc)
    if "metafora_" in message and ("does not exist" in message or "no such table" in message):
        return ConfigError(
            f"the metafora schema is not in the database of this connection (store {db.name}):"
            " it is created by the first Consumer or Client call on the store (for example"
            " `metafora tasks` or open_client(url).tasks()); check that the connection and the"
            " store URL name the same database"
        )
    return translate_error(exc, db.config)


def _kind(conn: Any) -> str:
    """The database kind of an application connection ("postgresql", "sqlite")."""
    if is_session(conn):
        bind = conn.get_bind()
        return str(bind.dialect.name)
    if isinstance(conn, Connection):
        return str(conn.dialect.name)
    psycopg = sys.modules.get("psycopg")  # not imported: no psycopg connection exists before it is
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        return "postgresql"
    raise ConfigError(
        "conn= takes a SQLAlchemy Connection or Session, or a psycopg Connection, in an open"
        f" transaction; got {type(conn).__name__}"
    )


def check_conn(conn: Any, db: Database) -> None:
    """Refuse a connection to another kind of database than the store's."""
    kind = _kind(conn)
    if kind != db.config.kind:
        raise ConfigError(f"conn= is a {kind} connection but the store {db.name} is {db.config.kind}")


_COMPILED: dict[TextClause, str] = {}  # the clauses are built once per store and mode


def psycopg_sql(clause: TextClause) -> str:
    """``clause`` as psycopg's SQL (named ``%(name)s`` parameters), compiled once."""
    sql = _COMPILED.get(clause)
    if sql is None:
        from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

        sql = _COMPILED[clause] = str(clause.compile(dialect=pg_psycopg.dialect()))  # type: ignore[no-untyped-call]
    return sql


def rows_of(result: Any) -> list[tuple[Any, ...]]:
    """The rows of a SQLAlchemy result ([] for a statement that returns none)."""
    return [tuple(r) for r in result] if result.returns_rows else []


def _sync_execute(target: Any) -> Any:
    """``execute(clause, params) -> rows`` on ``target``, a SQLAlchemy ``Connection`` or a
    psycopg ``Connection``."""
    if isinstance(target, Connection):
        def execute(clause: TextClause, params: dict[str, Any]) -> list[tuple[Any, ...]]:
            return rows_of(target.execute(clause, params))
    else:
        def execute(clause: TextClause, params: dict[str, Any]) -> list[tuple[Any, ...]]:
            cursor = target.execute(psycopg_sql(clause), params)
            return [tuple(r) for r in cursor.fetchall()] if cursor.description else []
    return execute


def run_app_steps(conn: Any, db: Database, steps: Steps[R]) -> R:
    """Drive ``steps`` on the application's connection ``conn`` (sync), checked (see
    :mod:`~metafora.coordinators.sql.appconn`) and in a savepoint; errors translated."""
    found, target = sync_app_conn(conn, db)
    expected = db.identity()  # on metafora's own connection (cached per handle)
    return drive(_sync_execute(target), db, in_savepoint(found, db, expected, steps))


def run_steps(conn: Any, db: Database, steps: Steps[R]) -> R:
    """Drive ``steps`` on the application's connection ``conn`` (sync), errors translated
    (:func:`drive`; steps that do not catch a driver error let it through unchanged)."""
    check_conn(conn, db)
    return drive(_sync_execute(conn.connection() if is_session(conn) else conn), db, steps)


def drive(execute: Any, db: Database, steps: Steps[R]) -> R:
    """Drive ``steps`` with ``execute(clause, params) -> rows`` (its result), errors thrown
    into the steps (which may roll back) and then translated."""
    try:
        step = next(steps)
        while True:
            try:
                rows = execute(*step)
            except driver_errors() as exc:  # the steps roll back to their savepoint, then re-raise
                step = steps.throw(exc)
            else:
                step = steps.send(rows)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except MetaforaError:
        raise
    except driver_errors() as exc:
        raise translate(exc, db) from exc


async def run_app_steps_async(conn: Any, db: Database, steps: Steps[R]) -> R:
    """Drive ``steps`` on the application's async connection ``conn`` (a SQLAlchemy
    ``AsyncConnection`` or ``AsyncSession``, or a psycopg ``AsyncConnection``), checked and in
    a savepoint as :func:`run_app_steps`."""
    import asyncio

    found, target = await async_app_conn(conn, db)
    expected = await asyncio.get_running_loop().run_in_executor(None, db.identity)
    return await drive_async(_async_execute(target), db, in_savepoint(found, db, expected, steps))


def _async_execute(target: Any) -> Any:
    """``await execute(clause, params) -> rows`` on ``target``, a psycopg ``AsyncConnection``
    or a SQLAlchemy ``AsyncConnection``."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(target, psycopg.AsyncConnection):
        async def execute(clause: TextClause, params: dict[str, Any]) -> list[tuple[Any, ...]]:
            cursor = await target.execute(psycopg_sql(clause), params)
            return [tuple(r) for r in await cursor.fetchall()] if cursor.description else []
    else:
        async def execute(clause: TextClause, params: dict[str, Any]) -> list[tuple[Any, ...]]:
            return rows_of(await target.execute(clause, params))
    return execute


def _async_kind(conn: Any) -> str | None:
    """The database kind of an async application connection (None: not one)."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncSession):
        return str(conn.sync_session.get_bind().dialect.name)
    if isinstance(conn, AsyncConnection):
        return str(conn.dialect.name)
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(conn, psycopg.AsyncConnection):
        return "postgresql"
    return None


async def run_steps_async(conn: Any, db: Database, steps: Steps[int]) -> int:
    """Drive ``steps`` on the application's async connection ``conn`` (a SQLAlchemy
    ``AsyncConnection`` or ``AsyncSession``, or a psycopg ``AsyncConnection``)."""
    from sqlalchemy.ext.asyncio import AsyncSession

    kind = _async_kind(conn)
    if kind is None:
        raise ConfigError(
            "the async client's conn= takes a SQLAlchemy AsyncConnection or AsyncSession, or a"
            f" psycopg AsyncConnection, in an open transaction; got {type(conn).__name__}"
        )
    if kind != db.config.kind:
        raise ConfigError(f"conn= is a {kind} connection but the store {db.name} is {db.config.kind}")
    target = await conn.connection() if isinstance(conn, AsyncSession) else conn
    return await drive_async(_async_execute(target), db, steps)


async def drive_async(execute: Any, db: Database, steps: Steps[R]) -> R:
    """Drive ``steps`` with ``await execute(clause, params) -> rows`` (its result), errors
    thrown into the steps (which may roll back) and then translated."""
    try:
        step = next(steps)
        while True:
            try:
                rows = await execute(*step)
            except driver_errors() as exc:
                step = steps.throw(exc)
            else:
                step = steps.send(rows)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except MetaforaError:
        raise
    except driver_errors() as exc:
        raise translate(exc, db) from exc
