"""Everything that differs between PostgreSQL and SQLite, in one place.

The rest of the package writes its SQL once, with ``{placeholders}`` for the few fragments
that differ (the database clock, time arithmetic, the token counter, row locks and
notifications); a :class:`Dialect` fills them in and builds the engine.

Times are judged by the database clock only: PostgreSQL ``now()`` (``timestamptz``), SQLite
``strftime('%Y-%m-%d %H:%M:%f', 'now')`` (UTC text with milliseconds, which sorts in time
order).
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import os
import random
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import URL, Connection, Engine, create_engine, event, text

from metafora.coordinators.sql.checkpoint import BACKSTOP, JOURNAL_LIMIT
from metafora.coordinators.sql.limits import PG_ROOM_FUNCTION, pg_fragments, sqlite_fragments
from metafora.coordinators.sql.options import SQLConfig

__all__ = ["Dialect", "PostgresDialect", "SQLiteDialect", "channel_name", "make_dialect"]

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_SQLITE_FMT = "%Y-%m-%d %H:%M:%S.%f"
BEGIN_OPTION = "metafora_begin"
"""Execution option naming the SQLite BEGIN mode of a transaction ("" = none, autocommit)."""


def channel_name(namespace: str) -> str:
    """The PostgreSQL LISTEN/NOTIFY channel of a namespace (a short, safe identifier)."""
    return "metafora_" + hashlib.sha1(namespace.encode()).hexdigest()[:16]


PLAIN_PROPS_MAX = 2000
"""Props (JSON text) at most this long go in a plain task's notification (limit: 8000 bytes)."""


class Dialect(abc.ABC):
    """The SQL fragments, engine set-up and value conversions of one database kind."""

    name: str

    def __init__(self, config: SQLConfig) -> None:
        self.config = config
        self.channel = channel_name(config.namespace)

    @abc.abstractmethod
    def fragments(self) -> dict[str, str]:
        """Values for the ``{placeholders}`` of the shared SQL texts.

        ``now`` (the database clock), ``ts_plus_secs`` (``now`` plus the ``:secs`` parameter),
        ``lease_until`` (``now`` plus the ``:ttl`` parameter), ``next_token`` (the next value
        of the store-wide counter), ``lock`` (row lock suffix of a sub-select), ``notify_task``,
        ``notify_held``, ``notify_cmd``, ``notify_task_cmd``, ``notify_owner``,
        ``notify_members`` (RETURNING items that send a notification), ``notify_batch`` (one
        notification: tasks from ready value ``:ready`` on became pending),
        ``secs_until_launch`` / ``secs_until_lease`` (seconds from now to a time, as a float),
        ``in_ids`` (membership in the ``:ids`` list parameter, see :meth:`ids_param`),
        ``offered_tasks`` / ``offered_pos`` (a FROM ... WHERE finding the task rows of ``:ids``
        / a row's place in that list), ``next_token_at`` (a distinct next token for each row of the
        claim_many UPDATE, from its ``picked(id, pos)`` CTE), ``in_picked`` / ``in_finished``
        (membership in the ids of the ``picked`` / ``v`` CTE), ``finish_rows`` (the ``:rows`` JSON list of
        ``{"fid", "ftoken", "ferror"}`` objects as a table with those columns, for
        the group-committed outcomes), ``selector_ok`` (the task's selector is matched by the
        labels in the ``:labels`` JSON parameter).
        """

    @abc.abstractmethod
    def ids_param(self, ids: list[str]) -> Any:
        """The ``:ids`` parameter for a list of task ids."""

    @abc.abstractmethod
    def ddl_types(self) -> dict[str, str]:
        """Column types for the schema: ``ts`` (a time), ``key`` (an id compared byte-wise),
        ``serial_pk`` (an auto-increment primary key)."""

    @abc.abstractmethod
    def counter_ddl(self) -> list[str]:
        """Statements creating the store-wide token counter."""

    @abc.abstractmethod
    def create_engine(self, autocommit: bool = False) -> Engine:
        """A pooled engine for the store (connects lazily); ``autocommit`` engines (PostgreSQL)
        run every statement as its own transaction."""

    @abc.abstractmethod
    def to_db_time(self, value: datetime | None) -> Any:
        """A UTC datetime as the database stores it."""

    @abc.abstractmethod
    def from_db_time(self, value: Any) -> datetime | None:
        """A stored time as an aware UTC datetime."""

    @abc.abstractmethod
    def bump_counter(self, conn: Connection, value: int) -> None:
        """Record that ``value`` of the token counter was used (SQLite's counter row)."""

    @abc.abstractmethod
    def lock_schema(self, conn: Connection) -> None:
        """Serialize schema creation between processes (inside the schema transaction)."""

    @property
    def counter_in_row(self) -> bool:
        """Whether taking a token needs :meth:`bump_counter` in the same transaction."""
        return False

    def limits_ddl(self) -> list[str]:
        """Statements the limits migration adds for this database (PostgreSQL: a function)."""
        return []


class PostgresDialect(Dialect):
    """PostgreSQL through psycopg 3: a SEQUENCE for tokens, LISTEN/NOTIFY for wake-ups."""

    name = "postgresql"

    def fragments(self) -> dict[str, str]:
        chan = self.channel
        return {
            "now": "now()",
            "ts_plus_secs": "(now() + make_interval(secs => :secs))",
            "lease_until": "(now() + make_interval(secs => :ttl))",
            "next_token": "nextval('metafora_token_seq')",
            "lock": " FOR UPDATE SKIP LOCKED",
            # 'p' id US props: a plain task (no priority, selector, placement, group or launch
            # time; short props): the payload is the whole offer, made without reading the
            # row. US (chr(31)) is a control character, which task ids never contain.
            "notify_task": (
                f"pg_notify('{chan}', CASE WHEN priority = 0 AND selector IS NULL AND placement"
                f" IS NULL AND launch_at IS NULL AND length(props) <= {PLAIN_PROPS_MAX}"
                " THEN 'p' || id || chr(31) || props ELSE 't' || id END)"
            ),
            # A task released held for its node (holds.py): named without its props, so the
            # others' watches look (and set their timer for the hold's end) but offer nothing.
            "notify_held": f"pg_notify('{chan}', 't' || id)",
            "notify_cmd": f"pg_notify('{chan}', 'c' || node_id)",
            "notify_task_cmd": f"pg_notify('{chan}', 'm' || task_id)",
            "notify_owner": f"CASE WHEN state = 'claimed' THEN pg_notify('{chan}', 'n' || owner) END",
            "notify_batch": f"pg_notify('{chan}', 'b' || CAST(:ready AS text))",
            "notify_members": f"pg_notify('{chan}', 'j' || node_id)",
            "in_ids": "= ANY(CAST(:ids AS text[]))",
            "offered_tasks": (
                "metafora_tasks WHERE namespace = :ns AND id = ANY(CAST(:ids AS text[]))"
            ),
            "offered_pos": "array_position(CAST(:ids AS text[]), metafora_tasks.id)",
            # Primary-key probes whatever the statistics say (see claim_many).
            "in_picked": "= ANY(ARRAY(SELECT id FROM picked))",
            "in_finished": "= ANY(ARRAY(SELECT fid FROM v))",
            "next_token_at": "nextval('metafora_token_seq')",
            "finish_rows": (
                "jsonb_to_recordset(CAST(:rows AS jsonb)) AS r(fid text, ftoken bigint, ferror text)"
            ),
            "secs_until_launch": "CAST(EXTRACT(EPOCH FROM (min(launch_at) - now())) AS double precision)",
            "secs_until_lease": "CAST(EXTRACT(EPOCH FROM (min(lease_until) - now())) AS double precision)",
            "selector_ok": (
                "(metafora_tasks.selector IS NULL OR CAST(metafora_tasks.selector AS jsonb)"
                " <@ CAST(:labels AS jsonb))"
            ),
            **pg_fragments(),
        }

    def limits_ddl(self) -> list[str]:
        return [PG_ROOM_FUNCTION]

    def ddl_types(self) -> dict[str, str]:
        return {
            "ts": "TIMESTAMP WITH TIME ZONE",
            "key": 'TEXT COLLATE "C"',
            "serial_pk": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
        }

    def counter_ddl(self) -> list[str]:
        return ["CREATE SEQUENCE metafora_token_seq AS BIGINT"]

    def connect_kwargs(self) -> dict[str, Any]:
        """libpq connection parameters (also used by the LISTEN connection)."""
        cfg = self.config
        host, port = cfg.url.hosts[0]
        kwargs: dict[str, Any] = {
            "host": host,
            "port": port or 5432,
            "dbname": cfg.url.path.strip("/"),
            "connect_timeout": max(2, math.ceil(cfg.connect_timeout)),
            "application_name": "metafora",
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
        }
        if cfg.url.username is not None:
            kwargs["user"] = cfg.url.username
        if cfg.url.password is not None:
            kwargs["password"] = cfg.url.password
        if cfg.sslmode is not None:
            kwargs["sslmode"] = cfg.sslmode
        return kwargs

    def engine_url(self) -> tuple[URL, dict[str, Any]]:
        """The SQLAlchemy URL (psycopg, sync or async) and the connect arguments left over,
        with the session in UTC."""
        kwargs = self.connect_kwargs()
        url = URL.create(
            "postgresql+psycopg",
            username=kwargs.pop("user", None),
            password=kwargs.pop("password", None),
            host=kwargs.pop("host"),
            port=kwargs.pop("port"),
            database=kwargs.pop("dbname"),
        )
        kwargs["options"] = "-c timezone=UTC"
        return url, kwargs

    def create_engine(self, autocommit: bool = False) -> Engine:
        url, kwargs = self.engine_url()
        if autocommit:
            # The hot statements are prepared (see store.HotCursor) and planned once for any
            # namespace. A plan for the namespace's value trusts statistics taken before its
            # tasks were submitted (autovacuum analyzes a minute later at best): it believed
            # the namespace held one row and filtered 20,000 rows per claim, 150+ ms each.
            kwargs["options"] += " -c plan_cache_mode=force_generic_plan"
        size = self.config.pool_size if autocommit else max(2, self.config.pool_size // 2)
        return create_engine(
            url,
            pool_size=size,
            max_overflow=size,
            pool_timeout=self.config.connect_timeout,
            connect_args=kwargs,
            **({"isolation_level": "AUTOCOMMIT"} if autocommit else {}),
        )

    def to_db_time(self, value: datetime | None) -> Any:
        return value

    def ids_param(self, ids: list[str]) -> Any:
        return ids  # a text[] for psycopg

    def from_db_time(self, value: Any) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a timestamp from PostgreSQL, got {value!r}")
        return value.astimezone(UTC)

    def lock_schema(self, conn: Connection) -> None:
        conn.execute(text("SELECT pg_advisory_xact_lock(4242016001)"))

    def bump_counter(self, conn: Connection, value: int) -> None:
        pass  # nextval() already moved the sequence


class SQLiteDialect(Dialect):
    """SQLite (stdlib sqlite3): WAL, BEGIN IMMEDIATE writes, a counter row for tokens."""

    name = "sqlite"

    def fragments(self) -> dict[str, str]:
        return {
            "now": _SQLITE_NOW,
            "ts_plus_secs": "strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', :secs))",
            "lease_until": "strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', :ttl))",
            "next_token": "(SELECT value + 1 FROM metafora_counter WHERE name = 'token')",
            "lock": "",
            "notify_task": "NULL",
            "notify_held": "NULL",
            "notify_cmd": "NULL",
            "notify_task_cmd": "NULL",
            "notify_owner": "NULL",
            "notify_batch": "NULL",
            "notify_members": "NULL",
            "in_ids": "IN (SELECT value FROM json_each(:ids))",
            # The offered ids drive the loop (CROSS JOIN fixes the order): one primary-key
            # probe each, and their places without re-reading the JSON per row.
            "offered_tasks": (
                "(SELECT key AS pos, value AS oid FROM json_each(:ids)) AS offered"
                " CROSS JOIN metafora_tasks"
                " WHERE metafora_tasks.namespace = :ns AND metafora_tasks.id = offered.oid"
            ),
            "offered_pos": "offered.pos",
            "in_picked": "IN (SELECT id FROM picked)",
            "in_finished": "IN (SELECT fid FROM v)",
            # One statement claims several rows: each takes counter + 1 + its place in :ids.
            "next_token_at": (
                "((SELECT value FROM metafora_counter WHERE name = 'token') + 1"
                " + (SELECT p.pos FROM picked p WHERE p.id = metafora_tasks.id))"
            ),
            "finish_rows": (
                "(SELECT json_extract(value, '$.fid') AS fid, json_extract(value, '$.ftoken')"
                " AS ftoken, json_extract(value, '$.ferror') AS ferror FROM json_each(:rows)) AS r"
            ),
            "secs_until_launch": "((julianday(min(launch_at)) - julianday('now')) * 86400.0)",
            "secs_until_lease": "((julianday(min(lease_until)) - julianday('now')) * 86400.0)",
            "selector_ok": (
                "(metafora_tasks.selector IS NULL OR NOT EXISTS (SELECT 1 FROM"
                " json_each(metafora_tasks.selector) s WHERE NOT EXISTS (SELECT 1 FROM"
                " json_each(:labels) l WHERE l.key = s.key AND l.value = s.value)))"
            ),
            **sqlite_fragments(),
        }

    @property
    def counter_in_row(self) -> bool:
        return True

    def ddl_types(self) -> dict[str, str]:
        return {"ts": "TEXT", "key": "TEXT", "serial_pk": "INTEGER PRIMARY KEY AUTOINCREMENT"}

    def counter_ddl(self) -> list[str]:
        return [
            "CREATE TABLE metafora_counter (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
            "INSERT INTO metafora_counter (name, value) VALUES ('token', 0)",
        ]

    def create_engine(self, autocommit: bool = False) -> Engine:
        cfg = self.config
        assert cfg.path is not None
        create_private(cfg.path)
        engine = create_engine(
            URL.create("sqlite+pysqlite", database=cfg.path),
            pool_size=cfg.pool_size,
            max_overflow=cfg.pool_size,
            pool_timeout=cfg.busy_timeout + 5.0,
            connect_args={
                "timeout": cfg.busy_timeout,
                "check_same_thread": False,
                "isolation_level": None,  # we emit BEGIN ourselves (see _begin)
            },
        )
        busy_ms = int(cfg.busy_timeout * 1000)

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"PRAGMA busy_timeout = {busy_ms}")
                wait_out_busy(lambda: cur.execute("PRAGMA journal_mode = WAL"), cfg.busy_timeout)
                cur.execute("PRAGMA synchronous = NORMAL")
                # Checkpoints run on a thread of their own (see checkpoint.py); a commit
                # checkpoints only when that thread has fallen far behind.
                cur.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP}")
                cur.execute(f"PRAGMA journal_size_limit = {JOURNAL_LIMIT}")
            finally:
                cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            # Writers take the lock up front: a deferred transaction that upgrades to a
            # writer fails with "database is locked" whatever the busy timeout.
            mode = conn.get_execution_options().get(BEGIN_OPTION, "IMMEDIATE")
            if mode:
                conn.exec_driver_sql(f"BEGIN {mode}")

        return engine

    def ids_param(self, ids: list[str]) -> Any:
        return json.dumps(ids)  # read with json_each()

    def to_db_time(self, value: datetime | None) -> Any:
        if value is None:
            return None
        text_value = value.astimezone(UTC).strftime(_SQLITE_FMT)
        return text_value[:-3]  # milliseconds, like strftime('%f')

    def from_db_time(self, value: Any) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, datetime):
            return value.astimezone(UTC)
        return datetime.fromisoformat(str(value)).replace(tzinfo=UTC)

    def bump_counter(self, conn: Connection, value: int) -> None:
        conn.execute(
            text("UPDATE metafora_counter SET value = :v WHERE name = 'token' AND value < :v"),
            {"v": value},
        )

    def lock_schema(self, conn: Connection) -> None:
        pass  # BEGIN IMMEDIATE already holds the only write lock


def create_private(path: str) -> None:
    """Create the SQLite file ``path`` empty with mode 0600 if it does not exist yet, before any
    data is in it (SQLite gives its -wal and -shm files the database's mode): the store holds
    the cluster's tasks, props and errors, not for every user of the machine to read."""
    if path == ":memory:" or path.startswith("file:"):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError:
        return  # a directory missing or not writable: SQLite's own error says it better
    os.close(fd)
    os.chmod(path, 0o600)  # whatever the umask


def wait_out_busy(step: Callable[[], object], timeout: float, *, first: float = 0.002,
                  most: float = 0.05, patient: tuple[float, float] | None = None) -> None:
    """Run ``step``, retrying while SQLite answers "locked"/"busy", for up to ``timeout`` seconds:
    after ``first`` seconds, doubling up to ``most`` (each with jitter); ``patient`` =
    ``(after, most)``: once ``after`` seconds have been waited, steps may grow to that ``most``.

    Switching a new file to WAL needs an exclusive lock and SQLite answers SQLITE_BUSY at once,
    without its busy handler, while another connection converts the file: several processes
    opening one fresh file at the same instant (the embedded default's normal start) must wait
    that out, not report the store unavailable. The hot path's ``BEGIN IMMEDIATE`` waits out
    another process's write lock the same way, in far shorter steps.
    """
    start = time.monotonic()
    deadline = start + timeout
    pause = first
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as exc:
            text_ = str(exc).lower()
            if ("locked" not in text_ and "busy" not in text_) or time.monotonic() >= deadline:
                raise
        time.sleep(pause * (1 + random.random()))  # jitter: racing processes do not retry in step
        if patient is not None and time.monotonic() - start >= patient[0]:
            most = max(most, patient[1])
        pause = min(pause * 2, most)


def make_dialect(config: SQLConfig) -> Dialect:
    """The dialect for a validated config."""
    if config.kind == "postgresql":
        return PostgresDialect(config)
    return SQLiteDialect(config)
