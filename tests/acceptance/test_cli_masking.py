"""Issue 16's and 18's reproductions, as a user runs them: ``python -m metafora`` in a subprocess.

Each runs at every log level, plain and JSON, and must print neither the password nor any
piece of it, while naming the part of the URL that is wrong. Issue 25's follow: a handler's
error can neither drive the terminal nor show a password (tables under a pseudo-terminal),
the consumer's log line is masked, and bidi controls are refused in ids.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.core.logs import LEVELS
from metafora.testing import RecordingContext
from tests.acceptance.test_cli_newcomer import _read_until
from tests.acceptance.test_cli_subprocess import metafora

CASES = [
    # an unencoded '/' in the password: was "bad host or port 'postgres:pa'" and the whole URL
    ("postgresql://postgres:pa/ssLeak77@127.0.0.1:5432/db", ["ssLeak77", "pa/ss", "postgres:pa"], 3,
     "postgresql://postgres:***@127.0.0.1:5432/db"),
    # an unencoded '@' and a bad port: was the tail 'ssLeak77' and a mangled '***ostgresql'
    ("postgresql://postgres:p@ssLeak77@host:99999/db", ["ssLeak77", "p@ss", "***ostgres"], 2,
     "'host:99999'"),
    # issue 18: a password in the query string
    ("postgresql://postgres@127.0.0.1:1/postgres?password=QueryPW123", ["QueryPW123"], 2,
     "password=***"),
]


@pytest.mark.parametrize(("url", "pieces", "code", "named"), CASES)
@pytest.mark.parametrize("json_logs", [False, True])
def test_reproductions_show_no_password(tmp_path: Path, url: str, pieces: list[str], code: int,
                                        named: str, json_logs: bool) -> None:
    for level in LEVELS:
        args = ["--url", url, "--log-level", level, *(["--log-json"] if json_logs else []), "tasks"]
        proc = metafora(*args, cwd=tmp_path)
        output = proc.stdout + proc.stderr
        assert proc.returncode == code, output
        assert named in proc.stderr
        assert [p for p in pieces if p in output] == [], output


# -- issue 25: terminal injection, a password in a handler's error, spoofed ids ----------------

ESCAPES = "\x1b]8;;http://evil.example\x1b\\CLICK\x1b]8;;\x1b\\\x1b[2J"
SECRET_ERROR = "cannot reach postgresql://app:SECRET@db/prod"


def in_pty(*args: str, cwd: Path, timeout: float = 60) -> str:
    """``python -m metafora ARGS`` on a pseudo-terminal (200 columns): all it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env.update(TERM="xterm-256color", COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "metafora", *args], cwd=cwd, env=env,
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        return _read_until(master, time.monotonic() + timeout, None).decode("utf-8", "replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def fail_task(url: str, task_id: str, error: str) -> None:
    """Task ``task_id`` failed by a handler whose exception said ``error``."""
    with open_client(url) as client:
        client.submit_task(Task(task_id))
    coord = open_coordinator(url, node_id="n1")
    try:
        coord.init(RecordingContext())
        claimed = coord.claim(Task(task_id))
        assert claimed is not None
        coord.fail(claimed, RuntimeError(error))
    finally:
        coord.close()


def write_row(url: str, task_id: str, error: str | None) -> None:
    """A row as an older metafora stored it (no check on the id, no masking of the error)."""
    with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
        db.execute("INSERT INTO metafora_tasks (namespace, id, props, state, error, created_at, updated_at)"
                   " VALUES ('metafora', ?, '{}', 'failed', ?, '2026-11-23 10:00:00.000',"
                   " '2026-11-23 10:00:00.000')", (task_id, error))


def test_handler_errors_cannot_drive_the_terminal(sqlite_url: str, tmp_path: Path) -> None:
    fail_task(sqlite_url, "hostile", ESCAPES)
    for args in (["show", "hostile"], ["tasks"], ["tasks", "--state", "failed"]):
        shown = in_pty("--url", sqlite_url, *args, cwd=tmp_path)
        assert "hostile" in shown, shown
        assert "\x1b]8" not in shown and "\x1b[2J" not in shown, (args, shown)
        assert "\\x1b" in shown, (args, shown)  # shown, escaped
    exact = metafora("--url", sqlite_url, "show", "hostile", "--json", cwd=tmp_path)
    assert json.loads(exact.stdout)["error"] == f"RuntimeError: {ESCAPES}"  # --json stays exact


def test_a_password_in_a_handler_error_is_never_shown(sqlite_url: str, tmp_path: Path) -> None:
    fail_task(sqlite_url, "leaky", SECRET_ERROR)
    with open_client(sqlite_url) as client:
        stored = client.get_task("leaky").error
    assert stored == "RuntimeError: cannot reach postgresql://app:***@db/prod"  # masked when stored
    write_row(sqlite_url, "old-row", SECRET_ERROR)  # stored before masking: masked on output
    for args in (["show", "leaky"], ["show", "old-row"], ["tasks"], ["tasks", "--state", "failed"]):
        shown = in_pty("--url", sqlite_url, *args, cwd=tmp_path)
        assert "SECRET" not in shown and "app:***@db" in shown, (args, shown)
    for args in (["tasks", "--json"], ["show", "old-row", "--json"]):
        listed = metafora("--url", sqlite_url, *args, cwd=tmp_path)
        assert listed.returncode == 0 and "SECRET" not in listed.stdout, listed.stdout
        json.loads(listed.stdout)


CONSUMER = """
import sys, threading
from metafora import Task, simple_handler
from metafora.core.logs import configure
from metafora.testing import LocalCluster

configure("info", json_lines=sys.argv[2] == "json")

def boom(task, stop):
    raise RuntimeError("cannot reach postgresql://app:SECRET@db/prod")

with LocalCluster(sys.argv[1]) as cluster:
    cluster.add(simple_handler(boom), "logger")
    cluster.client.submit_task(Task("t"))
    cluster.wait_for_state("t", "failed", timeout=60)
"""


@pytest.mark.parametrize("style", ["plain", "json"])
def test_the_consumer_log_line_is_masked(sqlite_url: str, tmp_path: Path, style: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CONSUMER, sqlite_url, style], cwd=Path.cwd(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "handler of task t raised" in proc.stderr, proc.stderr
    assert "SECRET" not in proc.stderr and "app:***@db" in proc.stderr, proc.stderr


def test_bidi_controls_are_refused_in_ids_and_escaped_when_shown(sqlite_url: str, tmp_path: Path) -> None:
    refused = metafora("--url", sqlite_url, "submit", "invoice\u202etxt.exe", cwd=tmp_path)
    assert refused.returncode == 2 and "bidi" in refused.stderr, refused.stderr
    with open_client(sqlite_url) as client:
        client.submit_task(Task("plain"))
    write_row(sqlite_url, "invoice\u202etxt.exe", None)  # an id stored before the rule
    for args in (["tasks"], ["show", "plain"]):
        shown = in_pty("--url", sqlite_url, *args, cwd=tmp_path)
        assert "\u202e" not in shown, shown
    assert "invoice\\u202etxt.exe" in in_pty("--url", sqlite_url, "tasks", cwd=tmp_path)
