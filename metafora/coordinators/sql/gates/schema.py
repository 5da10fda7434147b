"""The item store's tables: their own versioned schema, created on first use.

The gates keep a schema version apart from the coordinator's (``metafora_gates_schema``, one
row per applied migration), because an item database need not hold a coordinator at all (an
etcd coordinator keeps its items in a SQL database of their own). Migrations run in one
transaction under a lock (PostgreSQL: an advisory lock; SQLite: ``BEGIN IMMEDIATE``).

Tables (every row carries the ``namespace`` of its store URL):

- ``metafora_partitions``: one row per partition: its current ``gate``, ``status`` (open,
  completed) and ``token``, the highest claim token that has taken the partition (every
  item write is fenced by it).
- ``metafora_items``: the items: ``id`` (store-wide, insertion order), ``partition_id``,
  ``gate``, ``status`` (available, complete, failed), ``data`` (bytes), ``attempts``,
  ``error``, ``permanent`` (the failure is not retryable), ``token`` (the claim that last
  wrote it), ``created_at``/``updated_at`` (database clock). Index ``metafora_items_work``
  on ``(namespace, partition_id, gate, status, id)`` serves the handler's queries.
  Version 2 adds, for attempts recorded before processing: on items, ``taken`` (0: not in
  work; 1: an orphan -- its batch's claim ended without its result; 2: taken on its own)
  and ``deaths`` (claims in a row that took the item and ended without its result); on
  partitions, the batch taken last (``batch_token``, ``batch_gate``, ids ``batch_first``
  to ``batch_last``), written in the transaction that takes it.
"""

from __future__ import annotations

from sqlalchemy import Connection, text

from metafora.coordinators.sql.shared import Dialect, is_postgres
from metafora.coordinators.sql.side_schema import Migration, SideSchema

__all__ = ["GATES_SCHEMA_VERSION", "MIGRATIONS", "SCHEMA", "current_version", "migrate"]

_LOCK_KEY = 4242016006  # pg_advisory_xact_lock key of the gates schema (the coordinator's is ...001)


def _types(dialect: Dialect) -> dict[str, str]:
    types = dict(dialect.ddl_types())
    if is_postgres(dialect):
        types["bytes"] = "BYTEA"
        types["now_default"] = "now()"
    else:
        types["bytes"] = "BLOB"
        types["now_default"] = "(strftime('%Y-%m-%d %H:%M:%f', 'now'))"
    return types


_V1_DDL = [
    """CREATE TABLE metafora_partitions (
        namespace {key} NOT NULL,
        partition_id {key} NOT NULL,
        gate INTEGER NOT NULL DEFAULT 0,
        token BIGINT NOT NULL DEFAULT 0,
        status VARCHAR(16) NOT NULL DEFAULT 'open',
        created_at {ts} NOT NULL DEFAULT {now_default},
        updated_at {ts} NOT NULL DEFAULT {now_default},
        PRIMARY KEY (namespace, partition_id)
    )""",
    """CREATE TABLE metafora_items (
        id {serial_pk},
        namespace {key} NOT NULL,
        partition_id {key} NOT NULL,
        gate INTEGER NOT NULL,
        status VARCHAR(16) NOT NULL,
        data {bytes} NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        error TEXT,
        permanent INTEGER NOT NULL DEFAULT 0,
        token BIGINT NOT NULL DEFAULT 0,
        created_at {ts} NOT NULL DEFAULT {now_default},
        updated_at {ts} NOT NULL DEFAULT {now_default}
    )""",
    "CREATE INDEX metafora_items_work ON metafora_items (namespace, partition_id, gate, status, id)",
]


def _v1_initial(conn: Connection, dialect: Dialect) -> None:
    types = _types(dialect)
    for ddl in _V1_DDL:
        conn.execute(text(ddl.format(**types)))


_V2_COLUMNS = [
    ("metafora_items", "taken", "INTEGER"),
    ("metafora_items", "deaths", "INTEGER"),
    ("metafora_partitions", "batch_token", "BIGINT"),
    ("metafora_partitions", "batch_gate", "INTEGER"),
    ("metafora_partitions", "batch_first", "BIGINT"),
    ("metafora_partitions", "batch_last", "BIGINT"),
]


def _v2_batches(conn: Connection, dialect: Dialect) -> None:
    for table, column, kind in _V2_COLUMNS:
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {kind} NOT NULL DEFAULT 0"))


MIGRATIONS: list[tuple[str, Migration]] = [
    ("partitions and items", _v1_initial),
    ("batches taken, orphans and deaths (attempts recorded before processing)", _v2_batches),
]
"""Migration ``i`` (0-based) takes the gates schema from version ``i`` to ``i + 1``."""

GATES_SCHEMA_VERSION = len(MIGRATIONS)


SCHEMA = SideSchema("metafora_gates_schema", _LOCK_KEY, MIGRATIONS, "item tables")
"""The gates' side schema: its version table, lock and migrations."""


def current_version(conn: Connection) -> int:
    """The gates schema version of the database (0 if the item tables were never created)."""
    return SCHEMA.current_version(conn)


def check_version(version: int, where: str) -> None:
    """Refuse a schema newer than this code understands."""
    SCHEMA.check_version(version, where)


def migrate(conn: Connection, dialect: Dialect, where: str) -> int:
    """Bring the item tables up to :data:`GATES_SCHEMA_VERSION` inside the caller's transaction."""
    return SCHEMA.migrate(conn, dialect, where)
