"""Issue 52, finding 1, as processes on each store: a stored retention no setter writes any more
(``done 800000d``: written by an older version or another tool) once stopped every worker of
the namespace at its first prune turn ("the prune loop ... died; shutting down", exit 4). A
worker now keeps running and claiming across prune turns, and counts the loop's errors on
``/metrics``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from metafora import Task, TaskState, open_client
from metafora.core.retention import Retention
from metafora.core.schedule_model import Schedule
from metafora.testing import wait_for

DEADLINE = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def _loop_errors(text: str, loop: str = "prune") -> float:
    for line in text.splitlines():
        if line.startswith("metafora_loop_errors_total{") and f'loop="{loop}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def worker_dir(tmp_path: Path) -> Path:
    (tmp_path / "loop_handlers.py").write_text("def work(task, stop):\n    return True\n", encoding="utf-8")
    return tmp_path


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    started: list[subprocess.Popen[Any]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "etcd"])
def test_a_worker_survives_a_retention_it_cannot_apply(
        kind: str, metafora_store_url: Callable[[str], str], worker_dir: Path,
        procs: list[subprocess.Popen[Any]]) -> None:
    url = metafora_store_url(kind)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open_client(url) as client:
        # What `retention set --done 800000d` stored before the bound (the setters refuse it now).
        client._retention_put(Retention(done=timedelta(days=800_000)))  # type: ignore[attr-defined]
        # And a schedule whose next tick is past year 9999 (its cursor written by another tool).
        last = datetime(9999, 12, 31, tzinfo=UTC)
        client._schedule_insert(Schedule("huge", 86400, None, {}, "skip", False,  # type: ignore[attr-defined]
                                         last, datetime.now(UTC), 0))
        client.add_schedule("tick", every="1s")
        env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "metafora", "--url", url, "worker", "loop_handlers:work",
             "--http", f"127.0.0.1:{port}", "--prune-every", "1s"],
            cwd=worker_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        wait_for(lambda: proc.poll() is not None or _get(f"{base}/readyz")[0] == 200, DEADLINE, "ready")
        for turn in range(3):  # three prune turns, each one an error counted; claims go on
            wait_for(lambda turn=turn: proc.poll() is not None
                     or _loop_errors(_get(f"{base}/metrics")[1]) > turn, DEADLINE, "a prune turn")
            assert proc.poll() is None, f"the worker exited {proc.returncode}"  # before: exit 4
            client.submit_task(Task(f"after-{turn}"))
            wait_for(lambda turn=turn: client.get_task(f"after-{turn}").state is TaskState.DONE,
                     DEADLINE, "the task to be done")
        assert _get(f"{base}/readyz")[0] == 200
        assert _loop_errors(_get(f"{base}/metrics")[1], "schedules") >= 1
        wait_for(lambda: any(i.id.startswith("tick@") for i in client.tasks()), DEADLINE,
                 "a tick of the good schedule")  # the scheduler goes on with the others
        # Given all three kinds, the operator replaces the stored policy without reading it.
        assert client.set_retention(done="7d", failed="30d", killed=None).done == timedelta(days=7)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0
