"""Issue 34 against ``metafora worker`` and the CLI as their own processes, on SQLite.

One test per finding outside the dashboard: a handler's huge error is stored cut (1), the
worker's plain log in a terminal carries no escapes and no forged line (6), the info server
refuses other Hosts, cuts off a slow client and queues many connections (7), invisible ids
are refused (8), the working directory cannot shadow an installed module (9), new SQLite
files are private (12), deep JSON on the command line is a usage error (13).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metafora import Task, TaskState, open_client
from metafora.consumer.http import REQUEST_TIMEOUT
from metafora.contracts.coordinator import MAX_ERROR_BYTES
from tests.helpers import wait_until

DEADLINE = 60.0

HANDLERS = '''
import os


def huge(task, stop):
    raise ValueError("a://h/?%=1 " * 95000)


def hostile(task, stop):
    raise ValueError("\\x1b]8;;https://evil.example/\\x1b\\\\click\\x1b]8;;\\x1b\\\\ \\x1b[2J \\u202eabc "
                     "\\n2026-11-28 10:00:00,000 ERROR   metafora.consumer FAKE LOG LINE")


def work(task, stop):
    return True
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    return env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def handlers(tmp_path: Path) -> Path:
    """A directory holding ``sec_handlers.py`` (the worker runs there)."""
    (tmp_path / "sec_handlers.py").write_text(HANDLERS, encoding="utf-8")
    return tmp_path


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[Any]]]:
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


def _worker(url: str, cwd: Path, target: str, *args: str, **popen: Any) -> subprocess.Popen[Any]:
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)  # a pipe nobody reads would block its logs
    return subprocess.Popen([sys.executable, "-m", "metafora", "--url", url, "worker", target, *args],
                            cwd=cwd, env=_env(), **popen)


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(DEADLINE)


# -- 1: a handler's huge error is stored cut, with its type ------------------------------------


def test_a_huge_error_is_stored_cut(sqlite_url: str, handlers: Path, workers: list[Any]) -> None:
    with open_client(sqlite_url) as client:
        client.submit_tasks([Task(f"slow-err-{i}") for i in range(3)])
        workers.append(_worker(sqlite_url, handlers, "sec_handlers:huge"))
        wait_until(lambda: all(client.get_task(f"slow-err-{i}").state is TaskState.FAILED
                               for i in range(3)), DEADLINE, "the tasks to fail")
        _stop(workers[0])
        error = client.get_task("slow-err-0").error or ""
    assert len(error.encode()) <= MAX_ERROR_BYTES, len(error)  # before: 1,045,012 bytes
    assert error.startswith("ValueError: a://h/?") and error.endswith("… cut, 1045000 bytes"), error[-60:]
    shown = subprocess.run([sys.executable, "-m", "metafora", "--url", sqlite_url, "tasks"], env=_env(),
                           capture_output=True, text=True, timeout=DEADLINE, check=True)
    assert len(shown.stdout) < 5_000, len(shown.stdout)  # one short line per error


# -- 6: plain logs in a terminal ----------------------------------------------------------------


def test_the_plain_log_escapes_what_a_handler_raises(sqlite_url: str, handlers: Path) -> None:
    with open_client(sqlite_url) as client:
        client.submit_task(Task("hostile"))
    leader, follower = pty.openpty()
    proc = _worker(sqlite_url, handlers, "sec_handlers:hostile", stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    try:
        deadline = time.monotonic() + DEADLINE
        while b"FAKE LOG LINE" not in out or not out.endswith(b"\n"):
            assert time.monotonic() < deadline, out[-2000:]
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    out += os.read(leader, 65536)
                except OSError:
                    break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(DEADLINE)
        os.close(leader)
    text = out.decode("utf-8", "replace")
    assert "\x1b" not in text and "\u202e" not in text, repr(text[-1500:])
    assert "\\x1b]8;;https://evil.example/" in text and "\\u202e" in text
    forged = [line for line in text.splitlines() if "FAKE LOG LINE" in line]
    assert forged and all(not re.match(r"\s*2026-11-28 10:00:00", line) for line in forged), forged
    assert all("raised" in line for line in forged), forged  # on the worker's own line


# -- 7: the info server -------------------------------------------------------------------------


def _get(port: int, path: str, host: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if host is not None:
        request.add_header("Host", host)
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.timing  # the cut-off within the request timeout
def test_the_info_server_checks_host_and_cuts_off_slow_clients(
        sqlite_url: str, handlers: Path, workers: list[Any]) -> None:
    port = _free_port()
    workers.append(_worker(sqlite_url, handlers, "sec_handlers:work", "--http", f"127.0.0.1:{port}"))
    wait_until(lambda: _up(port), DEADLINE, "the info server")
    assert _get(port, "/info", host="evil.example")[0] == 421  # before: 200 (DNS rebinding)
    assert _get(port, "/info", host=f"localhost:{port}")[0] == 200
    # One byte at a time: cut off at the deadline, whatever the pace.
    slow = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    started = time.monotonic()
    cut = False
    for byte in b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200:
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            cut = True
            break
        ready, _, _ = select.select([slow], [], [], 0.5)
        if ready and slow.recv(100) == b"":
            cut = True
            break
    slow.close()
    assert cut and time.monotonic() - started < REQUEST_TIMEOUT + 5
    # Many connections at once queue in the backlog (before: 5), none refused.
    many = [socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) for _ in range(200)]
    for sock in many:
        sock.close()
    assert _get(port, "/healthz")[0] == 200


def _up(port: int) -> bool:
    try:
        return _get(port, "/healthz")[0] == 200
    except OSError:
        return False


# -- 8: invisible ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("char", ["\u200b", "\u2060", "\ufeff", "\u00ad", "\u034f", "\u180e", "\U000e0041"])
def test_invisible_characters_in_ids_are_refused(sqlite_url: str, char: str) -> None:
    submitted = subprocess.run([sys.executable, "-m", "metafora", "--url", sqlite_url, "submit",
                                f"task{char}1"], env=_env(), capture_output=True, text=True,
                               timeout=DEADLINE, check=False)
    assert submitted.returncode == 2 and "invisible" in submitted.stderr, submitted.stderr


def test_an_invisible_node_id_is_refused(sqlite_url: str, handlers: Path) -> None:
    proc = _worker(sqlite_url, handlers, "sec_handlers:work", "--node-id", "node\u200b1", text=True,
                   stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 2 and "invisible" in err, err


# -- 9: the working directory cannot shadow an installed module ----------------------------------


def test_a_module_planted_in_the_working_directory_is_not_imported(
        sqlite_url: str, handlers: Path, workers: list[Any]) -> None:
    pytest.importorskip("prometheus_client")
    planted = handlers / "planted-ran"
    (handlers / "prometheus_client.py").write_text(
        f"open({str(planted)!r}, 'w').write('ran')\n", encoding="utf-8")
    port = _free_port()
    workers.append(_worker(sqlite_url, handlers, "sec_handlers:work", "--http", f"127.0.0.1:{port}"))
    wait_until(lambda: _up(port), DEADLINE, "the info server")
    status, body = _get(port, "/metrics")
    assert status == 200 and b"metafora_running_tasks" in body, (status, body[:200])
    assert not planted.exists()


# -- 12: file modes -----------------------------------------------------------------------------


def test_a_new_sqlite_store_is_private(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/private.db"
    old = os.umask(0o022)
    try:
        subprocess.run([sys.executable, "-m", "metafora", "--url", url, "submit", "t1"], env=_env(),
                       capture_output=True, timeout=DEADLINE, check=True)
    finally:
        os.umask(old)
    for path in tmp_path.glob("private.db*"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, (path, oct(path.stat().st_mode))


# -- 13: deep JSON on the command line -----------------------------------------------------------


def test_deep_json_on_the_command_line_is_a_usage_error(sqlite_url: str, tmp_path: Path) -> None:
    deep = "[" * 50_000 + "]" * 50_000  # one argument may hold 128 KiB
    lines = tmp_path / "tasks.jsonl"
    lines.write_text(json.dumps({"id": "t"})[:-1] + ', "props": {"x": ' + deep + "}}\n", encoding="utf-8")
    past_limit = '{"x": ' + "[" * 70 + "]" * 70 + "}"  # not deep enough to crash: over the limit
    for args in (["submit", "t", "--props", '{"x": ' + deep + "}"], ["submit", "t", "--prop", "x=" + deep],
                 ["submit", "--from-file", str(lines)], ["submit", "t", "--props", past_limit]):
        done = subprocess.run([sys.executable, "-m", "metafora", "--url", sqlite_url, *args], env=_env(),
                              capture_output=True, text=True, timeout=DEADLINE, check=False)
        assert done.returncode == 2 and "nested deeper" in done.stderr, (args[:3], done.stderr[-300:])
        assert "RecursionError" not in done.stderr
