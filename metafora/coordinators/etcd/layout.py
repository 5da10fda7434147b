"""Where things live in etcd, and how stored values are encoded.

Every key is under ``/metafora/<namespace>/``; every prefix ends with ``/`` so that a
prefix operation on task ``foo`` can never touch task ``foobar``. Ids are percent-encoded
(``urllib.parse.quote(id, safe="")``), so an id containing ``/`` or ``%`` still maps to
exactly one path segment::

    tasks/<id>/props        {"props": {...}, "created_at": ISO[, "selector": {...}, "priority": N,
                            "prefer": {...}, "spread": "..."]}: the task exists iff this does
                            (placement keys only when set)
    tasks/<id>/state        {"state": "done"|"failed"|"expired", "error", "finished_at", "token"}
                            absent while the task is pending or claimed
    tasks/<id>/claim        {"node", "claimed_at"} of the latest claim (no lease):
                            mod_revision = that claim's token, version = number of claims
    tasks/<id>/running      {"crashes": N}: put by a claim, deleted by its outcome (no lease), so
                            a claim that finds it knows the previous one ended with its node dead;
                            or {"held_for": node, "until": ISO}: released by a node stopping
                            gracefully, held for its id (metafora.core.holds) on its hold lease, which
                            etcd expires at the end of the window (no crash either way)
    owners/<id>             value = owner node id, attached to the owner's lease;
                            create_revision = the fencing token of the claim
    nodes/<node>/alive      {"started_at", "host", "pid", "frozen", "leaving"[, "labels"][, "weight"]},
                            attached to the node's lease: the node is live (no weight: 1.0)
    nodes/<node>/hold       the id (decimal) of the node's hold lease, attached to it (drain)
    nodes/<node>/commands/<ns-time>-<random>   a command (JSON), attached to the node's lease;
                            taken in create-revision order and deleted when taken
    state/<id>              state-machine state of the task (fenced by the claim; written by
                            :mod:`metafora.coordinators.etcd.states`)
    taskcmds/<id>/<...>     state-machine commands to the task (same module)
    limits/<group>          {"max": N, "rate": [count, seconds]}: a group's limit (docs/limits.md)
    slots/<group>/<i>       "<task id>": concurrency slot i of the group (0 <= i < max), held by a
                            claim, attached to the claimer's lease; deleted by its outcome
    rates/<group>/<j>       "<task id>": rate slot j (0 <= j < count), put by a claim on a lease
                            that outlives the rate window
    schedules/<name>        a periodic schedule (JSON, see :mod:`metafora.coordinators.etcd.schedules`);
                            mod_revision = its compare-and-set version
    retention               the namespace's retention policy; ``retention-turn`` its prune turn
    pruned/<id>             a pruned task whose gate items (in SQL) are not deleted yet (both:
                            :mod:`metafora.coordinators.etcd.retention`)

Owner keys have their own prefix so that "who holds what" (node_task_count, the balancers'
view) is one small range read that never carries task props.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote

from metafora.coordinators.etcd.ops import KeyValue
from metafora.core.errors import InvalidProps, StoreError
from metafora.core.jsontext import load_object
from metafora.core.task import (
    MAX_PROPS_BYTES,
    MAX_PROPS_DEPTH,
    Task,
    TaskInfo,
    TaskState,
    parse_time,
    task_like,
    validate_group,
    validate_labels,
    validate_priority,
    validate_spread,
)

__all__ = [
    "Keys",
    "StoredProps",
    "TaskKeys",
    "crashes_of",
    "decode_json",
    "encode_json",
    "hold_of",
    "hold_record",
    "iso",
    "labels_of",
    "parse_iso",
    "props_of",
    "task_info",
    "task_record",
]

log = logging.getLogger(__name__)

ROOT = "metafora"


def escape(name: str) -> str:
    """One path segment for ``name`` (percent-encoding everything but ``A-Za-z0-9_.-~``)."""
    return quote(name, safe="")


def unescape(segment: str) -> str:
    """The name a segment encodes."""
    # Most ids need no escaping: a test is a tenth of unquote's cost (a re-list and every
    # watch event name a task).
    return unquote(segment) if "%" in segment else segment


def encode_json(data: dict[str, Any]) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def decode_json(raw: bytes) -> dict[str, Any] | None:
    """The JSON object in ``raw``, or None if it is not one (or is nested absurdly deep)."""
    try:
        return load_object(raw, "value", StoreError)
    except StoreError:
        return None


def iso(dt: datetime) -> str:
    """ISO-8601 text of an aware datetime."""
    return dt.isoformat()


def parse_iso(value: object) -> datetime | None:
    """An ISO-8601 time written by us, or None if absent or unreadable."""
    return _time(value)


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return parse_time(value, "time")
    except ValueError:
        return None


_TASK_KEYS_KEPT = 50_000
_TASK_FIELDS = {f.encode(): f for f in ("props", "state", "claim", "running")}


class Keys:
    """The key layout of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.root = f"/{ROOT}/{namespace}/".encode()
        self.tasks = self.root + b"tasks/"
        self.owners = self.root + b"owners/"
        self.nodes = self.root + b"nodes/"
        self.states = self.root + b"state/"
        self.task_commands = self.root + b"taskcmds/"
        self.schedules = self.root + b"schedules/"
        self.limits = self.root + b"limits/"  # limits/<group>: the limit (JSON)
        self.slots = self.root + b"slots/"  # slots/<group>/<i>: a held concurrency slot
        self.rates = self.root + b"rates/"  # rates/<group>/<j>: a claim inside the rate window
        self._task_keys: dict[str, TaskKeys] = {}

    def schedule(self, name: str) -> bytes:
        """The key of a periodic schedule."""
        return self.schedules + escape(name).encode()

    def task(self, task_id: str) -> TaskKeys:
        """The keys of one task (remembered: a claim and its outcome build them several times,
        and percent-encoding is not free)."""
        found = self._task_keys.get(task_id)
        if found is None:
            if len(self._task_keys) >= _TASK_KEYS_KEPT:
                self._task_keys.clear()  # simplest bound; rebuilt on demand
            found = self._task_keys[task_id] = self._build_task(task_id)
        return found

    def _build_task(self, task_id: str) -> TaskKeys:
        seg = escape(task_id).encode()
        base = self.tasks + seg + b"/"
        return TaskKeys(
            prefix=base,
            props=base + b"props",
            state=base + b"state",
            claim=base + b"claim",
            running=base + b"running",
            owner=self.owners + seg,
            machine=self.states + seg,
            commands=self.task_commands + seg + b"/",
        )

    def node_alive(self, node_id: str) -> bytes:
        """The registration key of a node."""
        return self.nodes + escape(node_id).encode() + b"/alive"

    def node_hold(self, node_id: str) -> bytes:
        """The key naming a node's hold lease (``metafora nodes drain`` revokes it)."""
        return self.nodes + escape(node_id).encode() + b"/hold"

    def node_commands(self, node_id: str) -> bytes:
        """The prefix of a node's command queue."""
        return self.nodes + escape(node_id).encode() + b"/commands/"

    def is_claim(self, key: bytes) -> bool:
        """Whether ``key`` is a task's claim key (``tasks/<escaped id>/claim``: an escaped id
        holds no slash). No watch cache keeps claim keys: their events are skipped undecoded."""
        return key.endswith(b"/claim") and key.startswith(self.tasks)

    def parse(self, key: bytes) -> tuple[str, str, str] | None:
        """Classify a key: ("task", id, field), ("owner", id, ""), ("alive", node, ""),
        ("command", node, name), ("taskcmd", id, name), ("schedule", name, "") or None for
        anything else."""
        # Owner and task keys first, in bytes: every watch event and re-listed key is one.
        if key.startswith(self.owners):
            owned = key[len(self.owners):]
            if owned and b"/" not in owned:
                return ("owner", unescape(owned.decode(errors="replace")), "")
            return None
        if key.startswith(self.tasks):
            task_seg, sep, task_field = key[len(self.tasks):].partition(b"/")
            name = _TASK_FIELDS.get(task_field)
            if sep and task_seg and name is not None:
                return ("task", unescape(task_seg.decode(errors="replace")), name)
            return None
        if not key.startswith(self.root):
            return None
        rest = key[len(self.root) :].decode(errors="replace")
        kind, _, tail = rest.partition("/")
        if kind == "schedules":
            if tail and "/" not in tail:
                return ("schedule", unescape(tail), "")
        elif kind == "taskcmds":
            seg, slash, name = tail.partition("/")
            if slash and seg and name:
                return ("taskcmd", unescape(seg), name)
        elif kind == "nodes":
            seg, slash, field = tail.partition("/")
            if slash and seg:
                if field == "alive":
                    return ("alive", unescape(seg), "")
                if field.startswith("commands/") and len(field) > len("commands/"):
                    return ("command", unescape(seg), field[len("commands/") :])
        return None


@dataclass(frozen=True)
class TaskKeys:
    """The keys of one task (see the module docstring)."""

    prefix: bytes
    props: bytes
    state: bytes
    claim: bytes
    running: bytes
    owner: bytes
    machine: bytes
    commands: bytes


@dataclass
class TaskRecord:
    """What etcd holds about one task, gathered from its keys."""

    props: KeyValue | None = None
    state: KeyValue | None = None
    claim: KeyValue | None = None
    owner: KeyValue | None = None
    running: KeyValue | None = None

    def set(self, field: str, kv: KeyValue | None) -> None:
        """Store a key by its field name (props, state, claim, owner, running)."""
        setattr(self, field, kv)


@dataclass(frozen=True)
class StoredProps:
    """What a props key holds: the props, or, for a damaged value, ``{}`` and the damage."""

    props: dict[str, Any]
    created_at: datetime | None
    error: str | None = None
    selector: dict[str, str] = field(default_factory=dict)
    priority: int = 0
    prefer: dict[str, str] = field(default_factory=dict)
    spread: str | None = None
    group: str | None = None

    made: list[Any] = field(default_factory=list, compare=False, repr=False)
    """The first task built from this record, then its props as JSON: later tasks of a
    record read once for many (see :func:`props_of`) are copies of it."""

    def task(self, task_id: str, token: int = 0) -> Task:
        """The task this record describes, carrying ``token``."""
        made = self.made
        if made:
            if len(made) == 1:
                made.append(json.dumps(made[0].props, separators=(",", ":")))
            text = made[1]
            return task_like(made[0], task_id, {} if text == "{}" else json.loads(text), token)
        task = Task(task_id, self.props, token, selector=self.selector, priority=self.priority,
                    prefer=self.prefer, spread=self.spread, group=self.group)
        made.append(task)
        return task


def task_record(task: Task, created: str) -> bytes:
    """The value of a new task's props key."""
    record: dict[str, Any] = {"props": dict(task.props), "created_at": created}
    if task.selector:
        record["selector"] = dict(task.selector)
    if task.priority:
        record["priority"] = task.priority
    if task.prefer:
        record["prefer"] = dict(task.prefer)
    if task.spread is not None:
        record["spread"] = task.spread
    if task.group is not None:
        record["group"] = task.group
    return encode_json(record)


def labels_of(data: dict[str, Any], node_id: str) -> dict[str, str]:
    """The labels a node's registration record publishes (damaged: none, logged)."""
    try:
        return validate_labels(data.get("labels") or {}, f"stored labels of node {node_id!r}")
    except InvalidProps as exc:
        log.warning("%s", exc)
        return {}


_SHAPES = 64  # props values kept with their validated task (see props_of)
_SHAPE_BYTES = 1024  # longer values are decoded each time


def props_of(kv: KeyValue, task_id: str) -> StoredProps:
    """Read a props key. A damaged value (not JSON, too deep or large, no props object) is
    reported in ``error``, never taken for empty props: a claim fails such a task.

    A value read before (a backlog submitted together shares one: same props, same
    ``created_at``) is decoded and validated once: the same :class:`StoredProps` is returned,
    whose :meth:`~StoredProps.task` copies the first task it built. Its props are shared,
    read-only.
    """
    if len(kv.value) <= _SHAPE_BYTES:
        stored = _shape(kv.value)
        if stored is not None:
            return stored
    return _props_of(kv.value, task_id)


@functools.lru_cache(maxsize=_SHAPES)
def _shape(value: bytes) -> StoredProps | None:
    """The record of a valid ``value``, kept for the next reads of the same value; None when
    damaged (then read again, to name the task in the damage)."""
    stored = _props_of(value, "shape")
    return None if stored.error is not None else stored


def _props_of(value: bytes, task_id: str) -> StoredProps:
    what = f"stored props of task {task_id!r}"
    try:
        if len(value) > 2 * MAX_PROPS_BYTES:
            raise InvalidProps(f"{what}: {len(value)} bytes, over the limit of {MAX_PROPS_BYTES}")
        # The record wraps the props one level down: {"props": {...}, "created_at": ...}.
        data = load_object(value, what, InvalidProps, MAX_PROPS_DEPTH, top=0)
        if "props" not in data:
            raise InvalidProps(f"{what}: the record has no props")
        props = data["props"]
        if not isinstance(props, dict):
            raise InvalidProps(f"{what}: must be a JSON object, not {type(props).__name__}")
        selector = validate_labels(data.get("selector") or {}, f"stored selector of task {task_id!r}")
        priority = validate_priority(data.get("priority", 0))
        prefer = validate_labels(data.get("prefer") or {}, f"stored prefer of task {task_id!r}")
        spread = validate_spread(data.get("spread"))
        group = validate_group(data.get("group"))
    except InvalidProps as exc:
        return StoredProps({}, None, str(exc))
    return StoredProps(props, _time(data.get("created_at")), selector=selector, priority=priority,
                       prefer=prefer, spread=spread, group=group)


def state_of(kv: KeyValue) -> tuple[TaskState, dict[str, Any]]:
    """The finished state a state key records (a damaged value reads as failed)."""
    data = decode_json(kv.value) or {}
    try:
        state = TaskState(str(data.get("state")))
    except ValueError:
        state = TaskState.FAILED
        data.setdefault("error", f"unreadable state record {kv.value[:80]!r}")
    if state in (TaskState.PENDING, TaskState.CLAIMED):
        state = TaskState.FAILED
    return state, data


def crashes_of(kv: KeyValue | None) -> int | None:
    """The crash count a running key records; None if there is no running key."""
    if kv is None:
        return None
    # A handful of distinct values ({"crashes": N}) come with every claim's watch event on
    # every node: each short one is decoded once.
    return _crashes_kept(kv.value) if len(kv.value) <= _SHAPE_BYTES else _crashes_in(kv.value)


def _crashes_in(value: bytes) -> int | None:
    data = decode_json(value) or {}
    if "held_for" in data:
        return None  # a graceful release held for its node: no crash
    count = data.get("crashes")
    return count if isinstance(count, int) and count >= 0 else 0


def hold_record(node_id: str, until: datetime) -> bytes:
    """The running key's value of a task released held for ``node_id`` (until: for views;
    the hold lease's expiry, by etcd's clock, is what ends it)."""
    return encode_json({"held_for": node_id, "until": iso(until)})


def hold_of(kv: KeyValue | None) -> tuple[str, datetime | None] | None:
    """(node, until) of a running key that holds its task for a node, else None."""
    if kv is None or b"held_for" not in kv.value:
        return None
    data = decode_json(kv.value) or {}
    node = data.get("held_for")
    return (node, _time(data.get("until"))) if isinstance(node, str) else None


_crashes_kept = functools.lru_cache(maxsize=_SHAPES)(_crashes_in)


def task_info(task_id: str, rec: TaskRecord) -> TaskInfo | None:
    """The :class:`TaskInfo` of a task's keys (None if it has no props key)."""
    if rec.props is None:
        return None
    stored = props_of(rec.props, task_id)
    claim = decode_json(rec.claim.value) if rec.claim is not None else None
    attempts = rec.claim.version if rec.claim is not None else 0
    token = rec.claim.mod_revision if rec.claim is not None else 0
    owner = None
    claimed_at = None
    error = stored.error
    finished = None
    if rec.state is not None:
        state, data = state_of(rec.state)
        err = data.get("error")
        error = err if isinstance(err, str) else error
        finished = _time(data.get("finished_at"))
    elif rec.owner is not None:
        state = TaskState.CLAIMED
        owner = rec.owner.value.decode(errors="replace")
        token = rec.owner.create_revision
        if claim is not None and rec.claim is not None and rec.claim.mod_revision == token:
            claimed_at = _time(claim.get("claimed_at"))
    else:
        state = TaskState.PENDING
    hold = hold_of(rec.running) if state is TaskState.PENDING else None
    return TaskInfo(
        id=task_id,
        props=stored.props,
        state=state,
        owner=owner,
        token=token,
        claimed_at=claimed_at,
        error=error,
        created_at=stored.created_at,
        finished_at=finished,
        attempts=attempts,
        selector=stored.selector,
        priority=stored.priority,
        prefer=stored.prefer,
        spread=stored.spread,
        group=stored.group,
        held_for=hold[0] if hold is not None else None,
        held_until=hold[1] if hold is not None else None,
    )


def gather(keys: Keys, kvs: list[KeyValue]) -> dict[str, TaskRecord]:
    """Group task and owner keys by task id."""
    records: dict[str, TaskRecord] = {}
    for kv in kvs:
        parsed = keys.parse(kv.key)
        if parsed is None:
            continue
        kind, task_id, field = parsed
        if kind in {"task", "owner"}:
            record = records.get(task_id)
            if record is None:  # (not setdefault: a record built for every key of a task)
                record = records[task_id] = TaskRecord()
            record.set(field if kind == "task" else "owner", kv)
    return records
