"""Three consumer processes on one store: each task runs once, no two runs of a task overlap,
and the tasks of a SIGKILLed process finish elsewhere.

Every worker appends ``start``/``end`` lines to its own ledger file (one ``write(2)`` per
line, so a killed process loses nothing it wrote); ``time.monotonic()`` is one clock for
all processes of this machine, so runs in different processes can be compared.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.testing import wait_for
from tests.helpers import SUBPROCESS_DEADLINE, stop_processes

# Long enough that the survivors keep their leases on a saturated machine: with 2 s leases
# (a renewal missed after a 1.3 s stall) every node's lease lapsed at load 50 in CI, a handler
# that had just finished saw its done() fenced off and the task ran again on the same node: the
# fenced at-least-once the store promises, but not the one kill this test is about.
LEASE_TTL = 6.0
WORKERS = 3
TASKS = 200


def _worker(url: str, node_id: str, ledger: str) -> None:
    """A consumer process: runs tasks until SIGTERM (then shuts down cleanly)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    fd = os.open(ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(kind: str, task: Task, extra: str = "") -> None:
        line = f"{kind} {task.id} {task.token} {time.monotonic():.6f} {node_id} {extra}\n"
        os.write(fd, line.encode())

    def work(task: Task, stop: threading.Event) -> bool:
        record("start", task)
        finished = not stop.wait(float(task.props["secs"]))
        record("end", task, "done" if finished else "stopped")
        return finished

    coord = open_coordinator(url, node_id=node_id, lease_ttl=LEASE_TTL)
    consumer = Consumer(coord, simple_handler(work), max_tasks=8, balance_every=3600)
    runner = threading.Thread(target=consumer.run, name="consumer")
    runner.start()
    signal.sigwait({signal.SIGTERM})
    consumer.shutdown(timeout=10)
    runner.join(30)
    os.close(fd)


@dataclass
class Run:
    task: str
    token: int
    node: str
    start: float
    end: float | None = None
    outcome: str | None = None


def read_ledgers(directory: Path) -> dict[str, list[Run]]:
    runs: dict[tuple[str, int], Run] = {}
    for path in directory.glob("*.ledger"):
        for line in path.read_text().splitlines():
            kind, task, token, at, node, *rest = line.split(" ")
            key = (task, int(token))
            if kind == "start":
                assert key not in runs, f"token {token} of {task} handed out twice"
                runs[key] = Run(task, int(token), node, float(at))
            else:
                runs[key].end = float(at)
                runs[key].outcome = rest[0] if rest else None
    by_task: dict[str, list[Run]] = {}
    for run in runs.values():
        by_task.setdefault(run.task, []).append(run)
    for task_runs in by_task.values():
        task_runs.sort(key=lambda r: r.start)
    return by_task


def assert_no_overlap(by_task: dict[str, list[Run]], killed: str | None, killed_at: float) -> None:
    for task, task_runs in by_task.items():
        for first, second in itertools.pairwise(task_runs):
            first_end = first.end
            if first_end is None:
                assert first.node == killed, f"run of {task} on {first.node} never ended"
                first_end = killed_at
            assert first_end <= second.start, f"runs of {task} overlap: {first} / {second}"


class Workers:
    def __init__(self, url: str, directory: Path) -> None:
        self.url = url
        self.directory = directory
        self.procs: dict[str, BaseProcess] = {}
        self.ctx = multiprocessing.get_context("spawn")

    def start(self, count: int) -> None:
        for i in range(count):
            node = f"w{i}"
            proc = self.ctx.Process(
                target=_worker, args=(self.url, node, str(self.directory / f"{node}.ledger")),
                name=f"worker-{node}", daemon=True,
            )
            proc.start()
            self.procs[node] = proc

    def stop_all(self) -> None:
        stop_processes(self.procs.values(), 30)


@pytest.fixture
def workers(sql_url: str, tmp_path: Path) -> Iterator[Workers]:
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    w = Workers(sql_url, ledgers)
    try:
        yield w
    finally:
        w.stop_all()


def _submit_all(url: str, secs: float) -> list[str]:
    ids = [f"job-{i:03d}" for i in range(TASKS)]
    with open_client(url) as client:
        for task_id in ids:
            client.submit_task(Task(task_id, {"secs": secs}))
    return ids


@pytest.mark.slow
def test_three_processes_run_two_hundred_tasks_exactly_once(workers: Workers) -> None:
    with open_client(workers.url) as client:
        workers.start(WORKERS)
        wait_for(lambda: len(client.nodes()) == WORKERS, SUBPROCESS_DEADLINE,
                 "three workers to register")  # 19-23 s at load 17 under nice 19
        ids = _submit_all(workers.url, 0.02)
        wait_for(lambda: len(client.tasks("done")) == TASKS, 120, "all tasks done")
        workers.stop_all()
        assert client.nodes() == []
        by_task = read_ledgers(workers.directory)
    assert sorted(by_task) == ids
    assert all(len(runs) == 1 for runs in by_task.values()), "a task ran more than once"
    assert all(r[0].outcome == "done" for r in by_task.values())
    assert_no_overlap(by_task, None, 0.0)
    nodes_used = {r[0].node for r in by_task.values()}
    assert len(nodes_used) >= 2, f"one node did everything: {nodes_used}"


@pytest.mark.slow
def test_sigkill_of_a_worker_moves_its_tasks_elsewhere(workers: Workers) -> None:
    with open_client(workers.url) as client:
        workers.start(WORKERS)
        wait_for(lambda: len(client.nodes()) == WORKERS, SUBPROCESS_DEADLINE,
                 "three workers to register")  # 19-23 s at load 17 under nice 19
        ids = _submit_all(workers.url, 0.3)

        def victim_busy() -> bool:
            runs = read_ledgers(workers.directory)
            mine = [r for rs in runs.values() for r in rs if r.node == "w0"]
            return sum(r.end is not None for r in mine) >= 3 and any(r.end is None for r in mine)

        wait_for(victim_busy, 60, "w0 to be running tasks")
        victim = workers.procs["w0"]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        victim.join(10)
        in_flight = {r.task for rs in read_ledgers(workers.directory).values() for r in rs
                     if r.node == "w0" and r.end is None}
        assert in_flight
        wait_for(lambda: len(client.tasks("done")) == TASKS, 120, "all tasks done")
        assert "w0" not in client.nodes()
        by_task = read_ledgers(workers.directory)
    assert sorted(by_task) == ids
    assert_no_overlap(by_task, "w0", killed_at)
    for task in ids:
        completed = [r for r in by_task[task] if r.outcome == "done"]
        assert completed, f"{task} never completed"
        # Only a run on the killed node may have finished without its done() reaching the store.
        assert all(r.node == "w0" and r.end is not None and r.end <= killed_at
                   for r in completed[:-1]), f"{task} completed twice: {completed}"
    moved = {task: by_task[task][-1] for task in in_flight}
    assert all(run.node != "w0" and run.outcome == "done" for run in moved.values())
    # The killed node's tasks became claimable again once its lease expired: the first
    # restarts then (the rest may queue behind busy workers). A generous deadline, not a
    # timing: on a saturated machine (load 20 on 2 cores) the survivors' own 2 s leases lapse
    # too and the restart took 11 s; the failover figure itself is benchmarks/failover.py's.
    first = min(run.start for run in moved.values()) - killed_at
    last = max(run.start for run in moved.values()) - killed_at
    assert first < 10 * LEASE_TTL, f"failover took {first:.2f}s"
    print(f"\nfailover of {len(moved)} in-flight task(s): first restart {first:.2f}s, "
          f"last {last:.2f}s after SIGKILL (lease_ttl {LEASE_TTL:g}s)")
