"""``metafora submit --from-file FILE|-``: JSON lines, each checked, errors name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from metafora import Task
from metafora.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, cli
from metafora.contracts.client import Client
from tests.unit.test_cli import client, on, run, url

__all__ = ["client", "url"]  # fixtures used here


def _lines(n: int) -> str:
    return "".join(json.dumps({"id": f"f{i:04d}", "props": {"n": i}}) + "\n" for i in range(n))


def test_from_file_submits_every_line(url: str, client: Client, tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(_lines(1100) + "\n" + json.dumps({"id": "no-props"}) + "\n", encoding="utf-8")
    result = on(url, "submit", "--from-file", str(path))
    assert result.exit_code == EXIT_OK, result.output
    assert "submitted 1101 task(s)" in result.stdout
    assert len(client.tasks()) == 1101 and client.get_task("f0042").props == {"n": 42}


def test_from_stdin(url: str, client: Client) -> None:
    result = CliRunner().invoke(cli, ["--url", url, "submit", "--from-file", "-"], input=_lines(3))
    assert result.exit_code == EXIT_OK, result.output
    assert [t.id for t in client.tasks()] == ["f0000", "f0001", "f0002"]


@pytest.mark.parametrize(
    ("line", "code", "needle"),
    [
        ("{not json", EXIT_USAGE, "line 3: not valid JSON"),
        ('["f9"]', EXIT_USAGE, "line 3: must be a JSON object"),
        ('{"props": {}}', EXIT_USAGE, "line 3: no 'id'"),
        ('{"id": "x", "prop": {}}', EXIT_USAGE, "line 3: unknown key(s) 'prop'"),
        ('{"id": "", "props": {}}', EXIT_USAGE, "line 3: task id must not be empty"),
        ('{"id": 7}', EXIT_USAGE, "line 3: task id must be a string"),
        ('{"id": "x", "props": [1]}', EXIT_USAGE, "line 3: props must be a JSON object"),
        ('{"id": "x", "props": {"launch_at": "soon"}}', EXIT_USAGE, "line 3: prop 'launch_at'"),
        ('{"id": "x", "props": {"expires_at": "2000-01-01T00:00:00Z"}}', EXIT_USAGE, "line 3: "),
        ('{"id": "f0000"}', EXIT_REFUSED, "given more than once"),
    ],
)
def test_a_bad_line_is_named_and_nothing_is_submitted(url: str, client: Client, tmp_path: Path,
                                                      line: str, code: int, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_lines(2) + line + "\n", encoding="utf-8")
    result = on(url, "submit", "--from-file", str(path))
    assert result.exit_code == code, result.output
    assert needle in result.stderr
    assert client.tasks() == []


def test_existing_ids_are_named(url: str, client: Client, tmp_path: Path) -> None:
    client.submit_task(Task("f0001"))
    path = tmp_path / "tasks.jsonl"
    path.write_text(_lines(3), encoding="utf-8")
    result = on(url, "submit", "--from-file", str(path))
    assert result.exit_code == EXIT_REFUSED
    assert "'f0001' already exist" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("extra", [["ID"], ["--prop", "a=1"], ["--launch-at", "now"]])
def test_from_file_takes_no_single_task_options(url: str, tmp_path: Path, extra: list[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_lines(1), encoding="utf-8")
    result = on(url, "submit", "--from-file", str(path), *extra)
    assert result.exit_code == EXIT_USAGE and "--from-file takes no ID" in result.stderr


def test_submit_needs_an_id_or_a_file(url: str) -> None:
    result = on(url, "submit")
    assert result.exit_code == EXIT_USAGE and "--from-file" in result.stderr
    assert run("--url", url, "submit", "--from-file", "/no/such/file").exit_code == EXIT_USAGE
