"""The database handle shared by the SQL coordinator and client.

Owns the engine, the built statements, schema creation (once per handle) and the
translation of driver errors into metafora's (the boundary: nothing above this module sees
a SQLAlchemy or psycopg exception, and no message carries the password).

Four ways in, each one round trip where the database allows it:

- :meth:`Database.hot`: the hot path (claim, release, done, fail, heartbeat): statements
  compiled once to the driver's SQL and run on a bare pooled driver connection, without
  SQLAlchemy's per-execution machinery (which costs ~0.2 ms a statement). PostgreSQL:
  autocommit, prepared by psycopg after a few runs; SQLite: ``BEGIN IMMEDIATE`` ... COMMIT.
- :meth:`Database.write`: one logical write. PostgreSQL: autocommit (a single statement is
  its own transaction; no BEGIN/COMMIT round trips). SQLite: ``BEGIN IMMEDIATE`` (takes the
  write lock up front, waits up to the busy timeout).
- :meth:`Database.transaction`: several statements atomically (PostgreSQL: a real
  transaction; SQLite: ``BEGIN IMMEDIATE``).
- :meth:`Database.read`: autocommit reads (SQLite: no BEGIN at all, so readers never queue
  behind writers in WAL mode).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy import Connection, Engine, PoolProxiedConnection, event
from sqlalchemy import exc as sa_exc

from metafora.coordinators.sql.checkpoint import Checkpointer
from metafora.coordinators.sql.dialect import BEGIN_OPTION, Dialect, make_dialect, wait_out_busy
from metafora.coordinators.sql.options import SQLConfig
from metafora.coordinators.sql.schema import migrate, needs_migration, require_current, store_identity
from metafora.coordinators.sql.statements import Statements
from metafora.core.errors import CoordinatorUnavailable, MetaforaError, StoreError, WriteConflict
from metafora.core.masking import scrub
from metafora.core.task import Task

__all__ = ["DRIVER_ERRORS", "Database", "driver_errors", "task_params", "translate_error"]

log = logging.getLogger(__name__)

DRIVER_ERRORS: tuple[type[BaseException], ...] = (sa_exc.SQLAlchemyError, sqlite3.Error)
"""The drivers' errors that :func:`translate_error` turns into metafora's, but psycopg's:
:func:`driver_errors` adds them."""
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    sqlite3.OperationalError,
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.DisconnectionError,
    sa_exc.TimeoutError,
)


# psycopg (an optional extra) is not imported here: it costs a tenth of a second of CPU to every
# start on SQLite (a worker, each ``metafora`` command). None of its errors can be raised before
# something imported it (a PostgreSQL engine does), so the clauses that catch driver errors ask
# for them when one is raised (``except driver_errors()``), and find psycopg's then.
def driver_errors() -> tuple[type[BaseException], ...]:
    """:data:`DRIVER_ERRORS`, and psycopg's errors once psycopg is loaded."""
    psycopg = sys.modules.get("psycopg")
    return DRIVER_ERRORS if psycopg is None else (*DRIVER_ERRORS, psycopg.Error)


def _unavailable() -> tuple[type[BaseException], ...]:
    """The errors that mean the store cannot be reached (psycopg's once it is loaded)."""
    psycopg = sys.modules.get("psycopg")
    return _UNAVAILABLE if psycopg is None else (
        *_UNAVAILABLE, psycopg.OperationalError, psycopg.InterfaceError)


def _reason(exc: BaseException, url: str) -> str:
    orig = getattr(exc, "orig", None)
    source = orig if isinstance(orig, BaseException) else exc
    lines = [line.strip() for line in str(source).strip().splitlines() if line.strip()]
    reason = lines[0] if lines else type(source).__name__
    return scrub(reason, url)


_CONFLICTS = frozenset({"40P01", "40001"})  # deadlock_detected, serialization_failure


def _sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    code = getattr(orig if orig is not None else exc, "sqlstate", None)
    return code if isinstance(code, str) else None


def translate_error(exc: BaseException, config: SQLConfig) -> MetaforaError:
    """A metafora error for a driver error; the URL in it never shows the password."""
    reason = _reason(exc, config.url.raw)
    if _sqlstate(exc) in _CONFLICTS:  # before the class test: psycopg's are OperationalErrors
        return WriteConflict(f"concurrent writes to {config.name} conflicted (rolled back, "
                             f"nothing applied; try again): {reason}")
    if isinstance(exc, _unavailable()) or (
        isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    ):
        return CoordinatorUnavailable(f"cannot reach the store {config.name}: {reason}")
    return StoreError(f"the store {config.name} failed: {reason}")


class HotCursor:
    """Runs compiled-once statements on one bare driver connection (see :meth:`Database.hot`)."""

    def __init__(self, db: Database, cursor: Any) -> None:
        self._db = db
        self._cursor = cursor
        # psycopg: prepared from the first run, so its generic plan is used at once (see
        # the PostgreSQL dialect's plan_cache_mode); sqlite3 caches statements by itself.
        self._options: dict[str, Any] = {"prepare": True} if db.config.kind == "postgresql" else {}

    def _run(self, name: str, params: dict[str, Any]) -> None:
        sql, order = self._db.driver_sql(name)
        params["ns"] = self._db.config.namespace
        self._cursor.execute(sql, [params[k] for k in order] if order is not None else params,
                             **self._options)

    def one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """Run statement ``name``; its first row (None if it returned no row)."""
        self._run(name, params)
        rows = self._cursor.fetchall()  # drain: SQLite cannot COMMIT with a statement open
        return tuple(rows[0]) if rows else None

    def all(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run statement ``name``; every row it returned."""
        self._run(name, params)
        return [tuple(row) for row in self._cursor.fetchall()]

    def token_used(self, value: int) -> None:
        """After a statement that took ``{next_token}``: keep SQLite's counter row ahead."""
        if self._db.dialect.counter_in_row:
            self._cursor.execute(_BUMP, (value, value))


_BUMP = "UPDATE metafora_counter SET value = ? WHERE name = 'token' AND value < ?"


# One simple-protocol query on an autocommit connection: the transaction and its bound in
# one round trip (the driver's implicit BEGIN would be a round trip of its own).
_BEGIN_BOUNDED = "BEGIN; SET LOCAL statement_timeout = {ms:d}"
_RLOCK = type(threading.RLock())


def _rollback(conn: Connection) -> None:
    """End a transaction begun by hand after an error; a connection that cannot is dropped."""
    try:
        conn.exec_driver_sql("ROLLBACK")
    except driver_errors():
        conn.invalidate()


def _millis(seconds: float) -> int:
    # Rounded up, so a timeout that fired means the whole allowance has passed.
    return max(1, math.ceil(seconds * 1000))


_SPIN_FIRST = 50e-6  # seconds before the first retry of a write lock held by another process
_SPIN_MOST = 100e-6  # the longest step between retries, while the wait is short...
_SPIN_PATIENT = (0.02, 1e-3)  # ...and once it has lasted 20 ms: then steps grow to 1 ms


def _begin_immediate(cursor: Any, busy_timeout: float) -> None:
    """``BEGIN IMMEDIATE`` on the hot path, waiting for another process's write lock in short
    steps: 50 us, then 100 us; after 20 ms of waiting doubling up to 1 ms; for up to
    ``busy_timeout`` seconds.

    A hot transaction holds the lock about a millisecond; the lock is free from the moment it
    commits, and every microsecond a waiter sleeps past that moment the lock sits idle (only
    one process can use it). SQLite's own busy handler sleeps 1, 2, 5, 10... ms between tries;
    with steps doubling up to 1 ms, two processes running short tasks made 5,250 tasks/s, with
    steps of 100 us 6,060 (medians of 4 runs of the peers throughput workload on SQLite, with
    no WAL checkpoint in either). A wait that lasts (a long write elsewhere) goes back to 1 ms
    steps, which cost next to no CPU. The connection's busy timeout is 0 during the tries (and
    restored after): a try answers at once.
    """
    try:
        cursor.execute("PRAGMA busy_timeout = 0")
        wait_out_busy(lambda: cursor.execute("BEGIN IMMEDIATE"), busy_timeout,
                      first=_SPIN_FIRST, most=_SPIN_MOST, patient=_SPIN_PATIENT)
    finally:
        cursor.execute(f"PRAGMA busy_timeout = {_millis(busy_timeout)}")


def _busy_timeout(raw: Any, millis: int) -> None:
    cursor = raw.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(millis)}")
    finally:
        cursor.close()


_SQLITE_WRITERS: dict[str, threading.RLock] = {}
_SQLITE_WRITERS_LOCK = threading.Lock()


def _sqlite_writer(path: str) -> threading.RLock:
    """One lock per SQLite file in this process.

    SQLite has one writer at a time and its busy handler waits by sleeping (up to 100 ms a
    step, unfairly): threads of one process queue here instead and take the file lock in
    turn, so only writers in other processes ever meet the busy handler.
    """
    with _SQLITE_WRITERS_LOCK:
        return _SQLITE_WRITERS.setdefault(os.path.realpath(path), threading.RLock())


class Database:
    """One store's engine, statements and schema, with errors translated at the boundary."""

    def __init__(self, config: SQLConfig) -> None:
        self.config = config
        self.dialect: Dialect = make_dialect(config)
        self.sql = Statements(self.dialect)
        self.engine: Engine = self.dialect.create_engine()
        self._write_engine: Engine
        self._read_engine: Engine
        if config.kind == "postgresql":
            # Single statements run in autocommit on their own pool (no per-checkout
            # isolation switching); the main engine keeps transactions for multi-statement work.
            self._write_engine = self.dialect.create_engine(autocommit=True)
            self._read_engine = self._write_engine
        else:
            self._write_engine = self.engine
            self._read_engine = self.engine.execution_options(**{BEGIN_OPTION: ""})
        self._driver_sql: dict[str, tuple[str, tuple[str, ...] | None]] = {}
        self._writer: AbstractContextManager[Any] = (
            _sqlite_writer(config.path) if config.kind == "sqlite" and config.path else nullcontext()
        )
        self._schema_lock = threading.Lock()
        self._schema_ready = False
        self._identity: tuple[str, str] | None = None
        self._closed = False
        self.checkpointer: Checkpointer | None = None
        if config.kind == "sqlite":
            self.checkpointer = Checkpointer(self._write_engine.raw_connection, self.name)
            event.listen(self._write_engine, "commit", lambda _conn: self._committed())

    def _committed(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.committed()

    @property
    def name(self) -> str:
        """The store URL without its password."""
        return self.config.name

    @contextmanager
    def translated(self) -> Iterator[None]:
        """Raise a driver error inside as metafora's (:func:`translate_error`)."""
        try:
            yield
        except MetaforaError:
            raise
        except driver_errors() as exc:
            raise translate_error(exc, self.config) from exc

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A connection for one logical write (see the module docstring)."""
        with self._writer, self.translated(), self._write_engine.begin() as conn:
            yield conn

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction for several statements."""
        with self._writer, self.translated(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def bounded(self, timeout: float | None) -> Iterator[Connection]:
        """A transaction (as :meth:`transaction`) that waits at most ``timeout`` seconds.

        PostgreSQL: the statements get a transaction-local ``statement_timeout`` (lock waits
        included); SQLite: this process's writer lock and the busy handler wait at most
        ``timeout``. Past it the store's error surfaces as CoordinatorUnavailable. For fenced
        writes that must not outlive the node's lease; ``None`` is a plain transaction.
        """
        if timeout is None:
            with self.transaction() as conn:
                yield conn
        elif self.config.kind == "postgresql":
            with self.translated(), self._write_engine.connect() as conn:
                conn.exec_driver_sql(_BEGIN_BOUNDED.format(ms=_millis(timeout)))
                try:
                    yield conn
                except BaseException:
                    _rollback(conn)
                    raise
                conn.exec_driver_sql("COMMIT")
        else:
            with self._sqlite_bounded(timeout) as conn:
                yield conn

    @contextmanager
    def _sqlite_bounded(self, timeout: float) -> Iterator[Connection]:
        lock = self._writer if isinstance(self._writer, _RLOCK) else None
        if lock is not None and not lock.acquire(timeout=max(0.0, timeout)):
            raise CoordinatorUnavailable(
                f"the store {self.name} is busy: no write lock within {timeout:.2f}s"
            )
        try:
            with self.translated(), self.engine.connect() as conn:
                # The connection's own busy_timeout bounds the wait already when it is shorter
                # (the usual case: a lease has far more left): two PRAGMAs per write saved.
                shorter = timeout < self.config.busy_timeout
                raw = conn.connection.driver_connection
                assert raw is not None
                if shorter:
                    _busy_timeout(raw, _millis(timeout))
                try:
                    with conn.begin():
                        yield conn
                finally:
                    if shorter:
                        _busy_timeout(raw, _millis(self.config.busy_timeout))
        finally:
            if lock is not None:
                lock.release()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads in autocommit."""
        with self.translated(), self._read_engine.connect() as conn:
            yield conn

    def driver_sql(self, name: str) -> tuple[str, tuple[str, ...] | None]:
        """Statement ``name`` compiled once for the driver: its SQL and positional order."""
        found = self._driver_sql.get(name)
        if found is None:
            compiled = self.sql[name].compile(dialect=self._write_engine.dialect)
            order = tuple(compiled.positiontup or ()) if compiled.positional else None
            found = self._driver_sql[name] = (str(compiled), order)
        return found

    @contextmanager
    def hot(self) -> Iterator[HotCursor]:
        """A bare pooled driver connection for compiled-once statements, as one transaction.

        PostgreSQL: autocommit (each statement is its own transaction, one round trip);
        SQLite: ``BEGIN IMMEDIATE`` ... ``COMMIT``. Errors are translated like everywhere else;
        a broken connection is thrown away with the rest of its pool.
        """
        sqlite = self.config.kind == "sqlite"
        with self._writer, self.translated():
            fairy: PoolProxiedConnection = self._write_engine.raw_connection()
            try:
                cursor = fairy.cursor()
                try:
                    if sqlite:
                        _begin_immediate(cursor, self.config.busy_timeout)
                    try:
                        yield HotCursor(self, cursor)
                    except BaseException:
                        if sqlite:
                            fairy.rollback()
                        raise
                    if sqlite:
                        cursor.execute("COMMIT")
                        self._committed()
                finally:
                    cursor.close()
            except _unavailable() as exc:
                if getattr(fairy.driver_connection, "broken", False):
                    fairy.invalidate(exc)
                    self._write_engine.dispose()
                raise
            finally:
                fairy.close()

    def next_token_used(self, conn: Connection, value: int) -> None:
        """After a statement that took ``{next_token}`` = ``value``: keep the counter ahead."""
        if self.dialect.counter_in_row:
            self.dialect.bump_counter(conn, value)

    def ensure_schema(self) -> None:
        """Create or upgrade the schema on first use (once per handle; cheap afterwards);
        with ``migrate=false`` only check it (SchemaNotReady naming ``metafora migrate``)."""
        if self._schema_ready:
            return
        with self._schema_lock:
            if self._schema_ready:
                return
            with self.read() as conn:
                if not self.config.migrate:  # the schema is the release step's, never ours
                    require_current(conn, self.name)
                # (With migrate=false a missing id row is written by `metafora migrate`.)
                needed = self.config.migrate and needs_migration(conn, self.name)
            if needed:
                with self.transaction() as conn:
                    migrate(conn, self.dialect, self.name)
                log.info("schema of %s is ready", self.name, extra={"action": "schema"})
            self._schema_ready = True

    def identity(self) -> tuple[str, str]:
        """(database name, id row) of this store, read on metafora's own connection (once per
        handle): what an application's ``conn=`` must show."""
        if self._identity is None:
            self.ensure_schema()  # writes the id row if the schema had none
            with self.read() as conn:
                self._identity = store_identity(conn, self.config.kind)
        return self._identity

    def execute(self, conn: Connection, name: str, params: dict[str, Any]) -> Any:
        """Run the built statement ``name`` with the namespace bound."""
        params["ns"] = self.config.namespace
        return conn.execute(self.sql[name], params)

    def close(self) -> None:
        """Close every pooled connection. Idempotent."""
        if not self._closed:
            self._closed = True
            if self.checkpointer is not None:
                self.checkpointer.close()
            self.engine.dispose()
            if self._write_engine is not self.engine:
                self._write_engine.dispose()


def task_params(task: Task, db: Database, suffix: str = "") -> dict[str, Any]:
    """The bind parameters of one submitted task (``suffix``: its row in a multi-row INSERT)."""
    to_db = db.dialect.to_db_time
    return {
        f"id{suffix}": task.id,
        f"props{suffix}": task.props_json(),
        f"launch_at{suffix}": to_db(task.launch_at),
        f"expires_at{suffix}": to_db(task.expires_at),
        f"selector{suffix}": task.selector_json(),
        f"priority{suffix}": task.priority,
        f"placement{suffix}": task.placement_json(),
        f"grp{suffix}": task.group,
    }
