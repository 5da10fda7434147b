"""Retention in SQL (table ``metafora_retention``, schema v10), shared by the SQL client and
coordinator: the policy, the prune turn and one prune batch (see :mod:`metafora.core.retention`).

- The policy is one row per namespace (``done_secs``, ``failed_secs``, ``killed_secs``; NULL
  for never). No row: :data:`~metafora.core.retention.DEFAULT_RETENTION`.
- The turn is one statement: an upsert of the row whose ``DO UPDATE`` moves ``next_prune``
  to now + interval only ``WHERE next_prune <= now`` (database clock), ``RETURNING`` the
  policy. Of nodes racing, one gets a row back -- the compare-and-set a schedule's tick takes.
- A batch is one transaction: ``DELETE FROM metafora_tasks WHERE id IN (SELECT ... LIMIT
  :limit FOR UPDATE SKIP LOCKED) RETURNING id`` (PostgreSQL: rows another transaction holds
  -- a retry, a delete -- are skipped, never waited for; claims lock only pending and claimed
  rows, which are never candidates), then the same ids' state, task commands and gate items
  and partitions. A node that dies mid-batch rolls the whole batch back. What
  :meth:`~metafora.core.retention.RetentionOps.prune_also` registered (items in another database)
  is called with the batch's ids after the commit.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, inspect, text

from metafora.coordinators.members import stored_capacity
from metafora.coordinators.sql.store import Database
from metafora.core.retention import (
    DEFAULT_RETENTION,
    FAILED_MARKS,
    KILLED_MARKS,
    Cutoffs,
    PruneAlso,
    Retention,
    RetentionOps,
)

__all__ = ["SQLRetention", "get", "now", "pending_count", "prune_batch", "put", "turn"]

_GET = "SELECT done_secs, failed_secs, killed_secs FROM metafora_retention WHERE namespace = :ns"
_PUT = (
    "INSERT INTO metafora_retention (namespace, done_secs, failed_secs, killed_secs, next_prune,"
    " updated_at) VALUES (:ns, :done, :failed, :killed, {now}, {now})"
    " ON CONFLICT (namespace) DO UPDATE SET done_secs = excluded.done_secs,"
    " failed_secs = excluded.failed_secs, killed_secs = excluded.killed_secs,"
    " updated_at = excluded.updated_at"
)
_TURN = (
    "INSERT INTO metafora_retention (namespace, done_secs, failed_secs, killed_secs, next_prune,"
    " updated_at) VALUES (:ns, :done, :failed, :killed, {ts_plus_secs}, {now})"
    " ON CONFLICT (namespace) DO UPDATE SET next_prune = excluded.next_prune"
    " WHERE metafora_retention.next_prune <= {now}"
    " RETURNING done_secs, failed_secs, killed_secs, {now}"
)
# A done task's kind, from its state-machine state (no state: done). One scalar subquery per
# candidate row, through the state's primary key: PostgreSQL hashes an EXISTS in a CASE by a
# sequential scan of every state row instead (each batch read the whole table, twice: at
# 100,000 states a batch took 180-240 ms against 13-20 ms, and the claims paid for it).
_KIND = (
    "COALESCE((SELECT CASE WHEN s.body LIKE :killed1 OR s.body LIKE :killed2 THEN 'killed'"
    " WHEN s.body LIKE :failed1 OR s.body LIKE :failed2 THEN 'failed' END"
    " FROM metafora_state s WHERE s.namespace = :ns AND s.task_id = t.id), 'done')"
)
_DOOMED = (
    "DELETE FROM metafora_tasks WHERE namespace = :ns AND id IN (SELECT t.id FROM metafora_tasks t"
    " WHERE t.namespace = :ns AND t.state IN ('done', 'failed', 'expired')"
    " AND t.finished_at <= :oldest AND t.finished_at <= CASE WHEN t.state <> 'done'"
    " THEN CAST(:cut_failed AS {ts}) ELSE CASE " + _KIND
    + " WHEN 'killed' THEN CAST(:cut_killed AS {ts}) WHEN 'failed' THEN CAST(:cut_failed AS {ts})"
    " ELSE CAST(:cut_done AS {ts}) END END LIMIT :limit{lock}) RETURNING id"
)
# What is keyed by a task besides its row: (table, its task id column).
_CHILDREN = (
    ("metafora_state", "task_id"),
    ("metafora_task_commands", "task_id"),
    ("metafora_items", "partition_id"),
    ("metafora_partitions", "partition_id"),
)
# The pending rows, through the partial index of pending rows (work, not held tasks).
_PENDING = "SELECT count(*) FROM metafora_tasks WHERE namespace = :ns AND state = 'pending'"

PAUSE_SQLITE = 7.0
"""Rest after a full batch, in multiples of the batch's time, on SQLite."""
PAUSE_POSTGRES = 3.0
"""Rest after a full batch, in multiples of the batch's time, on PostgreSQL."""

_CAPACITIES = (
    "SELECT node_id, capacity FROM metafora_nodes WHERE namespace = :ns AND lease_until > {now}"
)

_tables: weakref.WeakKeyDictionary[Database, set[str]] = weakref.WeakKeyDictionary()


_built: dict[tuple[str, str], Any] = {}


def _sql(db: Database, template: str) -> Any:
    """``template`` with the dialect's fragments and types, compiled once per dialect."""
    key = (db.config.kind, template)
    found = _built.get(key)
    if found is None:
        fragments = dict(db.dialect.fragments())
        fragments.update(db.dialect.ddl_types())
        found = _built[key] = text(template.format(**fragments))
    return found


def _params(db: Database, policy: Retention) -> dict[str, Any]:
    done, failed, killed = policy.seconds()
    return {"ns": db.config.namespace, "done": done, "failed": failed, "killed": killed}


def get(db: Database) -> Retention:
    """The namespace's policy (the default when none is stored)."""
    with db.read() as conn:
        row = conn.execute(_sql(db, _GET), {"ns": db.config.namespace}).first()
    return DEFAULT_RETENTION if row is None else Retention.from_seconds(row[0], row[1], row[2])


def put(db: Database, policy: Retention) -> None:
    """Store the namespace's policy (the turn's timing is kept)."""
    with db.transaction() as conn:
        conn.execute(_sql(db, _PUT), _params(db, policy))


def turn(db: Database, interval: float) -> tuple[Retention, Cutoffs] | None:
    """Take the prune turn (see the module docstring): the policy and its cut-offs at the
    database's now, or None (another node took it within ``interval``)."""
    params = _params(db, DEFAULT_RETENTION)
    params["secs"] = float(interval)
    with db.transaction() as conn:
        row = conn.execute(_sql(db, _TURN), params).first()
    if row is None:
        return None
    policy = Retention.from_seconds(row[0], row[1], row[2])
    now = db.dialect.from_db_time(row[3])
    assert now is not None
    return policy, Cutoffs.at(policy, now)


def _present(db: Database, conn: Connection) -> set[str]:
    """The child tables that exist (created on first use by the state machine and gates)."""
    found = _tables.setdefault(db, set())
    missing = [name for name, _ in _CHILDREN if name not in found]
    if missing:
        inspector = inspect(conn)
        found.update(name for name in missing if inspector.has_table(name))
    return found


def prune_batch(db: Database, cutoffs: Cutoffs, limit: int,
                also: Sequence[PruneAlso] = ()) -> int:
    """Delete up to ``limit`` finished tasks past ``cutoffs`` and what is keyed by them, in
    one transaction, then call each of ``also`` with their ids (what lives in another
    database: :meth:`~metafora.core.retention.RetentionOps.prune_also`); how many tasks."""
    oldest = cutoffs.oldest()
    if oldest is None:
        return 0
    to_db = db.dialect.to_db_time
    params: dict[str, Any] = {
        "ns": db.config.namespace, "limit": int(limit), "oldest": to_db(oldest),
        "cut_done": to_db(cutoffs.done), "cut_failed": to_db(cutoffs.failed),
        "cut_killed": to_db(cutoffs.killed),
        "killed1": f"%{KILLED_MARKS[0]}%", "killed2": f"%{KILLED_MARKS[1]}%",
        "failed1": f"%{FAILED_MARKS[0]}%", "failed2": f"%{FAILED_MARKS[1]}%",
    }
    with db.transaction() as conn:
        ids = [str(row[0]) for row in conn.execute(_sql(db, _DOOMED), params)]
        if ids:
            present = _present(db, conn)
            for table, column in _CHILDREN:
                if table in present:
                    stmt = text(f"DELETE FROM {table} WHERE namespace = :ns AND {column} IN :ids")
                    conn.execute(stmt.bindparams(bindparam("ids", expanding=True)),
                                 {"ns": db.config.namespace, "ids": ids})
    if ids:
        for delete in also:
            delete(ids)
    return len(ids)


def now(db: Database) -> datetime:
    """The database's clock."""
    with db.read() as conn:
        found = db.dialect.from_db_time(conn.execute(_sql(db, "SELECT {now}")).scalar())
    assert found is not None
    return found


def pending_count(db: Database) -> int:
    """How many tasks are pending (an indexed count)."""
    with db.read() as conn:
        return int(conn.execute(text(_PENDING), {"ns": db.config.namespace}).scalar_one())


class SQLRetention(RetentionOps):
    """The retention hooks of the SQL client and coordinator over their :class:`Database`."""

    def _retention_db(self) -> Database:
        raise NotImplementedError

    def _retention_get(self) -> Retention:
        return get(self._retention_db())

    def _retention_put(self, policy: Retention) -> None:
        put(self._retention_db(), policy)

    def _prune_now(self) -> datetime:
        return now(self._retention_db())

    def _prune_turn(self, interval: float) -> tuple[Retention, Cutoffs] | None:
        return turn(self._retention_db(), interval)

    def _prune_batch(self, cutoffs: Cutoffs, limit: int) -> int:
        return prune_batch(self._retention_db(), cutoffs, limit, self._prune_extras())

    def node_capacities(self) -> dict[str, int]:
        """Live node -> its published capacity (the client's read; coordinators have their
        own, shared with the counts)."""
        db = self._retention_db()
        with db.read() as conn:
            rows = conn.execute(_sql(db, _CAPACITIES), {"ns": db.config.namespace}).fetchall()
        return {str(r[0]): c for r in rows if (c := stored_capacity(r[1])) is not None}

    def namespace_label(self) -> str:
        return self._retention_db().config.namespace

    def _prune_pause(self, elapsed: float) -> float:
        # SQLite has one writer: a batch holds off every claim while it runs (a prune takes at
        # most an eighth of the write lock: a consumer bound by the lock keeps 7/8 of its
        # throughput; at a sixth, 1,000,000 rows measured 0.83x, too near the 0.8x aimed at).
        # PostgreSQL claims skip the locked rows, but the batch's CPU and I/O are the claims'
        # too (a prune takes at most a quarter of them).
        return elapsed * (PAUSE_SQLITE if self._retention_db().config.kind == "sqlite" else PAUSE_POSTGRES)

    def pending_count(self) -> int:
        return pending_count(self._retention_db())
