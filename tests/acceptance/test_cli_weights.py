"""Weighted nodes through the CLI: ``metafora nodes`` shows each node's weight (and --json)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from metafora import open_coordinator
from metafora.cli import EXIT_OK, cli
from metafora.coordinators.memory import drop_store
from metafora.testing import RecordingContext


@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/weights.db"
        return
    name = f"weights-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


def on(url: str, *args: str) -> Result:
    result = CliRunner().invoke(cli, ["--url", url, *args], catch_exceptions=True)
    assert "Traceback" not in result.output
    assert result.exit_code == EXIT_OK, result.output
    return result


def test_nodes_show_each_weight(url: str) -> None:
    heavy = open_coordinator(url, node_id="heavy")
    heavy.init(RecordingContext(weight=2.5))
    plain = open_coordinator(url, node_id="plain")
    plain.init(RecordingContext())
    try:
        listed = {n["node"]: n for n in json.loads(on(url, "nodes", "--json").output)}
        assert {node: n["weight"] for node, n in listed.items()} == {"heavy": 2.5, "plain": 1.0}
        table = on(url, "nodes").output
        header = next(line for line in table.splitlines() if "node" in line and "tasks" in line)
        assert "weight" in header
        rows = {line.split()[1]: line for line in table.splitlines() if line.split()[1:2] in
                (["heavy"], ["plain"])}
        assert " 2.5 " in rows["heavy"] and " 1 " in rows["plain"]
    finally:
        heavy.close()
        plain.close()
