"""The store-independent rules of sticky return (metafora.core.holds) and the consumer's option."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from metafora import Consumer, open_coordinator, simple_handler
from metafora.core.errors import ConfigError
from metafora.core.holds import check_sticky_for, held_against, held_by_node, hold_note, is_held
from metafora.core.task import TaskInfo, TaskState

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.mark.parametrize("bad", [-1, 3601, float("nan"), float("inf"), True, "10", None])
def test_sticky_for_is_bounded_where_parsed(bad: object) -> None:
    with pytest.raises(ConfigError, match="sticky_for"):
        check_sticky_for(bad)
    coord = open_coordinator("memory://holds-unit", node_id="n")
    with pytest.raises(ConfigError, match="sticky_for"):
        Consumer(coord, simple_handler(lambda task, stop: True), sticky_for=bad)  # type: ignore[arg-type]


def test_sticky_for_accepts_zero_to_an_hour() -> None:
    assert check_sticky_for(0) == 0.0
    assert check_sticky_for(3600) == 3600.0
    coord = open_coordinator("memory://holds-unit", node_id="n")
    assert Consumer(coord, simple_handler(lambda task, stop: True),
                    sticky_for=timedelta(seconds=30))._options.sticky_for == 30.0


def test_the_rule_other_nodes_until_the_end() -> None:
    until = NOW + timedelta(seconds=10)
    assert held_against("a", until, "b", NOW)
    assert not held_against("a", until, "a", NOW)  # its own node takes it back
    assert not held_against("a", until, "b", until)  # over at held_until
    assert not held_against(None, None, "b", NOW)


def test_views_show_live_holds_per_node() -> None:
    until = NOW + timedelta(seconds=10)
    held = TaskInfo("t1", {}, TaskState.PENDING, held_for="a", held_until=until)
    later = TaskInfo("t2", {}, TaskState.PENDING, held_for="a", held_until=until + timedelta(1))
    over = TaskInfo("t3", {}, TaskState.PENDING, held_for="b", held_until=NOW)
    assert is_held(held, NOW) and not is_held(over, NOW)
    assert hold_note(held, NOW) == "held for a until 03:04:15"
    assert hold_note(over, NOW) is None
    assert held_by_node([held, later, over], NOW) == {"a": (2, until + timedelta(1))}
    assert held.to_dict()["held_until"] == until.isoformat()
    assert TaskInfo("x", {}, TaskState.PENDING).to_dict()["held_for"] is None


def test_a_generated_id_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("METAFORA_NODE_ID", raising=False)
    assert open_coordinator("memory://holds-unit").node_id_generated
    assert not open_coordinator("memory://holds-unit", node_id="x").node_id_generated
    monkeypatch.setenv("METAFORA_NODE_ID", "pod-3")
    from_env = open_coordinator("memory://holds-unit")
    assert from_env.node_id == "pod-3" and not from_env.node_id_generated
