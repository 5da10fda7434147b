"""A group limit across processes: three consumer processes share 60 tasks of one group
limited to 4. A ledger of start/end times (one ``write(2)`` per line, wall clock of this one
machine) shows at no instant more than 4 running, all 60 complete, and with one process
SIGKILLed mid-way the limit still holds (its handlers end when it dies; its slots come back
with its lease).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from metafora import Consumer, Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.testing import wait_for
from tests.helpers import stop_processes

LIMIT = 4
TASKS = 60
NODES = ("w1", "w2", "w3")


def _worker(url: str, node_id: str, ledger: str) -> None:
    """A consumer process: runs tasks (50-200 ms each) until SIGTERM, then shuts down."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    fd = os.open(ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    rng = random.Random(node_id)

    def work(task: Task, stop: threading.Event) -> bool:
        os.write(fd, f"start {task.id} {time.time():.6f} {node_id}\n".encode())
        stop.wait(rng.uniform(0.05, 0.2))
        os.write(fd, f"end {task.id} {time.time():.6f} {node_id}\n".encode())
        return True

    coord = open_coordinator(url, node_id=node_id, lease_ttl=3.0)
    consumer = Consumer(coord, simple_handler(work), max_tasks=8, balance_every=3600,
                        refuse_retry=0.2)
    runner = threading.Thread(target=consumer.run, name="consumer")
    runner.start()
    signal.sigwait({signal.SIGTERM})
    consumer.shutdown(timeout=10)
    runner.join(30)
    os.close(fd)


@pytest.fixture(params=["sqlite", "postgresql", "etcd"])
def url(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> str:
    return metafora_store_url(str(request.param))


@pytest.fixture
def workers(url: str, tmp_path: Path) -> Iterator[dict[str, BaseProcess]]:
    ctx = multiprocessing.get_context("spawn")
    procs: dict[str, BaseProcess] = {}
    for node in NODES:
        proc = ctx.Process(target=_worker, args=(url, node, str(tmp_path / f"{node}.ledger")),
                           name=f"worker-{node}", daemon=True)
        proc.start()
        procs[node] = proc
    try:
        yield procs
    finally:
        stop_processes(procs.values(), 60)


def _intervals(tmp_path: Path, killed: dict[str, float]) -> list[tuple[float, float, str]]:
    """(start, end, task) of every run; a run of a killed node without an end ended when
    its process was killed."""
    runs: dict[tuple[str, str], list[float]] = {}
    for path in tmp_path.glob("*.ledger"):
        node = path.stem
        for line in path.read_text().splitlines():
            kind, task_id, at, _ = line.split(" ")
            key = (node, task_id)
            if kind == "start":
                runs.setdefault(key, []).append(float(at))
            else:
                runs[key].append(float(at))
    out = []
    for (node, task_id), times in runs.items():
        # One (start, end) pair per run; a task runs once per node unless released.
        for i in range(0, len(times), 2):
            start = times[i]
            end = times[i + 1] if i + 1 < len(times) else killed.get(node, float("inf"))
            out.append((start, end, task_id))
    return out


def _most_at_once(intervals: list[tuple[float, float, str]]) -> int:
    events = sorted([(s, 1) for s, _, _ in intervals] + [(e, -1) for _, e, _ in intervals],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    running = most = 0
    for _, delta in events:
        running += delta
        most = max(most, running)
    return most


def test_sixty_tasks_limited_to_four_across_three_processes(
        url: str, workers: dict[str, BaseProcess], tmp_path: Path) -> None:
    with open_client(url) as client:
        wait_for(lambda: len(client.nodes()) == 3, 120, "three worker processes registered")
        client.set_limit("g", max=LIMIT)
        client.submit_tasks([Task(f"t{i:02d}", group="g") for i in range(TASKS)])
        wait_for(lambda: client.task_counts()[TaskState.DONE] >= TASKS // 3, 120,
                 "a third of the tasks done")
        victim = workers["w2"]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        killed = {"w2": time.time()}
        victim.join(30)
        wait_for(lambda: client.task_counts()[TaskState.DONE] == TASKS, 240, "all 60 tasks done")
        assert client.group_usage()["g"].running == 0
    intervals = _intervals(tmp_path, killed)
    assert {task for _, _, task in intervals} == {f"t{i:02d}" for i in range(TASKS)}
    assert _most_at_once(intervals) <= LIMIT, sorted(intervals)
    assert _most_at_once(intervals) == LIMIT  # the limit was used, not just respected
