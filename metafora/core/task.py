"""Tasks, their stored view and their states."""

from __future__ import annotations

import enum
import json
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from metafora.core.errors import InvalidProps, InvalidTaskId
from metafora.core.jsontext import MAX_DEPTH, check_depth, load_object
from metafora.core.masking import BIDI_CONTROLS, invisible_char

__all__ = [
    "LOOKALIKE_BLANKS",
    "MAX_GROUP_LENGTH",
    "MAX_LABELS",
    "MAX_LABEL_KEY_LENGTH",
    "MAX_LABEL_VALUE_LENGTH",
    "MAX_PRIORITY",
    "MAX_PROPS_BYTES",
    "MAX_PROPS_DEPTH",
    "MAX_PROPS_TEXT",
    "MAX_TASK_ID_LENGTH",
    "MIN_PRIORITY",
    "Task",
    "TaskInfo",
    "TaskState",
    "decode_labels",
    "decode_placement",
    "decode_props",
    "decode_soft",
    "label_text",
    "matches",
    "parse_time",
    "placement_reason",
    "task_like",
    "validate_group",
    "validate_labels",
    "validate_priority",
    "validate_schedule",
    "validate_spread",
    "validate_task_id",
]

MAX_TASK_ID_LENGTH = 256
MAX_PROPS_BYTES = 1024 * 1024
"""The largest props a task may carry, as compact JSON (UTF-8 bytes). etcd refuses requests
over 1.5 MiB by default; one limit for every store keeps a task portable between them."""
MAX_PROPS_DEPTH = MAX_DEPTH
"""How deeply props may nest objects and arrays (the props object itself is level 1)."""
_TIME_PROPS = ("launch_at", "expires_at")
MAX_LABELS = 32
"""How many labels a node (or pairs a task's selector) may have."""
MAX_LABEL_KEY_LENGTH = 63
"""The longest label key, in characters."""
MAX_LABEL_VALUE_LENGTH = 255
"""The longest label value, in characters."""
MIN_PRIORITY = -1_000_000
"""The lowest task priority."""
MAX_PRIORITY = 1_000_000
"""The highest task priority (higher is offered and claimed first; 0 is the default)."""
MAX_GROUP_LENGTH = 255
"""The longest limit group name, in characters."""


class TaskState(enum.StrEnum):
    """Where a task is in its life. A task is always in exactly one of these."""

    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


LOOKALIKE_BLANKS: Final = frozenset("\u2800\u3164\u115f\u1160\uffa0\u2028\u2029")
"""Blanks outside Unicode's space category that an id may not hold either: the Braille
pattern blank and the Hangul fillers print as a space (besides every space of category Zs
but U+0020, and the line and paragraph separators)."""


def validate_task_id(task_id: object) -> str:
    """Return ``task_id`` if it is a valid id, else raise :class:`InvalidTaskId` saying why."""
    if not isinstance(task_id, str):
        raise InvalidTaskId(f"task id must be a string, not {type(task_id).__name__}")
    if (task_id.isascii() and task_id.isprintable() and 0 < len(task_id) <= MAX_TASK_ID_LENGTH
            and task_id[0] != " " and task_id[-1] != " "):
        return task_id  # printable ASCII without edge spaces passes every rule below
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
        if ch in BIDI_CONTROLS:
            # U+202E and its kin reorder what follows: "abc\u202egpj.exe" would read as another id.
            raise InvalidTaskId(f"task id {task_id!r} contains the bidi control {ch!r}")
    hidden = invisible_char(task_id)
    if hidden is None:
        hidden = next((ch for ch in task_id if unicodedata.category(ch) == "Cf"), None)
    if hidden is not None:
        # U+200B, U+2060, U+FEFF, U+00AD, U+034F...: "task\u200b1" shows as "task1".
        raise InvalidTaskId(f"task id {task_id!r} contains the invisible (format or default-ignorable) "
                            f"character U+{ord(hidden):04X}")
    blank = next((ch for ch in task_id if ch != " " and (
        ch in LOOKALIKE_BLANKS or unicodedata.category(ch) in ("Zs", "Zl", "Zp"))), None)
    if blank is not None:
        # "task 1", "task\u00a01" and "task\u20071" print alike in the CLI and the dashboard.
        raise InvalidTaskId(f"task id {task_id!r} contains the blank U+{ord(blank):04X} "
                            f"({unicodedata.name(blank, 'unnamed')}): the only space an id may "
                            "hold is the ASCII space U+0020, as other blanks look alike")
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


def _label_part(text: object, what: str, limit: int) -> str:
    if not isinstance(text, str):
        raise InvalidProps(f"{what} must be a string, not {type(text).__name__}")
    if not text:
        raise InvalidProps(f"{what} must not be empty")
    if len(text) > limit:
        raise InvalidProps(f"{what} {text[:20]!r}... is {len(text)} characters long; the limit is {limit}")
    if not text.isprintable() or text != text.strip():
        raise InvalidProps(f"{what} {text!r} must be printable, without leading or trailing spaces")
    return text


def validate_labels(labels: object, what: str = "labels") -> dict[str, str]:
    """``labels`` (node labels or a task's selector) as a plain dict, or :class:`InvalidProps`.

    Keys and values are non-empty printable strings (keys up to
    :data:`MAX_LABEL_KEY_LENGTH` characters and without ``=`` or ``,``, values up to
    :data:`MAX_LABEL_VALUE_LENGTH`), at most :data:`MAX_LABELS` pairs. ``what`` names the
    input in the error ("labels", "selector").
    """
    if labels is None or (type(labels) is dict and not labels):
        return {}
    if not isinstance(labels, Mapping):
        raise InvalidProps(f"{what} must be a mapping of strings to strings, not {type(labels).__name__}")
    if len(labels) > MAX_LABELS:
        raise InvalidProps(f"{what} has {len(labels)} pairs; the limit is {MAX_LABELS}")
    plain: dict[str, str] = {}
    for key, value in labels.items():
        _label_part(key, f"{what} key", MAX_LABEL_KEY_LENGTH)
        if "=" in key or "," in key:
            # `--select k=v` and the label listings could not say such a key unambiguously.
            raise InvalidProps(f"{what} key {key!r} must not contain '=' or ','")
        plain[key] = _label_part(value, f"{what} value of {key!r}", MAX_LABEL_VALUE_LENGTH)
    return dict(sorted(plain.items()))


def validate_priority(priority: object) -> int:
    """``priority`` if it is an integer in [:data:`MIN_PRIORITY`, :data:`MAX_PRIORITY`]."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidProps(f"priority must be an integer, not {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidProps(
            f"priority {priority} is out of range [{MIN_PRIORITY}, {MAX_PRIORITY}]"
        )
    return priority


def validate_spread(spread: object) -> str | None:
    """An anti-affinity group name (None for none): a non-empty printable string."""
    if spread is None:
        return None
    return _label_part(spread, "spread group", MAX_LABEL_VALUE_LENGTH)


def validate_group(group: object) -> str | None:
    """A limit group name (None for none): a non-empty printable string of at most
    :data:`MAX_GROUP_LENGTH` characters, without leading or trailing spaces."""
    if group is None:
        return None
    return _label_part(group, "group", MAX_GROUP_LENGTH)


def decode_placement(raw: str | bytes | None, task_id: str) -> tuple[dict[str, str], str | None]:
    """A task's soft placement as stored (``{"prefer": {...}, "spread": "..."}`` JSON text, None
    for none): ``(prefer, spread)``."""
    prefer, spread, _group = decode_soft(raw, task_id)
    return prefer, spread


def decode_soft(raw: str | bytes | None,
                task_id: str) -> tuple[dict[str, str], str | None, str | None]:
    """What a SQL store keeps in a task's ``placement`` column (``{"prefer": {...}, "spread":
    "...", "group": "..."}`` JSON text, None for none): ``(prefer, spread, group)``."""
    if raw is None or raw in ("", b""):
        return {}, None, None
    what = f"stored placement of task {task_id!r}"
    data = load_object(raw, what, InvalidProps)
    return (validate_labels(data.get("prefer") or {}, f"{what}: prefer"),
            validate_spread(data.get("spread")), validate_group(data.get("group")))


def decode_labels(raw: str | bytes | None, what: str) -> dict[str, str]:
    """Labels or a selector read back from a store (JSON text; None or empty means none)."""
    if raw is None or raw in ("", b""):
        return {}
    return validate_labels(load_object(raw, what, InvalidProps), what)


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` may run a task with ``selector`` (every pair present)."""
    return all(labels.get(key) == value for key, value in selector.items())


def label_text(labels: Mapping[str, str]) -> str:
    """``k=v,k2=v2`` (sorted by key), as listings show labels and selectors."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def placement_reason(selector: Mapping[str, str], nodes: Iterable[Mapping[str, str]]) -> str | None:
    """Why a pending task with ``selector`` cannot be claimed now, or None if a live node
    (given by their labels) matches it."""
    if not selector:
        return None
    if any(matches(selector, labels) for labels in nodes):
        return None
    return f"no live node matches {label_text(selector)}"


MAX_PROPS_TEXT = 4 * MAX_PROPS_BYTES
"""The longest props JSON *text* read from a user (``--props``, a ``--from-file`` line):
refused before it is decoded (whitespace and escapes may make a text longer than its compact
form, never four times for props that fit)."""


def _freeze_props(props: object) -> Mapping[str, Any]:
    if not isinstance(props, Mapping):
        raise InvalidProps(f"props must be a JSON object (a mapping), not {type(props).__name__}")
    for key in props:
        if not isinstance(key, str):
            raise InvalidProps(f"props keys must be strings, got {key!r}")
    # Depth first, without recursion: json.dumps of a deep structure would raise RecursionError
    # at a depth that depends on the caller's own stack.
    # Far too large props are refused before they are encoded, by the same walk: a 100 MB
    # value cost 346 MB (the JSON text, then its bytes) only to be refused.
    check_depth(props, "props", InvalidProps, max_chars=MAX_PROPS_BYTES)
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

    ``selector`` (placement): only a node whose labels include every pair may claim the
    task (see :func:`validate_labels`). ``priority``: among claimable tasks, higher ones are
    offered and claimed first (an integer in [-1,000,000, 1,000,000], default 0); it never
    pre-empts a running task. Soft placement: ``prefer`` (labels a node should have: others
    hold back briefly before they take the task) and ``spread`` (an anti-affinity group:
    a node already running a task of the group holds back briefly before it takes another),
    both best effort (see docs/placement.md). ``group``: the limit group of the task (see
    docs/limits.md): while the group is at its concurrency or rate limit, no node claims it.
    """

    id: str
    props: Mapping[str, Any] = field(default_factory=dict, hash=False)
    token: int = 0
    selector: Mapping[str, str] = field(default_factory=dict, hash=False, kw_only=True)
    priority: int = field(default=0, kw_only=True)
    prefer: Mapping[str, str] = field(default_factory=dict, hash=False, kw_only=True)
    spread: str | None = field(default=None, kw_only=True)
    group: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        validate_task_id(self.id)
        object.__setattr__(self, "props", _freeze_props(self.props))
        if not isinstance(self.token, int) or isinstance(self.token, bool) or self.token < 0:
            raise InvalidProps(f"token must be a non-negative integer, got {self.token!r}")
        object.__setattr__(self, "selector", validate_labels(self.selector, "selector"))
        validate_priority(self.priority)
        object.__setattr__(self, "prefer", validate_labels(self.prefer, "prefer"))
        validate_spread(self.spread)
        validate_group(self.group)

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

    def valid_until(self) -> datetime | None:
        """Until when (UTC, by this host's clock) this claim is guaranteed to be this node's.

        The node's fencing deadline: every renewal of its lease moves it on; reaching it,
        the node stops the handler. None for a task not handed to a handler by a
        :class:`~metafora.Consumer`, or on a store that bounds nothing (memory); not in the
        future once the claim is lost. See ``docs/claim-at-risk.md``.
        """
        claim = self.__dict__.get("_claim")
        return None if claim is None else claim.valid_until()

    def at_risk(self) -> bool:
        """Whether this claim is at risk now: the node's lease renewals are failing and the
        handler is stopped at :meth:`valid_until` unless one succeeds first."""
        claim = self.__dict__.get("_claim")
        return False if claim is None else bool(claim.at_risk())

    def props_json(self) -> str:
        """The props as a compact JSON object."""
        return json.dumps(dict(self.props), separators=(",", ":"), sort_keys=True)

    def selector_json(self) -> str | None:
        """The selector as compact JSON, or None when it is empty (how stores keep it)."""
        if not self.selector:
            return None
        return json.dumps(dict(self.selector), separators=(",", ":"), sort_keys=True)

    def placement_json(self) -> str | None:
        """``prefer``, ``spread`` and ``group`` as compact JSON, or None when none is set."""
        data: dict[str, Any] = {}
        if self.prefer:
            data["prefer"] = dict(self.prefer)
        if self.spread is not None:
            data["spread"] = self.spread
        if self.group is not None:
            data["group"] = self.group
        return json.dumps(data, separators=(",", ":"), sort_keys=True) if data else None

    def with_token(self, token: int) -> Task:
        """A copy of this task carrying another fencing token."""
        return Task(self.id, self.props, token, selector=self.selector, priority=self.priority,
                    prefer=self.prefer, spread=self.spread, group=self.group)


def task_like(shape: Task, task_id: str, props: dict[str, Any], token: int = 0) -> Task:
    """A task equal to what ``Task(task_id, props, token, ...)`` would build with ``shape``'s
    selector, priority and placement, without validating them again: ``shape`` is a task
    built (so validated) from the same stored texts, and ``props`` are this task's own copy,
    decoded from those texts. The id is always validated.

    Stores offer a backlog submitted alike (every task one shape) this way: validating the
    same texts again for every task was most of a start-up storm's offer cost.
    """
    validate_task_id(task_id)
    task = object.__new__(Task)
    fields = task.__dict__
    fields.update(shape.__dict__)
    fields.pop("_claim", None)
    fields["id"] = task_id
    fields["props"] = props
    fields["token"] = token
    fields["selector"] = dict(shape.selector)
    fields["prefer"] = dict(shape.prefer)
    return task


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
    selector: Mapping[str, str] = field(default_factory=dict)
    priority: int = 0
    prefer: Mapping[str, str] = field(default_factory=dict)
    spread: str | None = None
    group: str | None = None
    held_for: str | None = None
    """A pending task released by a node that stopped gracefully with a stable id: only that
    node may claim it until :attr:`held_until` (see :mod:`metafora.core.holds`); else None."""
    held_until: datetime | None = None
    """When the hold for :attr:`held_for` ends (the store's clock), or None."""

    def task(self) -> Task:
        """The task itself, carrying its current token."""
        return Task(self.id, self.props, self.token, selector=self.selector, priority=self.priority,
                    prefer=self.prefer, spread=self.spread, group=self.group)

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
            "selector": dict(self.selector),
            "priority": self.priority,
            "prefer": dict(self.prefer),
            "spread": self.spread,
            "group": self.group,
            "held_for": self.held_for,
            "held_until": iso(self.held_until),
        }
