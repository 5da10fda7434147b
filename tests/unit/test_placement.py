"""Placement values on their own: label and selector validation, matching, priorities."""

from __future__ import annotations

import pytest

from metafora import Consumer, Task, open_coordinator, simple_handler
from metafora.core.errors import ConfigError, InvalidProps
from metafora.core.task import (
    TaskInfo,
    TaskState,
    label_text,
    matches,
    placement_reason,
    validate_labels,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"selector": {"": "1"}}, "selector key must not be empty"),
        ({"selector": {"gpu": ""}}, "must not be empty"),
        ({"selector": {" gpu": "1"}}, "leading or trailing"),
        ({"selector": {"gpu": "a\nb"}}, "printable"),
        ({"selector": {"a=b": "1"}}, "must not contain"),
        ({"selector": {"a,b": "1"}}, "must not contain"),
        ({"selector": {"gpu": 1}}, "must be a string"),
        ({"selector": {"k" * 64: "1"}}, "the limit is 63"),
        ({"selector": {"k": "v" * 256}}, "the limit is 255"),
        ({"selector": {f"k{i}": "v" for i in range(33)}}, "the limit is 32"),
        ({"selector": ["gpu"]}, "must be a mapping"),
        ({"priority": 1_000_001}, "out of range"),
        ({"priority": -1_000_001}, "out of range"),
        ({"priority": "high"}, "must be an integer"),
        ({"priority": 1.5}, "must be an integer"),
        ({"priority": True}, "must be an integer"),
    ],
)
def test_bad_placement_input_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidProps, match=message):
        Task("t", **kwargs)  # type: ignore[arg-type]


def test_limits_are_inclusive() -> None:
    task = Task("t", selector={"k" * 63: "v" * 255}, priority=1_000_000)
    assert task.priority == 1_000_000
    assert Task("t", priority=-1_000_000).priority == -1_000_000
    assert len(validate_labels({f"k{i}": "v" for i in range(32)})) == 32


def test_selector_is_a_private_sorted_copy_carried_by_with_token() -> None:
    given = {"zone": "eu", "gpu": "1"}
    task = Task("t", selector=given, priority=4)
    given["gpu"] = "0"
    assert dict(task.selector) == {"gpu": "1", "zone": "eu"}
    assert list(task.selector) == ["gpu", "zone"]
    moved = task.with_token(9)
    assert (moved.token, dict(moved.selector), moved.priority) == (9, {"gpu": "1", "zone": "eu"}, 4)
    assert task.selector_json() == '{"gpu":"1","zone":"eu"}' and Task("u").selector_json() is None
    info = TaskInfo("t", {}, TaskState.PENDING, selector={"gpu": "1"}, priority=2)
    assert info.task().selector == {"gpu": "1"} and info.task().priority == 2
    assert info.to_dict()["selector"] == {"gpu": "1"} and info.to_dict()["priority"] == 2


def test_matching_and_the_reason_a_task_waits() -> None:
    assert matches({}, {}) and matches({}, {"gpu": "1"})
    assert matches({"gpu": "1"}, {"gpu": "1", "zone": "eu"})
    assert not matches({"gpu": "1"}, {"gpu": "0"}) and not matches({"gpu": "1"}, {})
    assert label_text({"zone": "eu", "gpu": "1"}) == "gpu=1,zone=eu"
    assert placement_reason({}, []) is None
    assert placement_reason({"gpu": "1"}, []) == "no live node matches gpu=1"
    assert placement_reason({"gpu": "1"}, [{"gpu": "0"}, {"gpu": "1"}]) is None


def test_consumer_labels_are_validated_and_shown() -> None:
    coord = open_coordinator("memory://placement-unit", node_id="n1")
    with pytest.raises(ConfigError, match="labels key must not be empty"):
        Consumer(coord, simple_handler(lambda task, stop: True), labels={"": "x"})
    consumer = Consumer(coord, simple_handler(lambda task, stop: True), labels={"gpu": "1"})
    assert consumer.labels == {"gpu": "1"}
    assert consumer.info()["labels"] == {"gpu": "1"}
    consumer.shutdown()


def test_soft_placement_values() -> None:
    task = Task("t", prefer={"zone": "eu"}, spread="shards")
    assert task.placement_json() == '{"prefer":{"zone":"eu"},"spread":"shards"}'
    assert Task("u").placement_json() is None
    moved = task.with_token(3)
    assert (dict(moved.prefer), moved.spread) == ({"zone": "eu"}, "shards")
    with pytest.raises(InvalidProps, match="spread group must not be empty"):
        Task("t", spread="")
    with pytest.raises(InvalidProps, match="spread group must be a string"):
        Task("t", spread=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidProps, match="prefer key must not be empty"):
        Task("t", prefer={"": "x"})
