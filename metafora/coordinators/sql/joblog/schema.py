"""The job logs' tables: their own versioned schema, created on first use.

Like the gates' items, job logs keep a schema version apart from the coordinator's
(``metafora_joblog_schema``, one row per applied migration), because a log's database need not
hold a coordinator at all (beside an etcd coordinator, a log lives in a SQL database of its
own). Migrations run in one transaction under a lock (PostgreSQL: an advisory lock; SQLite:
``BEGIN IMMEDIATE``).

Tables (every row carries the ``namespace`` of its store URL):

- ``metafora_joblogs``: one row per log: its ``name`` and ``head``, the highest index
  appended (-1: none). The row is the log's **counter**: an append locks it first, reads the
  head, inserts the jobs at the next indexes and writes the new head, all in one transaction;
  so appenders of one log queue on the row and indexes are dense (see
  :mod:`metafora.coordinators.sql.joblog.log`).
- ``metafora_joblog_jobs``: the jobs: ``log_name``, ``idx`` (primary key with the namespace
  and the log: :meth:`~.SQLJobLog.at_index` is one index lookup), ``job_key`` (unique per log:
  index ``metafora_joblog_jobs_key``), ``payload`` (JSON text) and ``created_at``.
"""

from __future__ import annotations

from sqlalchemy import Connection, text

from metafora.coordinators.sql.shared import Dialect, is_postgres
from metafora.coordinators.sql.side_schema import Migration, SideSchema

__all__ = ["JOBLOG_SCHEMA_VERSION", "MIGRATIONS", "SCHEMA", "current_version", "ensure_version", "migrate"]

_LOCK_KEY = 4242016007  # pg_advisory_xact_lock key of the job logs' schema (the gates' is ...006)


def _types(dialect: Dialect) -> dict[str, str]:
    types = dict(dialect.ddl_types())
    types["now_default"] = (
        "now()" if is_postgres(dialect) else "(strftime('%Y-%m-%d %H:%M:%f', 'now'))"
    )
    return types


_V1_DDL = [
    """CREATE TABLE metafora_joblogs (
        namespace {key} NOT NULL,
        name {key} NOT NULL,
        head BIGINT NOT NULL DEFAULT -1,
        created_at {ts} NOT NULL DEFAULT {now_default},
        updated_at {ts} NOT NULL DEFAULT {now_default},
        PRIMARY KEY (namespace, name)
    )""",
    """CREATE TABLE metafora_joblog_jobs (
        namespace {key} NOT NULL,
        log_name {key} NOT NULL,
        idx BIGINT NOT NULL,
        job_key {key} NOT NULL,
        payload TEXT NOT NULL,
        created_at {ts} NOT NULL DEFAULT {now_default},
        PRIMARY KEY (namespace, log_name, idx)
    )""",
    "CREATE UNIQUE INDEX metafora_joblog_jobs_key ON metafora_joblog_jobs (namespace, log_name, job_key)",
]


def _v1_initial(conn: Connection, dialect: Dialect) -> None:
    types = _types(dialect)
    for ddl in _V1_DDL:
        conn.execute(text(ddl.format(**types)))


MIGRATIONS: list[tuple[str, Migration]] = [
    ("job logs and their jobs", _v1_initial),
]
"""Migration ``i`` (0-based) takes the job logs' schema from version ``i`` to ``i + 1``."""

JOBLOG_SCHEMA_VERSION = len(MIGRATIONS)


SCHEMA = SideSchema("metafora_joblog_schema", _LOCK_KEY, MIGRATIONS, "job log tables")
"""The job logs' side schema: its version table, lock and migrations."""


def current_version(conn: Connection) -> int:
    """The job logs' schema version of the database (0 if their tables were never created)."""
    return SCHEMA.current_version(conn)


def ensure_version(version: int, where: str) -> None:
    """Refuse a schema newer than this code understands."""
    SCHEMA.check_version(version, where)


def migrate(conn: Connection, dialect: Dialect, where: str) -> int:
    """Bring the job log tables up to :data:`JOBLOG_SCHEMA_VERSION` in the caller's transaction."""
    return SCHEMA.migrate(conn, dialect, where)
