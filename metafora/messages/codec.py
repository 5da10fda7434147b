"""Messages to props and back (``{"@type": NAME, ...fields}``), and their JSON Schemas.

One entry per kind (:class:`~metafora.messages.naming.Kind`): dataclasses here and in
:mod:`~metafora.messages.dataclass_codec`, pydantic through its own ``model_dump`` /
``model_validate`` / ``model_json_schema``, protobuf in
:mod:`~metafora.messages.protobuf_codec` (imported only for a protobuf class).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from metafora.core.errors import InvalidProps
from metafora.messages.dataclass_codec import (
    BadField,
    decode_dataclass,
    encode_value,
    schema_of_dataclass,
)
from metafora.messages.errors import MalformedMessage, UnknownMessageType
from metafora.messages.naming import TYPE_KEY, Kind, bare_name, describe, kind_of, type_url

__all__ = ["decode", "encode", "named_type", "schema_of"]


def encode(msg: object) -> dict[str, Any]:
    """The props of a message: ``{"@type": ..., **fields}``. ConfigError for an object of no
    message type; InvalidProps when a field is not JSON (or is named ``@type``)."""
    cls = type(msg)
    kind = kind_of(cls)
    fields: Any
    if kind is Kind.PROTOBUF:
        from metafora.messages.protobuf_codec import encode_protobuf

        fields = encode_protobuf(msg)
    elif kind is Kind.PYDANTIC:
        fields = msg.model_dump(mode="json")  # type: ignore[attr-defined]
    else:
        fields = encode_value(msg)
    if TYPE_KEY in fields:
        raise InvalidProps(f"{cls.__qualname__}: a field named {TYPE_KEY!r} would hide the type")
    try:
        json.dumps(fields)
    except (TypeError, ValueError) as exc:
        raise InvalidProps(f"{cls.__qualname__} does not encode as JSON: {exc}") from exc
    return {TYPE_KEY: type_url(cls), **fields}


def named_type(props: Mapping[str, Any]) -> str:
    """The full type name a task's props name (``@type`` without its URL prefix);
    UnknownMessageType when they name none."""
    value = props.get(TYPE_KEY)
    if not isinstance(value, str) or not bare_name(value):
        raise UnknownMessageType(
            f"the task's props name no message type: {TYPE_KEY!r} is "
            f"{'missing' if value is None else describe(value)}", field=TYPE_KEY)
    return bare_name(value)


def decode(cls: type, props: Mapping[str, Any]) -> Any:
    """A message of ``cls`` from a task's props (``@type`` and unknown keys left out);
    MalformedMessage naming the type and the field that does not decode."""
    name = type_url(cls)
    fields = {k: v for k, v in props.items() if k != TYPE_KEY}
    kind = kind_of(cls)
    try:
        if kind is Kind.PROTOBUF:
            from metafora.messages.protobuf_codec import decode_protobuf

            return decode_protobuf(cls, fields)
        if kind is Kind.PYDANTIC:
            return _decode_pydantic(cls, fields)
        return decode_dataclass(cls, fields)
    except BadField as exc:
        raise MalformedMessage(f"message {name}: field {exc.path!r}: {exc.why}",
                               type_name=bare_name(name), field=exc.path) from None


def _decode_pydantic(cls: type, fields: dict[str, Any]) -> Any:
    import pydantic  # installed: cls is one of its models

    try:
        return cls.model_validate(fields)  # type: ignore[attr-defined]
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        first: dict[str, Any] = dict(errors[0]) if errors else {}
        path = ".".join(str(p) for p in first.get("loc", ())) or "(message)"
        raise BadField(path, f"{first.get('msg', exc)} (input {describe(first.get('input'))})") from None


def schema_of(cls: type) -> dict[str, Any]:
    """A JSON Schema of the props of ``cls``'s messages: its fields and ``@type``.

    Dataclass: from the type hints; pydantic: ``model_json_schema()``; protobuf: from the
    descriptor. ConfigError when a dataclass field's type is not supported.
    """
    kind = kind_of(cls)
    if kind is Kind.PROTOBUF:
        from metafora.messages.protobuf_codec import schema_of_protobuf

        schema = schema_of_protobuf(cls)
    elif kind is Kind.PYDANTIC:
        schema = dict(cls.model_json_schema())  # type: ignore[attr-defined]
    else:
        schema = schema_of_dataclass(cls)
    url = type_url(cls)
    props = {TYPE_KEY: {"type": "string", "enum": sorted({url, bare_name(url)})},
             **schema.get("properties", {})}
    required = [TYPE_KEY, *(r for r in schema.get("required", []) if r != TYPE_KEY)]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema,
            "properties": props, "required": required}
