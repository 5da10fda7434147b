"""Tasks, their stored view and their states."""

from __future__ import annotations

import enum
import json
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from metafora.errors import InvalidProps, InvalidTaskId
from metafora.jsontext import MAX_DEPTH, check_depth, load_object

__all__ = [
    "MAX_PROPS_BYTES",
    "MAX_PROPS_DEPTH",
    "MAX_TASK_ID_LENGTH",
    "Task",
    "TaskInfo",
    "TaskState",
    "decode_props",
    "parse_time",
    "validate_schedule",
    "validate_task_id",
]

MAX_TASK_ID_LENGTH = 256
MAX_PROPS_BYTES = 1024 * 1024
"""The largest props a task may carry, as compact JSON (UTF-8 bytes). etcd refuses requests
over 1.5 MiB by default; one limit for every store keeps a task portable between them."""
MAX_PROPS_DEPTH = MAX_DEPTH
"""How deeply props may nest objects and arrays (the props object itself is level 1)."""
_TIME_PROPS = ("launch_at", "expires_at")


class TaskState(enum.StrEnum):
    """Where a task is in its life. A task is always in exactly one of these."""

    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


def validate_task_id(task_id: object) -> str:
    """Return ``task_id`` if it is a valid id, else raise :class:`InvalidTaskId` saying why."""
    if not isinstance(task_id, str):
        raise InvalidTaskId(f"task id must be a string, not {type(task_id).__name__}")
    if not task_id.strip():
        raise InvalidTaskId("task id must not be empty or blank")
    if task_id != task_id.strip():
        # One rule for blank and padded ids: `"a "` and `"a"` would look alike in every listing.
        raise InvalidTaskId(f"task id {task_id!r} must not start or end with whitespace")
    if len(task_id) > MAX_TASK_ID_LENGTH:
        raise InvalidTaskId(
            f"task id is {len(task_id)} characters long; the limit is {MAX_TASK_ID_LENGTH}"
        )
    for ch in task_id:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            raise InvalidTaskId(f"task id {task_id!r} contains the control character {ch!r}")
    return task_id


def parse_time(value: object, what: str) -> datetime:
    """Parse an ISO-8601 time (naive means UTC) or a datetime into an aware UTC datetime."""
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            raise InvalidProps(f"{what} must be an ISO-8601 time, got {value!r}") from None
    else:
        raise InvalidProps(f"{what} must be an ISO-8601 time string, got {type(value).__name__}")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC)


def validate_schedule(task: Task, now: datetime) -> Task:
    """Return ``task`` if it could ever be claimed after ``now``, else raise :class:`InvalidProps`.

    Refused: an ``expires_at`` at or before ``launch_at`` (never claimable) and an
    ``expires_at`` already past at ``now`` (the store's clock where the client has one).
    Every ``Client.submit_task`` calls this; stored tasks are not re-checked, so a task
    that expires later is still read back and shown as ``expired``.
    """
    launch, expires = task.launch_at, task.expires_at
    if expires is None:
        return task
    if launch is not None and expires <= launch:
        raise InvalidProps(
            f"task {task.id!r}: expires_at {expires.isoformat()} is not after launch_at "
            f"{launch.isoformat()}, so the task could never be claimed"
        )
    if expires <= now:
        raise InvalidProps(
            f"task {task.id!r}: expires_at {expires.isoformat()} is already past "
            f"(now {now.astimezone(UTC).isoformat()})"
        )
    return task


def _freeze_props(props: object) -> Mapping[str, Any]:
    if not isinstance(props, Mapping):
        raise InvalidProps(f"props must be a JSON object (a mapping), not {type(props).__name__}")
    for key in props:
        if not isinstance(key, str):
            raise InvalidProps(f"props keys must be strings, got {key!r}")
    # Depth first, without recursion: json.dumps of a deep structure would raise RecursionError
    # at a depth that depends on the caller's own stack.
    check_depth(props, "props", InvalidProps)
    try:
        encoded = json.dumps(dict(props), allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidProps(f"props are not JSON-serialisable: {exc}") from None
    if len(encoded) > MAX_PROPS_BYTES:  # ASCII (json.dumps escapes the rest): len is bytes
        raise InvalidProps(f"props take {len(encoded)} bytes as JSON; the limit is {MAX_PROPS_BYTES}")
    # The JSON round trip also takes a private copy of the caller's data.
    plain: dict[str, Any] = json.loads(encoded)
    for name in _TIME_PROPS:
        if name in plain and plain[name] is not None:
            parse_time(plain[name], f"prop {name!r}")
    return plain  # a private copy; the dataclass is frozen, so it is never swapped


def decode_props(raw: str | bytes, task_id: str) -> dict[str, Any]:
    """Props read back from a store; raise :class:`InvalidProps` naming the damage.

    Rows and keys may be written around metafora (by hand, by another program): text that is
    not JSON, not an object, nested too deep or too large is reported, never read as ``{}``.
    """
    what = f"stored props of task {task_id!r}"
    if len(raw) > 2 * MAX_PROPS_BYTES:  # room for a store's own formatting of the text
        raise InvalidProps(f"{what}: {len(raw)} bytes, over the limit of {MAX_PROPS_BYTES}")
    return load_object(raw, what, InvalidProps)


@dataclass(frozen=True)
class Task:
    """A unit of long-running work, identified by ``id``.

    ``props`` is JSON-serialisable user data (kept as a read-only copy). ``token`` is the
    fencing token of the claim this object was handed out under (0 when not claimed):
    it strictly increases every time the task is claimed, by anyone.
    """

    id: str
    props: Mapping[str, Any] = field(default_factory=dict, hash=False)
    token: int = 0

    def __post_init__(self) -> None:
        validate_task_id(self.id)
        object.__setattr__(self, "props", _freeze_props(self.props))
        if not isinstance(self.token, int) or isinstance(self.token, bool) or self.token < 0:
            raise InvalidProps(f"token must be a non-negative integer, got {self.token!r}")

    @property
    def launch_at(self) -> datetime | None:
        """When the task becomes claimable (UTC), from the ``launch_at`` prop."""
        value = self.props.get("launch_at")
        return None if value is None else parse_time(value, "launch_at")

    @property
    def expires_at(self) -> datetime | None:
        """After this time (UTC) the task is not claimed but moved to ``expired``."""
        value = self.props.get("expires_at")
        return None if value is None else parse_time(value, "expires_at")

    def props_json(self) -> str:
        """The props as a compact JSON object."""
        return json.dumps(dict(self.props), separators=(",", ":"), sort_keys=True)

    def with_token(self, token: int) -> Task:
        """A copy of this task carrying another fencing token."""
        return Task(self.id, self.props, token)


@dataclass(frozen=True)
class TaskInfo:
    """What a store knows about a task (returned by ``Client.tasks()``)."""

    id: str
    props: Mapping[str, Any]
    state: TaskState
    owner: str | None = None
    token: int = 0
    claimed_at: datetime | None = None
    error: str | None = None
    created_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0

    def task(self) -> Task:
        """The task itself, carrying its current token."""
        return Task(self.id, self.props, self.token)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (times as ISO-8601 strings)."""

        def iso(dt: datetime | None) -> str | None:
            return None if dt is None else dt.isoformat()

        return {
            "id": self.id,
            "props": dict(self.props),
            "state": self.state.value,
            "owner": self.owner,
            "token": self.token,
            "claimed_at": iso(self.claimed_at),
            "error": self.error,
            "created_at": iso(self.created_at),
            "finished_at": iso(self.finished_at),
            "attempts": self.attempts,
        }
