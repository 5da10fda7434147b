"""The SQL watch and claims build tasks of rows shaped alike from one validated task: same result."""

from __future__ import annotations

import pytest

from metafora.coordinators.sql.shapes import OfferShapes
from metafora.core.errors import InvalidProps, InvalidTaskId
from metafora.core.task import Task

ROWS = [
    ("{}", None, 0, None),
    ('{"a": [1, {"b": 2}], "launch_at": "2020-01-01T00:00:00Z"}', '{"gpu": "1"}', 5,
     '{"prefer": {"zone": "eu"}, "spread": "g"}'),
]


@pytest.mark.parametrize("row", ROWS)
def test_a_copied_offer_equals_the_constructed_one(row: tuple[object, ...]) -> None:
    shapes = OfferShapes()
    first = shapes.task("t1", *row)  # type: ignore[arg-type]
    second = shapes.task("t2", *row)  # type: ignore[arg-type]
    fresh = shapes.task("t2", *row)  # type: ignore[arg-type]
    expected = Task("t2", first.props, selector=first.selector, priority=first.priority,
                    prefer=first.prefer, spread=first.spread)
    assert second == expected and second.__dict__ == expected.__dict__
    assert hash(second) == hash(expected)
    # Each offer has its own mutable parts: changing one changes no other.
    assert second.props is not first.props and second.props is not fresh.props
    assert second.selector is not first.selector and second.prefer is not first.prefer


def test_ids_are_still_validated_and_bad_texts_still_refused() -> None:
    shapes = OfferShapes()
    shapes.task("ok", "{}", None, 0, None)
    for bad in (" padded", "tab\there", "x" * 300):
        with pytest.raises(InvalidTaskId):
            shapes.task(bad, "{}", None, 0, None)
    assert shapes.task("é-ünïcode", "{}", None, 0, None).id == "é-ünïcode"
    for _ in range(2):  # an invalid text is never kept as a shape
        with pytest.raises(InvalidProps):
            shapes.task("t", "[1]", None, 0, None)
        with pytest.raises(InvalidProps):
            shapes.task("t", '{"x": NaN}', None, 0, None)


@pytest.mark.parametrize("row", ROWS)
def test_a_claimed_row_keeps_its_token_whether_its_shape_was_known_or_not(
        row: tuple[object, ...]) -> None:
    """A claim's rows go through the same shapes: each task carries its own claim's token."""
    shapes = OfferShapes()
    first = shapes.task("t1", *row, token=7)  # type: ignore[misc]
    copied = shapes.task("t2", *row, token=9)  # type: ignore[misc]
    offered = shapes.task("t3", *row)  # type: ignore[misc]
    assert (first.token, copied.token, offered.token) == (7, 9, 0)
    assert copied == Task("t2", first.props, 9, selector=first.selector, priority=first.priority,
                          prefer=first.prefer, spread=first.spread)
