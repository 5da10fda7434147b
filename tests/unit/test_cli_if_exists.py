"""Issue 35: ``metafora submit ID --if-exists error|ignore|replace`` (memory store, in-process)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from metafora import open_client
from metafora.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, cli
from metafora.coordinators.memory import drop_store


@pytest.fixture
def url() -> Iterator[str]:
    name = f"cli-ie-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


def _on(url: str, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["--url", url, *args], catch_exceptions=True)
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout, result.stderr


def test_if_exists_modes(url: str) -> None:
    assert _on(url, "submit", "t", "--prop", "v=1")[0] == EXIT_OK
    code, _out, err = _on(url, "submit", "t", "--prop", "v=2", "--if-exists", "error")
    assert code == EXIT_REFUSED and "already exists" in err
    code, out, _err = _on(url, "submit", "t", "--prop", "v=2", "--if-exists", "ignore")
    assert code == EXIT_OK and "left as it was" in out
    with open_client(url) as client:
        assert client.get_task("t").props == {"v": 1}
    code, out, _err = _on(url, "submit", "t", "--prop", "v=3", "--if-exists", "replace")
    assert code == EXIT_OK and "submitted task t" in out
    with open_client(url) as client:
        assert client.get_task("t").props == {"v": 3}
    assert _on(url, "submit", "t", "--if-exists", "skip")[0] == EXIT_USAGE


def test_if_exists_with_a_file(url: str, tmp_path: object) -> None:
    assert _on(url, "submit", "a")[0] == EXIT_OK
    lines = '{"id": "a"}\n{"id": "b"}\n'
    result = CliRunner().invoke(cli, ["--url", url, "submit", "--from-file", "-", "--if-exists",
                                      "ignore"], input=lines)
    assert result.exit_code == EXIT_OK, result.output
    assert "submitted 1 task(s), left 1 existing" in result.stdout
