"""The limit model: rates, limits, usage and the waiting reason (no store)."""

from __future__ import annotations

import pytest

from metafora import Task
from metafora.core.errors import ConfigError, InvalidProps
from metafora.core.limits import GroupUsage, Limit, Rate, parse_rate, validate_limit, waiting_reason
from metafora.core.task import TaskInfo, TaskState
from metafora.features.waiting import group_reasons, waiting_groups


@pytest.mark.parametrize(("text", "rate"), [
    ("100/1m", Rate(100, 60)), ("5/1s", Rate(5, 1)), ("1000/1h", Rate(1000, 3600)),
    ("2/1d", Rate(2, 86400)), ("10/m", Rate(10, 60)), (" 3 / 30s ", Rate(3, 30)),
])
def test_rates_parse(text: str, rate: Rate) -> None:
    assert parse_rate(text) == rate
    assert parse_rate(str(rate)) == rate


@pytest.mark.parametrize("text", ["", "100", "100/", "/1m", "ten/1m", "5/1y", "0/1s", "-1/1s",
                                  "5/0s", "5/8d", "5/1m/2"])
def test_bad_rates_say_so(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_rate(text)


def test_limits_validate_their_input() -> None:
    assert validate_limit("g", 3) == Limit("g", 3)
    assert validate_limit("g", rate="1/1s").describe() == "rate 1/1s"
    assert validate_limit("g", 2, "4/1m").describe() == "max 2, rate 4/1m"
    for bad in ({"max": 0}, {"max": -2}, {"max": 1.5}, {"max": "3"}, {}):
        with pytest.raises(ConfigError):
            validate_limit("g", **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidProps):
        validate_limit("", 1)
    with pytest.raises(ConfigError):
        validate_limit(None, 1)


def test_usage_says_why_a_task_waits() -> None:
    usage = {"a": GroupUsage(Limit("a", 2), running=2),
             "b": GroupUsage(Limit("b", None, Rate(3, 60)), recent=3),
             "c": GroupUsage(Limit("c", 5), running=1)}
    assert waiting_reason("a", usage) == "group a at its limit (2/2)"
    assert waiting_reason("b", usage) == "group b at its rate limit (3/3 per 1m)"
    assert waiting_reason("c", usage) is None
    assert waiting_reason("zzz", usage) is None and waiting_reason(None, usage) is None
    assert [u.condition() for u in usage.values()] == [
        "at its limit (2/2)", "at its rate limit (3/3 per 1m)", None]


def test_waiting_groups_count_the_tasks_each_full_group_holds_back() -> None:
    usage = {"a": GroupUsage(Limit("a", 1), running=1), "c": GroupUsage(Limit("c", 5))}
    infos = [TaskInfo("a1", {}, TaskState.PENDING, group="a"),
             TaskInfo("a2", {}, TaskState.PENDING, group="a"),
             TaskInfo("a3", {}, TaskState.CLAIMED, group="a"),
             TaskInfo("a4", {}, TaskState.PENDING, group="a", selector={"gpu": "yes"}),
             TaskInfo("c1", {}, TaskState.PENDING, group="c"),
             TaskInfo("free", {}, TaskState.PENDING)]
    # a4 waits for a node (that reason comes first), c has room, a3 runs
    assert waiting_groups(infos, usage, [{}]) == [(usage["a"], 2)]
    assert waiting_groups(infos, usage, [{"gpu": "yes"}]) == [(usage["a"], 3)]
    assert group_reasons(infos, usage) == {
        f"a{i}": "waiting: group a at its limit (1/1)" for i in (1, 2, 4)}
    assert waiting_groups(infos, {}, [{}]) == []


def test_a_task_keeps_its_group() -> None:
    task = Task("t", group="tenant:42")
    assert task.with_token(3).group == "tenant:42"
    assert task.placement_json() == '{"group":"tenant:42"}'
    with pytest.raises(InvalidProps):
        Task("t", group="")
    with pytest.raises(InvalidProps):
        Task("t", group="x" * 256)
