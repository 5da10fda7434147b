"""The driver's values (:mod:`metafora.coordinators.etcd.ops`) and their protobuf messages
(:mod:`metafora.coordinators.etcd.messages`, built with the installed client library's
generated module): pure logic, no server."""

from __future__ import annotations

from typing import Any

import pytest

from metafora.coordinators.etcd.messages import (
    compare_message,
    events_from,
    kv_from,
    op_message,
    range_request,
    txn_request,
    txn_result,
)
from metafora.coordinators.etcd.ops import (
    Compare,
    Delete,
    KeyValue,
    Put,
    Range,
    WatchEvent,
    absent,
    created_at,
    exists,
    modified_at,
    prefix_end,
    value_is,
)


@pytest.fixture(scope="module")
def rpc() -> Any:
    from metafora.coordinators.etcd.driver import load_library

    try:
        return load_library().etcdrpc
    except ImportError as exc:  # pragma: no cover - the etcd extra is not installed
        pytest.skip(str(exc))


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_compares_say_what_they_check() -> None:
    assert absent(b"k") == Compare(b"k", "create", "==", 0)
    assert exists(b"k") == Compare(b"k", "create", ">", 0)
    assert created_at(b"k", 5) == Compare(b"k", "create", "==", 5)
    assert modified_at(b"k", 6) == Compare(b"k", "mod", "==", 6)
    assert value_is(b"k", b"v") == Compare(b"k", "value", "==", b"v")


def test_compare_messages(rpc: Any) -> None:
    msg = compare_message(rpc, created_at(b"k", 5))
    assert (msg.key, msg.target, msg.result, msg.create_revision) == (
        b"k", rpc.Compare.CREATE, rpc.Compare.EQUAL, 5)
    assert compare_message(rpc, value_is(b"k", b"v")).value == b"v"
    assert compare_message(rpc, modified_at(b"k", 7)).mod_revision == 7
    assert compare_message(rpc, exists(b"k")).result == rpc.Compare.GREATER


def test_op_messages(rpc: Any) -> None:
    put = op_message(rpc, Put(b"k", b"v", 9)).request_put
    assert (put.key, put.value, put.lease) == (b"k", b"v", 9)
    delete = op_message(rpc, Delete(b"/p/", prefix=True)).request_delete_range
    assert (delete.key, delete.range_end) == (b"/p/", b"/p0")
    read = op_message(rpc, Range(b"k")).request_range
    assert (read.key, read.range_end) == (b"k", b"")


def test_range_requests(rpc: Any) -> None:
    r = range_request(rpc, Range(b"/p/", prefix=True, keys_only=True, limit=3), 12)
    assert (r.range_end, r.keys_only, r.limit, r.revision) == (b"/p0", True, 3, 12)
    r = range_request(rpc, Range(b"a", end=b"m", by_create=True), 0)
    assert r.range_end == b"m" and r.sort_target == rpc.RangeRequest.CREATE
    assert r.sort_order == rpc.RangeRequest.ASCEND


def test_txn_request_and_result(rpc: Any) -> None:
    request = txn_request(rpc, [absent(b"k")], [Put(b"k", b"v")], [Range(b"k")])
    assert len(request.compare) == 1 and len(request.success) == 1 and len(request.failure) == 1
    read = rpc.RangeResponse()
    read.kvs.add(key=b"k", value=b"v", create_revision=2, mod_revision=3, version=1, lease=0)
    response = rpc.TxnResponse(
        succeeded=False, header=rpc.ResponseHeader(revision=4),
        responses=[rpc.ResponseOp(response_range=read),
                   rpc.ResponseOp(response_put=rpc.PutResponse())])
    result = txn_result(response, retried=True)
    assert (result.succeeded, result.revision, result.retried) == (False, 4, True)
    assert result.ranges == [[KeyValue(b"k", b"v", 2, 3, 1, 0)]]


def test_kv_from_a_protobuf_key_value(rpc: Any) -> None:
    """Its fields come through as they are (bytes and ints: no conversion on the hot path)."""
    read = rpc.RangeResponse()
    kv = read.kvs.add(key=b"k", value=b"v", create_revision=2, mod_revision=3, version=1, lease=7)
    got = kv_from(kv)
    assert got == KeyValue(b"k", b"v", 2, 3, 1, 7)
    assert [type(v) for v in got] == [bytes, bytes, int, int, int, int]
    assert got.mod_revision == 3 and isinstance(got, KeyValue)


def test_events_from_a_watch_response(rpc: Any) -> None:
    """Puts and deletes in order, as named tuples; the keys ``skip`` names left out."""
    response = rpc.WatchResponse()
    for kind, key in ((0, b"a"), (0, b"skip-me"), (1, b"b")):
        ev = response.events.add(type=kind)
        ev.kv.key, ev.kv.mod_revision = key, 9
    got = events_from(response.events, lambda key: key.startswith(b"skip"))
    assert got == [WatchEvent("put", KeyValue(b"a", b"", 0, 9, 0, 0)),
                   WatchEvent("delete", KeyValue(b"b", b"", 0, 9, 0, 0))]
    assert got[1].kind == "delete" and got[1].kv.key == b"b"
    assert len(events_from(response.events)) == 3
