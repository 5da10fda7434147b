"""The queue the group-commit writers share (metafora.core.groupcommit.Gathering)."""

from __future__ import annotations

from metafora.core.groupcommit import Gathering


def test_the_first_item_to_wait_is_told_and_timed() -> None:
    waiting: Gathering[int] = Gathering()
    with waiting.cond:
        assert waiting.add(1) is True
        first = waiting.oldest
        assert waiting.add(2) is False and waiting.oldest == first
        assert len(waiting) == 2


def test_batches_come_oldest_first_and_what_was_not_written_goes_back_first() -> None:
    waiting: Gathering[int] = Gathering()
    with waiting.cond:
        for n in range(5):
            waiting.add(n)
        assert waiting.take(2) == [0, 1]
        assert waiting.take(0) == []
        waiting.give_back([0, 1])
        assert list(waiting.items) == [0, 1, 2, 3, 4]
        assert waiting.take(10) == [0, 1, 2, 3, 4] and len(waiting) == 0
        waiting.add(7)
        assert waiting.take() == [7] and waiting.take() == []
