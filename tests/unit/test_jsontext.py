"""metafora.core.jsontext: bounded JSON decoding of stored or user text into typed errors."""

from __future__ import annotations

import pytest

from metafora.core.errors import InvalidProps
from metafora.core.jsontext import MAX_DEPTH, check_depth, load_object


def nested(levels: int) -> str:
    """A JSON object whose arrays nest ``levels`` deep (the object is level 1)."""
    return '{"a":' + "[" * (levels - 1) + "]" * (levels - 1) + "}"


def test_an_object_decodes_from_text_or_bytes() -> None:
    assert load_object('{"a": [1, {"b": null}]}', "props", InvalidProps) == {"a": [1, {"b": None}]}
    assert load_object(b'{"x": "\xc3\xa9"}', "props", InvalidProps) == {"x": "\u00e9"}


@pytest.mark.parametrize(("data", "message"), [
    ("{", "props: not valid JSON"),
    (b"\xff\xfe{", "props: not valid JSON"),
    ("[1, 2]", "props: must be a JSON object, not list"),
    ('"text"', "props: must be a JSON object, not str"),
    ("null", "props: must be a JSON object, not NoneType"),
])
def test_what_is_not_an_object_raises_the_callers_error(data: str | bytes, message: str) -> None:
    with pytest.raises(InvalidProps, match=message):
        load_object(data, "props", InvalidProps)


def test_the_depth_limit_counts_the_top_object_as_level_one() -> None:
    assert load_object(nested(MAX_DEPTH), "props", InvalidProps)
    with pytest.raises(InvalidProps, match=f"nested deeper than {MAX_DEPTH} levels"):
        load_object(nested(MAX_DEPTH + 1), "props", InvalidProps)
    with pytest.raises(InvalidProps, match="nested deeper than 3 levels"):
        load_object(nested(4), "props", InvalidProps, limit=3)


def test_an_envelope_at_level_zero_lets_its_contents_use_the_whole_limit() -> None:
    assert load_object(nested(MAX_DEPTH + 1), "envelope", InvalidProps, top=0)
    with pytest.raises(InvalidProps):
        load_object(nested(MAX_DEPTH + 2), "envelope", InvalidProps, top=0)


def test_text_too_deep_for_the_parser_is_the_callers_error_not_a_recursion_error() -> None:
    deep = '{"a":' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(InvalidProps, match="nested deeper than"):
        load_object(deep, "props", InvalidProps)


def test_check_depth_walks_python_values_without_recursion() -> None:
    value: list[object] = []
    inner = value
    for _ in range(10_000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    with pytest.raises(InvalidProps, match="props: nested deeper than"):
        check_depth(value, "props", InvalidProps)
    check_depth({"t": (1, (2, (3,)))}, "props", InvalidProps, limit=4)
    with pytest.raises(InvalidProps):
        check_depth({"t": (1, (2, (3,)))}, "props", InvalidProps, limit=3)


def test_a_structure_that_contains_itself_ends_at_the_depth_limit() -> None:
    loop: dict[str, object] = {}
    loop["self"] = loop
    with pytest.raises(InvalidProps, match="nested deeper than"):
        check_depth(loop, "props", InvalidProps)
