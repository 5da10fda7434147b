"""The application's connection (``conn=``): one open transaction on the store's own database.

A ``conn=`` argument promises the application that what the call writes is in its
transaction: it exists if that transaction commits, and nothing of it if it rolls back. So
the connection is checked before anything is written:

- **kind**: a SQLAlchemy ``Connection``/``Session`` or a psycopg ``Connection`` (the async
  client: ``AsyncConnection``/``AsyncSession``, psycopg ``AsyncConnection``) on the store's
  kind of database;
- **a transaction, not autocommit**: a connection in autocommit (SQLAlchemy's ``AUTOCOMMIT``
  isolation level, psycopg's ``autocommit``, a ``sqlite3`` connection with no isolation
  level) outside an explicit ``BEGIN`` is refused: each statement would commit on its own,
  and other clients would see (and workers run) tasks the call may still refuse;
- **the store's own database, by identity**: the database's name and the store's id row
  (:func:`~metafora.coordinators.sql.schema.store_identity`) read on the connection must be
  those metafora's own connection reads; another database with a metafora schema of its own
  is refused, not silently written to.

Everything the call writes then runs inside a ``SAVEPOINT`` of the application's transaction
(:func:`in_savepoint`): a refused or failed call rolls back to it, so the transaction holds
no part of the call (a refused multi-batch ``submit_tasks`` leaves none of its batches) and
stays usable (PostgreSQL: a failed statement no longer aborts the application's work). No
row is ever deleted: nothing another transaction wrote can be touched.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import Any, TypeVar

from sqlalchemy import Connection, TextClause, text

from metafora.coordinators.sql.schema import identity_query
from metafora.coordinators.sql.store import Database
from metafora.core.errors import ConfigError

__all__ = ["AppConn", "async_app_conn", "in_savepoint", "is_session", "sync_app_conn"]

R = TypeVar("R")
Steps = Generator[tuple[TextClause, dict[str, Any]], list[tuple[Any, ...]], R]

_BEGIN = text("BEGIN")
_SAVEPOINT = text("SAVEPOINT metafora_call")
_ROLLBACK_TO = text("ROLLBACK TO SAVEPOINT metafora_call")
_RELEASE = text("RELEASE SAVEPOINT metafora_call")


class AppConn:
    """What the checks found on an application's connection: its kind, and whether metafora
    must open the DBAPI transaction itself (a ``sqlite3`` connection in its default mode has
    none until the first write: a ``SAVEPOINT`` outside one would commit on release)."""

    __slots__ = ("begin", "kind")

    def __init__(self, kind: str, begin: bool) -> None:
        self.kind = kind
        self.begin = begin


def _psycopg() -> Any:
    """psycopg when it is loaded, else None: a psycopg connection cannot exist before, and
    importing it here would cost every start on SQLite a tenth of a second of CPU."""
    return sys.modules.get("psycopg")


def _refuse_autocommit(what: str) -> ConfigError:
    return ConfigError(
        f"conn= is {what}: each statement would commit on its own, so other clients would see "
        "the tasks before your transaction decides; pass a connection in an open transaction "
        "(SQLAlchemy: engine.begin() or session.begin(); psycopg: autocommit=False)")


def _check_raw(raw: Any, options: dict[str, Any]) -> bool:
    """Refuse an autocommit DBAPI connection ``raw``; whether a ``BEGIN`` is needed first."""
    if str(options.get("isolation_level", "")).upper() == "AUTOCOMMIT":
        raise _refuse_autocommit("a SQLAlchemy connection with isolation_level='AUTOCOMMIT'")
    psycopg = _psycopg()
    if psycopg is not None and isinstance(raw, (psycopg.Connection, psycopg.AsyncConnection)):
        if raw.autocommit and raw.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
            raise _refuse_autocommit("a psycopg connection in autocommit outside a BEGIN")
        return False  # psycopg begins before the first statement itself
    in_tx = getattr(raw, "in_transaction", None)
    if isinstance(in_tx, bool) and hasattr(raw, "isolation_level"):  # sqlite3, aiosqlite
        if in_tx:
            return False
        if getattr(raw, "autocommit", None) is True or raw.isolation_level is None:
            raise _refuse_autocommit("a sqlite3 connection in autocommit outside a BEGIN")
        return True
    return False


def _kind_error(conn: Any, async_: bool) -> ConfigError:
    if async_:
        return ConfigError(
            "the async client's conn= takes a SQLAlchemy AsyncConnection or AsyncSession, or a"
            f" psycopg AsyncConnection, in an open transaction; got {type(conn).__name__}")
    return ConfigError(
        "conn= takes a SQLAlchemy Connection or Session, or a psycopg Connection, in an open"
        f" transaction; got {type(conn).__name__}")


def _same_kind(kind: str, db: Database) -> None:
    if kind != db.config.kind:
        raise ConfigError(f"conn= is a {kind} connection but the store {db.name} is {db.config.kind}")


def is_session(conn: Any) -> bool:
    """A SQLAlchemy ``Session``? Told without importing ``sqlalchemy.orm`` (a tenth of a second
    at every worker's start, for a node that never uses it): an application that passes a
    Session has imported it already."""
    orm = sys.modules.get("sqlalchemy.orm")
    return orm is not None and isinstance(conn, orm.Session)


def sync_app_conn(conn: Any, db: Database) -> tuple[AppConn, Any]:
    """Check a sync application connection; (what was found, the connection to execute on:
    a SQLAlchemy ``Connection`` or the psycopg one). ConfigError."""
    if is_session(conn):
        conn = conn.connection()
    if isinstance(conn, Connection):
        kind = str(conn.dialect.name)
        _same_kind(kind, db)
        raw = conn.connection.dbapi_connection
        return AppConn(kind, _check_raw(raw, conn.get_execution_options())), conn
    psycopg = _psycopg()
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        _same_kind("postgresql", db)
        return AppConn("postgresql", _check_raw(conn, {})), conn
    raise _kind_error(conn, async_=False)


async def async_app_conn(conn: Any, db: Database) -> tuple[AppConn, Any]:
    """As :func:`sync_app_conn` for the async client's connections."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()
    if isinstance(conn, AsyncConnection):
        kind = str(conn.dialect.name)
        _same_kind(kind, db)
        raw = (await conn.get_raw_connection()).driver_connection
        options = conn.sync_connection.get_execution_options() if conn.sync_connection else {}
        return AppConn(kind, _check_raw(raw, dict(options))), conn
    psycopg = _psycopg()
    if psycopg is not None and isinstance(conn, psycopg.AsyncConnection):
        _same_kind("postgresql", db)
        return AppConn("postgresql", _check_raw(conn, {})), conn
    raise _kind_error(conn, async_=True)


def _same_database(row: list[tuple[Any, ...]], expected: tuple[str, str], db: Database) -> None:
    name, ident = (str(row[0][0] or ""), row[0][1]) if row else ("", None)
    want_name, want_id = expected
    if db.config.kind == "sqlite":  # the same file, by any path
        name, want_name = os.path.realpath(name) if name else "", os.path.realpath(want_name)
    if ident != want_id or name != want_name:
        raise ConfigError(
            f"conn= is on another database than the store {db.name} (its database is "
            f"{name[:200]!r}, its metafora schema another store's or none): nothing was written;"
            " pass a connection to the store's own database")


def in_savepoint(found: AppConn, db: Database, expected: tuple[str, str], steps: Steps[R]) -> Steps[R]:
    """``steps`` in the application's transaction, checked and all-or-nothing: ``BEGIN`` if
    the driver has not begun one, a ``SAVEPOINT``, the identity check, the steps, and
    ``RELEASE``; on any error (thrown in by the driver, or raised by the steps) ``ROLLBACK TO``
    the savepoint first, so the transaction holds nothing of the call."""
    if found.begin:
        yield _BEGIN, {}
    yield _SAVEPOINT, {}
    try:
        _same_database((yield identity_query(found.kind), {}), expected, db)
        result = yield from steps
    except BaseException:
        yield _ROLLBACK_TO, {}
        yield _RELEASE, {}
        raise
    yield _RELEASE, {}
    return result
