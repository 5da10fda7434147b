"""SQLite's WAL checkpoints run on a thread of the store, not in the commit that crosses the
threshold (see metafora/coordinators/sql/checkpoint.py): real SQLite files, real commits."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.contracts.coordinator import Finish, Outcome
from metafora.coordinators.sql.checkpoint import BACKSTOP, EVERY, JOURNAL_LIMIT, Checkpointer
from metafora.testing import RecordingContext, wait_for


def _wal_pages(path: Path) -> int:
    """The log's length in pages, as a fresh connection's passive checkpoint reports it."""
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])
    finally:
        conn.close()


def test_the_store_checkpoints_on_its_own_thread_after_its_commits(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    url = f"sqlite:///{path}"
    with open_client(url) as client:
        client.submit_tasks([Task(f"t{i:04d}") for i in range(3 * EVERY)])
    coord = open_coordinator(url, node_id="n1")
    coord.init(RecordingContext())
    try:
        db = coord._db  # type: ignore[attr-defined]
        checkpointer = db.checkpointer
        assert checkpointer is not None and checkpointer.runs == 0
        with db.read() as conn:  # every connection checkpoints only as a backstop
            raw = conn.connection.driver_connection
            assert raw.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == BACKSTOP
        # The consumer's hot path: a claim and a finish per transaction, EVERY of them.
        tasks = [Task(f"t{i:04d}") for i in range(3 * EVERY)]
        held = coord.claim_many(tasks[:1], 1)
        for i in range(1, EVERY + 1):
            _, held = coord.finish_and_claim([Finish(t, Outcome.DONE) for t in held],
                                             tasks[i:i + 1], 1)
        wait_for(lambda: checkpointer.runs >= 1, 30, "a checkpoint on the store's thread")
        names = [t.name for t in threading.enumerate()]
        assert "metafora-checkpoint" in names
    finally:
        coord.close()
    assert checkpointer._thread is not None and not checkpointer._thread.is_alive()  # closed
    # Nothing was lost to the moves between the log and the file.
    with open_client(url) as client:
        states = {i.id: i.state.value for i in client.tasks()}
    assert sum(1 for s in states.values() if s == "done") == EVERY
    assert len(states) == 3 * EVERY


def test_a_busy_writer_keeps_the_log_bounded_by_the_thread(tmp_path: Path) -> None:
    """Thousands of commits of one process leave a log far shorter than the backstop: the
    thread's passive checkpoints let SQLite start the log over."""
    path = tmp_path / "m.db"
    with open_client(f"sqlite:///{path}") as client:
        for start in range(0, 10 * EVERY * 10, 10):
            client.submit_tasks([Task(f"t{i:05d}") for i in range(start, start + 10)])
        checkpointer = client._db.checkpointer  # type: ignore[attr-defined]
        wait_for(lambda: checkpointer.runs >= 9, 30, "nine checkpoints")
    assert _wal_pages(path) < BACKSTOP // 2


def test_the_log_file_is_cut_back_after_a_burst(tmp_path: Path) -> None:
    """A bulk submit grows the log's file past the limit; once a checkpoint has copied it back
    and the log starts over (the next commit), the file is cut back to ``JOURNAL_LIMIT``."""
    path = tmp_path / "m.db"
    wal = Path(f"{path}-wal")
    props = {"blob": "x" * 2000}
    with open_client(f"sqlite:///{path}") as client:
        batch = 0
        while not wal.exists() or wal.stat().st_size <= JOURNAL_LIMIT:
            assert batch < 100, "the log never grew past the limit"
            client.submit_tasks([Task(f"b{batch:03d}-{i:04d}", props) for i in range(1000)])
            batch += 1
        checkpointer = client._db.checkpointer  # type: ignore[attr-defined]
        busy, log_pages, done = checkpointer.checkpoint()
        assert busy == 0 and done == log_pages  # everything copied back: the log may start over
        client.submit_task(Task("after"))
        assert wal.stat().st_size <= JOURNAL_LIMIT


def test_the_checkpointer_survives_a_failed_checkpoint_and_stops_on_close(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "c.db"
    setup = sqlite3.connect(path)
    setup.execute("PRAGMA journal_mode = WAL")
    setup.execute("CREATE TABLE t (x)")
    setup.commit()
    setup.close()
    calls = {"n": 0}

    def connect() -> sqlite3.Connection:
        calls["n"] += 1
        if calls["n"] == 1:  # the store is unreachable for one turn
            raise sqlite3.OperationalError("unable to open database file")
        return sqlite3.connect(path, check_same_thread=False)

    checkpointer = Checkpointer(connect, "c.db", every=3)
    for _ in range(3):
        checkpointer.committed()
    wait_for(lambda: any("unable to open" in r.getMessage() for r in caplog.records
                         if r.levelno == logging.WARNING), 30, "the failed turn's warning")
    assert calls["n"] == 1 and checkpointer.runs == 0
    for _ in range(3):
        checkpointer.committed()
    wait_for(lambda: checkpointer.runs == 1, 30, "the next turn's checkpoint")
    thread = checkpointer._thread
    assert thread is not None
    checkpointer.close()
    assert not thread.is_alive()
    for _ in range(6):  # a closed checkpointer starts nothing again
        checkpointer.committed()
    assert checkpointer._thread is thread and not thread.is_alive()


def test_no_checkpoint_while_nothing_is_written(tmp_path: Path) -> None:
    checkpointer = Checkpointer(lambda: sqlite3.connect(tmp_path / "i.db"), "i.db", every=5)
    for _ in range(4):
        checkpointer.committed()
    assert checkpointer._thread is None and checkpointer.runs == 0
    checkpointer.close()
