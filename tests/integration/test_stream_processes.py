"""Streams on a live multi-process cluster (SQLite, PostgreSQL, etcd).

Each worker is a separate Python process (this module run with ``-m``) running a Consumer
with a stream handler whose source is a file of lines shared by the processes (the job at
index i is line i), recording every job's start (with the jobs running then) and end in an
append-only JSON-lines ledger. The test process SIGKILLs and SIGSTOPs workers by pid and
reads the store.

- across a SIGKILL of the owner, no index is skipped and none below the stored processed
  index runs again; the window's bounds hold at every recorded start;
- a SIGSTOPped owner, resumed after another node took the stream over, cannot move the
  processed index (its writes are fenced by the claim token);
- ``check_stream`` wakes an idle stream in another process with the fallback poll at an
  hour: the push paths (SQLite data_version, PostgreSQL NOTIFY, the etcd watch).
"""

from __future__ import annotations

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

from metafora import Consumer, Task, open_client, open_coordinator
from metafora.streams import Job, JobContext, Jobs, stream_handler
from tests.helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LEASE_TTL = 2  # seconds (the minimum etcd accepts)
MAX_PROCESSING = 4
MAX_SEARCH_AHEAD = 16
_FIXTURE = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "etcd": "etcd_url"}


# -- the worker process -----------------------------------------------------------------


def _record(ledger: str, **event: Any) -> None:
    line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    fd = os.open(ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class FileJobs(Jobs):
    """Line i of a text file is the job at index i (the test appends lines); ``head()``
    re-reads the file, ``at_index`` reads what the last ``head()`` saw."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines: list[str] = []

    def head(self) -> int:
        try:
            with open(self.path, encoding="utf-8") as fh:
                self.lines = fh.read().split("\n")[:-1]
        except FileNotFoundError:
            self.lines = []
        return len(self.lines) - 1

    def at_index(self, index: int) -> Job | None:
        return Job(index, self.lines[index]) if index < len(self.lines) else None


def worker_main(url: str, node: str, ledger: str, gate: str, flush_every: str,
                poll_every: str) -> None:
    """Run a stream consumer until SIGTERM. With ``gate`` (a path), jobs from index 50 on
    wait until that file exists (a test freezes the worker there)."""
    lock = threading.Lock()
    running: set[int] = set()
    pace = threading.Event()  # never set: waiting on it paces a job (the fake work)

    def work(job: Job, ctx: JobContext) -> None:
        with lock:
            running.add(job.index)
            count = len(running)
        _record(ledger, e="begin", node=node, token=ctx.task.token, i=job.index, running=count)
        try:
            if gate and job.index >= 50:
                while not os.path.exists(gate):
                    pace.wait(0.02)
            pace.wait(0.004)
        finally:
            with lock:
                running.discard(job.index)
        _record(ledger, e="end", node=node, token=ctx.task.token, i=job.index)

    coord = open_coordinator(url, node_id=node, lease_ttl=LEASE_TTL)
    handler = stream_handler(lambda task: FileJobs(task.props["file"]), work,
                             max_processing=MAX_PROCESSING, max_search_ahead=MAX_SEARCH_AHEAD,
                             flush_every=float(flush_every), poll_every=float(poll_every),
                             stop_grace=0.5)
    consumer = Consumer(coord, handler, release_backoff=0.1, shutdown_timeout=5)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    _record(ledger, e="up", node=node, pid=os.getpid())
    consumer.run()


# -- the test side ------------------------------------------------------------------------


class Fleet:
    """Worker processes on one store, their ledger and the stream's job file."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.tmp = tmp
        self.ledger = str(tmp / "ledger.jsonl")
        self.jobs = tmp / "jobs.txt"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.client = open_client(url)

    def add_jobs(self, count: int) -> None:
        with open(self.jobs, "a", encoding="utf-8") as fh:
            fh.write("job\n" * count)

    def start(self, node: str, *, gate: str = "", flush_every: float = 0.05,
              poll_every: float = 3600.0) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.tmp / f"{node}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.test_stream_processes", self.url, node,
                 self.ledger, gate, str(flush_every), str(poll_every)],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        self.procs[node] = proc
        wait_until(lambda: any(e["e"] == "up" and e["node"] == node for e in self.events())
                   or proc.poll() is not None, 120, message=f"worker {node} up")
        assert proc.poll() is None, (self.tmp / f"{node}.log").read_text()
        return proc

    def events(self, kind: str | None = None, node: str | None = None) -> list[dict[str, Any]]:
        if not os.path.exists(self.ledger):
            return []
        with open(self.ledger, encoding="utf-8") as fh:
            found = [json.loads(line) for line in fh if line.endswith("\n")]
        return [e for e in found if (kind is None or e["e"] == kind)
                and (node is None or e["node"] == node)]

    def processed(self) -> int:
        return self.client.stream("s1").processed

    def log_of(self, node: str) -> str:
        return (self.tmp / f"{node}.log").read_text(errors="replace")

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
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    url = request.getfixturevalue(_FIXTURE[request.param])
    f = Fleet(url, tmp_path)
    try:
        yield f
    finally:
        f.close()


def _window_held(fleet: Fleet) -> None:
    for begin in fleet.events("begin"):
        assert begin["running"] <= MAX_PROCESSING, begin


def test_no_gap_and_no_rerun_below_the_watermark_across_a_sigkill(fleet: Fleet) -> None:
    fleet.add_jobs(100_000)  # more than the test lets it do: the stream is mid-way at the kill
    a = fleet.start("a")
    fleet.client.submit_task(Task("s1", {"file": str(fleet.jobs)}))
    wait_until(lambda: fleet.processed() >= 150, 120, message="progress on a")
    fleet.start("b")
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    kept = fleet.processed()  # nobody writes until b claims: the watermark a left
    wait_until(lambda: fleet.processed() >= kept + 300, 180, message="b goes on")
    last = fleet.processed()
    b_begins = [e["i"] for e in fleet.events("begin", "b")]
    assert b_begins and min(b_begins) == kept + 1  # resumed at processed + 1, not below
    ended = {e["i"] for e in fleet.events("end")}
    assert set(range(last + 1)) <= ended  # no gap below the watermark
    _window_held(fleet)
    # Every start was inside its owner's window: at most max_search_ahead above what that
    # owner had seen done (its own ends, over the watermark it started from).
    for node, base in (("a", -1), ("b", kept)):
        seen: set[int] = set()
        low = base
        for event in fleet.events(node=node):
            if event["e"] == "end":
                seen.add(event["i"])
                while low + 1 in seen:
                    low += 1
            elif event["e"] == "begin":
                assert event["i"] <= low + MAX_SEARCH_AHEAD, (node, event, low)


def test_a_resumed_zombie_cannot_move_the_watermark(fleet: Fleet) -> None:
    gate = str(fleet.tmp / "go")
    fleet.add_jobs(5000)
    # a writes its progress once at the start and then only every 30 s: frozen, it holds a
    # watermark (49) it has not written, lower than where b will be.
    a = fleet.start("a", gate=gate, flush_every=30.0)
    fleet.client.submit_task(Task("s1", {"file": str(fleet.jobs)}))
    wait_until(lambda: len(fleet.events("begin", "a")) >= 50 + MAX_PROCESSING, 120,
               message="a stuck at the gate")
    os.kill(a.pid, signal.SIGSTOP)  # a zombie, holding the claim
    try:
        fleet.start("b")
        wait_until(lambda: fleet.processed() >= 200, 180, message="b past a's watermark")
        reached = fleet.processed()
    finally:
        Path(gate).touch()
        os.kill(a.pid, signal.SIGCONT)
    # a runs again: its gated jobs end, its window moves, and whatever it tries to write is
    # refused (or it learns first that its lease is gone and stops without writing).
    wait_until(lambda: any(e["i"] >= 50 for e in fleet.events("end", "a")), 60,
               message="the zombie's jobs end")
    wait_until(lambda: "lost" in fleet.log_of("a"), 60, message="a learns it lost the claim")
    samples = [fleet.processed() for _ in range(20)]
    assert all(s >= reached for s in samples)
    assert samples == sorted(samples)
    a_token = fleet.events("begin", "a")[0]["token"]
    assert all(e["token"] > a_token for e in fleet.events("begin", "b"))


def test_check_stream_wakes_an_idle_stream_in_another_process(fleet: Fleet) -> None:
    fleet.add_jobs(10)
    fleet.start("a", poll_every=3600.0)  # no fallback poll within the test
    fleet.client.submit_task(Task("s1", {"file": str(fleet.jobs)}))
    wait_until(lambda: fleet.processed() >= 9, 120, message="the first 10 jobs")
    fleet.add_jobs(5)
    assert fleet.client.check_stream("s1") is True
    wait_until(lambda: fleet.processed() >= 14, 60, message="the check woke the stream")
    assert {e["i"] for e in fleet.events("end")} == set(range(15))


if __name__ == "__main__":
    worker_main(*sys.argv[1:7])
