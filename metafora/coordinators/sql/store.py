"""The database handle shared by the SQL coordinator and client.

Owns the engine, the built statements, schema creation (once per handle) and the
translation of driver errors into metafora's (the boundary: nothing above this module sees
a SQLAlchemy or psycopg exception, and no message carries the password).

Three ways in, each one round trip where the database allows it:

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
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc

from metafora.coordinators.sql.dialect import BEGIN_OPTION, Dialect, make_dialect
from metafora.coordinators.sql.options import SQLConfig
from metafora.coordinators.sql.schema import migrate, needs_migration
from metafora.coordinators.sql.statements import Statements
from metafora.errors import CoordinatorUnavailable, MetaforaError, StoreError

__all__ = ["Database", "translate_error"]

log = logging.getLogger(__name__)

try:  # psycopg is an optional extra (only PostgreSQL needs it)
    import psycopg

    _PSYCOPG_UNAVAILABLE: tuple[type[BaseException], ...] = (psycopg.OperationalError,)
    _PSYCOPG_ERROR: tuple[type[BaseException], ...] = (psycopg.Error,)
except ImportError:  # pragma: no cover - depends on the installation
    _PSYCOPG_UNAVAILABLE = ()
    _PSYCOPG_ERROR = ()

_DB_ERRORS: tuple[type[BaseException], ...] = (sa_exc.SQLAlchemyError, *_PSYCOPG_ERROR)
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.DisconnectionError,
    sa_exc.TimeoutError,
    *_PSYCOPG_UNAVAILABLE,
)


def _reason(exc: BaseException, password: str | None) -> str:
    orig = getattr(exc, "orig", None)
    source = orig if isinstance(orig, BaseException) else exc
    lines = [line.strip() for line in str(source).strip().splitlines() if line.strip()]
    reason = lines[0] if lines else type(source).__name__
    if password:
        reason = reason.replace(password, "***")
    return reason


def translate_error(exc: BaseException, config: SQLConfig) -> MetaforaError:
    """A metafora error for a driver error; the URL in it never shows the password."""
    reason = _reason(exc, config.url.password)
    if isinstance(exc, _UNAVAILABLE) or (
        isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    ):
        return CoordinatorUnavailable(f"cannot reach the store {config.name}: {reason}")
    return StoreError(f"the store {config.name} failed: {reason}")


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
            self._write_engine = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            self._read_engine = self._write_engine
        else:
            self._write_engine = self.engine
            self._read_engine = self.engine.execution_options(**{BEGIN_OPTION: ""})
        self._schema_lock = threading.Lock()
        self._schema_ready = False
        self._closed = False

    @property
    def name(self) -> str:
        """The store URL without its password."""
        return self.config.name

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except MetaforaError:
            raise
        except _DB_ERRORS as exc:
            raise translate_error(exc, self.config) from exc

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A connection for one logical write (see the module docstring)."""
        with self._translated(), self._write_engine.begin() as conn:
            yield conn

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction for several statements."""
        with self._translated(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads in autocommit."""
        with self._translated(), self._read_engine.connect() as conn:
            yield conn

    def next_token_used(self, conn: Connection, value: int) -> None:
        """After a statement that took ``{next_token}`` = ``value``: keep the counter ahead."""
        if self.dialect.counter_in_row:
            self.dialect.bump_counter(conn, value)

    def ensure_schema(self) -> None:
        """Create or upgrade the schema on first use (once per handle; cheap afterwards)."""
        if self._schema_ready:
            return
        with self._schema_lock:
            if self._schema_ready:
                return
            with self.read() as conn:
                needed = needs_migration(conn, self.name)
            if needed:
                with self.transaction() as conn:
                    migrate(conn, self.dialect, self.name)
                log.info("schema of %s is ready", self.name)
            self._schema_ready = True

    def execute(self, conn: Connection, name: str, params: dict[str, Any]) -> Any:
        """Run the built statement ``name`` with the namespace bound."""
        params["ns"] = self.config.namespace
        return conn.execute(self.sql[name], params)

    def close(self) -> None:
        """Close every pooled connection. Idempotent."""
        if not self._closed:
            self._closed = True
            self.engine.dispose()
