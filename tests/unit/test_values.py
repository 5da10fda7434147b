"""Tasks, commands, URLs and options: validation with clear errors."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime

import pytest

from metafora import Task, TaskInfo, TaskState, open_client, open_coordinator
from metafora.core import commands
from metafora.core.commands import Command
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError, InvalidCommand, InvalidProps, InvalidTaskId
from metafora.surfaces.connect import new_node_id


@pytest.mark.parametrize("bad", ["", "   ", "a\x00b", "tab\there", "x" * 257, 42, None])
def test_bad_task_ids_are_refused(bad: object) -> None:
    with pytest.raises(InvalidTaskId):
        Task(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("padded", [" a", "a ", "\ta", "a\n", "\u00a0a"])
def test_ids_with_surrounding_whitespace_are_refused_like_blank_ones(padded: str) -> None:
    """One rule (issue 18): " a" and "a" would look alike in every listing."""
    with pytest.raises(InvalidTaskId, match=r"must not start or end with whitespace|control character"):
        Task(padded)
    with pytest.raises(ConfigError, match="node id"):
        open_coordinator("memory://padded", node_id=padded)


def test_schedule_that_could_never_run_is_refused() -> None:
    from datetime import timedelta

    from metafora.core.task import validate_schedule

    now = datetime(2030, 1, 1, tzinfo=UTC)
    at = (now + timedelta(hours=1)).isoformat()
    with pytest.raises(InvalidProps, match="is not after launch_at"):
        validate_schedule(Task("t", {"launch_at": at, "expires_at": at}), now)
    with pytest.raises(InvalidProps, match="already past"):
        validate_schedule(Task("t", {"expires_at": now.isoformat()}), now)
    fine = Task("t", {"launch_at": now.isoformat(), "expires_at": at})
    assert validate_schedule(fine, now) is fine
    assert validate_schedule(Task("t", {"launch_at": "2000-01-01"}), now).id == "t"  # no expiry


def test_good_task_ids() -> None:
    for ok in ("a", "x" * 256, "ünïcode/with spaces", "a.b-c_d:e"):
        assert Task(ok).id == ok


@pytest.mark.parametrize("bad", [[1, 2], "str", {"x": object()}, {1: "int key"}, {"x": float("nan")},
                                 {"launch_at": "tomorrow"}, {"expires_at": 5}])
def test_bad_props_are_refused(bad: object) -> None:
    with pytest.raises(InvalidProps):
        Task("t", bad)  # type: ignore[arg-type]


def test_task_props_are_a_private_copy_and_task_pickles() -> None:
    props = {"a": [1, 2], "launch_at": "2030-01-01T00:00:00Z"}
    task = Task("t", props, 7)
    props["a"].append(3)
    assert task.props == {"a": [1, 2], "launch_at": "2030-01-01T00:00:00Z"}
    assert task.launch_at == datetime(2030, 1, 1, tzinfo=UTC)
    assert task.expires_at is None
    assert pickle.loads(pickle.dumps(task)) == task
    assert task.with_token(9).token == 9
    assert hash(task) == hash(Task("t", {}, 7))
    with pytest.raises(InvalidProps):
        Task("t", {}, -1)


def test_naive_times_are_utc() -> None:
    assert Task("t", {"launch_at": "2030-01-01T10:00:00"}).launch_at == datetime(
        2030, 1, 1, 10, tzinfo=UTC)


def test_task_info_to_dict() -> None:
    info = TaskInfo("t", {"x": 1}, TaskState.CLAIMED, owner="n", token=3,
                    claimed_at=datetime(2030, 1, 1, tzinfo=UTC))
    d = info.to_dict()
    assert d["state"] == "claimed" and d["claimed_at"] == "2030-01-01T00:00:00+00:00"
    assert info.task() == Task("t", {"x": 1}, 3)


def test_command_wire_format_round_trips() -> None:
    for cmd in (commands.freeze(), commands.unfreeze(), commands.balance(), commands.stop_task("t1")):
        assert Command.from_json(cmd.to_json()) == cmd
    assert commands.stop_task("t1").to_json() == '{"command": "stop_task", "parameters": {"task": "t1"}}'
    assert Command.from_json({"command": "freeze"}) == commands.freeze()


@pytest.mark.parametrize("raw", [
    "not json", "[]", '{"command": 1}', '{"command": "reboot"}', '{"command": "freeze", "x": 1}',
    '{"command": "stop_task"}', '{"command": "stop_task", "parameters": {"task": ""}}',
    '{"command": "stop_task", "parameters": {"task": 5}}', '{"command": "freeze", "parameters": []}',
    '{"command": "freeze", "parameters": {"extra": 1}}', b"\xff",
])
def test_malformed_commands_are_rejected(raw: str | bytes) -> None:
    with pytest.raises(InvalidCommand):
        Command.from_json(raw)


def test_store_urls_parse_and_redact() -> None:
    url = parse_store_url("postgresql://bob:s%40cret@db.example:5433/app?namespace=blue&lease_ttl=5")
    assert (url.username, url.password, url.hosts, url.path) == (
        "bob", "s@cret", (("db.example", 5433),), "/app")
    assert "cret" not in str(url) and "cret" not in repr(url)
    assert url.query == {"namespace": "blue", "lease_ttl": "5"}
    many = parse_store_url("etcd://a:1,b:2/ns")
    assert many.hosts == (("a", 1), ("b", 2)) and many.path == "/ns"
    assert parse_store_url("memory://x?namespace=y").query == {"namespace": "y"}
    assert parse_store_url("sqlite:////tmp/x.db").path == "//tmp/x.db"


@pytest.mark.parametrize("bad", ["nourl", "postgresql://u:pw@h:notaport/db", "etcd://a:1,,b/ns",
                                 "memory://x?a=1&a=2"])
def test_bad_urls_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_store_url(bad)
    assert "pw" not in str(err.value)


def test_unknown_scheme_and_options() -> None:
    with pytest.raises(ConfigError, match="unknown store scheme"):
        open_client("redis://localhost")
    with pytest.raises(ConfigError, match="lease_tll"):
        open_client("memory://opts?lease_tll=3")
    with pytest.raises(ConfigError, match="lease_ttl"):
        open_coordinator("memory://opts", node_id="n", lease_ttl="soon")
    with pytest.raises(ConfigError, match="namespace"):
        open_client("memory://opts?namespace=has space")
    with pytest.raises(ConfigError, match="node id"):
        open_coordinator("memory://opts", node_id="")


def test_node_ids_are_unique_and_valid() -> None:
    ids = {new_node_id() for _ in range(100)}
    assert len(ids) == 100
    coord = open_coordinator("memory://ids")
    assert coord.node_id and "-" in coord.node_id
