"""A node holding many handlers (thread and async) shuts down within one shared deadline."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from metafora import AsyncHandler, Handler, Task, TaskState, simple_handler
from metafora.testing import LocalCluster, wait_for

N = 600  # half thread handlers, half async: enough to show per-task waits and writes


async def hold_async(task: Task, stop: asyncio.Event) -> bool:
    await stop.wait()
    return False


def hold(task: Task, stop: threading.Event) -> bool:
    stop.wait()
    return False


@pytest.mark.timing
def test_shutdown_of_many_handlers_shares_one_deadline(
    sql_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async_make, sync_make = simple_handler(hold_async), simple_handler(hold)

    def make(task: Task) -> Handler | AsyncHandler:
        return async_make(task) if int(task.id[1:]) % 2 else sync_make(task)

    with LocalCluster(sql_url, shutdown_timeout=60) as cluster:
        consumer = cluster.add(make, "big")
        for i in range(N):
            cluster.client.submit_task(Task(f"m{i:04d}"))
        wait_for(lambda: len(consumer.tasks()) == N, 120, f"{N} handlers running")
        with caplog.at_level(logging.INFO, logger="metafora.consumer"):
            began = time.monotonic()
            cluster.stop(consumer, timeout=60)
            took = time.monotonic() - began
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "ignored stop()" in m]
        # Released in batches (finish_many, at most 100 per pass while handlers still stop)
        # and by the coordinator's close() in one request, never one write per handler.
        releases = [r for r in caplog.records if getattr(r, "action", None) == "release"]
        assert not [r for r in releases if r.getMessage().startswith("task ")]
        assert len(releases) < N // 10  # batches, however slowly the handlers return
        assert took < 60
        assert {t.state for t in cluster.client.tasks()} == {TaskState.PENDING}
        assert len(cluster.client.tasks()) == N
