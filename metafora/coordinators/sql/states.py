"""State store and task commands for SQL coordinators (SQLite, PostgreSQL).

Tables:

- ``metafora_state`` (the SQL coordinator's schema: namespace, task_id, token, body,
  updated_at): one row per task, ``body`` the state's JSON wire form, ``token`` the claim it
  was written under. ``delete_task`` and ``purge`` remove it with the task.
- ``metafora_task_commands`` (created here, ``CREATE TABLE IF NOT EXISTS``, on first use):
  per-task command FIFO by ``id``; a row is deleted when the task's machine takes it.

Commands are pushed: queuing one sends ``m<task id>`` on the namespace's NOTIFY channel
(PostgreSQL), which the owner's coordinator hands to its
:class:`~metafora.statemachine.mailbox.CommandBell`; on SQLite the coordinator's
``data_version`` check asks for one look at which tasks have commands. Either way a waiting
task reads its queue only when something arrived, and the safety net is one
``cmd_pending_ids`` per node per ``command_recheck`` (``max(poll_interval, 30 s)``), not a
query per task.

Fencing: a write is **one statement** -- an upsert whose ``SELECT`` only yields a row while
the task is claimed under ``task.token`` by a node whose lease is live by the database
clock, and whose ``DO UPDATE`` only replaces a state written under a token ``<=`` ours. No
row back means the claim is gone: ClaimLost. A zombie (paused past its lease, the task
re-claimed elsewhere) can therefore never commit a state.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from sqlalchemy import Connection, TextClause, text

from metafora.coordinators.sql.shared import Database, claim_held, database_of, schema_not_ready
from metafora.core.errors import ClaimLost, StoreError
from metafora.core.task import Task
from metafora.statemachine.machine import State
from metafora.statemachine.mailbox import CommandBell
from metafora.statemachine.store import (
    LeaseBound,
    StateStore,
    TaskCommands,
    bell_for,
    lease_bound_of,
    parsed_page,
    poll_take,
)

__all__ = ["SQLStateStore", "SQLTaskCommands", "ensure_command_table"]

log = logging.getLogger(__name__)

_POLL = 0.5  # real seconds between looks of the stateless receive() (mailboxes are pushed)

_CLAIM_HELD = claim_held()

_TASK_CREATED = (
    "(SELECT tc.created_at FROM metafora_tasks tc WHERE tc.namespace = :ns AND tc.id = :id)"
)
_CURRENT = "c.namespace = :ns AND c.task_id = :id AND c.created_at >= " + _TASK_CREATED
_STALE = (
    "c.namespace = :ns AND c.task_id = :id AND (c.created_at < " + _TASK_CREATED
    + " OR NOT EXISTS (SELECT 1 FROM metafora_tasks tx WHERE tx.namespace = :ns AND tx.id = :id))"
)

_SQL: dict[str, str] = {
    "store": (
        "INSERT INTO metafora_state (namespace, task_id, token, body, updated_at)"
        " SELECT :ns, :id, :token, :body, {now} WHERE " + _CLAIM_HELD
        + " ON CONFLICT (namespace, task_id) DO UPDATE SET token = excluded.token,"
        " body = excluded.body, updated_at = excluded.updated_at"
        " WHERE metafora_state.token <= excluded.token"
        " RETURNING token"
    ),
    "load": (
        "SELECT s.token, s.body FROM metafora_tasks t LEFT JOIN metafora_state s"
        " ON s.namespace = t.namespace AND s.task_id = t.id"
        " WHERE t.namespace = :ns AND t.id = :id AND " + _CLAIM_HELD
    ),
    "get": "SELECT token, body FROM metafora_state WHERE namespace = :ns AND task_id = :id",
    "put_raw": (
        "INSERT INTO metafora_state (namespace, task_id, token, body, updated_at)"
        " VALUES (:ns, :id, :token, :body, {now}) ON CONFLICT (namespace, task_id) DO UPDATE"
        " SET token = excluded.token, body = excluded.body, updated_at = excluded.updated_at"
    ),
    "claim_held": "SELECT 1 WHERE " + _CLAIM_HELD,
    # A command is current if it was queued after the task was (last) submitted: a task
    # deleted and submitted again under the same id must not get its namesake's commands.
    "cmd_peek": (
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM metafora_task_commands c WHERE " + _CURRENT
        + ") THEN 1 ELSE 0 END, CASE WHEN EXISTS (SELECT 1 FROM metafora_task_commands c"
        " WHERE " + _STALE + ") THEN 1 ELSE 0 END, CASE WHEN " + _CLAIM_HELD + " THEN 1 ELSE 0 END"
    ),
    "cmd_drop_stale": "DELETE FROM metafora_task_commands WHERE id IN (SELECT c.id"
    " FROM metafora_task_commands c WHERE " + _STALE + ")",
    "cmd_take": (
        "DELETE FROM metafora_task_commands WHERE id = (SELECT c.id FROM metafora_task_commands c"
        " WHERE " + _CURRENT + " ORDER BY c.id LIMIT 1{lock}) RETURNING body"
    ),
    "cmd_take_fenced": (
        "DELETE FROM metafora_task_commands WHERE id = (SELECT c.id FROM metafora_task_commands c"
        " WHERE " + _CURRENT + " ORDER BY c.id LIMIT 1{lock}) AND " + _CLAIM_HELD
        + " RETURNING body"
    ),
    "cmd_push": (
        "INSERT INTO metafora_task_commands (namespace, task_id, body, created_at)"
        " VALUES (:ns, :id, :body, {now}) RETURNING {notify_task_cmd}"
    ),
    "cmd_pending_ids": "SELECT DISTINCT task_id FROM metafora_task_commands WHERE namespace = :ns",
    "cmd_count": "SELECT count(*) FROM metafora_task_commands c WHERE " + _CURRENT,
    "cmd_clear": "DELETE FROM metafora_task_commands WHERE namespace = :ns AND task_id = :id",
}

_DDL = [
    "CREATE TABLE IF NOT EXISTS metafora_task_commands ("
    " id {serial_pk}, namespace {key} NOT NULL, task_id {key} NOT NULL,"
    " body TEXT NOT NULL, created_at {ts} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS metafora_task_commands_task"
    " ON metafora_task_commands (namespace, task_id, id)",
]


class _Statements:
    """This module's statements, built once per database handle."""

    _cache: weakref.WeakKeyDictionary[Database, _Statements] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, db: Database) -> None:
        fragments = db.dialect.fragments()
        self.db = weakref.proxy(db)
        self.sql: dict[str, TextClause] = {
            name: text(sql.format(now=fragments["now"], lock=fragments["lock"],
                                  notify_task_cmd=fragments["notify_task_cmd"]))
            for name, sql in _SQL.items()
        }
        types = db.dialect.ddl_types()
        self.ddl = [text(ddl.format(**types)) for ddl in _DDL]
        self.tables_ready = False

    @classmethod
    def of(cls, db: Database) -> _Statements:
        with cls._lock:
            built = cls._cache.get(db)
            if built is None:
                built = cls._cache[db] = cls(db)
            return built

    def run(self, conn: Connection, name: str, params: dict[str, Any]) -> Any:
        params["ns"] = self.db.config.namespace
        return conn.execute(self.sql[name], params)

    def ensure(self) -> None:
        """The coordinator's schema, plus this module's command table (once per handle)."""
        if self.tables_ready:
            return
        self.db.ensure_schema()
        with self._lock:
            if self.tables_ready:
                return
            if not self.db.config.migrate:  # the release step creates it (metafora migrate)
                self._require_table()
                self.tables_ready = True
                return
            try:
                with self.db.transaction() as conn:
                    for ddl in self.ddl:
                        conn.execute(ddl)
            except StoreError:
                # Two processes creating the table at once (PostgreSQL may report a
                # duplicate type): fine if it now exists.
                with self.db.read() as conn:
                    conn.execute(text("SELECT 1 FROM metafora_task_commands WHERE 1 = 0"))
            self.tables_ready = True

    def _require_table(self) -> None:
        try:
            with self.db.read() as conn:
                conn.execute(text("SELECT 1 FROM metafora_task_commands WHERE 1 = 0"))
        except StoreError:
            raise schema_not_ready(self.db.name, "task command table", 0, 1) from None


def ensure_command_table(db: Database) -> None:
    """Create the task command table if it is missing (what ``metafora migrate`` applies
    beside the migrations; a no-op once it exists)."""
    _Statements.of(db).ensure()


class SQLStateStore(StateStore):
    """Task states in ``metafora_state``, fenced by the claim token and the owner's lease."""

    def __init__(self, db: Database, bound: LeaseBound | None = None) -> None:
        self._db = db
        self._st = _Statements.of(db)
        self._bound = bound or LeaseBound()

    @classmethod
    def of(cls, coordinator_or_client: object) -> SQLStateStore:
        """The state store on a SQL coordinator's or client's database handle (a
        coordinator's bounds every fenced call by the node's lease)."""
        return cls(database_of(coordinator_or_client), lease_bound_of(coordinator_or_client))

    def load(self, task: Task) -> State:
        return self.load_stored(task) or State()

    def load_stored(self, task: Task) -> State | None:
        self._st.ensure()

        def read(_timeout: float | None) -> Any:
            # A read never waits for a lock (WAL / MVCC); it is bounded for the lost check.
            with self._db.read() as conn:
                return self._st.run(conn, "load", {"id": task.id, "token": task.token}).first()

        row = self._bound.call(task, "state load", read)
        if row is None:
            raise ClaimLost(f"task {task.id!r} is no longer claimed with token {task.token}")
        token, body = row
        if body is None:
            return None
        if int(token) > task.token:
            raise ClaimLost(f"task {task.id!r}: state was written under token {token} > {task.token}")
        return State.from_json(body)

    def store(self, task: Task, state: State) -> None:
        self._st.ensure()
        params = {"id": task.id, "token": task.token, "body": state.to_json()}

        def write(timeout: float | None) -> Any:
            if timeout is None:
                with self._db.write() as conn:  # one round trip when unbounded
                    return self._st.run(conn, "store", params).first()
            with self._db.bounded(timeout) as conn:
                return self._st.run(conn, "store", params).first()

        row = self._bound.call(task, "state write", write)
        if row is None:
            raise ClaimLost(f"task {task.id!r} is no longer claimed with token {task.token}")

    def store_in(self, task: Task, state: State, conn: Any) -> None:
        """As :meth:`store`, on the application's transaction ``conn`` (one fenced upsert;
        ClaimLost when the claim is not current: roll back). ``conn`` is checked as every
        ``conn=`` is (an open transaction on this store's own database, never autocommit)."""
        from metafora.coordinators.sql.submit import run_app_steps

        self._st.ensure()  # the command table, on metafora's own connection
        clause = self._st.sql["store"]
        params = {"ns": self._db.config.namespace, "id": task.id, "token": task.token,
                  "body": state.to_json()}

        def steps() -> Any:
            rows = yield clause, params
            if not rows:
                raise ClaimLost(f"task {task.id!r} is no longer claimed with token {task.token}: "
                                "nothing was written (roll back)")
            return 1

        run_app_steps(conn, self._db, steps())

    def get(self, task_id: str) -> State | None:
        self._st.ensure()
        with self._db.read() as conn:
            row = self._st.run(conn, "get", {"id": task_id}).first()
        return None if row is None else State.from_json(row[1])

    def page(self, *, prefix: str = "", after: str | None = None,
             limit: int = 100) -> list[tuple[str, State]] | None:
        """One indexed query on ``metafora_state``'s primary key (``task_id > :after ORDER
        BY task_id LIMIT``): it reads the states it returns (damaged ones left out), no task."""
        from metafora.coordinators.sql.client import key_range

        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._st.ensure()
        where = ["namespace = :ns"]
        params: dict[str, Any] = {"ns": self._db.config.namespace, "limit": limit}
        key_range("task_id", prefix, after, where, params)
        sql = (f"SELECT task_id, body FROM metafora_state WHERE {' AND '.join(where)}"
               " ORDER BY task_id LIMIT :limit")
        with self._db.read() as conn:
            rows = conn.execute(text(sql), params).fetchall()
        return parsed_page((str(task_id), body) for task_id, body in rows)

    def token_of(self, task_id: str) -> int | None:
        """The claim token the task's state was last written under (for tests)."""
        self._st.ensure()
        with self._db.read() as conn:
            row = self._st.run(conn, "get", {"id": task_id}).first()
        return None if row is None else int(row[0])

    def put_raw(self, task_id: str, token: int, body: str) -> None:
        """Store raw (possibly malformed) state text, unfenced, for fault tests."""
        self._st.ensure()
        with self._db.write() as conn:
            self._st.run(conn, "put_raw", {"id": task_id, "token": token, "body": body})


class SQLTaskCommands(TaskCommands):
    """Per-task command queues in ``metafora_task_commands``."""

    def __init__(self, db: Database, owner: object = None) -> None:
        self._db = db
        self._st = _Statements.of(db)
        self._bell = bell_for(owner, self._take, self._pending_ids, db.config.command_recheck)

    @classmethod
    def of(cls, coordinator_or_client: object) -> SQLTaskCommands:
        """The command channel on a SQL coordinator's or client's database handle
        (pushed to mailboxes when built from a coordinator)."""
        return cls(database_of(coordinator_or_client), coordinator_or_client)

    def bell(self) -> CommandBell | None:
        return self._bell

    def _pending_ids(self) -> set[str]:
        self._st.ensure()
        with self._db.read() as conn:
            return {str(row[0]) for row in self._st.run(conn, "cmd_pending_ids", {})}

    def _push(self, task_id: str, raw: str) -> None:
        self._st.ensure()
        with self._db.write() as conn:
            self._st.run(conn, "cmd_push", {"id": task_id, "body": raw}).all()  # (sends the NOTIFY)

    def inject_raw(self, task_id: str, raw: str) -> None:
        """Queue raw (possibly malformed) command text, bypassing validation (fault tests)."""
        self._push(task_id, raw)

    def _take(self, task_id: str, token: int | None) -> str | None:
        self._st.ensure()
        params = {"id": task_id, "token": -1 if token is None else token}
        # A read first: waiting tasks must not take SQLite's write lock on every look.
        with self._db.read() as conn:
            waiting, stale, held = self._st.run(conn, "cmd_peek", params).one()
        if stale:
            with self._db.write() as conn:
                dropped = self._st.run(conn, "cmd_drop_stale", {"id": task_id}).rowcount
            log.info("dropped %s command(s) queued for an earlier task %s", dropped, task_id)
        if token is not None and not held:
            raise ClaimLost(f"task {task_id!r} is no longer claimed with token {token}")
        if not waiting:
            return None
        with self._db.write() as conn:
            if token is None:
                row = self._st.run(conn, "cmd_take", {"id": task_id}).first()
            else:
                params = {"id": task_id, "token": token}
                row = self._st.run(conn, "cmd_take_fenced", params).first()
                if row is None and self._st.run(conn, "claim_held", params).first() is None:
                    raise ClaimLost(f"task {task_id!r} is no longer claimed with token {token}")
        return None if row is None else str(row[0])

    def _pop(self, task_id: str, timeout: float | None, token: int | None,
             cancel: threading.Event | None) -> str | None:
        return poll_take(lambda: self._take(task_id, token), timeout, cancel, _POLL)

    def pending(self, task_id: str) -> int:
        self._st.ensure()
        with self._db.read() as conn:
            return int(self._st.run(conn, "cmd_count", {"id": task_id}).scalar_one())

    def clear(self, task_id: str) -> None:
        """Drop every queued command of the task (e.g. after deleting it)."""
        self._st.ensure()
        with self._db.write() as conn:
            self._st.run(conn, "cmd_clear", {"id": task_id})
