"""Issue 50 point 4: ``metafora gates worker --processor-url URL [--batch N] [--concurrency N]``
as a subprocess against a small HTTP processor served by the test (http.server on loopback),
on SQLite and PostgreSQL: partitions complete with no Python module written, one item a
request or N a request, and bad flags are usage errors. Every process is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import metafora
from metafora import Task, TaskState, open_client
from metafora.gates import ItemStatus, ItemStore, NewItem
from tests.helpers import SUBPROCESS_DEADLINE, wait_until

REPO = Path(metafora.__file__).resolve().parents[1]


class Processor:
    """The HTTP processor: upper-cases each item's data; records every request's size."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sizes: list[int] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/process"

    def _answer(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"done": True, "data": str(item["data"]).upper()}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if "items" in body:
                    answer: Any = {"responses": [outer._answer(i) for i in body["items"]]}
                    size = len(body["items"])
                else:
                    answer, size = outer._answer(body), 1
                with outer.lock:
                    outer.sizes.append(size)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        return Handler

    def __enter__(self) -> Processor:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(SUBPROCESS_DEADLINE)


def _start(spawned: list[subprocess.Popen[str]], url: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "metafora", "--url", url, "gates", "worker", *args],
        env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    spawned.append(proc)
    return proc


@pytest.mark.parametrize("mode", ["one", "batch"])
def test_gates_worker_completes_partitions_against_an_http_processor(
        sql_url: str, mode: str, spawned: list[subprocess.Popen[str]]) -> None:
    with ItemStore(sql_url) as items, open_client(sql_url) as client, Processor() as processor:
        for p in ("p1", "p2"):
            items.add(p, [NewItem(0, f"{p}-{n}".encode()) for n in range(12)]
                      + [NewItem(1, f"{p}-last".encode())])
            client.submit_task(Task(p))
        flags = ["--batch", "5", "--concurrency", "2"] if mode == "batch" else ["--concurrency", "3"]
        proc = _start(spawned, sql_url, "--processor-url", processor.url, "--node-id", "g1", *flags)
        for p in ("p1", "p2"):
            wait_until(lambda p=p: client.get_task(p).state is TaskState.DONE or proc.poll() is not None,
                       SUBPROCESS_DEADLINE, f"{p} done")
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            done = items.list(p, status=ItemStatus.COMPLETE)
            assert len(done) == 13 and {i.data for i in done} >= {f"{p}-0".upper().encode()}
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(SUBPROCESS_DEADLINE) == 0
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in stderr
    with processor.lock:
        sizes = list(processor.sizes)
    assert sum(sizes) == 26
    if mode == "batch":
        assert max(sizes) == 5 and len(sizes) < 26  # items reached it 5 at a time
    else:
        assert set(sizes) == {1}


@pytest.mark.parametrize(("flags", "text"), [
    (["--processor-url", "ftp://example.com/x"], "http:// or https://"),
    (["--processor-url", "http://"], "with a host"),
    (["--processor-url", "http://127.0.0.1:9/x", "--batch", "0"], "--batch"),
    (["--processor-url", "http://127.0.0.1:9/x", "--concurrency", "100000"], "--concurrency"),
    (["--processor-url", "http://127.0.0.1:9/x", "--header", "no colon"], "--header"),
    ([], "--processor-url"),
])
def test_bad_flags_are_usage_errors(tmp_path: Path, flags: list[str], text: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "metafora", "--url", f"sqlite:///{tmp_path}/x.db", "gates", "worker",
         *flags], env=_env(), capture_output=True, text=True, timeout=SUBPROCESS_DEADLINE,
        check=False)
    assert proc.returncode == 2, proc.stderr
    assert text in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.db").exists()  # refused before the store was touched
