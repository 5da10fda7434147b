"""metafora.core.task: times, props read back from a store, and a task's own JSON forms.

Task ids, props checks and TaskInfo.to_dict: test_values.py; labels, selectors and soft
placement: test_placement.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from metafora.core.errors import InvalidProps
from metafora.core.task import (
    MAX_PRIORITY,
    MAX_PROPS_BYTES,
    MIN_PRIORITY,
    Task,
    TaskState,
    decode_labels,
    decode_props,
    parse_time,
    validate_priority,
)


@pytest.mark.parametrize(("value", "expected"), [
    ("2030-01-01T10:00:00Z", datetime(2030, 1, 1, 10, tzinfo=UTC)),
    ("2030-01-01T10:00:00z", datetime(2030, 1, 1, 10, tzinfo=UTC)),
    (" 2030-01-01T12:00:00+02:00 ", datetime(2030, 1, 1, 10, tzinfo=UTC)),
    ("2030-01-01 10:00", datetime(2030, 1, 1, 10, tzinfo=UTC)),
    (datetime(2030, 1, 1, 5, tzinfo=timezone(timedelta(hours=-5))), datetime(2030, 1, 1, 10, tzinfo=UTC)),
])
def test_times_parse_to_aware_utc(value: object, expected: datetime) -> None:
    parsed = parse_time(value, "launch_at")
    assert parsed == expected and parsed.tzinfo is UTC


@pytest.mark.parametrize(("value", "message"), [
    ("tomorrow", "launch_at must be an ISO-8601 time, got 'tomorrow'"),
    (1893456000, "launch_at must be an ISO-8601 time string, got int"),
])
def test_what_is_not_a_time_is_refused_naming_the_prop(value: object, message: str) -> None:
    with pytest.raises(InvalidProps, match=message):
        parse_time(value, "launch_at")


def test_launch_and_expiry_come_from_the_props() -> None:
    task = Task("t", {"launch_at": "2030-01-01T00:00:00Z", "expires_at": None})
    assert task.launch_at == datetime(2030, 1, 1, tzinfo=UTC) and task.expires_at is None
    assert Task("plain").launch_at is None
    with pytest.raises(InvalidProps, match="prop 'expires_at' must be an ISO-8601 time"):
        Task("t", {"expires_at": "never"})


def test_props_read_back_from_a_store_report_their_damage() -> None:
    assert decode_props(b'{"a": 1}', "t1") == {"a": 1}
    with pytest.raises(InvalidProps, match="stored props of task 't1': not valid JSON"):
        decode_props("{oops", "t1")
    with pytest.raises(InvalidProps, match="stored props of task 't1': must be a JSON object"):
        decode_props("[]", "t1")
    with pytest.raises(InvalidProps, match="over the limit"):
        decode_props("{" + " " * (2 * MAX_PROPS_BYTES) + "}", "t1")


def test_labels_read_back_from_a_store() -> None:
    assert decode_labels(None, "labels") == decode_labels("", "labels") == {}
    assert decode_labels('{"zone": "b", "gpu": "1"}', "labels") == {"gpu": "1", "zone": "b"}
    with pytest.raises(InvalidProps, match="labels key 'a=b' must not contain"):
        decode_labels('{"a=b": "c"}', "labels")


def test_json_forms_are_compact_sorted_and_absent_when_empty() -> None:
    task = Task("t", {"b": 1, "a": [1, 2]}, selector={"zone": "a"}, prefer={"ssd": "y"}, spread="g")
    assert task.props_json() == '{"a":[1,2],"b":1}'
    assert task.selector_json() == '{"zone":"a"}'
    assert task.placement_json() == '{"prefer":{"ssd":"y"},"spread":"g"}'
    plain = Task("p")
    assert (plain.props_json(), plain.selector_json(), plain.placement_json()) == ("{}", None, None)
    assert Task("s", spread="g").placement_json() == '{"spread":"g"}'


def test_with_token_keeps_everything_else() -> None:
    task = Task("t", {"x": 1}, selector={"a": "b"}, priority=5, prefer={"c": "d"}, spread="g")
    moved = task.with_token(9)
    assert moved.token == 9 and moved == Task("t", {"x": 1}, 9, selector={"a": "b"}, priority=5,
                                               prefer={"c": "d"}, spread="g")
    assert task.token == 0


@pytest.mark.parametrize("token", [-1, True, 1.0, "3"])
def test_a_token_is_a_non_negative_integer(token: object) -> None:
    with pytest.raises(InvalidProps, match="token must be a non-negative integer"):
        Task("t", {}, token)  # type: ignore[arg-type]


def test_priorities_are_bounded_integers_and_not_booleans() -> None:
    assert validate_priority(MIN_PRIORITY) == MIN_PRIORITY and validate_priority(MAX_PRIORITY) == MAX_PRIORITY
    with pytest.raises(InvalidProps, match="out of range"):
        validate_priority(MAX_PRIORITY + 1)
    with pytest.raises(InvalidProps, match="priority must be an integer, not bool"):
        validate_priority(True)


def test_states_are_their_stored_strings() -> None:
    assert [s.value for s in TaskState] == ["pending", "claimed", "done", "failed", "expired"]
    assert TaskState("done") is TaskState.DONE and TaskState.DONE == "done"
