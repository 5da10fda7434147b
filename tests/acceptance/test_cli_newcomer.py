"""What a newcomer tripped over (issue 18), as users meet it: the CLI and the examples in subprocesses.

Every case checks the exit code, the one ``Error:`` line and that no traceback is printed.
``metafora top`` runs under a pseudo-terminal (the pty module). Nothing sleeps to synchronise:
waits poll with a deadline, and every process started is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.testing import RecordingContext

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"
TIME_FORMS = ("ISO-8601", "'now'", "'+DURATION'")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def run(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (after the interpreter); assert it never prints a traceback."""
    proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env or _env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def metafora(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m metafora ARGS``."""
    return run("-m", "metafora", *args, cwd=cwd)


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'x.db'}"


def test_submit_refuses_a_task_that_could_never_be_claimed(tmp_path: Path, db: str) -> None:
    proc = metafora("--url", db, "submit", "inv", "--launch-at", "+1h", "--expires-at", "+1s", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("Error: task 'inv': expires_at ")
    assert "is not after launch_at" in proc.stderr
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    proc = metafora("--url", db, "submit", "late", "--expires-at", past, cwd=tmp_path)
    assert proc.returncode == 2
    assert "is already past" in proc.stderr
    proc = metafora("--url", db, "submit", "fine", "--launch-at", "now", "--expires-at", "+1h", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(metafora("--url", db, "tasks", "--json", cwd=tmp_path).stdout)[0]["id"] == "fine"


def test_time_errors_name_every_accepted_form(tmp_path: Path, db: str) -> None:
    for args in (("submit", "t", "--launch-at", "yesterday"), ("submit", "t", "--expires-at", "+soon"),
                 ("sleep", "t", "--until", "whenever")):
        proc = metafora("--url", db, *args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert all(form in proc.stderr for form in TIME_FORMS), proc.stderr


@pytest.mark.parametrize("task_id", [" padded", "padded ", "\tpadded"])
def test_ids_with_surrounding_whitespace_are_refused(tmp_path: Path, db: str, task_id: str) -> None:
    for command in ("submit", "show", "delete"):
        proc = metafora("--url", db, command, task_id, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert "must not start or end with whitespace" in proc.stderr
    proc = metafora("--url", db, "freeze", task_id, cwd=tmp_path)
    assert proc.returncode == 2 and "node id" in proc.stderr


def test_an_empty_url_is_an_error(tmp_path: Path) -> None:
    proc = metafora("--url", "", "tasks", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Invalid value for '--url': must not be empty" in proc.stderr
    assert not (tmp_path / "metafora.db").exists()  # no silent fall-back to the default store


@pytest.fixture
def node(db: str) -> Iterator[str]:
    """A registered node of another "process" (a coordinator in this one), never frozen."""
    coord = open_coordinator(db, node_id="n1")
    coord.init(RecordingContext())
    try:
        yield "n1"
    finally:
        coord.close()


def test_stop_to_an_unknown_node_says_no_live_node(tmp_path: Path, db: str, node: str) -> None:
    with open_client(db) as client:
        client.submit_task(Task("t1"))
    proc = metafora("--url", db, "stop", "ghost", "t1", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == "Error: no live node 'ghost'\n"


def test_nodes_shows_no_for_a_node_never_frozen(tmp_path: Path, db: str, node: str) -> None:
    proc = metafora("--url", db, "nodes", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if "n1" in line)
    assert re.search(r"│\s*no\s*│", row), row
    assert json.loads(metafora("--url", db, "nodes", "--json", cwd=tmp_path).stdout)[0]["frozen"] is False


def test_items_of_a_partition_that_never_existed(tmp_path: Path, db: str) -> None:
    proc = metafora("--url", db, "items", "never", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == "Error: no partition 'never': no items were ever added to it\n"
    proc = metafora("--url", db, "items", "add", "real", "--data", "x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert metafora("--url", db, "items", "real", cwd=tmp_path).returncode == 0


def test_items_usage_error_shows_the_usage_typed(tmp_path: Path, db: str) -> None:
    proc = metafora("--url", db, "items", "part", "--gate", "-1", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("Usage: metafora items [OPTIONS] PARTITION\n"), proc.stderr
    assert "Try 'metafora items --help'" in proc.stderr and "items list" not in proc.stderr
    proc = metafora("--url", db, "items", "list", "part", "--gate", "-1", cwd=tmp_path)
    assert proc.stderr.startswith("Usage: metafora items list [OPTIONS] PARTITION\n"), proc.stderr


def test_task_commands_to_a_task_no_state_machine_runs(tmp_path: Path, db: str) -> None:
    with open_client(db) as client:
        client.submit_task(Task("plain"))
    for args in (("pause",), ("resume",), ("kill",), ("sleep", "--until", "+1h")):
        proc = metafora("--url", db, args[0], "plain", *args[1:], cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr
        assert "is not run by a state machine" in proc.stderr
    proc = metafora("--url", db, "pause", "plain", "--queue", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "sent pause to task plain\n"


# -- top ------------------------------------------------------------------------------------

HIDE_CURSOR, SHOW_CURSOR = b"\x1b[?25l", b"\x1b[?25h"


def test_top_prints_one_snapshot_when_not_a_terminal(tmp_path: Path, db: str, node: str) -> None:
    proc = metafora("--url", db, "top", cwd=tmp_path)  # would run forever if it went live
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("metafora top — ") and "n1" in proc.stdout
    assert "press q" not in proc.stdout and "\x1b[" not in proc.stdout


def _read_until(fd: int, deadline: float, want: bytes | None) -> bytes:
    """Read the pty until ``want`` appears (or EOF); AssertionError at ``deadline``."""
    out = b""
    while want is None or want not in out:
        assert time.monotonic() < deadline, f"timed out; got {out[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        out += data
    return out


def test_top_restores_the_cursor_on_sigterm(tmp_path: Path, db: str, node: str) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: `metafora top` on a terminal
        try:
            os.chdir(tmp_path)
            os.execve(sys.executable, [sys.executable, "-m", "metafora", "--url", db, "top",
                                       "--interval", "0.2"], _env())
        finally:
            os._exit(127)
    try:
        deadline = time.monotonic() + 60
        seen = _read_until(fd, deadline, b"heartbeat age")
        assert HIDE_CURSOR in seen  # a live view: the cursor is hidden while it runs
        os.kill(pid, signal.SIGTERM)
        seen += _read_until(fd, deadline, None)
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert seen.rfind(SHOW_CURSOR) > seen.rfind(HIDE_CURSOR), seen[-300:]
    assert b"Traceback" not in seen


# -- the examples ---------------------------------------------------------------------------


def _hello_state(url: str) -> str:
    with open_client(url) as client:
        return client.get_task("hello").state.value


def test_quickstart_reads_url_then_environment(tmp_path: Path) -> None:
    given = f"sqlite:///{tmp_path / 'given.db'}"
    proc = run(str(QUICKSTART), "--url", given, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "working on hello" in proc.stdout
    assert _hello_state(given) == "done"
    from_env = f"sqlite:///{tmp_path / 'env.db'}"
    proc = run(str(QUICKSTART), cwd=tmp_path, env=_env(METAFORA_URL=from_env))
    assert proc.returncode == 0, proc.stderr
    assert _hello_state(from_env) == "done"
    assert not (tmp_path / "metafora.db").exists()  # the default was never used


def test_quickstart_errors_are_the_cli_errors(tmp_path: Path) -> None:
    proc = run(str(QUICKSTART), "--url", "nosuch://h/x", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("Error: unknown store scheme 'nosuch'")
    proc = run(str(QUICKSTART), "--url", "", cwd=tmp_path)
    assert proc.returncode == 2 and "must not be empty" in proc.stderr


def test_readme_runs_examples_with_the_venv_python() -> None:
    """`python examples/...` is not the venv's interpreter (ModuleNotFoundError for a newcomer)."""
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if "examples/" in line and ".py" in line]
    assert lines
    for line in lines:
        for match in re.finditer(r"([\w./]*python3?) examples/", line):
            assert match.group(1) == ".venv/bin/python", line


# -- the repository's own checks ------------------------------------------------------------


def test_ruff_finds_no_invalid_noqa(tmp_path: Path) -> None:
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this interpreter")
    proc = subprocess.run([str(ruff), "check", "tests/faults/waiting.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout
    assert "Invalid `# noqa`" not in proc.stderr + proc.stdout


def test_ci_script_defaults_ci_to_true() -> None:
    """The README: `.ci/run` runs the tests with CI=true unless CI says otherwise."""
    proc = subprocess.run(["bash", "-c", 'eval "$(grep -E \'^export CI=\' .ci/run)"; echo "$CI"'],
                          cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "CI"},
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.stdout.strip() == "true"


@pytest.mark.parametrize("args", [("demo", "--url", ""), ("items", "p", "--items-url", "")])
def test_other_empty_url_options_are_errors(tmp_path: Path, args: tuple[str, ...]) -> None:
    proc = metafora(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"Invalid value for '{args[-2]}': must not be empty" in proc.stderr
