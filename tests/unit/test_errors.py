"""metafora.core.errors: one root, and the standard classes callers may also catch them as."""

from __future__ import annotations

import pytest

from metafora.core import errors
from metafora.core.errors import MetaforaError, TaskExists


def test_every_error_is_a_metafora_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), MetaforaError), name


@pytest.mark.parametrize(("name", "standard"), [
    ("ConfigError", ValueError), ("InvalidTaskId", ValueError), ("InvalidProps", ValueError),
    ("InvalidCommand", ValueError), ("RequestTooLarge", ValueError),
    ("TaskNotFound", LookupError), ("NodeNotFound", LookupError), ("ScheduleNotFound", LookupError),
])
def test_usage_errors_are_value_errors_and_misses_are_lookup_errors(name: str, standard: type) -> None:
    assert issubclass(getattr(errors, name), standard)


def test_retryable_and_usage_errors_stay_apart() -> None:
    # A caller retries CoordinatorUnavailable; it must never catch a usage error that way.
    assert not issubclass(errors.CoordinatorUnavailable, ValueError)
    assert not issubclass(errors.ConfigError, errors.CoordinatorUnavailable)


def test_task_exists_carries_the_refused_ids_and_what_was_added() -> None:
    plain = TaskExists("task 'a' exists")
    assert (str(plain), plain.ids, plain.submitted) == ("task 'a' exists", (), 0)
    bulk = TaskExists("refused", ids=["a", "b"], submitted=3)
    assert (bulk.ids, bulk.submitted) == (("a", "b"), 3)
    assert TaskExists().args == ()  # no message: no empty-string argument either
