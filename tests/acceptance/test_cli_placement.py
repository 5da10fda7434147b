"""Placement and priorities through the CLI: submit --select/--priority, nodes, tasks, top."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from metafora import open_client, open_coordinator
from metafora.cli import EXIT_OK, EXIT_USAGE, cli
from metafora.coordinators.memory import drop_store
from metafora.testing import RecordingContext
from tests.acceptance.test_cli_subprocess import _env


@pytest.fixture
def url() -> Iterator[str]:
    name = f"place-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


def on(url: str, *args: str) -> Result:
    result = CliRunner().invoke(cli, ["--url", url, *args], catch_exceptions=True)
    assert "Traceback" not in result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_submit_select_and_priority_are_stored(url: str) -> None:
    result = on(url, "submit", "t1", "--select", "gpu=1", "--select", "zone=eu", "--priority", "7")
    assert result.exit_code == EXIT_OK, result.output
    with open_client(url) as client:
        info = client.get_task("t1")
    assert (dict(info.selector), info.priority) == ({"gpu": "1", "zone": "eu"}, 7)
    shown = json.loads(on(url, "show", "t1", "--json").output)
    assert shown["selector"] == {"gpu": "1", "zone": "eu"} and shown["priority"] == 7
    assert "gpu=1,zone=eu" in on(url, "show", "t1").output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--select", "=1"], "key must not be empty"),
        (["--select", "gpu"], "is not KEY=VALUE"),
        (["--select", "gpu="], "must not be empty"),
        (["--select", "gpu=1", "--select", "gpu=2"], "twice"),
        (["--priority", "1000001"], "out of range"),
        (["--priority", "-1000001"], "out of range"),
        (["--priority", "high"], "not a valid integer"),
    ],
)
def test_bad_select_or_priority_is_a_clear_usage_error(url: str, args: list[str], message: str) -> None:
    result = on(url, "submit", "t1", *args)
    assert result.exit_code == EXIT_USAGE
    assert message in result.output
    with open_client(url) as client:
        assert client.tasks() == []


def test_from_file_carries_selector_and_priority(url: str, tmp_path: Path) -> None:
    lines = tmp_path / "tasks.jsonl"
    lines.write_text(json.dumps({"id": "a", "selector": {"gpu": "1"}, "priority": 3}) + "\n"
                     + json.dumps({"id": "b", "props": {"n": 1}}) + "\n")
    assert on(url, "submit", "--from-file", str(lines)).exit_code == EXIT_OK
    with open_client(url) as client:
        got = {i.id: (dict(i.selector), i.priority) for i in client.tasks()}
    assert got == {"a": ({"gpu": "1"}, 3), "b": ({}, 0)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "c", "selector": {"": "1"}}) + "\n")
    result = on(url, "submit", "--from-file", str(bad))
    assert result.exit_code == EXIT_USAGE and "line 1" in result.output and "empty" in result.output
    bad.write_text(json.dumps({"id": "c", "priority": 5_000_000}) + "\n")
    result = on(url, "submit", "--from-file", str(bad))
    assert result.exit_code == EXIT_USAGE and "out of range" in result.output
    result = on(url, "submit", "--from-file", str(lines), "--priority", "1")
    assert result.exit_code == EXIT_USAGE


def test_nodes_show_labels_and_tasks_say_why_nothing_runs_them(url: str) -> None:
    coord = open_coordinator(url, node_id="cpu-node")
    coord.init(RecordingContext(labels={"gpu": "0", "zone": "eu"}))
    try:
        nodes = json.loads(on(url, "nodes", "--json").output)
        assert nodes[0]["labels"] == {"gpu": "0", "zone": "eu"}
        assert "gpu=0,zone=eu" in on(url, "nodes").output
        on(url, "submit", "needs-gpu", "--select", "gpu=1")
        on(url, "submit", "any", "--priority", "2")
        listed = {t["id"]: t for t in json.loads(on(url, "tasks", "--json").output)}
        assert listed["needs-gpu"]["reason"] == "no live node matches gpu=1"
        assert listed["any"]["reason"] is None and listed["any"]["priority"] == 2
        table = on(url, "tasks").output
        assert "no live node matches gpu=1" in table and "priority" in table
        top = on(url, "top").output
        assert "pending with no matching node 1" in top and "gpu=0,zone=eu" in top
    finally:
        coord.close()


def test_bad_select_in_a_subprocess_exits_2_without_traceback(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/place.db"
    proc = subprocess.run([sys.executable, "-m", "metafora", "--url", url, "submit", "t", "--select",
                           "=x"], env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--select key must not be empty" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "metafora", "--url", url, "submit", "t", "--select",
                         "gpu=1", "--priority", "-4"], env=_env(), capture_output=True, text=True,
                        timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    with open_client(url) as client:
        info = client.get_task("t")
    assert (dict(info.selector), info.priority) == ({"gpu": "1"}, -4)


def test_submit_prefer_and_spread(url: str, tmp_path: Path) -> None:
    result = on(url, "submit", "t1", "--prefer", "zone=eu", "--spread", "shards")
    assert result.exit_code == EXIT_OK, result.output
    lines = tmp_path / "soft.jsonl"
    lines.write_text(json.dumps({"id": "t2", "prefer": {"ssd": "yes"}, "spread": "g"}) + "\n")
    assert on(url, "submit", "--from-file", str(lines)).exit_code == EXIT_OK
    with open_client(url) as client:
        got = {i.id: (dict(i.prefer), i.spread) for i in client.tasks()}
    assert got == {"t1": ({"zone": "eu"}, "shards"), "t2": ({"ssd": "yes"}, "g")}
    assert "zone=eu" in on(url, "show", "t1").output
    bad = on(url, "submit", "t3", "--spread", "")
    assert bad.exit_code == EXIT_USAGE and "spread group must not be empty" in bad.output
    bad = on(url, "submit", "t3", "--prefer", "=x")
    assert bad.exit_code == EXIT_USAGE and "--prefer key must not be empty" in bad.output
