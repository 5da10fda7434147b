"""The values the etcd driver takes and returns: keys, compares, ops, txn and watch results.

Plain named tuples and dataclasses, free of gRPC and of the client library: every module
above the driver builds its requests and reads its answers with these
(:mod:`metafora.coordinators.etcd.messages` turns them into etcd's protobuf messages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from metafora.core.errors import StoreError

__all__ = [
    "Compare",
    "Delete",
    "KeyValue",
    "LeaseNotFound",
    "Op",
    "Put",
    "Range",
    "TxnRequest",
    "TxnResult",
    "WatchBatch",
    "WatchCallback",
    "WatchCompacted",
    "WatchEvent",
    "WatchFailure",
    "absent",
    "created_at",
    "exists",
    "modified_at",
    "prefix_end",
    "value_is",
]


class LeaseNotFound(StoreError):
    """etcd does not know the lease (it expired or was revoked)."""


class WatchCompacted(StoreError):
    """The requested start revision of a watch has been compacted away."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd history before revision {revision} is compacted")
        self.revision = revision


class KeyValue(NamedTuple):
    """One stored key with its revisions and lease."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


class Compare(NamedTuple):
    """A txn condition: ``target(key) op value``."""

    key: bytes
    target: Literal["create", "mod", "version", "value"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes


def absent(key: bytes) -> Compare:
    """The key does not exist."""
    return Compare(key, "create", "==", 0)


def exists(key: bytes) -> Compare:
    """The key exists."""
    return Compare(key, "create", ">", 0)


def created_at(key: bytes, revision: int) -> Compare:
    """The key exists and was created at ``revision`` (this incarnation of it)."""
    return Compare(key, "create", "==", revision)


def modified_at(key: bytes, revision: int) -> Compare:
    """The key was last written at ``revision``."""
    return Compare(key, "mod", "==", revision)


def value_is(key: bytes, value: bytes) -> Compare:
    """The key holds ``value``."""
    return Compare(key, "value", "==", value)


class Put(NamedTuple):
    """Write ``value`` at ``key``, attached to ``lease`` (0: none)."""

    key: bytes
    value: bytes
    lease: int = 0


class Delete(NamedTuple):
    """Delete ``key`` (or every key under it when ``prefix``)."""

    key: bytes
    prefix: bool = False


class Range(NamedTuple):
    """Read ``key`` (or every key under it when ``prefix``, or every key from it up to
    ``end`` excluded)."""

    key: bytes
    prefix: bool = False
    keys_only: bool = False
    limit: int = 0
    by_create: bool = False  # ascending create revision instead of key order
    end: bytes | None = None


Op = Put | Delete | Range

TxnRequest = tuple[Sequence[Compare], Sequence[Op], Sequence[Op]]
"""A txn for :meth:`EtcdDriver.txns`: (compares, success ops, failure ops)."""


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What a txn did: which branch ran, at which revision, and what its ranges read."""

    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]]
    retried: bool = False  # an earlier attempt may have been applied (connection lost)


class WatchEvent(NamedTuple):
    """A put or a delete seen by a watch. For deletes only ``key`` and ``mod_revision`` count."""

    kind: Literal["put", "delete"]
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """Events of one watch response (all at revisions <= ``revision``)."""

    revision: int
    events: list[WatchEvent]


@dataclass(frozen=True, slots=True)
class WatchFailure:
    """The watch ended: the stream broke, the server closed it, or history was compacted."""

    error: BaseException | None
    compacted: bool = False


WatchCallback = Callable[[WatchBatch | WatchFailure], None]


def prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix``."""
    data = bytearray(prefix)
    for i in reversed(range(len(data))):
        if data[i] < 0xFF:
            data[i] += 1
            return bytes(data[: i + 1])
    return b"\0"
