"""The driver's values (:mod:`metafora.coordinators.etcd.ops`) to and from etcd's protobuf
messages. ``rpc`` is the client library's generated module (``etcdrpc``): this module
imports neither grpc nor the library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from metafora.coordinators.etcd.ops import (
    Compare,
    Delete,
    KeyValue,
    Op,
    Put,
    Range,
    TxnResult,
    WatchEvent,
    prefix_end,
)

__all__ = [
    "compare_message",
    "events_from",
    "kv_from",
    "op_message",
    "range_request",
    "txn_request",
    "txn_result",
]


def kv_from(kv: Any) -> KeyValue:
    """A :class:`KeyValue` of a protobuf ``mvccpb.KeyValue`` (its fields are bytes and ints
    already: no conversion, this runs for every key a re-list reads and every watch event)."""
    return _new_kv(KeyValue, (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version,
                              kv.lease))


_new_kv = tuple.__new__  # a NamedTuple's own __new__ adds a call and a keyword binding


def events_from(events: Iterator[Any], skip: Callable[[bytes], bool] | None = None
                ) -> list[WatchEvent]:
    """The watch events of a response, without those whose key ``skip`` names (not decoded).

    Every node decodes every event of its namespace (each claim of every node): built
    without the named tuples' own constructors.
    """
    out: list[WatchEvent] = []
    append = out.append
    for ev in events:
        if skip is not None and skip(ev.kv.key):
            continue
        append(_new_kv(WatchEvent, ("delete" if ev.type == 1 else "put", kv_from(ev.kv))))
    return out


def txn_request(rpc: Any, compares: Sequence[Compare], success: Sequence[Op],
                 failure: Sequence[Op] = ()) -> Any:
    return rpc.TxnRequest(
        compare=[compare_message(rpc, c) for c in compares],
        success=[op_message(rpc, op) for op in success],
        failure=[op_message(rpc, op) for op in failure],
    )


def txn_result(response: Any, retried: bool) -> TxnResult:
    ranges = [
        [kv_from(kv) for kv in r.response_range.kvs]
        for r in response.responses
        if r.WhichOneof("response") == "response_range"
    ]
    return TxnResult(bool(response.succeeded), int(response.header.revision), ranges, retried)


def range_request(rpc: Any, r: Range, revision: int) -> Any:
    request = rpc.RangeRequest(key=r.key, keys_only=r.keys_only, limit=r.limit, revision=revision)
    if r.end is not None:
        request.range_end = r.end
    elif r.prefix:
        request.range_end = prefix_end(r.key)
    if r.by_create:
        request.sort_target = rpc.RangeRequest.CREATE
        request.sort_order = rpc.RangeRequest.ASCEND
    return request


_TARGETS = {"create": "CREATE", "mod": "MOD", "version": "VERSION", "value": "VALUE"}
_OPS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


def compare_message(rpc: Any, c: Compare) -> Any:
    cls = rpc.Compare
    msg = cls(key=c.key, target=getattr(cls, _TARGETS[c.target]), result=getattr(cls, _OPS[c.op]))
    if c.target == "value":
        assert isinstance(c.value, bytes)
        msg.value = c.value
    elif c.target == "create":
        msg.create_revision = int(c.value)
    elif c.target == "mod":
        msg.mod_revision = int(c.value)
    else:
        msg.version = int(c.value)
    return msg


def op_message(rpc: Any, op: Op) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        request = rpc.DeleteRangeRequest(key=op.key)
        if op.prefix:
            request.range_end = prefix_end(op.key)
        return rpc.RequestOp(request_delete_range=request)
    return rpc.RequestOp(request_range=range_request(rpc, op, 0))
