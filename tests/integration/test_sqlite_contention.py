"""Several processes opening one fresh SQLite file at the same instant (the embedded default's
normal start) all succeed: lock contention is waited out, never reported as an outage.

Before the fix, 4 processes calling ``open_coordinator(url).init(...)`` together failed in
about 2 trials of 10 with ``CoordinatorUnavailable: ... database is locked``, raised by
``PRAGMA journal_mode = WAL`` (SQLite answers SQLITE_BUSY at once, without its busy handler,
while another connection converts the file).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.core.errors import CoordinatorUnavailable
from metafora.testing import RecordingContext

pytestmark = [pytest.mark.slow]

PROCESSES = 4
TRIALS = 8


def _start_node(urls: list[str], barrier: Any, results: Any) -> None:
    for trial, url in enumerate(urls):
        barrier.wait(60)  # every process has imported everything: they open the file together
        try:
            coord = open_coordinator(url, node_id=f"n-{uuid.uuid4().hex[:8]}")
            coord.init(RecordingContext())
            coord.close()
            results.put((trial, "ok"))
        except Exception as exc:
            results.put((trial, f"{type(exc).__name__}: {exc}"))


def test_processes_starting_together_on_a_fresh_file_all_start(tmp_path: Path) -> None:
    # The same PROCESSES processes make every trial (a fresh file each, opened by all of them at
    # the barrier's instant): spawning PROCESSES new ones per trial cost 32 interpreter starts
    # and imports for the same race, three quarters of the test's time.
    ctx = multiprocessing.get_context("spawn")
    urls = [f"sqlite:///{tmp_path}/trial-{trial}.db" for trial in range(TRIALS)]
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_start_node, args=(urls, barrier, results), daemon=True)
             for _ in range(PROCESSES)]
    for proc in procs:
        proc.start()
    failures: list[str] = []
    outcomes: list[list[str]] = [[] for _ in urls]
    try:
        for trial, url in enumerate(urls):
            # A queue's put is flushed by a thread: the next trial's outcome can come first.
            while len(outcomes[trial]) < PROCESSES:
                done, outcome = results.get(timeout=120)
                outcomes[done].append(outcome)
            failures += [f"trial {trial}: {o}" for o in outcomes[trial] if o != "ok"]
            with open_client(url) as client:  # and the store works
                client.submit_task(Task("t"))
                assert [i.id for i in client.tasks()] == ["t"]
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert failures == []


def _hold_write_lock(path: Path, held: threading.Event, release: threading.Event) -> None:
    """Another writer (a plain sqlite3 connection, as another process's would be) holds the
    file's write lock until ``release``."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(60)
        conn.execute("COMMIT")
    finally:
        conn.close()


@contextlib.contextmanager
def _locked_by_another_writer(url: str, path: Path) -> Iterator[tuple[Any, threading.Event]]:
    """A node ``n1`` on a store with task ``t1`` pending, while another connection holds the
    file's write lock until the event it yields is set (or the block ends)."""
    with open_client(url) as client:
        client.submit_task(Task("t1"))
    coord = open_coordinator(url, node_id="n1")
    coord.init(RecordingContext())
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_write_lock, args=(path, held, release))
    holder.start()
    try:
        assert held.wait(30)
        yield coord, release
    finally:
        release.set()
        holder.join(30)
        coord.close()


def test_a_hot_write_waits_out_another_writer_and_goes_on_once_it_commits(tmp_path: Path) -> None:
    """The hot path's BEGIN IMMEDIATE retries in short steps while another connection holds
    the write lock, and gets it once that one commits: the claim succeeds."""
    path = tmp_path / "hot.db"
    with _locked_by_another_writer(f"sqlite:///{path}", path) as (coord, release):
        claimed: list[Any] = []
        claimer = threading.Thread(target=lambda: claimed.append(coord.claim(Task("t1"))))
        claimer.start()
        claimer.join(0.3)  # a window to be inside the wait (it cannot end while the lock is held)
        assert claimer.is_alive() and not claimed
        release.set()
        claimer.join(30)
        assert claimed and claimed[0] is not None and claimed[0].id == "t1"


def test_a_hot_write_gives_up_after_the_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "busy.db"
    url = f"sqlite:///{path}?busy_timeout=0.5"
    with _locked_by_another_writer(url, path) as (coord, _), pytest.raises(
            CoordinatorUnavailable, match=r"locked|busy"):
        coord.claim(Task("t1"))
    # The connection's own busy timeout was put back: a later write waits as configured.
    with open_client(url) as client:
        assert client.get_task("t1").state.value == "pending"
