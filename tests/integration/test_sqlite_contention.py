"""Several processes opening one fresh SQLite file at the same instant (the embedded default's
normal start) all succeed: lock contention is waited out, never reported as an outage.

Before the fix, 4 processes calling ``open_coordinator(url).init(...)`` together failed in
about 2 trials of 10 with ``CoordinatorUnavailable: ... database is locked``, raised by
``PRAGMA journal_mode = WAL`` (SQLite answers SQLITE_BUSY at once, without its busy handler,
while another connection converts the file).
"""

from __future__ import annotations

import multiprocessing
import uuid
from pathlib import Path
from typing import Any

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.testing import RecordingContext

pytestmark = [pytest.mark.slow]

PROCESSES = 4
TRIALS = 8


def _start_node(url: str, barrier: Any, results: Any) -> None:
    barrier.wait(60)  # every process has imported everything: they open the file together
    try:
        coord = open_coordinator(url, node_id=f"n-{uuid.uuid4().hex[:8]}")
        coord.init(RecordingContext())
        coord.close()
        results.put("ok")
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")


def test_processes_starting_together_on_a_fresh_file_all_start(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    failures: list[str] = []
    for trial in range(TRIALS):
        url = f"sqlite:///{tmp_path}/trial-{trial}.db"
        barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
        procs = [ctx.Process(target=_start_node, args=(url, barrier, results), daemon=True)
                 for _ in range(PROCESSES)]
        for proc in procs:
            proc.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(30)
        failures += [f"trial {trial}: {o}" for o in outcomes if o != "ok"]
        with open_client(url) as client:  # and the store works
            client.submit_task(Task("t"))
            assert [i.id for i in client.tasks()] == ["t"]
    assert failures == []
