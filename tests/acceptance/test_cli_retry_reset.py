"""``metafora retry TASK [--reset-state [--keep-cursor]]`` in subprocesses, on SQLite: a
stateful task that ended killed or failed is refused with the reason without the flag,
and re-run with it (cursor kept only with --keep-cursor)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.statemachine import ErrorRecord, State, StateCode, get_state, state_store_for
from metafora.testing import RecordingContext
from tests.acceptance.test_cli_subprocess import metafora


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'x.db'}"


def _end(db: str, task_id: str, code: StateCode, *, fail: bool = False) -> None:
    """Run ``task_id`` to ``code`` by hand, as the state machine would (cursor ``p9``)."""
    with open_client(db) as client:
        client.submit_task(Task(task_id))
    coord = open_coordinator(db, node_id=f"n-{task_id}")
    coord.init(RecordingContext())
    try:
        task = coord.claim(Task(task_id))
        assert task is not None
        failed = code is StateCode.FAILED
        errors = (ErrorRecord(datetime(2026, 1, 1, tzinfo=UTC), "E: boom"),) if failed else ()
        state_store_for(coord).store(task, State(code, errors=errors, cursor="p9"))
        if fail:
            coord.fail(task, "PartitionFailed: boom")
        else:
            coord.done(task)
    finally:
        coord.close()


def test_retry_reset_state_from_the_command_line(tmp_path: Path, db: str) -> None:
    _end(db, "k", StateCode.KILLED)
    _end(db, "f", StateCode.FAILED, fail=True)
    _end(db, "c", StateCode.COMPLETED)

    for task_id, code in (("k", "killed"), ("f", "failed")):
        refused = metafora("--url", db, "retry", task_id, cwd=tmp_path)
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.startswith("Error: ")
        assert f"ended {code}" in refused.stderr and "would end it at once" in refused.stderr
        assert f"metafora retry {task_id} --reset-state" in refused.stderr
        assert "--keep-cursor" in refused.stderr
    with open_client(db) as client:  # nothing changed
        assert client.get_task("k").state is TaskState.DONE
        assert client.get_task("f").state is TaskState.FAILED

    usage = metafora("--url", db, "retry", "k", "--keep-cursor", cwd=tmp_path)
    assert usage.returncode == 2 and "reset_state" in usage.stderr

    kept = metafora("--url", db, "retry", "k", "--reset-state", "--keep-cursor", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    assert "pending again" in kept.stdout and "cursor kept" in kept.stdout
    fresh = metafora("--url", db, "retry", "f", "--reset-state", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    with open_client(db) as client:
        assert client.get_task("k").state is TaskState.PENDING
        assert client.get_task("f").state is TaskState.PENDING
        assert get_state(client, "k") == State(cursor="p9")
        assert get_state(client, "f") == State()

    completed = metafora("--url", db, "retry", "c", cwd=tmp_path)
    assert completed.returncode == 1 and "ended completed" in completed.stderr
    assert "submit it again" in completed.stderr
    also = metafora("--url", db, "retry", "c", "--reset-state", cwd=tmp_path)
    assert also.returncode == 1 and "ended completed" in also.stderr
