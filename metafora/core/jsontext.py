"""Bounded JSON decoding for data read from a store or a user.

Data in a shared store may have been written by another program, by hand, or by an attacker:
``json.loads`` of text nested a thousand levels deep raises ``RecursionError`` (not a
``ValueError``), and how deep it can go depends on the caller's own stack. Every decode of
stored or user-supplied JSON goes through :func:`load_object`, which turns any such failure into
the caller's typed error and enforces one documented depth limit, whatever the stack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from metafora.core.errors import MetaforaError

__all__ = ["MAX_DEPTH", "check_depth", "load_object", "load_value"]

MAX_DEPTH = 64
"""How deeply JSON objects and arrays may nest (the top-level object is level 1)."""

# A JSON value takes at least one character, so more values than this cannot fit in the
# size limits callers apply; it also bounds the walk of a structure that shares or cycles.
_MAX_VALUES = 16 * 1024 * 1024


def check_depth(
    value: object, what: str, error: type[MetaforaError], limit: int = MAX_DEPTH, top: int = 1,
    *, max_chars: int | None = None,
) -> None:
    """Raise ``error`` if ``value`` nests lists/dicts deeper than ``limit`` (iteratively: no recursion).

    ``top`` is the level of ``value`` itself: 0 for an envelope whose contents are what counts.
    ``max_chars``: also raise once its strings and keys alone take more characters than that
    (its JSON can only be longer), before anything is encoded or copied.
    """
    stack: list[tuple[object, int]] = [(value, top)]
    seen = chars = 0
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
            if max_chars is not None:
                chars += sum(len(k) if isinstance(k, str) else 1 for k in item)
        elif isinstance(item, list | tuple):
            children = item
        else:
            if max_chars is not None and isinstance(item, str):
                chars += len(item)
                if chars > max_chars:
                    raise error(f"{what}: more than {max_chars} bytes as JSON; the limit is {max_chars}")
            continue
        if depth > limit:
            raise error(f"{what}: nested deeper than {limit} levels")
        seen += len(children)
        if seen > _MAX_VALUES:
            raise error(f"{what}: more than {_MAX_VALUES} values")
        stack.extend((child, depth + 1) for child in children)
    if max_chars is not None and chars + seen > max_chars:
        raise error(f"{what}: more than {max_chars} bytes as JSON; the limit is {max_chars}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_value(
    data: str | bytes, what: str, error: type[MetaforaError], limit: int = MAX_DEPTH, top: int = 1,
    *, constants: bool = True, deep: type[MetaforaError] | None = None,
) -> Any:
    """Decode ``data`` as any JSON value, bounded as :func:`load_object` is.

    ``constants=False`` refuses ``NaN`` and ``Infinity`` (not JSON, though Python writes
    them). Nesting deeper than ``limit`` raises ``deep`` (default ``error``): a caller that
    takes text that is not JSON as plain text (``--prop k=v``) still refuses deep JSON.
    """
    too_deep = deep or error
    try:
        obj = json.loads(data) if constants else json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise too_deep(f"{what}: nested deeper than {limit} levels") from None
    except (ValueError, UnicodeDecodeError, TypeError) as exc:
        raise error(f"{what}: not valid JSON: {exc}") from None
    if not _may_nest(data, limit - top + 1):
        return obj  # the walk could find nothing: most stored values take this path
    check_depth(obj, what, too_deep, limit, top)
    return obj


def _may_nest(data: str | bytes, containers: int) -> bool:
    """Whether ``data`` may hold more than ``containers`` nested objects and arrays, or more
    values than :func:`check_depth` allows: each container opens with a bracket of the text
    (brackets inside strings only make this answer yes more often), and each value takes one
    character at least."""
    if len(data) > _MAX_VALUES:
        return True
    if isinstance(data, bytes):
        return data.count(b"{") + data.count(b"[") > containers
    return data.count("{") + data.count("[") > containers


def load_object(
    data: str | bytes, what: str, error: type[MetaforaError], limit: int = MAX_DEPTH, top: int = 1,
    *, constants: bool = True,
) -> dict[str, Any]:
    """Decode ``data`` as a JSON object; raise ``error`` naming ``what`` and the problem.

    Invalid JSON, invalid UTF-8, nesting deeper than ``limit`` (the object being at level
    ``top``) and a value that is not an object all raise ``error`` (never ``RecursionError``,
    never a bare ``ValueError``); ``constants=False`` refuses ``NaN`` and ``Infinity`` too.
    """
    obj = load_value(data, what, error, limit, top, constants=constants)
    if not isinstance(obj, dict):
        raise error(f"{what}: must be a JSON object, not {type(obj).__name__}")
    return obj
