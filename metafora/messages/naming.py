"""Message types and their names: ``@message(name)``, the three kinds, the ``@type`` value.

The props of a message task follow protobuf's JSON mapping of ``Any``: ``{"@type": NAME,
...fields}``, so a producer in any language writes the same JSON. ``NAME`` is a type URL
whose part after the last ``/`` is the type's full name; metafora writes

- ``type.googleapis.com/<full name>`` for a protobuf message (what protobuf's own JSON
  printer writes for an ``Any``, so a protobuf consumer elsewhere reads it unchanged);
- the name given to ``@message(...)`` as it is, for a dataclass or a pydantic model (a
  bare ``shop.OrderPlaced``, or a URL if the name is given as one).

When reading, a bare name and any ``prefix/`` form mean the same type: the lookup is by the
part after the last ``/``.

pydantic and protobuf are optional: this module looks at them only through
``sys.modules`` (a class of theirs cannot exist unless they were imported), never imports
them.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from metafora.core.errors import ConfigError

__all__ = [
    "MAX_NAME_LENGTH",
    "TYPE_KEY",
    "TYPE_URL_PREFIX",
    "Kind",
    "bare_name",
    "kind_of",
    "message",
    "type_name",
    "type_url",
]

TYPE_KEY = "@type"
"""The props key that names a message's type (protobuf's JSON mapping of ``Any``)."""
TYPE_URL_PREFIX = "type.googleapis.com/"
"""The type URL prefix protobuf writes (and metafora writes for protobuf messages)."""
MAX_NAME_LENGTH = 512
"""The longest ``@type`` value accepted."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_ATTR = "__metafora_message__"

C = TypeVar("C", bound=type)


class Kind(enum.Enum):
    """How a message class is encoded and decoded."""

    DATACLASS = "dataclass"
    PYDANTIC = "pydantic"
    PROTOBUF = "protobuf"


def bare_name(value: str) -> str:
    """The full type name of an ``@type`` value: the part after the last ``/``."""
    return value.rsplit("/", 1)[-1]


def _checked_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise ConfigError(f"a message name must be a non-empty string of at most "
                          f"{MAX_NAME_LENGTH} characters, not {name!r}")
    if not _NAME.fullmatch(bare_name(name)):
        raise ConfigError(f"message name {name!r}: the full name (after the last '/') must be "
                          "dotted identifiers, e.g. 'shop.OrderPlaced'")
    return name


def message(name: str) -> Callable[[C], C]:
    """Class decorator: name a dataclass or a pydantic model as a message type.

    ``@message("shop.OrderPlaced")`` above ``@dataclass`` (or on a ``BaseModel``). The name
    is what ``@type`` says in the props (see the module docstring); a protobuf class needs
    none (its name is ``DESCRIPTOR.full_name``).
    """
    checked = _checked_name(name)

    def mark(cls: C) -> C:
        setattr(cls, _ATTR, checked)
        return cls

    return mark


def _is_pydantic(cls: type) -> bool:
    module = sys.modules.get("pydantic")
    base = getattr(module, "BaseModel", None)
    return isinstance(base, type) and issubclass(cls, base)


def _is_protobuf(cls: type) -> bool:
    module = sys.modules.get("google.protobuf.message")
    base = getattr(module, "Message", None)
    return isinstance(base, type) and issubclass(cls, base) and hasattr(cls, "DESCRIPTOR")


def kind_of(cls: object) -> Kind:
    """The kind of a message class; ConfigError for anything else."""
    if not isinstance(cls, type):
        raise ConfigError(f"a message type must be a class, not {cls!r}")
    if _is_protobuf(cls):
        return Kind.PROTOBUF
    if _is_pydantic(cls):
        return Kind.PYDANTIC
    if dataclasses.is_dataclass(cls):
        return Kind.DATACLASS
    raise ConfigError(f"{cls.__qualname__} is not a message type: use a dataclass or a pydantic "
                      "model named with @message(...), or a protobuf message class")


def type_url(cls: type) -> str:
    """What ``@type`` says for ``cls`` when metafora writes it (see the module docstring)."""
    if kind_of(cls) is Kind.PROTOBUF:
        return TYPE_URL_PREFIX + str(cls.DESCRIPTOR.full_name)  # type: ignore[attr-defined]
    name = cls.__dict__.get(_ATTR)
    if name is None:
        raise ConfigError(f"{cls.__qualname__} has no message name: decorate it with "
                          f"@message('package.{cls.__name__}')")
    return str(name)


def type_name(cls: type) -> str:
    """The full name of a message class (``@type`` without its URL prefix)."""
    return bare_name(type_url(cls))


def describe(value: Any) -> str:
    """A short, bounded rendering of a bad value for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
