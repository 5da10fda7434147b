"""Issue 15 item 3, cluster behaviour: three consumer processes share a 1 s schedule, one is
SIGKILLed midway, and every tick becomes exactly one task (no gap, no double) over 20+ ticks."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.process import BaseProcess

import pytest

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.core.schedule_model import tick_id
from metafora.core.task import parse_time
from metafora.testing import wait_for
from tests.helpers import stop_processes

WORKERS = 3
# 20 ticks of 1 s: the kill comes after a third of them, leaving 13+ ticks (more than six 2 s
# leases) across the failover and after it (30 ticks proved nothing more, 10 s a store).
TICKS = 20


def _worker(url: str, node_id: str) -> None:
    """A consumer process that finishes every task at once, until SIGTERM."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def work(task: Task, stop: threading.Event) -> bool:
        return True

    coord = open_coordinator(url, node_id=node_id, lease_ttl=2.0)
    consumer = Consumer(coord, simple_handler(work), balance_every=3600)
    runner = threading.Thread(target=consumer.run, name="consumer")
    runner.start()
    signal.sigwait({signal.SIGTERM})
    consumer.shutdown(timeout=10)
    runner.join(30)


@pytest.fixture(params=["sqlite_url", "postgres_url", "etcd_url"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(request.param))


@pytest.fixture
def procs(url: str) -> Iterator[dict[str, BaseProcess]]:
    ctx = multiprocessing.get_context("spawn")
    running: dict[str, BaseProcess] = {}
    try:
        for i in range(WORKERS):
            proc = ctx.Process(target=_worker, args=(url, f"w{i}"), name=f"worker-w{i}", daemon=True)
            proc.start()
            running[f"w{i}"] = proc
        yield running
    finally:
        stop_processes(running.values(), 30)


@pytest.mark.slow
def test_every_tick_once_with_three_nodes_and_one_sigkilled(url: str, procs: dict[str, BaseProcess]) -> None:
    with open_client(url) as client:
        wait_for(lambda: len(client.nodes()) == WORKERS, 60, "three workers to register")
        client.add_schedule("beat", every="1s", props={"from": "schedule"})

        def ticks() -> list[str]:
            return [i.id for i in client.task_page(prefix="beat@", limit=1000)]

        wait_for(lambda: len(ticks()) >= TICKS // 3, 120, "the first ticks")
        victim = procs["w0"]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        wait_for(lambda: len(ticks()) >= TICKS + 1, 180, f"{TICKS} ticks")
        made = ticks()
        wait_for(lambda: all(client.get_task(i).state.value == "done" for i in made), 120,
                 "every tick task to run")
        assert "w0" not in client.nodes()
    # Ids are NAME@tick: the ticks are consecutive seconds, none missing, none twice.
    times = [parse_time(i.split("@", 1)[1], "tick") for i in made]
    assert len(set(made)) == len(made) >= TICKS + 1
    assert made == [tick_id("beat", times[0] + timedelta(seconds=k)) for k in range(len(made))]
