"""koalemosd + koalemosctl end to end, in subprocesses, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from metafora import TaskState, open_client
from tests.helpers import SUBPROCESS_DEADLINE, wait_until

ROOT = Path(__file__).resolve().parents[2]
KOALEMOSD = ROOT / "examples" / "koalemos" / "koalemosd.py"
KOALEMOSCTL = ROOT / "examples" / "koalemos" / "koalemosctl.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url"))


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(url: str, node: str, *extra: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{node}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, str(KOALEMOSD), "--url", url, "--node", node,
                                 "--grace", "2", *extra], env=_env(), stdout=log, stderr=log)
        procs.append(proc)
        with open_client(url) as client:
            wait_until(lambda: node in client.nodes() or proc.poll() is not None,
                       SUBPROCESS_DEADLINE, f"koalemosd {node} registered")
        assert proc.poll() is None, (tmp_path / f"{node}.log").read_text()
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def ctl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(KOALEMOSCTL), "--url", url, *args], env=_env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_real_command_runs_and_a_failing_one_fails(url: str, daemons: Callable[..., object],
                                                    tmp_path: Path) -> None:
    daemons(url, "k1")
    marker = tmp_path / "ran.txt"
    ok = ctl(url, "--id", "write", "--wait", "30", "--", "sh", "-c", f"echo hello > {marker}")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["write", "done"]
    assert marker.read_text() == "hello\n"
    bad = ctl(url, "--id", "oops", "--wait", "30", "--", "sh", "-c", "echo broken pipe >&2; exit 3")
    assert bad.returncode == 1
    with open_client(url) as client:
        info = client.get_task("oops")
    assert info.state is TaskState.FAILED
    assert info.error == "CommandFailed: exit code 3: broken pipe"


def test_sigterm_releases_at_once_and_another_daemon_takes_over(
    url: str, daemons: Callable[..., subprocess.Popen[bytes]]
) -> None:
    # A long lease: if the hand-over waited for it, this test would time out.
    first = daemons(url, "k1", "--lease-ttl", "120")
    assert ctl(url, "--id", "long", "--", "sleep", "300").returncode == 0
    with open_client(url) as client:
        wait_until(lambda: client.get_task("long").owner == "k1", 30, "k1 runs the command")
        daemons(url, "k2", "--lease-ttl", "120")
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        info = wait_until(lambda: (i := client.get_task("long")).owner == "k2" and i, 20,
                          "k2 took the task over")
        assert info.state is TaskState.CLAIMED
        assert "k1" not in client.nodes()


# -- user errors: the metafora command's messages and exit codes, never a traceback (issue 18) --


def _script(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("--id", "", "--", "true"), 2, "Error: task id must not be empty or blank"),
        (("--id", " x", "--", "true"), 2, "Error: task id ' x' must not start or end with whitespace"),
        (("--id", "bad\x01id", "--", "true"), 2, "Error: task id 'bad\\x01id' contains the control"),
        (("--url", "nosuch://h/x", "--", "true"), 2, "Error: unknown store scheme 'nosuch'"),
        (("--url", "", "--", "true"), 2, "Error: Invalid value for '--url': must not be empty"),
        (("--url", "postgresql://postgres:Pw123@127.0.0.1:1/postgres", "--", "true"), 3,
         "Error: cannot reach the store postgresql://postgres:***@127.0.0.1:1/postgres"),
    ],
)
def test_koalemosctl_user_errors(tmp_path: Path, args: tuple[str, ...], code: int, message: str) -> None:
    proc = _script(KOALEMOSCTL, "--url", f"sqlite:///{tmp_path / 'k.db'}", *args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr and "Pw123" not in proc.stderr
    assert proc.stdout == ""  # nothing submitted, no id printed


def test_koalemosctl_refuses_a_taken_id(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    assert _script(KOALEMOSCTL, "--url", url, "--id", "a", "--", "true", cwd=tmp_path).stdout == "a\n"
    proc = _script(KOALEMOSCTL, "--url", url, "--id", "a", "--", "true", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: task 'a' already exists")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("--http", "9103"), 2, "Error: http_addr must be HOST:PORT, got '9103'"),
        (("--node", "bad node "), 2, "Error: node id 'bad node ' must not start or end with whitespace"),
        (("--url", "nosuch://h/x"), 2, "Error: unknown store scheme 'nosuch'"),
        (("--url", ""), 2, "Error: Invalid value for '--url': must not be empty"),
        (("--url", "postgresql://postgres:Pw123@127.0.0.1:1/postgres", "--start-timeout", "1"), 3,
         "Error: cannot reach the store postgresql://postgres:***@127.0.0.1:1/postgres"),
        (("--start-timeout", "-1"), 2, "Error: Invalid value for '--start-timeout'"),
    ],
)
def test_koalemosd_user_errors(tmp_path: Path, args: tuple[str, ...], code: int, message: str) -> None:
    proc = _script(KOALEMOSD, "--url", f"sqlite:///{tmp_path / 'k.db'}", *args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr and "Pw123" not in proc.stderr


def test_koalemosd_http_port_in_use(tmp_path: Path) -> None:
    import socket

    url = f"sqlite:///{tmp_path / 'k.db'}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _script(KOALEMOSD, "--url", url, "--node", "k1", "--http", f"127.0.0.1:{port}", cwd=tmp_path)
    assert proc.returncode == 2
    assert f"Error: cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    with open_client(url) as client:
        assert "k1" not in client.nodes()  # it left nothing registered behind


def test_the_shell_handler_runs_under_metafora_worker(url: str, tmp_path: Path) -> None:
    """``metafora worker koalemosd:shell``: the example's handler with no main of its own."""
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "metafora", "--url", url, "worker", "koalemosd:shell",
                                 "--node-id", "kw"], cwd=KOALEMOSD.parent,
                                env={**_env(), "KOALEMOS_GRACE": "2"}, stdout=out, stderr=out)
        try:
            marker = tmp_path / "ran.txt"
            done = ctl(url, "--id", "via-worker", "--wait", "60", "--", "sh", "-c", f"echo hi > {marker}")
            assert done.returncode == 0, done.stderr + log.read_text()
            assert marker.read_text() == "hi\n"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
