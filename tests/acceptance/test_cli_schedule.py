"""``metafora schedule add|list|delete|pause|resume`` in subprocesses on SQLite, and bad input:
one ``Error:`` line, a named exit code, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metafora import open_client
from tests.acceptance.test_cli_subprocess import metafora


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'x.db'}"


def test_schedule_verbs(tmp_path: Path, db: str) -> None:
    proc = metafora("--url", db, "schedule", "add", "report", "--every", "5m", "--props", '{"k": 1}',
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("added schedule report (every 5m); first tick ")
    proc = metafora("--url", db, "schedule", "add", "nightly", "--cron", "0 3 * * *", "--missed", "once",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(metafora("--url", db, "schedule", "list", "--json", cwd=tmp_path).stdout)
    assert [(s["name"], s["every"], s["cron"], s["missed"], s["paused"], s["props"]) for s in listed] == [
        ("nightly", None, "0 3 * * *", "once", False, {}),
        ("report", 300, None, "skip", False, {"k": 1}),
    ]
    assert listed[0]["next"].endswith("T03:00:00+00:00")
    table = metafora("--url", db, "schedule", "list", cwd=tmp_path).stdout
    assert "every 5m" in table and "cron 0 3 * * *" in table
    assert metafora("--url", db, "schedule", "pause", "report", cwd=tmp_path).returncode == 0
    assert "paused" in metafora("--url", db, "schedule", "list", cwd=tmp_path).stdout
    with open_client(db) as client:
        assert [s.paused for s in client.schedules()] == [False, True]
    assert metafora("--url", db, "schedule", "resume", "report", cwd=tmp_path).returncode == 0
    assert metafora("--url", db, "schedule", "delete", "nightly", cwd=tmp_path).returncode == 0
    with open_client(db) as client:
        assert [(s.name, s.paused) for s in client.schedules()] == [("report", False)]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["add", "a", "--cron", "every tuesday"], 2, "Error: unknown cron syntax 'every tuesday'"),
        (["add", "a", "--cron", "0 0 31 2 *"], 2, "Error: cron expression '0 0 31 2 *' never matches"),
        (["add", "a", "--every", "1h", "--props", '{"expires_at": "2031-01-01"}'], 2, "must not set"),
        (["add", "a"], 2, "give exactly one of --every DURATION and --cron EXPR"),
        (["add", "a", "--every", "5m", "--cron", "* * * * *"], 2, "exactly one of"),
        (["add", "a", "--every", "soon"], 2, "Error: bad duration 'soon'"),
        (["add", "a", "--every", "0s"], 2, "at least 1s"),
        (["add", "a", "--every", "5m", "--props", "[1]"], 2, "JSON object"),
        (["add", "a", "--every", "5m", "--props", "{"], 2, "not valid JSON"),
        (["add", "a", "--every", "5m", "--missed", "never"], 2, "'never' is not one of"),
        (["add", "bad\x01name", "--every", "5m"], 2, "Error: bad schedule name"),
        (["add", "x" * 250, "--every", "5m"], 2, "the limit is"),
        (["delete", "nope"], 1, "Error: no schedule 'nope'"),
        (["pause", "nope"], 1, "Error: no schedule 'nope'"),
        (["resume", "nope"], 1, "Error: no schedule 'nope'"),
    ],
)
def test_bad_schedule_input(tmp_path: Path, db: str, args: list[str], code: int, message: str) -> None:
    proc = metafora("--url", db, "schedule", *args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr


def test_adding_a_name_twice_is_refused(tmp_path: Path, db: str) -> None:
    assert metafora("--url", db, "schedule", "add", "a", "--every", "1h", cwd=tmp_path).returncode == 0
    proc = metafora("--url", db, "schedule", "add", "a", "--every", "1h", cwd=tmp_path)
    assert proc.returncode == 1 and "Error: schedule 'a' already exists" in proc.stderr
