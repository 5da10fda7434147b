"""Stateful tasks on a live multi-process cluster (SQLite, PostgreSQL, etcd).

Each worker is a separate Python process (this module run with ``-m``) running a Consumer
with a stateful handler that checkpoints numbered pages and records what it does in an
append-only JSON-lines ledger. The test process plays the operator (task commands), kills
workers (SIGKILL), freezes them (SIGSTOP / SIGCONT) and reads the store.

- operator commands pause / resume / kill change a running task's state in another process;
- a task whose owner is SIGKILLed resumes on another process from its last cursor;
- a zombie (SIGSTOP past the lease, the task re-claimed elsewhere, then SIGCONT) cannot
  write state: its checkpoint is refused and the new owner's cursor stands.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metafora import Consumer, Task, TaskState, open_client, open_coordinator
from metafora.core.errors import ClaimLost
from metafora.statemachine import (
    AsyncCommands,
    Commands,
    Message,
    StateCode,
    get_state,
    handler_func,
    send_task_command,
)
from tests.helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LEASE_TTL = 2  # seconds (the minimum etcd accepts)
_FIXTURE = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "etcd": "etcd_url"}


# -- the worker process -----------------------------------------------------------------


def _record(ledger: str, **event: Any) -> None:
    line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    fd = os.open(ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def worker_main(url: str, node: str, ledger: str, gate: str, mode: str = "sync") -> None:
    """Run a consumer until SIGTERM. With ``gate`` set to a path, the handler waits after
    its first page until that file exists (so a test can freeze it at a known point), then
    checkpoints again at once, without looking at commands: what a zombie would do.
    ``mode`` ``async`` runs the same crawl as an async stateful handler (no gate)."""
    pace = threading.Event()

    async def crawl_async(task: Task, cmds: AsyncCommands) -> Message:
        _record(ledger, e="start", node=node, token=task.token, cursor=cmds.cursor)
        page = int(cmds.cursor or 0)
        while True:
            message = await cmds.poll()
            if message is not None:
                _record(ledger, e="message", node=node, token=task.token, kind=message.kind.value)
                return message
            page += 1
            await cmds.checkpoint(str(page))
            _record(ledger, e="ok", node=node, token=task.token, page=page)
            await asyncio.sleep(0.02)  # pacing the fake work

    def crawl(task: Task, cmds: Commands) -> Message:
        _record(ledger, e="start", node=node, token=task.token, cursor=cmds.cursor)
        page = int(cmds.cursor or 0)
        gated = False
        while True:
            message = None if gated else cmds.poll()  # straight on after the gate: a zombie
            if message is not None:
                _record(ledger, e="message", node=node, token=task.token, kind=message.kind.value)
                return message
            page += 1
            _record(ledger, e="attempt", node=node, token=task.token, page=page)
            try:
                cmds.checkpoint(str(page))
            except ClaimLost:
                _record(ledger, e="refused", node=node, token=task.token, page=page)
                raise
            _record(ledger, e="ok", node=node, token=task.token, page=page)
            gated = bool(gate) and page == 1
            if gated:
                _record(ledger, e="gated", node=node, token=task.token)
                while not os.path.exists(gate):
                    pace.wait(0.02)
            else:
                pace.wait(0.02)  # pacing the fake work

    coord = open_coordinator(url, node_id=node, lease_ttl=LEASE_TTL)
    step = crawl_async if mode == "async" else crawl
    consumer = Consumer(coord, handler_func(step, coord, poll_interval=0.1),
                        release_backoff=0.1, shutdown_timeout=5)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    _record(ledger, e="up", node=node, pid=os.getpid())
    consumer.run()


# -- the test side ------------------------------------------------------------------------


class Cluster:
    """Worker processes on one store, and their shared ledger."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.ledger = str(tmp / "ledger.jsonl")
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.client = open_client(url)

    def start(self, node: str, gate: str = "", mode: str = "sync") -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.tmp / f"{node}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.test_statemachine_processes",
                 self.url, node, self.ledger, gate, mode],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
            )
        self.procs[node] = proc
        wait_until(lambda: any(e["e"] == "up" and e["node"] == node for e in self.events())
                   or proc.poll() is not None, 60, message=f"worker {node} up")
        assert proc.poll() is None, (self.tmp / f"{node}.log").read_text()
        return proc

    def events(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.ledger):
            return []
        with open(self.ledger, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]

    def of(self, node: str, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["node"] == node and e["e"] == kind]

    def cursor(self) -> int:
        state = get_state(self.client, "t1")
        return int(state.cursor or 0) if state is not None else 0

    def code(self) -> StateCode | None:
        state = get_state(self.client, "t1")
        return None if state is None else state.code

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.client.close()


@pytest.fixture(params=list(_FIXTURE))
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    url = request.getfixturevalue(_FIXTURE[request.param])
    c = Cluster(url, tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_operator_pauses_resumes_and_kills_a_task_in_another_process(cluster: Cluster) -> None:
    cluster.start("a")
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cluster.cursor() >= 3, 60, message="progress")
    send_task_command(cluster.url, "t1", Message.pause())
    wait_until(lambda: cluster.code() is StateCode.PAUSED, 30, message="paused")
    assert cluster.client.get_task("t1").state is TaskState.CLAIMED
    paused_at = cluster.cursor()
    send_task_command(cluster.url, "t1", Message.run())
    wait_until(lambda: cluster.cursor() > paused_at, 30, message="resumed")
    send_task_command(cluster.url, "t1", Message.kill())
    wait_until(lambda: cluster.client.get_task("t1").state is TaskState.DONE, 30, message="done")
    assert cluster.code() is StateCode.KILLED
    kinds = [e["kind"] for e in cluster.of("a", "message")]
    assert kinds == ["pause", "kill"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_task_resumes_from_its_cursor_after_its_owner_is_killed(cluster: Cluster, mode: str) -> None:
    a = cluster.start("a", mode=mode)
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cluster.cursor() >= 5, 60, message="progress on a")
    cluster.start("b", mode=mode)
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    last = max(e["page"] for e in cluster.of("a", "ok"))
    wait_until(lambda: cluster.of("b", "start"), 60, message="b takes over after a's lease")
    start = cluster.of("b", "start")[0]
    assert start["cursor"] is not None and int(start["cursor"]) >= last
    a_token = cluster.of("a", "start")[0]["token"]
    assert start["token"] > a_token
    wait_until(lambda: cluster.cursor() > last + 2, 30, message="progress on b")


def test_a_zombie_owner_cannot_write_state(cluster: Cluster, tmp_path: Path) -> None:
    gate = str(tmp_path / "go")
    a = cluster.start("a", gate=gate)
    cluster.client.submit_task(Task("t1"))
    wait_until(lambda: cluster.of("a", "gated"), 60, message="a checkpointed page 1")
    os.kill(a.pid, signal.SIGSTOP)  # a zombie: frozen while holding the claim
    try:
        cluster.start("b")
        wait_until(lambda: len(cluster.of("b", "ok")) >= 3, 60,
                   message="b claims the task after a's lease ran out and makes progress")
    finally:
        Path(gate).touch()
        os.kill(a.pid, signal.SIGCONT)
    a_token = cluster.of("a", "start")[0]["token"]
    b_token = cluster.of("b", "start")[0]["token"]
    assert b_token > a_token
    wait_until(lambda: cluster.of("a", "refused"), 30, message="the zombie's checkpoint refused")
    assert [e["page"] for e in cluster.of("a", "ok")] == [1]  # nothing after the freeze landed
    state = get_state(cluster.client, "t1")
    assert state is not None and state.code is StateCode.RUNNABLE
    b_pages = [e["page"] for e in cluster.of("b", "ok")]
    wait_until(lambda: cluster.cursor() >= max(b_pages), 10, message="b's cursor stands")


if __name__ == "__main__":
    worker_main(*sys.argv[1:6])
