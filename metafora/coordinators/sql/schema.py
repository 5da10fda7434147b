"""The store's tables, created on first use and upgraded by a list of migrations.

``metafora_schema`` holds one row per applied migration; the schema version is the highest.
A migration is a function applied inside one transaction, under a lock that keeps two
processes from migrating at once (PostgreSQL: an advisory lock; SQLite: BEGIN IMMEDIATE).
Every table has a ``namespace`` column, so several clusters share one database.

Tables (all prefixed ``metafora_``):

- ``tasks``: one row per task: props (JSON text), state, owner, token, claim and life-cycle
  times, ``launch_at``/``expires_at`` (copied from the props at submit), error, attempts, and
  ``ready`` (the counter value at which the row last became pending: lets a watcher find what
  is new since its last look), ``crashes`` (v3: the latest claims in a row that ended with their
  node dead and no outcome), ``selector`` (v4: JSON object, NULL for none), ``priority``
  (v4, default 0) and ``placement`` (v4: the soft ``prefer``/``spread`` as a JSON object, NULL
  for none), ``held_for``/``held_until`` (v12: a released task held for a stopped node's id
  until then, see :mod:`metafora.core.holds`). Partial indexes keep pending and claimed rows findable without
  reading the done rows that pile up.
- ``nodes``: one row per registration: ``lease_until`` (database time), ``session`` (this
  registration's random id), started/renewed times, host, pid, task count, ``frozen`` (v2),
  ``labels`` (v4: JSON object, NULL for none), ``leaving`` (v6: the node announced it is
  shutting down; balancers no longer count it), ``weight`` (v7, default 1.0: its fair share
  is proportional to it).
- ``commands``: per-node FIFO by ``id``; a row is deleted when its node takes it.
- ``state``: per-task state of the state machine, fenced by the claim token.
- ``schedules`` (v5): one row per periodic schedule: ``every_secs`` or ``cron``, props, the
  ``missed`` policy, ``paused``, ``tick_cursor`` (every tick at or before it is settled) and
  ``version`` (the compare-and-set token materialising a tick checks).
- ``limits`` (v8): one row per limited
  group: ``max_running`` and/or ``rate_count`` per ``rate_secs``. ``tasks.grp`` (v8) is the
  task's group; ``rate_log`` (v8) holds the claim times of rate-limited groups inside their
  window (older rows are pruned by the next claim of the group). PostgreSQL also gets the
  function ``metafora_group_room(ns, grp)`` the claim statements call (see ``Dialect.limits_ddl``).
- ``retention`` (v10): one row per namespace: how long finished tasks are kept
  (``done_secs``, ``failed_secs``, ``killed_secs``; NULL: for ever) and ``next_prune``, the
  time before which no node takes the prune turn (see ``coordinators/sql/retention.py``).
- the token counter: a SEQUENCE on PostgreSQL, a ``metafora_counter`` row on SQLite.
- the store's **id row**: ``metafora_schema`` row ``version = 0`` (no migration has that
  number; ``max(version)`` is unchanged), its description ``id <random hex>``, written once by
  the first handle that asks (:func:`store_identity`). With the database's own name it is how
  an application's ``conn=`` is checked to be on the store's own database, not another one
  that happens to hold a metafora schema too.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from sqlalchemy import Connection, TextClause, inspect, text

from metafora.coordinators.sql.dialect import Dialect
from metafora.core.errors import SchemaNotReady, StoreError

__all__ = ["ID_ROW", "MIGRATIONS", "SCHEMA_VERSION", "current_version", "identity_query", "migrate",
           "needs_migration", "require_current", "schema_not_ready", "store_identity"]

Migration = Callable[[Connection, Dialect], None]

_V1_DDL = [
    """CREATE TABLE metafora_tasks (
        namespace {key} NOT NULL,
        id {key} NOT NULL,
        props TEXT NOT NULL,
        state VARCHAR(16) NOT NULL
            CHECK (state IN ('pending', 'claimed', 'done', 'failed', 'expired')),
        owner {key},
        token BIGINT NOT NULL DEFAULT 0,
        ready BIGINT NOT NULL DEFAULT 0,
        claimed_at {ts},
        launch_at {ts},
        expires_at {ts},
        error TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        created_at {ts} NOT NULL,
        updated_at {ts} NOT NULL,
        finished_at {ts},
        PRIMARY KEY (namespace, id)
    )""",
    "CREATE INDEX metafora_tasks_pending ON metafora_tasks (namespace, id)"
    " WHERE state = 'pending'",
    "CREATE INDEX metafora_tasks_ready ON metafora_tasks (namespace, ready, id)"
    " WHERE state = 'pending'",
    "CREATE INDEX metafora_tasks_launch ON metafora_tasks (namespace, launch_at)"
    " WHERE state = 'pending' AND launch_at IS NOT NULL",
    "CREATE INDEX metafora_tasks_expiry ON metafora_tasks (namespace, expires_at)"
    " WHERE state = 'pending' AND expires_at IS NOT NULL",
    "CREATE INDEX metafora_tasks_owner ON metafora_tasks (namespace, owner, id)"
    " WHERE state = 'claimed'",
    "CREATE INDEX metafora_tasks_finished ON metafora_tasks (namespace, finished_at)"
    " WHERE state IN ('done', 'failed', 'expired')",
    """CREATE TABLE metafora_nodes (
        namespace {key} NOT NULL,
        node_id {key} NOT NULL,
        session VARCHAR(64) NOT NULL,
        lease_until {ts} NOT NULL,
        started_at {ts} NOT NULL,
        renewed_at {ts} NOT NULL,
        host TEXT,
        pid INTEGER,
        task_count INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (namespace, node_id)
    )""",
    """CREATE TABLE metafora_commands (
        id {serial_pk},
        namespace {key} NOT NULL,
        node_id {key} NOT NULL,
        body TEXT NOT NULL,
        created_at {ts} NOT NULL
    )""",
    "CREATE INDEX metafora_commands_node ON metafora_commands (namespace, node_id, id)",
    """CREATE TABLE metafora_state (
        namespace {key} NOT NULL,
        task_id {key} NOT NULL,
        token BIGINT NOT NULL,
        body TEXT NOT NULL,
        updated_at {ts} NOT NULL,
        PRIMARY KEY (namespace, task_id)
    )""",
]


def _v1_initial(conn: Connection, dialect: Dialect) -> None:
    types = dialect.ddl_types()
    for ddl in _V1_DDL:
        conn.execute(text(ddl.format(**types)))
    for ddl in dialect.counter_ddl():
        conn.execute(text(ddl))


def _v2_node_frozen(conn: Connection, dialect: Dialect) -> None:
    conn.execute(text("ALTER TABLE metafora_nodes ADD COLUMN frozen BOOLEAN"))


def _v3_task_crashes(conn: Connection, dialect: Dialect) -> None:
    conn.execute(text("ALTER TABLE metafora_tasks ADD COLUMN crashes INTEGER NOT NULL DEFAULT 0"))


def _v4_placement(conn: Connection, dialect: Dialect) -> None:
    conn.execute(text("ALTER TABLE metafora_nodes ADD COLUMN labels TEXT"))
    conn.execute(text("ALTER TABLE metafora_tasks ADD COLUMN selector TEXT"))
    conn.execute(text("ALTER TABLE metafora_tasks ADD COLUMN priority INTEGER NOT NULL DEFAULT 0"))
    conn.execute(text("ALTER TABLE metafora_tasks ADD COLUMN placement TEXT"))
    # The full scan walks the pending rows one priority at a time, highest first.
    conn.execute(text("CREATE INDEX metafora_tasks_priority ON metafora_tasks"
                      " (namespace, priority, id) WHERE state = 'pending'"))
_V5_SCHEDULES = """CREATE TABLE metafora_schedules (
    namespace {key} NOT NULL,
    name {key} NOT NULL,
    every_secs INTEGER CHECK (every_secs IS NULL OR every_secs >= 1),
    cron TEXT,
    props TEXT NOT NULL,
    missed VARCHAR(8) NOT NULL CHECK (missed IN ('skip', 'once', 'all')),
    paused BOOLEAN NOT NULL,
    tick_cursor {ts} NOT NULL,
    created_at {ts} NOT NULL,
    version BIGINT NOT NULL,
    PRIMARY KEY (namespace, name),
    CHECK ((every_secs IS NULL) <> (cron IS NULL))
)"""


def _v5_schedules(conn: Connection, dialect: Dialect) -> None:
    conn.execute(text(_V5_SCHEDULES.format(**dialect.ddl_types())))


def _v6_node_leaving(conn: Connection, dialect: Dialect) -> None:
    conn.execute(text("ALTER TABLE metafora_nodes ADD COLUMN leaving BOOLEAN"))


def _v7_node_weight(conn: Connection, dialect: Dialect) -> None:
    # A node registered by an earlier release (or before this migration) weighs 1.0.
    conn.execute(text("ALTER TABLE metafora_nodes ADD COLUMN weight DOUBLE PRECISION NOT NULL"
                      " DEFAULT 1.0"))


def _v9_node_capacity(conn: Connection, dialect: Dialect) -> None:
    # NULL: no bound (a node of an earlier release, or one that runs without a cap).
    conn.execute(text("ALTER TABLE metafora_nodes ADD COLUMN capacity INTEGER"))


def _v11_node_pokes(conn: Connection, dialect: Dialect) -> None:
    # Bumped by whoever changes a live node's claim from outside (a client deleting a claimed
    # task): the node compares it at each renewal instead of counting its claims.
    conn.execute(text("ALTER TABLE metafora_nodes ADD COLUMN pokes INTEGER NOT NULL DEFAULT 0"))


_V8_LIMITS = [
    "ALTER TABLE metafora_tasks ADD COLUMN grp {key}",
    # A group's live claims are counted through this index (claimed rows of the group only).
    "CREATE INDEX metafora_tasks_group ON metafora_tasks (namespace, grp, owner)"
    " WHERE state = 'claimed' AND grp IS NOT NULL",
    """CREATE TABLE metafora_limits (
        namespace {key} NOT NULL,
        grp {key} NOT NULL,
        max_running INTEGER CHECK (max_running IS NULL OR max_running >= 1),
        rate_count INTEGER CHECK (rate_count IS NULL OR rate_count >= 1),
        rate_secs INTEGER CHECK (rate_secs IS NULL OR rate_secs >= 1),
        updated_at {ts} NOT NULL,
        PRIMARY KEY (namespace, grp),
        CHECK ((rate_count IS NULL) = (rate_secs IS NULL))
    )""",
    """CREATE TABLE metafora_rate_log (
        namespace {key} NOT NULL,
        grp {key} NOT NULL,
        at {ts} NOT NULL
    )""",
    "CREATE INDEX metafora_rate_log_at ON metafora_rate_log (namespace, grp, at)",
]


def _v8_limits(conn: Connection, dialect: Dialect) -> None:
    types = dialect.ddl_types()
    for ddl in _V8_LIMITS:
        conn.execute(text(ddl.format(**types)))
    for ddl in dialect.limits_ddl():
        conn.execute(text(ddl))


_V10_RETENTION = """CREATE TABLE metafora_retention (
    namespace {key} NOT NULL PRIMARY KEY,
    done_secs BIGINT,
    failed_secs BIGINT,
    killed_secs BIGINT,
    next_prune {ts} NOT NULL,
    updated_at {ts} NOT NULL
)"""


def _v10_retention(conn: Connection, dialect: Dialect) -> None:
    conn.execute(text(_V10_RETENTION.format(**dialect.ddl_types())))


def _v12_task_holds(conn: Connection, dialect: Dialect) -> None:
    # A gracefully stopped node's released tasks wait for its id until held_until (holds.py);
    # the watch finds the soonest end of a hold through this index (held rows only).
    types = dialect.ddl_types()
    conn.execute(text(f"ALTER TABLE metafora_tasks ADD COLUMN held_for {types['key']}"))
    conn.execute(text(f"ALTER TABLE metafora_tasks ADD COLUMN held_until {types['ts']}"))
    conn.execute(text("CREATE INDEX metafora_tasks_held ON metafora_tasks (namespace, held_until)"
                      " WHERE state = 'pending' AND held_until IS NOT NULL"))


MIGRATIONS: list[tuple[str, Migration]] = [
    ("tasks, nodes, commands, state and the token counter", _v1_initial),
    ("nodes.frozen: whether a node is frozen, for operators' views", _v2_node_frozen),
    ("tasks.crashes: claims in a row that ended with their node dead", _v3_task_crashes),
    ("nodes.labels, tasks.selector, priority and placement: placement and priorities",
     _v4_placement),
    ("schedules: masterless periodic tasks", _v5_schedules),
    ("nodes.leaving: a node shutting down, not counted by balancers", _v6_node_leaving),
    ("nodes.weight: a node's fair share is proportional to it", _v7_node_weight),
    ("tasks.grp, limits and rate_log: cluster-wide limits per task group", _v8_limits),
    ("nodes.capacity: no share above what a node can run", _v9_node_capacity),
    ("retention: how long finished tasks are kept, and the prune turn", _v10_retention),
    ("nodes.pokes: claims changed from outside, checked without counting the claims",
     _v11_node_pokes),
    ("tasks.held_for, held_until: a stopped node's tasks held for its id (sticky return)",
     _v12_task_holds),
]
"""Migration ``i`` (0-based) takes the schema from version ``i`` to ``i + 1``."""

SCHEMA_VERSION = len(MIGRATIONS)


def current_version(conn: Connection) -> int:
    """The schema version of the database (0 if metafora never ran on it)."""
    if not inspect(conn).has_table("metafora_schema"):
        return 0
    version = conn.execute(text("SELECT max(version) FROM metafora_schema")).scalar()
    return int(version or 0)


def _check(version: int, where: str) -> None:
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the schema of {where} is at version {version}, newer than this metafora "
            f"understands ({SCHEMA_VERSION}); upgrade metafora"
        )


def migrate(conn: Connection, dialect: Dialect, where: str) -> int:
    """Bring the schema up to :data:`SCHEMA_VERSION` inside the caller's write transaction."""
    dialect.lock_schema(conn)
    types = dialect.ddl_types()
    conn.execute(
        text(
            "CREATE TABLE IF NOT EXISTS metafora_schema (version INTEGER PRIMARY KEY,"
            " description TEXT NOT NULL, applied_at {ts} NOT NULL)".format(**types)
        )
    )
    version = int(conn.execute(text("SELECT coalesce(max(version), 0) FROM metafora_schema")).scalar_one())
    _check(version, where)
    now = dialect.fragments()["now"]
    for number, (description, migration) in enumerate(MIGRATIONS[version:], start=version + 1):
        migration(conn, dialect)
        conn.execute(
            text(
                f"INSERT INTO metafora_schema (version, description, applied_at)"
                f" VALUES (:v, :d, {now})"
            ),
            {"v": number, "d": description},
        )
    _write_id_row(conn, dialect)  # a store made before the id row gets one now
    return SCHEMA_VERSION


ID_ROW = 0
"""The ``metafora_schema`` version of the store's id row (migrations start at 1)."""


def identity_query(kind: str) -> TextClause:
    """The database's name (PostgreSQL: ``current_database()``; SQLite: the main file) and
    the store's id row (NULL while none), for any connection to a database of ``kind``."""
    name = ("current_database()" if kind == "postgresql"
            else "(SELECT file FROM pragma_database_list WHERE name = 'main')")
    return text(f"SELECT {name}, (SELECT description FROM metafora_schema WHERE version = {ID_ROW})")


def store_identity(conn: Connection, kind: str) -> tuple[str, str]:
    """(database name, id) of the store on ``conn`` (metafora's own); StoreError if the
    schema has no id row (:func:`migrate` writes it)."""
    row = conn.execute(identity_query(kind)).one()
    if row[1] is None:
        raise StoreError("the metafora schema has no id row: run `metafora migrate` on the store")
    return str(row[0] or ""), str(row[1])


def _has_id_row(conn: Connection) -> bool:
    return conn.execute(text(f"SELECT 1 FROM metafora_schema WHERE version = {ID_ROW}")).first() is not None


def _write_id_row(conn: Connection, dialect: Dialect) -> None:
    now = dialect.fragments()["now"]
    conn.execute(text(f"INSERT INTO metafora_schema (version, description, applied_at)"
                      f" VALUES ({ID_ROW}, :d, {now}) ON CONFLICT (version) DO NOTHING"),
                 {"d": f"id {uuid.uuid4().hex}"})


def needs_migration(conn: Connection, where: str) -> bool:
    """Whether :func:`migrate` has work to do (a cheap read, outside any write lock)."""
    version = current_version(conn)
    _check(version, where)
    return version < SCHEMA_VERSION or not _has_id_row(conn)


def schema_not_ready(where: str, what: str, version: int, needed: int) -> SchemaNotReady:
    """The error of a store told ``migrate=false`` whose schema ``what`` is at ``version``
    where this metafora needs ``needed``."""
    found = "missing" if version == 0 else f"at version {version}"
    return SchemaNotReady(
        f"the {what} of {where} is {found}, this metafora needs version {needed}, and the URL "
        f"says migrate=false: run 'metafora migrate --url URL' (the same URL) to apply the "
        "migrations, then start again"
    )


def require_current(conn: Connection, where: str) -> None:
    """What ``migrate=false`` does instead of :func:`migrate`: SchemaNotReady unless the
    schema is at :data:`SCHEMA_VERSION` (StoreError when newer). Only reads."""
    version = current_version(conn)
    _check(version, where)
    if version < SCHEMA_VERSION:
        raise schema_not_ready(where, "schema", version, SCHEMA_VERSION)
