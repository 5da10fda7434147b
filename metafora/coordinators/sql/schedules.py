"""Periodic schedules in SQL (table ``metafora_schedules``, schema v5), shared by the SQL
coordinator (list, materialise) and client (add, delete, pause, resume).

The atomic step of :meth:`~metafora.contracts.coordinator.Coordinator.materialise` is one transaction:
a conditional ``UPDATE ... WHERE version = :version`` of the schedule row (the
compare-and-set) and an ``INSERT ... ON CONFLICT DO NOTHING`` of the ticks' tasks. A node
that lost the race updates no row and writes nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from metafora.coordinators.sql.store import Database, task_params
from metafora.core.errors import InvalidProps, ScheduleExists, ScheduleNotFound
from metafora.core.schedule_model import Schedule
from metafora.core.task import Task, decode_props

__all__ = ["delete", "insert", "list_schedules", "materialise", "set_paused"]

log = logging.getLogger(__name__)

_COLUMNS = "name, every_secs, cron, props, missed, paused, tick_cursor, created_at, version"

_LIST = text(f"SELECT {_COLUMNS} FROM metafora_schedules WHERE namespace = :ns ORDER BY name")
_GET = text(f"SELECT {_COLUMNS} FROM metafora_schedules WHERE namespace = :ns AND name = :name")
_INSERT = text(
    "INSERT INTO metafora_schedules (namespace, name, every_secs, cron, props, missed, paused,"
    " tick_cursor, created_at, version) VALUES (:ns, :name, :every, :cron, :props, :missed,"
    " :paused, :cursor, :created, 1) ON CONFLICT (namespace, name) DO NOTHING RETURNING version"
)
_DELETE = text("DELETE FROM metafora_schedules WHERE namespace = :ns AND name = :name RETURNING version")
_PAUSE = text(
    "UPDATE metafora_schedules SET paused = :paused, tick_cursor = :cursor, version = version + 1"
    " WHERE namespace = :ns AND name = :name RETURNING version"
)
# The compare-and-set of materialise: only the holder of the version read moves the cursor.
_ADVANCE = text(
    "UPDATE metafora_schedules SET tick_cursor = :cursor, version = version + 1"
    " WHERE namespace = :ns AND name = :name AND version = :version RETURNING version"
)


def _schedule(db: Database, row: Any) -> Schedule:
    conv = db.dialect.from_db_time
    name = str(row[0])
    cursor = conv(row[6])
    assert cursor is not None
    return Schedule(
        name=name,
        every=None if row[1] is None else int(row[1]),
        cron=row[2],
        props=decode_props(row[3], name),
        missed=str(row[4]),
        paused=bool(row[5]),
        cursor=cursor,
        created_at=conv(row[7]),
        version=int(row[8]),
    )


def _notify(db: Database, conn: Connection) -> None:
    """Tell every node's scheduler (PostgreSQL NOTIFY, sent at commit)."""
    if db.config.kind == "postgresql":
        conn.execute(text("SELECT pg_notify(:chan, 's')"), {"chan": db.dialect.channel})


def list_schedules(db: Database) -> list[Schedule]:
    """Every schedule of the namespace, by name."""
    with db.read() as conn:
        rows = conn.execute(_LIST, {"ns": db.config.namespace}).fetchall()
    found = []
    for row in rows:
        try:
            found.append(_schedule(db, row))
        except InvalidProps as exc:  # a row written around metafora must not stop the others
            log.warning("schedule %s ignored: %s", row[0], exc, extra={"action": "schedule"})
    return found


def insert(db: Database, schedule: Schedule) -> None:
    """Store a new schedule. Raises ScheduleExists."""
    to_db = db.dialect.to_db_time
    params = {
        "ns": db.config.namespace, "name": schedule.name, "every": schedule.every,
        "cron": schedule.cron, "missed": schedule.missed, "paused": schedule.paused,
        "props": json.dumps(dict(schedule.props), separators=(",", ":"), sort_keys=True),
        "cursor": to_db(schedule.cursor), "created": to_db(schedule.created_at),
    }
    with db.transaction() as conn:
        row = conn.execute(_INSERT, params).first()
        if row is not None:
            _notify(db, conn)
    if row is None:
        raise ScheduleExists(f"schedule {schedule.name!r} already exists in {db.name}")


def delete(db: Database, name: str) -> None:
    """Delete a schedule. Raises ScheduleNotFound."""
    with db.transaction() as conn:
        row = conn.execute(_DELETE, {"ns": db.config.namespace, "name": name}).first()
        if row is not None:
            _notify(db, conn)
    if row is None:
        raise ScheduleNotFound(f"no schedule {name!r} in {db.name}")


def set_paused(db: Database, name: str, paused: bool, now: datetime) -> None:
    """Pause or resume (a resumed schedule starts after ``now``). Raises ScheduleNotFound."""
    ns = db.config.namespace
    with db.transaction() as conn:
        row = conn.execute(_GET, {"ns": ns, "name": name}).first()
        if row is None:
            raise ScheduleNotFound(f"no schedule {name!r} in {db.name}")
        found = _schedule(db, row)
        if found.paused == paused:
            return
        cursor = found.cursor if paused else max(found.cursor, now)
        conn.execute(_PAUSE, {"ns": ns, "name": name, "paused": paused,
                              "cursor": db.dialect.to_db_time(cursor)})
        _notify(db, conn)


def materialise(db: Database, schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
    """The atomic step (see the module docstring); whether this call moved the cursor."""
    ns = db.config.namespace
    with db.transaction() as conn:
        moved = conn.execute(_ADVANCE, {"ns": ns, "name": schedule.name, "version": schedule.version,
                                        "cursor": db.dialect.to_db_time(cursor)}).first()
        if moved is None:
            return False
        if tasks:
            params: dict[str, Any] = {"ns": ns}
            for n, task in enumerate(tasks):
                params.update(task_params(task, db, f"_{n}"))
            added = [int(row[1]) for row in conn.execute(db.sql.submit_many(len(tasks)), params)]
            if added:
                db.next_token_used(conn, max(added))
                db.execute(conn, "notify_batch", {"ready": min(added)})
            if len(added) < len(tasks):
                log.info("schedule %s: %d tick task(s) existed already", schedule.name,
                         len(tasks) - len(added), extra={"action": "schedule"})
    return True
