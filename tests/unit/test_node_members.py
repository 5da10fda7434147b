"""What stores tell balancers besides the counts (metafora.coordinators.members): stored
weights, a context's weight, and the weights and frozen nodes a count read saw."""

from __future__ import annotations

import logging
import math

import pytest

from metafora.contracts.coordinator import CoordinatorContext
from metafora.coordinators.members import SeenWithCounts, context_weight, stored_weight
from metafora.core.errors import ConfigError
from metafora.core.task import Task
from metafora.testing import FakeClock, RecordingContext


def test_a_context_weighs_one_unless_it_says_otherwise() -> None:
    class Plain(CoordinatorContext):
        def lost(self, task: Task) -> None:
            return

    assert Plain().weight == 1.0 and context_weight(Plain()) == 1.0
    assert context_weight(object()) == 1.0  # a duck-typed context from before weights
    assert context_weight(RecordingContext(weight=2)) == 2.0


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "2", None])
def test_a_bad_context_weight_is_a_config_error_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^weight must be a positive number, got "):
        context_weight(RecordingContext(weight=bad))  # type: ignore[arg-type]


def test_a_stored_weight_that_is_missing_or_damaged_is_one(caplog: pytest.LogCaptureFixture) -> None:
    assert stored_weight(2.5, "n") == 2.5 and stored_weight(3, "n") == 3.0
    assert stored_weight(None, "n") == 1.0
    with caplog.at_level(logging.WARNING, logger="metafora.coordinators.members"):
        for bad in (0, -2.0, math.nan, math.inf, True, "2"):
            assert stored_weight(bad, "n") == 1.0
    assert len(caplog.records) == 6 and "stored weight of node 'n'" in caplog.records[0].getMessage()


def test_what_a_count_read_saw_answers_the_next_asks_once_while_recent() -> None:
    clock = FakeClock()
    seen = SeenWithCounts(max_age=1.0, monotonic=clock.monotonic)
    assert seen.weights() is None and seen.frozen() is None
    seen.seen({"a": 2.0}, frozenset({"b"}))
    assert seen.weights() == {"a": 2.0}
    assert seen.weights() is None  # taken: the next ask reads again
    assert seen.frozen() == frozenset({"b"}) and seen.frozen() is None
    seen.seen({"a": 1.0}, frozenset())
    clock.advance(1.5)
    assert seen.weights() is None and seen.frozen() is None  # too old
