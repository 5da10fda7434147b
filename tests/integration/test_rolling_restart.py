"""A rolling restart of worker processes (issue 51 point 1), on each SQL store.

Three processes hold long-running tasks (a handler runs until stopped, as a stream consumer
does). Each process in turn gets SIGTERM and is started again. With fixed node ids (a
StatefulSet, systemd units) the restarted process takes its own tasks back: about one
handler start per task for the whole restart, and each task waits no longer than its
process's restart. With generated ids (a Deployment) nothing is held, and tasks move as
before. Every start and stop is written by the handler to a file of its process.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.testing import wait_for
from tests.helpers import stop_processes

TASKS = 60
NODES = ("w0", "w1", "w2")
STICKY = 60.0


def _worker(url: str, node_id: str | None, log_dir: str) -> None:
    """A consumer process holding its tasks until stopped; shuts down on SIGTERM."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    log = Path(log_dir) / f"{node_id or 'gen'}-{os.getpid()}.log"
    lock = threading.Lock()

    def write(line: str) -> None:
        with lock, log.open("a") as out:
            out.write(line + "\n")

    def hold(task: Task, stop: threading.Event) -> bool:
        write(f"start {task.id} {time.time()}")
        stop.wait(600)
        write(f"stop {task.id} {time.time()}")
        return False

    coord = open_coordinator(url, node_id=node_id, poll_interval=0.2)
    # A window well past a restart on a loaded machine (a spawn and an import took 20 s at
    # load 26 on 2 cores): what is measured is what moves, not how long the window is.
    consumer = Consumer(coord, simple_handler(hold), rebalance_window=1.0, sticky_for=STICKY)
    runner = threading.Thread(target=consumer.run, name="consumer")
    runner.start()
    signal.sigwait({signal.SIGTERM})
    consumer.shutdown(timeout=10)
    runner.join(30)


class Fleet:
    """The worker processes, by name (a node id, or a name for a generated id)."""

    def __init__(self, url: str, log_dir: Path) -> None:
        self.url = url
        self.log_dir = log_dir
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, BaseProcess] = {}
        self.stopped: list[BaseProcess] = []

    def start(self, name: str, node_id: str | None) -> None:
        proc = self.ctx.Process(target=_worker, args=(self.url, node_id, str(self.log_dir)),
                                name=f"worker-{name}", daemon=True)
        proc.start()
        self.procs[name] = proc

    def term(self, name: str) -> None:
        proc = self.procs.pop(name)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(60)
        self.stopped.append(proc)

    def events(self) -> list[tuple[str, str, float]]:
        """Every (kind, task, time) the handlers wrote, by time."""
        found = []
        for path in self.log_dir.glob("*.log"):
            for line in path.read_text().splitlines():
                kind, task, at = line.split()
                found.append((kind, task, float(at)))
        return sorted(found, key=lambda e: e[2])


@pytest.fixture
def fleet(sql_url: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(sql_url, tmp_path)
    try:
        yield f
    finally:
        stop_processes([*f.procs.values(), *f.stopped], 30)


def _even(counts: dict[str, int]) -> bool:
    share = TASKS / len(NODES)
    return (len(counts) == len(NODES) and sum(counts.values()) == TASKS
            and all(abs(n - share) <= max(1.0, 0.1 * share) for n in counts.values()))


def _restart(fleet: Fleet, ids: dict[str, str | None], *, stable: bool) -> tuple[int, list[float]]:
    """Start the fleet, restart every process in turn; (starts during the restart, and for
    each restart the seconds from its SIGTERM until the new process registered)."""
    restarts: list[float] = []
    with open_client(fleet.url) as client:
        for name in NODES:
            fleet.start(name, ids[name])
        wait_for(lambda: len(client.nodes()) == len(NODES), 60, "three workers registered")
        client.submit_tasks(Task(f"r{i:02d}") for i in range(TASKS))
        wait_for(lambda: _even(client.node_task_count()), 120, "the cluster even")
        wait_for(lambda: len(_running(fleet.events())) == TASKS, 60, "every task's start written")
        before = len([e for e in fleet.events() if e[0] == "start"])
        for name in NODES:
            began = time.monotonic()
            fleet.term(name)  # joined: the old registration is gone
            fleet.start(name, ids[name] if stable else None)
            wait_for(lambda: len(client.nodes()) == len(NODES), 60, f"{name} registered again")
            restarts.append(time.monotonic() - began)
            wait_for(lambda: _even(client.node_task_count()), 120, f"even after {name} restarted")
        # A claim is counted before its handler writes its start: wait for every task's.
        wait_for(lambda: len(_running(fleet.events())) == TASKS, 60, "every task's start written")
        starts = len([e for e in fleet.events() if e[0] == "start"]) - before
    return starts, restarts


def _running(events: list[tuple[str, str, float]]) -> set[str]:
    """The tasks whose last event is a start."""
    last: dict[str, str] = {}
    for kind, task, _ in events:
        last[task] = kind
    return {task for task, kind in last.items() if kind == "start"}


@pytest.mark.slow
@pytest.mark.timing
def test_rolling_restart_with_fixed_ids_moves_nothing(fleet: Fleet) -> None:
    ids: dict[str, str | None] = {name: name for name in NODES}
    starts, restarts = _restart(fleet, ids, stable=True)
    # The floor is one start per task (each process restarts once); 5 % more at most.
    assert starts <= math.floor(1.05 * TASKS), (starts, restarts)
    # Each task's gap: from its handler's stop to its next start, at most its process's restart
    # (SIGTERM to registered again) and a second.
    events = fleet.events()
    stopped: dict[str, float] = {}
    gaps: list[float] = []
    for kind, task, at in events:
        if kind == "stop":
            stopped[task] = at
        elif task in stopped:
            gaps.append(at - stopped.pop(task))
    kinds = Counter(kind for kind, _, _ in events)
    # Every task stopped by a restart started again.
    assert not stopped and len(gaps) >= TASKS * 0.95, (kinds, len(gaps), stopped, restarts)
    assert max(gaps) <= max(restarts) + 1.0, (max(gaps), restarts)
    per_task = Counter(task for kind, task, _ in events if kind == "start")
    assert max(per_task.values()) <= 3  # its first start and at most two more


@pytest.mark.slow
@pytest.mark.timing
def test_rolling_restart_with_new_ids_holds_nothing(fleet: Fleet) -> None:
    """Generated ids (a Deployment): nothing is held for an id that never comes back, so no
    task waits out a window; tasks move as before: about two starts per task (each stopped
    task starts on another node, then a share moves to the new one)."""
    ids: dict[str, str | None] = dict.fromkeys(NODES)
    starts, restarts = _restart(fleet, ids, stable=False)
    # Two starts per task, and per restart at most one task more: released tasks race to
    # their new owners and a node at its share may take one too many, which the follow-up
    # balance moves back (consumer/balancing.py). Seen: 121 of 120 once in CI.
    assert starts <= 2 * TASKS + len(NODES), (starts, restarts)
    with open_client(fleet.url) as client:
        assert all(info.held_for is None for info in client.tasks())
