"""Deploys as operators run them (docs/deploys.md): ``metafora worker --node-id`` restarted
under the same id takes its tasks back; ``metafora nodes drain ID`` hands them off at once.
Subprocesses on SQLite and PostgreSQL; every wait polls with a deadline, every process is
stopped by its pid."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metafora import Task, TaskState, open_client
from tests.acceptance.test_cli_worker import DEADLINE, HANDLERS, Worker, _env, marks, node_live
from tests.helpers import wait_until


@pytest.fixture
def app(tmp_path: Path) -> Path:
    """A directory holding the handlers' module ``workmod`` (and their marks)."""
    (tmp_path / "workmod.py").write_text(HANDLERS.format(marks=str(tmp_path / "marks")))
    return tmp_path


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """The workers a test started, killed by pid at its end if still running."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


def _cli(app: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "metafora", "--url", url, *args], cwd=app,
                          env=_env(app), capture_output=True, text=True, timeout=DEADLINE,
                          check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _starts(app: Path, task_id: str) -> int:
    return sum(1 for m in marks(app) if m.startswith(f"{task_id}.") and m.endswith(".started"))


def test_restart_under_the_same_id_takes_the_task_back_and_drain_hands_it_off(
        app: Path, sql_url: str, workers: list[Worker]) -> None:
    first = Worker(app, sql_url, "workmod:long", "--node-id", "w-0", "--sticky-for", "5m")
    workers.append(first)
    with open_client(sql_url) as client:
        wait_until(lambda: node_live(client, "w-0"), DEADLINE, "w-0 registered")
        client.submit_task(Task("long-1"))
        wait_until(lambda: _starts(app, "long-1") == 1, DEADLINE, "w-0 started long-1")
        other = Worker(app, sql_url, "workmod:long", "--node-id", "w-1")
        workers.append(other)
        wait_until(lambda: node_live(client, "w-1"), DEADLINE, "w-1 registered")

        first.signal(signal.SIGTERM)  # a rolling restart: held for w-0, not for w-1
        assert first.wait() == 0, first.stderr
        held = client.get_task("long-1")
        assert (held.state, held.held_for) == (TaskState.PENDING, "w-0")
        listed = _cli(app, sql_url, "tasks")
        assert listed.returncode == 0 and "held for w-0 until" in listed.stdout
        shown = json.loads(_cli(app, sql_url, "tasks", "--json").stdout)
        assert shown[0]["held_for"] == "w-0" and shown[0]["reason"].startswith("held for w-0")

        again = Worker(app, sql_url, "workmod:long", "--node-id", "w-0", "--sticky-for", "5m")
        workers.append(again)
        wait_until(lambda: client.get_task("long-1").owner == "w-0", DEADLINE, "w-0 took it back")
        wait_until(lambda: _starts(app, "long-1") == 2, DEADLINE, "w-0 started it again")
        assert client.get_task("long-1").owner == "w-0"  # w-1 never ran it

        again.signal(signal.SIGTERM)  # now a scale-down: held, then drained
        assert again.wait() == 0, again.stderr
        assert client.get_task("long-1").held_for == "w-0"
        drained = _cli(app, sql_url, "nodes", "drain", "w-0")
        assert drained.returncode == 0, drained.stderr
        assert "handed 1 task held for node w-0 to every node" in drained.stdout
        wait_until(lambda: client.get_task("long-1").owner == "w-1", DEADLINE, "w-1 took it")
        wait_until(lambda: _starts(app, "long-1") == 3, DEADLINE, "w-1 started it")

        nothing = _cli(app, sql_url, "nodes", "drain", "w-0")
        assert "handed 0 tasks" in nothing.stdout
        live = _cli(app, sql_url, "nodes", "drain", "w-1")
        assert live.returncode == 0 and "node w-1 is live" in live.stderr
        assert _cli(app, sql_url, "nodes").returncode == 0  # the listing is still `nodes`
        other.signal(signal.SIGTERM)
        assert other.wait() == 0, other.stderr


def test_node_id_from_the_environment_and_bad_input(app: Path, sqlite_url: str,
                                                    workers: list[Worker]) -> None:
    worker = Worker(app, sqlite_url, "workmod:long", env={"METAFORA_NODE_ID": "pod-0"})
    workers.append(worker)
    with open_client(sqlite_url) as client:
        wait_until(lambda: node_live(client, "pod-0"), DEADLINE, "pod-0 registered")
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.stderr
    bad = _cli(app, sqlite_url, "nodes", "drain", "")
    assert bad.returncode == 2 and "node id" in bad.stderr
    too_long = _cli(app, sqlite_url, "worker", "workmod:long", "--sticky-for", "2h")
    assert too_long.returncode == 2 and "--sticky-for must be between 0 and 3600" in too_long.stderr
