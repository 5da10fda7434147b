"""Dataclass messages: fields from JSON by their type hints, to JSON, and a JSON Schema.

The common types are supported, and checked when the class is registered (ConfigError
naming the field otherwise): ``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes``
(base64, as protobuf's JSON), ``datetime`` / ``date`` (ISO 8601), ``uuid.UUID``, ``Enum``
(by value), ``Literal``, unions and ``Optional``, ``list`` / ``tuple`` / ``set`` /
``frozenset`` / ``Sequence``, ``dict`` / ``Mapping`` with ``str`` keys, nested dataclasses
and ``Any``. Fields are read by their Python names; unknown keys are ignored (a newer
producer may add fields); a missing field without a default is an error naming it.
"""

from __future__ import annotations

import base64
import binascii
import collections.abc
import dataclasses
import datetime as dt
import enum
import types
import typing
import uuid
from typing import Any

from metafora.core.errors import ConfigError
from metafora.messages.naming import describe

__all__ = ["BadField", "decode_dataclass", "encode_value", "schema_of_dataclass"]

_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence,
              collections.abc.Set, collections.abc.MutableSequence)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)
_SIMPLE: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    bytes: {"type": "string", "contentEncoding": "base64"},
    dt.datetime: {"type": "string", "format": "date-time"},
    dt.date: {"type": "string", "format": "date"},
    uuid.UUID: {"type": "string", "format": "uuid"},
}


class BadField(Exception):
    """A field that does not decode: ``path`` (``items[2].qty``) and why."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"field {path!r}: {why}")
        self.path = path
        self.why = why


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception as exc:  # a name the annotations use cannot be resolved
        raise ConfigError(f"cannot read the type hints of {cls.__qualname__}: {exc}") from exc


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


# -- decoding -----------------------------------------------------------------------------


def decode_dataclass(cls: type, data: Any, path: str = "") -> Any:
    """An instance of the dataclass ``cls`` from the JSON object ``data``; BadField."""
    if not isinstance(data, dict):
        raise BadField(path or "(message)", f"expected an object, got {describe(data)}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        where = f"{path}.{f.name}" if path else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BadField(where, "is missing")
            continue
        values[f.name] = _convert(hints.get(f.name, Any), data[f.name], where)
    try:
        return cls(**values)
    except BadField:
        raise
    except Exception as exc:  # the class's own checks (__post_init__)
        raise BadField(path or "(message)", f"{type(exc).__name__}: {exc}") from exc


def _convert(tp: Any, value: Any, path: str) -> Any:
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        whys = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, path)
            except BadField as exc:
                whys.append(exc.why)
        raise BadField(path, " or ".join(whys) or f"got {describe(value)}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise BadField(path, f"expected one of {list(args)}, got {describe(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise BadField(path, f"expected null, got {describe(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise BadField(path, f"expected a boolean, got {describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise BadField(path, f"expected an integer, got {describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise BadField(path, f"expected a number, got {describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise BadField(path, f"expected a string, got {describe(value)}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = [m.value for m in tp]
            raise BadField(path, f"expected one of {allowed}, got {describe(value)}") from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return decode_dataclass(tp, value, path)
    if tp in (bytes, dt.datetime, dt.date, uuid.UUID):
        return _from_text(tp, value, path)
    if origin in _SEQUENCES or tp in (list, tuple, set, frozenset):
        return _sequence(tp, origin or tp, args, value, path)
    if origin in _MAPPINGS or tp is dict:
        if not isinstance(value, dict):
            raise BadField(path, f"expected an object, got {describe(value)}")
        item = args[1] if len(args) == 2 else Any
        return {k: _convert(item, v, f"{path}[{k!r}]") for k, v in value.items()}
    raise BadField(path, f"unsupported type {tp!r}")


def _from_text(tp: Any, value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise BadField(path, f"expected a string, got {describe(value)}")
    try:
        if tp is bytes:
            return base64.b64decode(value, validate=True)
        if tp is uuid.UUID:
            return uuid.UUID(value)
        text = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
        return dt.datetime.fromisoformat(text) if tp is dt.datetime else dt.date.fromisoformat(value)
    except (ValueError, binascii.Error) as exc:
        raise BadField(path, f"not a valid {tp.__name__}: {describe(value)} ({exc})") from None


def _sequence(tp: Any, origin: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if not isinstance(value, list):
        raise BadField(path, f"expected an array, got {describe(value)}")
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise BadField(path, f"expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    item = args[0] if args else Any
    items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        return tuple(items)
    if origin in (set, collections.abc.Set):
        return set(items)
    if origin is frozenset:
        return frozenset(items)
    return items


# -- encoding -----------------------------------------------------------------------------


def encode_value(value: Any) -> Any:
    """``value`` (a dataclass instance, or anything in one) as JSON data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return encode_value(value.value)
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    return value


# -- JSON Schema --------------------------------------------------------------------------


def schema_of_dataclass(cls: type) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of the dataclass ``cls``'s fields; nested dataclasses
    in ``$defs``. ConfigError naming a field whose type is not supported."""
    defs: dict[str, Any] = {}
    schema = _object_schema(cls, defs)
    if defs:
        schema["$defs"] = defs
    return schema


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = _hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        try:
            props[f.name] = _schema(hints.get(f.name, Any), defs)
        except _Unsupported as exc:
            raise ConfigError(f"{cls.__qualname__}.{f.name}: type {exc.args[0]!r} is not supported "
                              "in a dataclass message (see metafora.messages.dataclass_codec)") from None
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    schema: dict[str, Any] = {"type": "object", "title": cls.__name__, "properties": props}
    if required:
        schema["required"] = required
    return schema


class _Unsupported(Exception):
    pass


def _schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if tp is Any or tp is object:
        return {}
    if tp in _SIMPLE:
        return dict(_SIMPLE[tp])
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        return {"anyOf": [_schema(a, defs) for a in args]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [encode_value(m.value) for m in tp]}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        name = tp.__qualname__
        if name not in defs:
            defs[name] = {}  # placeholder first: a type that contains itself refers to it
            defs[name] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{name}"}
    if origin in _SEQUENCES or tp in (list, tuple, set, frozenset):
        kind = origin or tp
        if kind is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return {"type": "array", "prefixItems": [_schema(a, defs) for a in args],
                    "minItems": len(args), "maxItems": len(args)}
        schema: dict[str, Any] = {"type": "array", "items": _schema(args[0], defs) if args else {}}
        if kind in (set, frozenset, collections.abc.Set):
            schema["uniqueItems"] = True
        return schema
    if origin in _MAPPINGS or tp is dict:
        if args and args[0] is not str:
            raise _Unsupported(tp)
        return {"type": "object", "additionalProperties": _schema(args[1], defs) if args else {}}
    raise _Unsupported(tp)
