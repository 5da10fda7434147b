"""Protobuf messages: protobuf's own JSON mapping (``json_format``), and a schema from the
descriptor. Imported only when a protobuf class is used (protobuf is then installed).

As in protobuf's JSON for an ``Any``: the fields sit beside ``@type`` under their JSON
names (lowerCamelCase), and a well-known type with a special JSON form (``Timestamp``,
``Duration``, ``Struct``, the wrappers...) carries it under ``"value"``. Unknown fields are
ignored when reading (a newer producer may add some).
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from metafora.messages.dataclass_codec import BadField

__all__ = ["decode_protobuf", "encode_protobuf", "schema_of_protobuf"]

# Well-known types whose JSON form is not an object of their fields (protobuf's JSON
# mapping of Any puts it under "value").
_SPECIAL = {f"google.protobuf.{n}" for n in (
    "Any", "Duration", "FieldMask", "Struct", "Timestamp", "Value", "ListValue", "DoubleValue",
    "FloatValue", "Int64Value", "UInt64Value", "Int32Value", "UInt32Value", "BoolValue",
    "StringValue", "BytesValue",
)}
_FIELD = re.compile(r"Failed to parse (\w+) field|no field named \"(\w+)\"")

_INT = {"type": "integer"}
_INT64 = {"type": ["integer", "string"], "pattern": "^-?[0-9]+$"}  # int64 is a string in JSON
_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": ["number", "string"]},  # "NaN", "Infinity"
    FieldDescriptor.TYPE_FLOAT: {"type": ["number", "string"]},
    FieldDescriptor.TYPE_INT64: _INT64, FieldDescriptor.TYPE_UINT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64, FieldDescriptor.TYPE_FIXED64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_INT32: _INT, FieldDescriptor.TYPE_UINT32: _INT,
    FieldDescriptor.TYPE_SINT32: _INT, FieldDescriptor.TYPE_FIXED32: _INT,
    FieldDescriptor.TYPE_SFIXED32: _INT,
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
}
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?s$"},
    "google.protobuf.FieldMask": {"type": "string"},
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Value": {},
    "google.protobuf.Any": {"type": "object", "required": ["@type"]},
    "google.protobuf.DoubleValue": {"type": ["number", "string"]},
    "google.protobuf.FloatValue": {"type": ["number", "string"]},
    "google.protobuf.Int64Value": _INT64, "google.protobuf.UInt64Value": _INT64,
    "google.protobuf.Int32Value": _INT, "google.protobuf.UInt32Value": _INT,
    "google.protobuf.BoolValue": {"type": "boolean"},
    "google.protobuf.StringValue": {"type": "string"},
    "google.protobuf.BytesValue": {"type": "string", "contentEncoding": "base64"},
}


def _full_name(cls: type) -> str:
    return str(cls.DESCRIPTOR.full_name)  # type: ignore[attr-defined]


def encode_protobuf(msg: Any) -> dict[str, Any]:
    """The JSON fields of a protobuf message (without ``@type``)."""
    data = json_format.MessageToDict(msg)
    if _full_name(type(msg)) in _SPECIAL:
        return {"value": data}
    return dict(data)


def decode_protobuf(cls: type, fields: dict[str, Any]) -> Any:
    """A message of the protobuf class ``cls`` from its JSON ``fields``; BadField."""
    special = _full_name(cls) in _SPECIAL
    data = fields.get("value") if special else fields
    if special and "value" not in fields:
        raise BadField("value", "is missing (a well-known type's JSON sits under \"value\")")
    try:
        return json_format.ParseDict(data, cls(), ignore_unknown_fields=True)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        text = str(exc).splitlines()[0]
        found = _FIELD.search(text)
        name = (found.group(1) or found.group(2)) if found else ("value" if special else "(message)")
        raise BadField(name, text) from None


def schema_of_protobuf(cls: type) -> dict[str, Any]:
    """A JSON Schema of a protobuf class's JSON form, from its descriptor (nested messages
    in ``$defs`` by full name)."""
    desc: Descriptor = cls.DESCRIPTOR  # type: ignore[attr-defined]
    if desc.full_name in _SPECIAL:
        value = dict(_WELL_KNOWN.get(desc.full_name, {}))
        return {"type": "object", "title": desc.name, "properties": {"value": value},
                "required": ["value"]}
    defs: dict[str, Any] = {}
    schema = _message_schema(desc, defs)
    if defs:
        schema["$defs"] = defs
    return schema


def _message_schema(desc: Descriptor, defs: dict[str, Any]) -> dict[str, Any]:
    props = {f.json_name: _field_schema(f, defs) for f in desc.fields}
    return {"type": "object", "title": desc.name, "properties": props}


def _field_schema(field: FieldDescriptor, defs: dict[str, Any]) -> dict[str, Any]:
    msg = field.message_type
    if msg is not None and msg.GetOptions().map_entry:
        value = msg.fields_by_name["value"]
        return {"type": "object", "additionalProperties": _single_schema(value, defs)}
    one = _single_schema(field, defs)
    repeated = getattr(field, "is_repeated", None)
    if repeated if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED:
        return {"type": "array", "items": one}
    return one


def _single_schema(field: FieldDescriptor, defs: dict[str, Any]) -> dict[str, Any]:
    if field.type == FieldDescriptor.TYPE_ENUM:
        names: list[Any] = [v.name for v in field.enum_type.values]
        return {"enum": names + [v.number for v in field.enum_type.values]}
    if field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
        desc = field.message_type
        if desc.full_name in _WELL_KNOWN:
            return dict(_WELL_KNOWN[desc.full_name])
        if desc.full_name not in defs:
            defs[desc.full_name] = {}  # placeholder: a message that contains itself
            defs[desc.full_name] = _message_schema(desc, defs)
        return {"$ref": f"#/$defs/{desc.full_name}"}
    return dict(_SCALARS.get(field.type, {}))
