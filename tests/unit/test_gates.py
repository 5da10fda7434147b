"""Gates without a consumer: values and their validation, the JSON wire form, processors,
handler_func's settings, the gates' error handler (on a real SQLite item store)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from metafora import Task, gates, open_coordinator
from metafora import gates as metafora_gates
from metafora.coordinators.memory import drop_store
from metafora.coordinators.sql.gates import items_channel
from metafora.core.errors import ConfigError
from metafora.gates import (
    GateError,
    Item,
    ItemResult,
    ItemStatus,
    ItemStore,
    NewItem,
    PartitionInfo,
    PermanentError,
    Response,
)
from metafora.statemachine import ErrorRecord, Message, MessageKind, State, StateCode

NOW = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def items(tmp_path: Path) -> Iterator[ItemStore]:
    store = ItemStore(f"sqlite:///{tmp_path}/items.db")
    try:
        yield store
    finally:
        store.close()


def test_new_items_and_responses_validate_and_normalise() -> None:
    assert NewItem(3, "héllo").data == "héllo".encode()
    assert NewItem(0, bytearray(b"x")).data == b"x"
    for bad in (-1, gates.MAX_GATE + 1, 1.5, True, "0"):
        with pytest.raises(GateError):
            NewItem(bad, b"")  # type: ignore[arg-type]
    response = Response(gate=2, done=False, data="x", spawn=[NewItem(3, b"s")])
    assert response.spawn == (NewItem(3, b"s"),) and response.data == b"x"
    with pytest.raises(GateError):
        Response(gate=0, done="yes")  # type: ignore[arg-type]
    with pytest.raises(GateError):
        Response(gate=0, done=True, spawn=NewItem(1, b""))  # type: ignore[arg-type]
    with pytest.raises(GateError):
        Response(gate=0, done=True, spawn=[b"raw"])  # type: ignore[list-item]


def test_the_wire_form_of_answers() -> None:
    assert Response.from_wire({"done": True}, 4) == Response(4, True)
    assert Response.from_wire({"gate": 5, "done": False, "data": "t"}, 4).data == b"t"
    assert Response.from_wire({"done": True, "data": {"b": 1, "a": [1]}}, 0).data == b'{"a":[1],"b":1}'
    assert Response.from_wire({"done": True, "data_base64": "AP8="}, 0).data == b"\x00\xff"
    assert Response.from_wire({"done": True, "spawn": [{"gate": 2}]}, 0).spawn == (NewItem(2, b""),)
    for bad in ([], {"gate": 1}, {"done": 1}, {"done": True, "gate": -1}, {"done": True, "spawn": {}},
                {"done": True, "spawn": ["x"]}, {"done": True, "data_base64": "***"},
                {"done": True, "spawn": [{"gate": "one"}]}):
        with pytest.raises(PermanentError):
            Response.from_wire(bad, 0)


def test_items_and_partition_views_as_json() -> None:
    item = Item("p", 7, 1, ItemStatus.FAILED, b"\xff", attempts=2, error="boom", permanent=True)
    doc = item.to_dict()
    assert (doc["data"], doc["data_base64"]) == (None, "/w==")
    assert (doc["status"], doc["permanent"]) == ("failed", True)
    assert item.to_wire() == {"partition": "p", "id": 7, "gate": 1, "attempts": 2, "data": None,
                              "data_base64": "/w=="}
    assert item.text == "\ufffd"
    info = PartitionInfo("p", 1, counts={0: {ItemStatus.COMPLETE: 3}, 1: {ItemStatus.AVAILABLE: 2,
                                                                          ItemStatus.FAILED: 1}})
    assert (info.total(), info.total("complete"), info.total(ItemStatus.FAILED)) == (6, 3, 1)
    assert info.to_dict()["counts"] == {"0": {"complete": 3}, "1": {"available": 2, "failed": 1}}


def test_callable_processor_checks_what_the_function_returns() -> None:
    ok = gates.callable_processor(lambda i: Response(i.gate, True), concurrency=3)
    assert isinstance(ok, gates.Processor) and ok.concurrency == 3
    assert ok.process(Item("p", 1, 2, ItemStatus.AVAILABLE)) == Response(2, True)
    wrong = gates.callable_processor(lambda i: "done")  # type: ignore[arg-type, return-value]
    with pytest.raises(PermanentError, match=r"not a gates\.Response"):
        wrong.process(Item("p", 1, 0, ItemStatus.AVAILABLE))
    with pytest.raises(ConfigError):
        gates.callable_processor("nope")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        gates.callable_processor(lambda i: Response(0, True), concurrency=0)


def test_handler_func_validates_its_settings(items: ItemStore) -> None:
    coord = open_coordinator("memory://gates-unit", node_id="n1")
    try:
        step = gates.callable_processor(lambda i: Response(i.gate, True), concurrency=5)
        handler = gates.handler_func(step, coord, items)
        assert handler.options.concurrency == 5 and not handler.claim_fence  # memory: token fencing
        assert gates.handler_func(lambda i: Response(0, True), coord, items).options.concurrency == 1
        for bad in ({"batch_size": 0}, {"concurrency": -1}, {"max_attempts": 0}, {"retry_delay": -1},
                    {"poll_interval": 0}, {"command_interval": 0}, {"batch_size": 2.5}):
            with pytest.raises(ConfigError):
                gates.handler_func(step, coord, items, **bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="ItemStore"):
            gates.handler_func(step, coord, "sqlite:///x.db")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="Processor"):
            gates.handler_func(42, coord, items)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="coordinator"):
            gates.handler_func(step, None, items)
    finally:
        coord.close()
        drop_store("gates-unit/metafora")


def test_claim_fencing_is_used_only_on_the_coordinators_own_database(
        items: ItemStore, tmp_path: Path) -> None:
    same = open_coordinator(f"sqlite:///{tmp_path}/items.db", node_id="n1")
    other_ns = open_coordinator(f"sqlite:///{tmp_path}/items.db?namespace=other", node_id="n1")
    other_db = open_coordinator(f"sqlite:///{tmp_path}/other.db", node_id="n1")
    step = gates.callable_processor(lambda i: Response(i.gate, True))
    try:
        assert gates.handler_func(step, same, items).claim_fence
        assert not gates.handler_func(step, other_ns, items).claim_fence
        assert not gates.handler_func(step, other_db, items).claim_fence
    finally:
        for coord in (same, other_ns, other_db):
            coord.close()


def test_the_error_handler_fails_at_once_when_only_permanent_failures_remain(items: ItemStore) -> None:
    ids = items.add("p", [NewItem(0, b"a"), NewItem(0, b"b")])
    lease = items.lease(Task("p", token=1))
    lease.take_over()
    fault = State(StateCode.FAULT, errors=(ErrorRecord(NOW, "ItemsFailed: ..."),))
    handler = gates.gate_error_handler(items, lambda t, s, n: Message.sleep(NOW))
    assert handler(Task("p"), fault, NOW).kind is MessageKind.SLEEP  # nothing failed: the base policy
    lease.finish(0, [ItemResult(ids[0], ItemStatus.FAILED, 0, 3, error="flaky")])
    assert handler(Task("p"), fault, NOW).kind is MessageKind.SLEEP  # retryable: back off, retry
    lease.reopen_failed(0)
    lease.finish(0, [ItemResult(ids[0], ItemStatus.FAILED, 0, 1, error="HTTP 404", permanent=True)])
    message = handler(Task("p"), fault, NOW)
    assert message.kind is MessageKind.ERROR and "failed permanently" in (message.reason or "")
    assert "HTTP 404" in (message.reason or "") and "metafora items retry p" in (message.reason or "")


def test_items_channel_is_a_short_stable_identifier() -> None:
    channel = items_channel("metafora")
    assert channel == items_channel("metafora") != items_channel("other")
    assert channel.isidentifier() and len(channel) < 63


def test_the_published_old_module_name_keeps_working() -> None:
    """``metafora.statemachine.gates`` (the contract's first name of metafora.gates) follows the
    one policy for moved names (metafora.core._moved): a published name forwards."""
    from metafora.statemachine import gates as old

    assert old.Response is metafora_gates.Response
    assert old.handler_func is metafora_gates.handler_func
    assert "ItemStore" in dir(old)
    with pytest.raises(AttributeError):
        _ = old.no_such_name


def test_a_moved_name_says_where_it_went() -> None:
    with pytest.raises(AttributeError, match=r"moved to metafora\.coordinators\.sql\.gates\.items_channel"):
        _ = metafora_gates.items_channel
