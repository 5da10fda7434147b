"""The stream's stored progress and its window, as pure values: the watermark is the lowest
gap, the bounds of the window, and a damaged cursor named as such."""

from __future__ import annotations

import pytest

from metafora.statemachine.machine import MAX_CURSOR_LENGTH
from metafora.streams import StreamFailing, StreamInfo
from metafora.streams.progress import InvalidProgress, Progress, Window


def test_the_watermark_moves_only_when_the_gap_closes() -> None:
    window = Window(processed=-1)
    for index in range(4):
        window.start(index)
    assert window.finished(2) is False and window.finished(1) is False
    assert window.processed == -1  # 0 still runs
    assert window.finished(0) is True and window.processed == 2
    window.failed(3)
    assert window.waiting == {3} and window.processed == 2
    window.start(3)  # a retry of a waiting index
    assert window.finished(3) and window.processed == 3


def test_room_respects_the_head_the_pool_and_the_window() -> None:
    window = Window(processed=9)
    assert window.room(head=5, max_processing=4, max_search_ahead=10) == 0  # nothing new
    assert window.room(head=100, max_processing=4, max_search_ahead=10) == 4  # the pool
    for index in range(10, 14):
        window.start(index)
    assert window.room(head=100, max_processing=4, max_search_ahead=10) == 0
    for index in range(11, 14):
        window.finished(index)  # 10 still runs: the watermark stays at 9
    assert window.room(head=100, max_processing=8, max_search_ahead=10) == 6  # 14..19 only
    assert window.room(head=15, max_processing=8, max_search_ahead=10) == 2  # up to the head


def test_progress_round_trips_and_cuts_long_errors() -> None:
    progress = Progress(start=5, processed=41, head=97, in_flight=8,
                        failing=StreamFailing(42, "E: " + "x" * 100_000, 5))
    text = progress.to_cursor()
    assert len(text) <= MAX_CURSOR_LENGTH
    back = Progress.from_cursor(text, start=0)
    assert (back.start, back.processed, back.head, back.in_flight) == (5, 41, 97, 8)
    assert back.failing is not None and back.failing.error.endswith("...")
    assert Progress.from_cursor(None, start=3) == Progress(3, 2)
    assert back.info() == StreamInfo(41, 97, 8, back.failing)
    assert StreamInfo(41, None, 0).lag is None and StreamInfo(41, 40, 0).lag == 0


@pytest.mark.parametrize(("cursor", "match"), [
    ("page 3", "not a stream's progress"),
    ('{"stream": 2, "start": 0, "processed": 1}', "not a stream's progress"),
    ('{"stream": 1, "start": 0, "processed": -5, "in_flight": 0}', "'processed' must be"),
    ('{"stream": 1, "start": 0, "processed": 1, "in_flight": 0, "x": 1}', "unknown fields: x"),
    ('{"stream": 1, "start": 0, "processed": 1, "in_flight": 0, "failing": 3}', "bad 'failing'"),
    ('{"stream": 1, "start": true, "processed": 1, "in_flight": 0}', "'start' must be"),
])
def test_a_damaged_cursor_is_named(cursor: str, match: str) -> None:
    with pytest.raises(InvalidProgress, match=match):
        Progress.from_cursor(cursor, start=0)
