"""Placement across processes: three consumer processes, one of which has the labels a set
of tasks selects. Those tasks all run there, exactly once; the others run anywhere.

Each worker appends ``start``/``end`` lines to its own ledger (one ``write(2)`` per line).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from metafora import Consumer, Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.testing import wait_for
from tests.helpers import stop_processes

LABELS = {"w-gpu": {"gpu": "1", "zone": "eu"}, "w-cpu": {"gpu": "0", "zone": "eu"}, "w-bare": {}}


def _worker(url: str, node_id: str, labels: dict[str, str], ledger: str) -> None:
    """A consumer process with ``labels``: runs tasks until SIGTERM, then shuts down."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    fd = os.open(ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def work(task: Task, stop: threading.Event) -> bool:
        os.write(fd, f"start {task.id} {task.token} {node_id}\n".encode())
        return True

    coord = open_coordinator(url, node_id=node_id, lease_ttl=3.0)
    consumer = Consumer(coord, simple_handler(work), max_tasks=4, balance_every=3600,
                        labels=labels)
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
    for node, labels in LABELS.items():
        proc = ctx.Process(target=_worker, args=(url, node, labels, str(tmp_path / f"{node}.ledger")),
                           name=f"worker-{node}", daemon=True)
        proc.start()
        procs[node] = proc
    try:
        yield procs
    finally:
        stop_processes(procs.values(), 60)


def test_three_processes_one_matches(url: str, workers: dict[str, BaseProcess], tmp_path: Path) -> None:
    with open_client(url) as client:
        wait_for(lambda: len(client.nodes()) == 3, 120, "three worker processes registered")
        labels = {n.id: dict(n.labels) for n in client.node_infos()}
        assert labels == LABELS
        client.submit_tasks([Task(f"gpu{i:02d}", selector={"gpu": "1"}, priority=i % 3)
                             for i in range(30)]
                            + [Task(f"eu{i:02d}", selector={"zone": "eu"}) for i in range(30)]
                            + [Task(f"any{i:02d}") for i in range(30)])
        wait_for(lambda: client.task_counts()[TaskState.DONE] == 90, 180, "90 tasks done")
    runs: dict[str, list[str]] = {}
    for path in tmp_path.glob("*.ledger"):
        for line in path.read_text().splitlines():
            _, task_id, _, node = line.split(" ")
            runs.setdefault(task_id, []).append(node)
    assert len(runs) == 90 and all(len(nodes) == 1 for nodes in runs.values()), runs
    assert {runs[f"gpu{i:02d}"][0] for i in range(30)} == {"w-gpu"}
    assert {runs[f"eu{i:02d}"][0] for i in range(30)} <= {"w-gpu", "w-cpu"}
    for proc in workers.values():
        assert proc.is_alive()
