"""The etcd key layout and record encodings (:mod:`metafora.coordinators.etcd.layout`): pure logic."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from metafora.coordinators.etcd.layout import (
    Keys,
    TaskRecord,
    crashes_of,
    decode_json,
    encode_json,
    escape,
    gather,
    iso,
    parse_iso,
    props_of,
    state_of,
    task_info,
    task_record,
    unescape,
)
from metafora.coordinators.etcd.ops import KeyValue
from metafora.core.task import Task, TaskState


def kv(key: bytes, value: bytes, create: int = 1, mod: int = 1, version: int = 1) -> KeyValue:
    return KeyValue(key, value, create, mod, version, 0)


@pytest.mark.parametrize("name", ["plain", "a/b", "100%", "sp ace", "ünï", "a-1.b_c~"])
def test_an_id_is_one_path_segment_and_reads_back(name: str) -> None:
    seg = escape(name)
    assert "/" not in seg
    assert unescape(seg) == name


def test_task_keys_never_share_a_prefix_with_a_longer_id() -> None:
    keys = Keys("ns")
    foo, foobar = keys.task("foo"), keys.task("foobar")
    assert foo.prefix == b"/metafora/ns/tasks/foo/"
    assert not foobar.props.startswith(foo.prefix)
    assert foo.owner == b"/metafora/ns/owners/foo"
    assert keys.task("foo") is foo  # remembered


def test_parse_classifies_every_kind_of_key() -> None:
    keys = Keys("ns")
    tk = keys.task("a/b")
    assert keys.parse(tk.props) == ("task", "a/b", "props")
    assert keys.parse(tk.running) == ("task", "a/b", "running")
    assert keys.parse(tk.owner) == ("owner", "a/b", "")
    assert keys.parse(keys.node_alive("n1")) == ("alive", "n1", "")
    assert keys.parse(keys.node_commands("n1") + b"0001-x") == ("command", "n1", "0001-x")
    assert keys.parse(tk.commands + b"c1") == ("taskcmd", "a/b", "c1")
    assert keys.parse(keys.schedule("nightly")) == ("schedule", "nightly", "")
    plain = keys.task("s0000001")  # no escaping: the common id
    assert keys.parse(plain.claim) == ("task", "s0000001", "claim")
    assert keys.parse(plain.owner) == ("owner", "s0000001", "")
    assert keys.parse(keys.task("50%").state) == ("task", "50%", "state")


@pytest.mark.parametrize("key", [
    b"/metafora/other/tasks/a/props",  # another namespace
    b"/metafora/ns/tasks/a/unknown",
    b"/metafora/ns/tasks/a",
    b"/metafora/ns/owners/a/b",
    b"/metafora/ns/owners/",
    b"/metafora/ns/tasks//props",
    b"/metafora/ns/tasks/a/props/x",
    b"/metafora/ns/nodes/n1/commands/",
    b"/metafora/ns/state/a",  # the state machine's key: not the coordinator's
])
def test_parse_ignores_keys_it_does_not_own(key: bytes) -> None:
    assert Keys("ns").parse(key) is None


def test_json_round_trip_and_damage() -> None:
    assert decode_json(encode_json({"b": 1, "a": [1, 2]})) == {"a": [1, 2], "b": 1}
    assert encode_json({"b": 1, "a": 2}) == b'{"a":2,"b":1}'
    assert decode_json(b"not json") is None
    assert decode_json(b"[1, 2]") is None


def test_times_round_trip_and_unreadable_ones_are_none() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_iso(iso(now)) == now
    assert parse_iso("yesterday") is None
    assert parse_iso(None) is None


def test_a_task_record_keeps_placement_only_when_set() -> None:
    plain = decode_json(task_record(Task("t", {"x": 1}), "2026-01-01T00:00:00+00:00"))
    assert plain == {"props": {"x": 1}, "created_at": "2026-01-01T00:00:00+00:00"}
    placed = Task("t", {}, selector={"zone": "a"}, priority=5, prefer={"rack": "r1"}, spread="zone")
    stored = props_of(kv(b"k", task_record(placed, "2026-01-01T00:00:00+00:00")), "t")
    assert stored.error is None
    assert stored.task("t", 7) == Task("t", {}, 7, selector={"zone": "a"}, priority=5,
                                       prefer={"rack": "r1"}, spread="zone")


@pytest.mark.parametrize("value", [b"garbage", b'{"created_at": "x"}', b'{"props": [1]}'])
def test_damaged_props_are_reported_not_taken_for_empty(value: bytes) -> None:
    stored = props_of(kv(b"k", value), "t")
    assert stored.props == {}
    assert stored.error is not None and "'t'" in stored.error


def test_state_records_and_damage_read_as_failed() -> None:
    assert state_of(kv(b"k", b'{"state": "done"}'))[0] is TaskState.DONE
    state, data = state_of(kv(b"k", b"???"))
    assert state is TaskState.FAILED and "unreadable" in data["error"]
    assert state_of(kv(b"k", b'{"state": "claimed"}'))[0] is TaskState.FAILED


def test_crashes_of_a_running_key() -> None:
    assert crashes_of(None) is None
    assert crashes_of(kv(b"k", b'{"crashes": 2}')) == 2
    assert crashes_of(kv(b"k", b'{"crashes": -1}')) == 0
    assert crashes_of(kv(b"k", b"junk")) == 0
    # Short values are decoded once and kept; asked again (from another key), the same answer.
    for _ in range(2):
        assert crashes_of(kv(b"other", b'{"crashes": 2}')) == 2
        assert crashes_of(kv(b"other", b'{"crashes": 0}')) == 0
    # A long value (a hand-written key) is decoded each time, with the same rules.
    padded = b'{"pad": "' + b"x" * 2000 + b'", "crashes": 3}'
    assert crashes_of(kv(b"k", padded)) == 3


def test_gather_and_task_info_of_a_claimed_task() -> None:
    keys = Keys("ns")
    tk = keys.task("t")
    kvs = [
        kv(tk.props, task_record(Task("t", {"x": 1}), "2026-01-01T00:00:00+00:00"), 2, 2),
        kv(tk.claim, b'{"node": "n1", "claimed_at": "2026-01-01T00:01:00+00:00"}', 3, 9, 2),
        kv(tk.owner, b"n1", 9, 9),
        kv(b"/metafora/ns/nodes/n1/alive", b"{}"),
    ]
    records = gather(keys, kvs)
    assert list(records) == ["t"]
    info = task_info("t", records["t"])
    assert info is not None
    assert (info.state, info.owner, info.token, info.attempts) == (TaskState.CLAIMED, "n1", 9, 2)
    assert info.claimed_at == datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    assert task_info("gone", TaskRecord()) is None


def test_task_info_of_pending_and_finished_tasks() -> None:
    keys = Keys("ns")
    tk = keys.task("t")
    props = kv(tk.props, task_record(Task("t"), "2026-01-01T00:00:00+00:00"))
    pending = task_info("t", TaskRecord(props=props))
    assert pending is not None and pending.state is TaskState.PENDING and pending.token == 0
    state = kv(tk.state, b'{"state": "failed", "error": "boom", "finished_at": '
                         b'"2026-01-01T00:02:00+00:00", "token": 4}')
    failed = task_info("t", TaskRecord(props=props, state=state))
    assert failed is not None and failed.state is TaskState.FAILED and failed.error == "boom"
    assert failed.finished_at == datetime(2026, 1, 1, 0, 2, tzinfo=UTC)


@pytest.mark.parametrize("task_id", ["a", "a/claim", "claim", "x%2Fclaim"])
def test_is_claim_names_only_claim_keys(task_id: str) -> None:
    """The watch drops claim keys' events undecoded: no other key may look like one."""
    keys = Keys("ns")
    tk = keys.task(task_id)
    assert keys.is_claim(tk.claim)
    assert keys.parse(tk.claim) == ("task", task_id, "claim")
    for other in (tk.props, tk.state, tk.running, tk.owner, keys.nodes + escape(task_id).encode(),
                  keys.root + b"commands/" + escape(task_id).encode() + b"/claim"):
        assert not keys.is_claim(other), other
