"""Issue 50: typed messages -- the ``@type`` envelope (protobuf's JSON mapping of ``Any``),
dataclass / pydantic / protobuf codecs, their errors naming the type and the field, JSON
Schemas, the Router's registration rules, and pydantic / protobuf imported only when used."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest
from google.protobuf import descriptor_pb2, timestamp_pb2, wrappers_pb2

import metafora
from metafora import Task
from metafora.core.errors import ConfigError, InvalidProps
from metafora.messages import (
    TYPE_KEY,
    MalformedMessage,
    Router,
    UnknownMessageType,
    decode,
    encode,
    message,
    message_task,
    named_type,
    schema_of,
    type_name,
    type_url,
)
from metafora.testing import LocalCluster

REPO = Path(metafora.__file__).resolve().parents[1]
FIELD_PROTO = "google.protobuf.FieldDescriptorProto"


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Line:
    sku: str
    qty: int


@message("shop.OrderPlaced")
@dataclasses.dataclass
class OrderPlaced:
    order_id: str
    lines: list[Line]
    total: float
    at: dt.datetime
    color: Color = Color.RED
    note: str | None = None
    tags: dict[str, int] = dataclasses.field(default_factory=dict)
    ref: uuid.UUID | None = None
    raw: bytes = b""
    mode: Literal["fast", "slow"] = "fast"


@message("type.example.com/shop.Refund")
class Refund(pydantic.BaseModel):
    order_id: str
    amount: int


def order() -> OrderPlaced:
    return OrderPlaced("o-1", [Line("a", 2), Line("b", 1)], 9.5,
                       dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC), Color.BLUE, None,
                       {"x": 1}, uuid.UUID(int=7), b"\x00\x01", "slow")


# -- names and the envelope ----------------------------------------------------------------


def test_names_follow_the_registration_and_both_forms_are_read() -> None:
    assert type_url(OrderPlaced) == "shop.OrderPlaced"  # @message as given: a bare name
    assert type_url(Refund) == "type.example.com/shop.Refund"
    assert type_name(Refund) == "shop.Refund"
    proto = descriptor_pb2.FieldDescriptorProto
    assert type_url(proto) == f"type.googleapis.com/{FIELD_PROTO}"  # as protobuf writes Any
    for value in ("shop.OrderPlaced", "type.googleapis.com/shop.OrderPlaced", "x.io/a/shop.OrderPlaced"):
        assert named_type({TYPE_KEY: value}) == "shop.OrderPlaced"


@pytest.mark.parametrize("bad", ["", "shop..X", "1shop.X", "shop X", 3, "a" * 600])
def test_bad_message_names_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigError):
        message(bad)


def test_a_class_of_no_kind_or_without_a_name_is_refused() -> None:
    @dataclasses.dataclass
    class Unnamed:
        x: int

    with pytest.raises(ConfigError, match="no message name"):
        Router().register(Unnamed, lambda m, c: None)
    with pytest.raises(ConfigError, match="not a message type"):
        Router().register(int, lambda m, c: None)
    with pytest.raises(ConfigError, match="no message name"):
        encode(Unnamed(1))


def test_props_without_a_type_name_the_missing_key() -> None:
    for props in ({}, {TYPE_KEY: 5}, {TYPE_KEY: ""}):
        with pytest.raises(UnknownMessageType, match="@type"):
            named_type(props)


# -- dataclasses ---------------------------------------------------------------------------


def test_a_dataclass_goes_round_trip_through_props() -> None:
    props = encode(order())
    assert props[TYPE_KEY] == "shop.OrderPlaced"
    assert props["lines"] == [{"sku": "a", "qty": 2}, {"sku": "b", "qty": 1}]
    assert props["at"] == "2026-01-02T03:04:05+00:00" and props["color"] == "blue"
    assert props["raw"] == "AAE=" and props["ref"] == str(uuid.UUID(int=7))
    Task("t", props)  # valid task props
    assert decode(OrderPlaced, props) == order()
    # A newer producer's extra field is ignored; defaults fill what is left out.
    assert decode(OrderPlaced, {**props, "extra": 1}) == order()
    minimal = decode(OrderPlaced, {"order_id": "o", "lines": [], "total": 1, "at": "2026-01-02T00:00:00Z"})
    assert minimal.color is Color.RED and minimal.total == 1.0 and minimal.at.tzinfo is not None


@pytest.mark.parametrize(("change", "field", "why"), [
    ({"lines": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": "two"}]}, "lines[1].qty", "integer"),
    ({"lines": [{"qty": 1}]}, "lines[0].sku", "missing"),
    ({"total": True}, "total", "number"),
    ({"color": "green"}, "color", "one of"),
    ({"at": "yesterday"}, "at", "datetime"),
    ({"tags": {"x": "1"}}, "tags['x']", "integer"),
    ({"mode": "medium"}, "mode", "one of"),
    ({"raw": "%%"}, "raw", "bytes"),
    ({"lines": "no"}, "lines", "array"),
])
def test_a_field_that_does_not_decode_is_named_with_the_type(change: dict[str, Any], field: str,
                                                            why: str) -> None:
    props = {**encode(order()), **change}
    with pytest.raises(MalformedMessage) as caught:
        decode(OrderPlaced, props)
    assert caught.value.type_name == "shop.OrderPlaced" and caught.value.field == field
    assert "shop.OrderPlaced" in str(caught.value) and repr(field) in str(caught.value)
    assert why in str(caught.value)
    assert isinstance(caught.value, InvalidProps)


def test_a_missing_required_field_is_named() -> None:
    with pytest.raises(MalformedMessage, match="'order_id': is missing"):
        decode(OrderPlaced, {TYPE_KEY: "shop.OrderPlaced"})


def test_a_dataclass_schema_comes_from_its_type_hints() -> None:
    schema = schema_of(OrderPlaced)
    assert schema["required"] == ["@type", "order_id", "lines", "total", "at"]
    props = schema["properties"]
    assert props["@type"] == {"type": "string", "enum": ["shop.OrderPlaced"]}
    assert props["lines"] == {"type": "array", "items": {"$ref": "#/$defs/Line"}}
    assert schema["$defs"]["Line"]["properties"] == {"sku": {"type": "string"}, "qty": {"type": "integer"}}
    assert props["at"] == {"type": "string", "format": "date-time"}
    assert props["color"] == {"enum": ["red", "blue"]}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert props["tags"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["mode"] == {"enum": ["fast", "slow"]}


def test_a_dataclass_field_of_an_unsupported_type_is_refused_at_registration() -> None:
    @message("odd.Thing")
    @dataclasses.dataclass
    class Thing:
        when: dt.time
        keys: dict[int, str]

    with pytest.raises(ConfigError, match=r"Thing\.when"):
        Router().register(Thing, lambda m, c: None)


# -- pydantic ------------------------------------------------------------------------------


def test_a_pydantic_model_goes_round_trip_and_names_its_bad_field() -> None:
    props = encode(Refund(order_id="o-1", amount=3))
    assert props == {TYPE_KEY: "type.example.com/shop.Refund", "order_id": "o-1", "amount": 3}
    assert decode(Refund, {**props, TYPE_KEY: "shop.Refund"}) == Refund(order_id="o-1", amount=3)
    with pytest.raises(MalformedMessage) as caught:
        decode(Refund, {"order_id": "o-1", "amount": "lots"})
    assert caught.value.field == "amount" and caught.value.type_name == "shop.Refund"
    schema = schema_of(Refund)
    assert schema["properties"]["amount"]["type"] == "integer"
    assert schema["properties"][TYPE_KEY]["enum"] == ["shop.Refund", "type.example.com/shop.Refund"]
    assert schema["required"] == [TYPE_KEY, "order_id", "amount"]


# -- protobuf ------------------------------------------------------------------------------


def test_a_protobuf_message_uses_protobufs_json_mapping_of_any() -> None:
    msg = descriptor_pb2.FieldDescriptorProto(name="qty", number=3, type=5, json_name="qty")
    props = encode(msg)
    assert props == {TYPE_KEY: f"type.googleapis.com/{FIELD_PROTO}", "name": "qty", "number": 3,
                     "type": "TYPE_INT32", "jsonName": "qty"}
    assert decode(descriptor_pb2.FieldDescriptorProto, props) == msg
    assert decode(descriptor_pb2.FieldDescriptorProto, {**props, TYPE_KEY: FIELD_PROTO}) == msg
    with pytest.raises(MalformedMessage) as caught:
        decode(descriptor_pb2.FieldDescriptorProto, {**props, "number": "three"})
    assert caught.value.field == "number" and caught.value.type_name == FIELD_PROTO


def test_well_known_types_carry_their_json_under_value() -> None:
    stamp = timestamp_pb2.Timestamp(seconds=86400)
    props = encode(stamp)
    assert props == {TYPE_KEY: "type.googleapis.com/google.protobuf.Timestamp",
                     "value": "1970-01-02T00:00:00Z"}
    assert decode(timestamp_pb2.Timestamp, props) == stamp
    assert encode(wrappers_pb2.StringValue(value="hi"))["value"] == "hi"
    with pytest.raises(MalformedMessage, match="value"):
        decode(timestamp_pb2.Timestamp, {"value": "not a time"})


def test_a_protobuf_schema_comes_from_the_descriptor() -> None:
    schema = schema_of(descriptor_pb2.FieldDescriptorProto)
    props = schema["properties"]
    assert props["number"] == {"type": "integer"}
    assert props["jsonName"] == {"type": "string"}
    assert "TYPE_INT32" in props["type"]["enum"]
    assert props["options"] == {"$ref": "#/$defs/google.protobuf.FieldOptions"}
    assert "google.protobuf.FieldOptions" in schema["$defs"]
    assert schema_of(timestamp_pb2.Timestamp)["properties"]["value"]["format"] == "date-time"


# -- the router and submit_message ---------------------------------------------------------


def test_a_type_gets_one_handler_and_schemas_list_every_type() -> None:
    router = Router()
    router.register(OrderPlaced, lambda m, c: None)
    with pytest.raises(ConfigError, match="already has a handler"):
        router.register(OrderPlaced, lambda m, c: None)
    with pytest.raises(ConfigError, match="callable"):
        router.register(Refund, "not a function")  # type: ignore[arg-type]
    router.register(Refund, lambda m, c: None)
    router.register(descriptor_pb2.FieldDescriptorProto, lambda m, c: None)
    assert list(router.schemas()) == [FIELD_PROTO, "shop.OrderPlaced", "shop.Refund"]


def test_submit_message_takes_the_submit_and_task_options() -> None:
    task, submit = message_task("t1", Refund(order_id="o", amount=1),
                                {"priority": 5, "group": "g", "if_exists": "ignore"})
    assert task.priority == 5 and task.group == "g" and submit == {"if_exists": "ignore"}
    with pytest.raises(ConfigError, match="unknown option"):
        message_task("t1", Refund(order_id="o", amount=1), {"prio": 5})
    with LocalCluster() as cluster:
        assert cluster.client.submit_message("m1", order(), priority=3) is True
        info = cluster.client.get_task("m1")
        assert info.props == encode(order()) and info.priority == 3
        assert cluster.client.submit_message("m1", order(), if_exists="ignore") is False


def test_memory_store_refuses_completion_in_a_transaction() -> None:
    with LocalCluster() as cluster, pytest.raises(ConfigError, match="SQL store"):
        cluster.client.complete_task(Task("t", token=1), conn=object())


# -- optional dependencies -----------------------------------------------------------------

_PROBE = """
import dataclasses, sys
{block}
from metafora import Task
from metafora.messages import Router, decode, encode, message

@message("shop.Ping")
@dataclasses.dataclass
class Ping:
    n: int

router = Router()
router.register(Ping, lambda msg, ctx: seen.append(msg))
seen = []
props = encode(Ping(3))
handler = router(Task("t", props))
assert handler.run() is True and seen == [Ping(3)], seen
assert list(router.schemas()) == ["shop.Ping"]
assert "pydantic" not in sys.modules, "pydantic was imported"
assert not any(m.startswith("google.protobuf") for m in sys.modules), "protobuf was imported"
print("ok")
"""

_BLOCK = """
import importlib.abc
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "google"):
            raise ImportError(f"{name} is not installed (blocked by the test)")
        return None
sys.meta_path.insert(0, Blocker())
"""


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "not-installed"])
def test_dataclass_messages_need_neither_pydantic_nor_protobuf(installed: bool) -> None:
    code = textwrap.dedent(_PROBE.format(block="" if installed else _BLOCK))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_context_on_the_memory_store() -> None:
    """ctx.checkpoint/cursor work on every store; ctx.complete(conn=) is a ConfigError where
    no transaction can be shared; a router outside a consumer needs its store."""
    seen: dict[str, Any] = {}
    router = Router()

    @router.handles(Refund)
    def refunded(msg: Refund, ctx: Any) -> None:
        seen["token"] = ctx.token
        seen["before"] = ctx.cursor
        ctx.checkpoint("half")
        seen["after"] = ctx.cursor
        try:
            ctx.complete(conn=object())
        except ConfigError as exc:
            seen["complete"] = str(exc)
        seen["stopping"] = (ctx.stopping, ctx.is_stopping())

    with LocalCluster() as cluster:
        cluster.add(router, "runner")
        cluster.client.submit_message("r1", Refund(order_id="o", amount=1))
        cluster.wait_for_state("r1", "done", 10)
    assert seen["token"] > 0 and seen["before"] is None and seen["after"] == "half"
    assert "needs a SQL store" in seen["complete"]
    assert seen["stopping"] == (False, False)
    lonely = router(Task("r2", encode(Refund(order_id="o", amount=1)), token=5))
    with pytest.raises(ConfigError, match="came from no consumer"):
        lonely.run()  # type: ignore[union-attr]
