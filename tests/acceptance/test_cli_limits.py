"""``metafora limit set|list|delete``, ``submit --group`` and the waiting reason of
``tasks``/``show``, in subprocesses on SQLite; bad input: one ``Error:`` line, a named exit
code, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.testing import RecordingContext
from tests.acceptance.test_cli_subprocess import metafora


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'x.db'}"


def test_limit_verbs_and_the_waiting_reason(tmp_path: Path, db: str) -> None:
    def run(*args: str) -> str:
        proc = metafora("--url", db, *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert run("limit", "set", "tenant:42", "--max", "1") == "limit of group tenant:42: max 1\n"
    assert "rate 100/1m" in run("limit", "set", "api", "--rate", "100/1m", "--max", "3")
    listed = json.loads(run("limit", "list", "--json"))
    assert [(x["group"], x["max"], x["rate"], x["running"]) for x in listed] == [
        ("api", 3, "100/1m", 0), ("tenant:42", 1, None, 0)]
    run("submit", "a", "--group", "tenant:42")
    (tmp_path / "lines.jsonl").write_text('{"id": "b", "group": "tenant:42"}\n{"id": "c"}\n')
    run("submit", "--from-file", str(tmp_path / "lines.jsonl"))
    with open_client(db) as client:
        assert [(i.id, i.group) for i in client.tasks()] == [
            ("a", "tenant:42"), ("b", "tenant:42"), ("c", None)]
    with open_coordinator(db, node_id="n") as coord:
        coord.init(RecordingContext())
        assert coord.claim(Task("a")) is not None
        shown = json.loads(run("show", "b", "--json"))
        assert shown["group"] == "tenant:42"
        assert shown["reason"] == "waiting: group tenant:42 at its limit (1/1)"
        assert "waiting: group tenant:42 at its limit (1/1)" in run("show", "b")
        table = run("tasks")
        assert "waiting: group tenant:42" in table
        assert "full" in run("limit", "list")
    run("limit", "delete", "api")
    assert [x["group"] for x in json.loads(run("limit", "list", "--json"))] == ["tenant:42"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["set", "g"], 2, "give --max N, --rate N/WINDOW or both"),
        (["set", "g", "--max", "0"], 2, "Error: max must be between 1 and"),
        (["set", "g", "--max", "-3"], 2, "Error: max must be between 1 and"),
        (["set", "g", "--max", "many"], 2, "'many' is not a valid integer"),
        (["set", "g", "--rate", "lots"], 2, "Error: bad rate 'lots'"),
        (["set", "g", "--rate", "5/1y"], 2, "Error: bad rate '5/1y'"),
        (["set", "g", "--rate", "0/1s"], 2, "count must be between 1 and"),
        (["set", "bad\x01group", "--max", "1"], 2, "Error: group 'bad\\x01group' must be printable"),
        (["set", "x" * 300, "--max", "1"], 2, "the limit is 255"),
        (["delete", "nope"], 1, "Error: no limit is set on group 'nope'"),
    ],
)
def test_bad_limit_input(tmp_path: Path, db: str, args: list[str], code: int, message: str) -> None:
    proc = metafora("--url", db, "limit", *args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_group_on_submit_is_a_usage_error(tmp_path: Path, db: str) -> None:
    proc = metafora("--url", db, "submit", "t", "--group", " padded", cwd=tmp_path)
    assert proc.returncode == 2 and "Error: group ' padded' must be printable" in proc.stderr
