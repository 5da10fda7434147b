"""Values of gated partitions: items, new items, processor responses, partition views, errors.

Pure data (no I/O). Every constructor validates its input and raises a
:class:`~metafora.core.errors.MetaforaError` subclass naming the bad value.
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from metafora.core.errors import MetaforaError
from metafora.core.task import validate_task_id

__all__ = [
    "MAX_GATE",
    "Advance",
    "GateError",
    "GateMoveRefused",
    "Item",
    "ItemBelowGate",
    "ItemNotFound",
    "ItemResult",
    "ItemStatus",
    "ItemsFailed",
    "NewItem",
    "PartitionClosed",
    "PartitionFailed",
    "PartitionInfo",
    "PartitionStatus",
    "PermanentError",
    "ProcessingError",
    "Response",
    "check_gate",
    "data_fields",
]

MAX_GATE: Final = 2**31 - 1
"""The highest gate number (gates are 32-bit integers in every store)."""


class ItemStatus(enum.StrEnum):
    """Where an item is: waiting for its gate (or in work), finished, or given up on."""

    AVAILABLE = "available"
    """Waiting to be processed at its gate (or being processed now)."""
    COMPLETE = "complete"
    """Processed; it never runs again."""
    FAILED = "failed"
    """Processing failed (retries exhausted, or a non-retryable error); see ``error``."""


class PartitionStatus(enum.StrEnum):
    """A partition is open (takes items) until its handler completes it."""

    OPEN = "open"
    COMPLETED = "completed"


# -- errors ------------------------------------------------------------------------------


class GateError(MetaforaError, ValueError):
    """An item or a gate is not acceptable for the partition (the message says why)."""


class ItemBelowGate(MetaforaError):
    """Refused: an item was added below the partition's current gate, where it would never run."""


class GateMoveRefused(MetaforaError):
    """Refused: moving the gate would strand items below it that are still available or failed."""


class PartitionClosed(MetaforaError):
    """The partition is completed; it takes no more items until it is reopened
    (:func:`metafora.gates.reopen_partition`, ``metafora partition reopen ID``)."""


class ItemNotFound(MetaforaError, LookupError):
    """No item with this id in the partition."""


class ProcessingError(MetaforaError):
    """A processor could not process an item; retried up to the handler's ``max_attempts``.

    Any other exception a processor raises is treated the same way (retryable).
    """

    retryable: bool = True


class PermanentError(ProcessingError):
    """A processor failure that retrying cannot fix (HTTP 4xx, a malformed answer, bad data):
    the item fails at once."""

    retryable = False


class ItemsFailed(MetaforaError):
    """Items of the partition's current gate failed: the partition faults (see the error policy)."""


class PartitionFailed(MetaforaError):
    """The partition's state machine gave up (``failed``): the task is marked failed with this."""


# -- validation helpers --------------------------------------------------------------------


def check_gate(value: object, what: str = "gate") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GateError(f"{what} must be an integer, not {type(value).__name__}")
    if not 0 <= value <= MAX_GATE:
        raise GateError(f"{what} must be from 0 to {MAX_GATE}, got {value}")
    return value


def _bytes(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise GateError(f"{what} must be bytes or str, not {type(value).__name__}")


def data_fields(data: bytes) -> dict[str, str | None]:
    """``data`` for JSON: ``{"data": UTF-8 text or None, "data_base64": base64}``."""
    try:
        as_text: str | None = data.decode("utf-8")
    except UnicodeDecodeError:
        as_text = None
    return {"data": as_text, "data_base64": base64.b64encode(data).decode("ascii")}


def _wire_data(obj: Mapping[str, Any], what: str) -> bytes | None:
    """The data of a JSON answer: ``data_base64``, else ``data`` (text as UTF-8, any other
    JSON value as compact JSON), else None (keep)."""
    if obj.get("data_base64") is not None:
        raw = obj["data_base64"]
        if not isinstance(raw, str):
            raise PermanentError(f"{what}: 'data_base64' must be a string")
        try:
            return base64.b64decode(raw, validate=True)
        except ValueError as exc:
            raise PermanentError(f"{what}: 'data_base64' is not base64: {exc}") from None
    value = obj.get("data")
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")


# -- values -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewItem:
    """An item to add to a partition: its ``gate`` (default 0) and ``data`` (bytes; a str is
    stored as UTF-8)."""

    gate: int = 0
    data: bytes = b""

    def __post_init__(self) -> None:
        check_gate(self.gate, "item gate")
        object.__setattr__(self, "data", _bytes(self.data, "item data"))

    @classmethod
    def from_wire(cls, obj: object, what: str = "spawned item") -> NewItem:
        """Parse ``{"gate": int, "data"|"data_base64": ...}``; PermanentError naming the problem."""
        if not isinstance(obj, Mapping):
            raise PermanentError(f"{what} must be a JSON object, not {type(obj).__name__}")
        gate = obj.get("gate", 0)
        try:
            return cls(gate, _wire_data(obj, what) or b"")
        except GateError as exc:
            raise PermanentError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class Item:
    """One item of a partition, as stored.

    ``id`` is store-wide unique and orders items of a partition by insertion; ``attempts``
    counts processing attempts, each recorded when the item is taken for processing (so an
    attempt whose process died counts too; items taken but never started are given back
    when their claim ends cleanly); ``error`` is the last
    failure (cleared on success); ``permanent`` says whether that failure was non-retryable;
    ``token`` is the claim token under which the item was last written by a handler.
    """

    partition: str
    id: int
    gate: int
    status: ItemStatus
    data: bytes = b""
    attempts: int = 0
    error: str | None = None
    permanent: bool = False
    token: int = 0
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @property
    def text(self) -> str:
        """``data`` decoded as UTF-8 (invalid bytes replaced)."""
        return self.data.decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (data as text when it is UTF-8, and always as base64)."""
        return {
            "partition": self.partition,
            "id": self.id,
            "gate": self.gate,
            "status": self.status.value,
            **data_fields(self.data),
            "attempts": self.attempts,
            "error": self.error,
            "permanent": self.permanent,
            "token": self.token,
            "created_at": None if self.created_at is None else self.created_at.isoformat(),
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
        }

    def to_wire(self) -> dict[str, Any]:
        """What :class:`~metafora.gates.HTTPProcessor` posts for this item."""
        return {
            "partition": self.partition,
            "id": self.id,
            "gate": self.gate,
            "attempts": self.attempts,
            **data_fields(self.data),
        }


@dataclass(frozen=True)
class Response:
    """A processor's answer for one item.

    ``done=True`` completes the item (recorded at ``gate``); ``done=False`` moves it to
    ``gate`` (which must be >= its current gate), still available -- at the current gate it
    is processed again in a later batch (a multi-step item). ``data`` replaces the item's
    data (None keeps it). ``spawn`` adds new items, at gates above the current one.
    """

    gate: int
    done: bool
    data: bytes | None = None
    spawn: tuple[NewItem, ...] = field(default=())

    def __post_init__(self) -> None:
        check_gate(self.gate, "response gate")
        if not isinstance(self.done, bool):
            raise GateError(f"response 'done' must be a bool, not {type(self.done).__name__}")
        if self.data is not None:
            object.__setattr__(self, "data", _bytes(self.data, "response data"))
        spawn = self.spawn
        if isinstance(spawn, NewItem) or not isinstance(spawn, Iterable):
            raise GateError("response 'spawn' must be a sequence of NewItem")
        items = tuple(spawn)
        for new in items:
            if not isinstance(new, NewItem):
                raise GateError(f"response 'spawn' must hold NewItem values, got {new!r}")
        object.__setattr__(self, "spawn", items)

    @classmethod
    def from_wire(cls, obj: object, default_gate: int) -> Response:
        """Parse ``{"gate", "done", "data"|"data_base64", "spawn"}`` (``gate`` defaults to
        ``default_gate``; ``done`` is required). PermanentError naming the problem."""
        if not isinstance(obj, Mapping):
            raise PermanentError(f"the answer must be a JSON object, not {type(obj).__name__}")
        if not isinstance(obj.get("done"), bool):
            raise PermanentError("the answer needs 'done': true or false")
        raw_spawn = obj.get("spawn")
        if raw_spawn is None:
            raw_spawn = []
        if not isinstance(raw_spawn, list):
            raise PermanentError("'spawn' must be a list of {gate, data} objects")
        spawn = tuple(NewItem.from_wire(s, f"spawn[{i}]") for i, s in enumerate(raw_spawn))
        try:
            return cls(obj.get("gate", default_gate), obj["done"], _wire_data(obj, "the answer"), spawn)
        except GateError as exc:
            raise PermanentError(str(exc)) from None


@dataclass(frozen=True)
class PartitionInfo:
    """A partition as the item store sees it: current gate, status, the token of the claim
    that last took it, and item counts by gate and status (``exists`` is False when nothing
    was ever stored for it)."""

    partition: str
    gate: int = 0
    status: PartitionStatus = PartitionStatus.OPEN
    token: int = 0
    counts: Mapping[int, Mapping[ItemStatus, int]] = field(default_factory=dict)
    exists: bool = False
    updated_at: datetime | None = None

    def __post_init__(self) -> None:
        validate_task_id(self.partition)

    def total(self, status: ItemStatus | str | None = None) -> int:
        """How many items (in ``status``, or in all)."""
        wanted = None if status is None else ItemStatus(status)
        return sum(n for by in self.counts.values() for s, n in by.items() if wanted in (None, s))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "partition": self.partition,
            "gate": self.gate,
            "status": self.status.value,
            "token": self.token,
            "exists": self.exists,
            "counts": {str(g): {s.value: n for s, n in by.items()} for g, by in sorted(self.counts.items())},
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
        }


# -- what an owner writes and finds ----------------------------------------------------------


@dataclass(frozen=True)
class ItemResult:
    """What to write for one processed item (see
    :meth:`~metafora.gates.lease.PartitionLease.finish`).

    ``status`` available (moved, or retried later), complete or failed; ``gate`` the item's
    gate afterwards; ``data`` None keeps the stored data; ``tries`` the attempts made.
    """

    item_id: int
    status: ItemStatus
    gate: int
    tries: int
    data: bytes | None = None
    error: str | None = None
    permanent: bool = False
    spawn: tuple[NewItem, ...] = ()


@dataclass(frozen=True)
class Advance:
    """What :meth:`~metafora.gates.lease.PartitionLease.advance` found or did.

    ``kind``: ``work`` (items are available at the current gate), ``failed`` (failed items
    block the gate), ``moved`` (the gate jumped to ``gate``), ``waiting`` (work exists at
    higher gates but gates move by hand), ``completed`` (no work left; the partition is now
    completed), ``idle`` (no work left; the partition stays open).
    """

    kind: str
    gate: int
