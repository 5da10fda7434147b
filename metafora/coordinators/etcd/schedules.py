"""Periodic schedules in etcd, shared by the etcd coordinator and client.

One key per schedule, ``schedules/<name>`` (JSON: every, cron, props, missed, paused,
cursor, created_at); its ``mod_revision`` is the schedule's version. Materialising ticks is
one txn: the schedule key's mod_revision is unchanged (the compare-and-set) and every tick's
task key is absent; success writes the new cursor and creates the tasks. When some task
already exists (a user submitted that id), the txn is tried again without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from metafora.coordinators.etcd.driver import (
    Delete,
    EtcdDriver,
    KeyValue,
    Op,
    Put,
    Range,
    absent,
    modified_at,
)
from metafora.coordinators.etcd.layout import Keys, decode_json, encode_json, iso, parse_iso, unescape
from metafora.core.errors import ScheduleExists, ScheduleNotFound, StoreError
from metafora.core.schedule_model import Schedule
from metafora.core.task import Task

__all__ = ["delete", "insert", "list_schedules", "materialise", "set_paused"]

log = logging.getLogger(__name__)

_RETRIES = 5


def _encode(schedule: Schedule) -> bytes:
    return encode_json({
        "every": schedule.every,
        "cron": schedule.cron,
        "props": dict(schedule.props),
        "missed": schedule.missed,
        "paused": schedule.paused,
        "cursor": iso(schedule.cursor),
        "created_at": None if schedule.created_at is None else iso(schedule.created_at),
    })


def _decode(keys: Keys, kv: KeyValue) -> Schedule | None:
    name = unescape(kv.key[len(keys.schedules):].decode(errors="replace"))
    data = decode_json(kv.value)
    cursor = None if data is None else parse_iso(data.get("cursor"))
    if data is None or cursor is None:
        log.warning("schedule %s has an unreadable value; ignored", name)
        return None
    every: Any = data.get("every")
    expr: Any = data.get("cron")
    props: Any = data.get("props")
    if (isinstance(every, int) and every >= 1) == isinstance(expr, str):
        log.warning("schedule %s needs exactly one of every and cron; ignored", name)
        return None
    return Schedule(
        name=name,
        every=every if isinstance(every, int) else None,
        cron=expr if isinstance(expr, str) else None,
        props=props if isinstance(props, dict) else {},
        missed=str(data.get("missed", "skip")),
        paused=bool(data.get("paused", False)),
        cursor=cursor,
        created_at=parse_iso(data.get("created_at")),
        version=kv.mod_revision,
    )


def list_schedules(driver: EtcdDriver, keys: Keys) -> list[Schedule]:
    """Every schedule of the namespace, by name."""
    kvs, _ = driver.range(Range(keys.schedules, prefix=True))
    found = [_decode(keys, kv) for kv in kvs]
    return sorted((s for s in found if s is not None), key=lambda s: s.name)


def insert(driver: EtcdDriver, keys: Keys, schedule: Schedule) -> None:
    """Store a new schedule. Raises ScheduleExists."""
    key = keys.schedule(schedule.name)
    value = _encode(schedule)
    result = driver.txn([absent(key)], [Put(key, value)], [Range(key)], repeatable=True)
    if not result.succeeded and not (result.retried and result.ranges[0]
                                     and result.ranges[0][0].value == value):
        raise ScheduleExists(f"schedule {schedule.name!r} already exists")


def delete(driver: EtcdDriver, keys: Keys, name: str) -> None:
    """Delete a schedule. Raises ScheduleNotFound."""
    key = keys.schedule(name)
    kvs, _ = driver.range(Range(key))
    if not kvs:
        raise ScheduleNotFound(f"no schedule {name!r}")
    driver.txn([modified_at(key, kvs[0].mod_revision)], [Delete(key)], repeatable=True)


def set_paused(driver: EtcdDriver, keys: Keys, name: str, paused: bool, now: datetime) -> None:
    """Pause or resume (a resumed schedule starts after ``now``). Raises ScheduleNotFound."""
    key = keys.schedule(name)
    for _ in range(_RETRIES):
        kvs, _ = driver.range(Range(key))
        found = _decode(keys, kvs[0]) if kvs else None
        if found is None:
            raise ScheduleNotFound(f"no schedule {name!r}")
        if found.paused == paused:
            return
        cursor = found.cursor if paused else max(found.cursor, now)
        changed = Schedule(found.name, found.every, found.cron, found.props, found.missed, paused,
                           cursor, found.created_at)
        if driver.txn([modified_at(key, found.version)], [Put(key, _encode(changed))]).succeeded:
            return
    raise StoreError(f"could not {'pause' if paused else 'resume'} schedule {name!r}: it kept changing")


def materialise(driver: EtcdDriver, keys: Keys, schedule: Schedule, tasks: Sequence[Task],
                cursor: datetime, now: datetime) -> bool:
    """The atomic step (see the module docstring); whether this call moved the cursor."""
    key = keys.schedule(schedule.name)
    moved = Schedule(schedule.name, schedule.every, schedule.cron, schedule.props, schedule.missed,
                     schedule.paused, cursor, schedule.created_at)
    todo = list(tasks)
    created = iso(now)
    for _ in range(_RETRIES + len(todo)):
        task_keys = [keys.task(t.id) for t in todo]
        # A fresh task starts clean even if a crashed writer left a stray key behind.
        ops: list[Op] = [Put(key, _encode(moved))]
        for tk, task in zip(task_keys, todo, strict=True):
            ops += [Put(tk.props, encode_json({"props": dict(task.props), "created_at": created})),
                    Delete(tk.state), Delete(tk.claim), Delete(tk.running)]
        result = driver.txn([modified_at(key, schedule.version)] + [absent(tk.props) for tk in task_keys],
                            ops, [Range(key)] + [Range(tk.props, keys_only=True) for tk in task_keys])
        if result.succeeded:
            return True
        current = result.ranges[0]
        if not current or current[0].mod_revision != schedule.version:
            return False  # another node settled it first, or an operator changed it
        existing = {t.id for t, found in zip(todo, result.ranges[1:], strict=True) if found}
        log.info("schedule %s: %d tick task(s) existed already", schedule.name, len(existing),
                 extra={"action": "schedule"})
        todo = [t for t in todo if t.id not in existing]
    raise StoreError(f"could not materialise schedule {schedule.name!r}: the store kept changing")
