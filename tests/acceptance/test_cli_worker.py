"""``metafora worker MODULE:NAME`` as operators run it: subprocesses on SQLite and PostgreSQL.

The handlers live in a module written to ``tmp_path`` and found through ``PYTHONPATH``; each
records what it did in a file, so the test sees which handler ran a task and what it did
when it was stopped. Every wait polls with a deadline; every process is stopped by its pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import metafora
from metafora import Task, TaskState, open_client
from metafora.contracts.client import Client
from tests.helpers import SUBPROCESS_DEADLINE, wait_until

REPO = Path(metafora.__file__).resolve().parents[1]
DEADLINE = SUBPROCESS_DEADLINE  # seconds any one step may take on a loaded 2-core machine

HANDLERS = '''
import asyncio
import threading
import urllib.error
import urllib.request
from pathlib import Path

from metafora import AsyncHandler, Handler, Task
from metafora.statemachine import AsyncCommands, Commands, Message

MARKS = Path({marks!r})


def mark(task, what):
    MARKS.mkdir(exist_ok=True)
    (MARKS / f"{{task.id}}.{{task.token}}.{{what}}").write_text(what)


def plain(task, stop):
    mark(task, "plain")
    return True


async def aplain(task, stop):
    mark(task, "aplain")
    await asyncio.sleep(0)
    return True


class Counted(Handler):
    def __init__(self, task):
        self.task = task

    def run(self):
        mark(self.task, "handler")
        return True

    def stop(self):
        pass


def make(task):
    return Counted(task)


class AsyncCounted(AsyncHandler):
    def __init__(self, task):
        self.task = task

    async def run(self):
        mark(self.task, "async-handler")
        return True

    def stop(self):
        pass


def step(task, cmds: Commands):
    mark(task, "step")
    return Message.complete()


async def astep(task, c: AsyncCommands):
    mark(task, "astep")
    return Message.complete()


def long(task, stop):
    mark(task, "started")
    stop.wait(120)
    mark(task, "released" if stop.is_set() else "timeout")
    return False


def lingering(task, stop):
    """Holds its task until stopped, then until a gate file appears: the shutdown's window."""
    mark(task, "started")
    stop.wait(120)
    mark(task, "stopping")
    gate = MARKS.parent / "gate"
    for _ in range(2400):
        if gate.exists():
            break
        threading.Event().wait(0.05)
    return False


def stubborn(task, stop):
    mark(task, "started")
    threading.Event().wait(120)
    return True


class Broken:
    """A balancer whose init raises: the consumer dies after it registered."""


from metafora.balancers import DumbBalancer


class BrokenBalancer(DumbBalancer):
    def init(self, ctx):
        raise RuntimeError("the balancer broke")


def two(task, other):
    return True


async def one_async(task):
    return True


INSTANCE = Counted(Task("x"))
NUMBER = 42
'''

KINDS = {  # NAME -> what its handler marks
    "plain": "plain",
    "aplain": "aplain",
    "make": "handler",
    "Counted": "handler",
    "AsyncCounted": "async-handler",
    "step": "step",
    "astep": "astep",
}


@pytest.fixture
def app(tmp_path: Path) -> Path:
    """A directory holding the handlers' module ``workmod`` (and their marks)."""
    (tmp_path / "workmod.py").write_text(HANDLERS.format(marks=str(tmp_path / "marks")))
    (tmp_path / "badsyntax.py").write_text("def broken(:\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('no config for this module')\n")
    (tmp_path / "needsdep.py").write_text("import surely_not_installed_dep\n")
    return tmp_path


def _env(app: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(app), str(REPO)])
    return env


def marks(app: Path) -> list[str]:
    folder = app / "marks"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


class Worker:
    """``metafora --url URL worker ARGS`` in a subprocess; stderr collected by a thread."""

    def __init__(self, app: Path, url: str | None, *args: str, env: dict[str, str] | None = None) -> None:
        root = ["--url", url] if url is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metafora", *root, "worker", *args],
            cwd=app, env={**_env(app), **(env or {})}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self._lines.append(line)

    def wait_line(self, text: str, timeout: float = DEADLINE) -> str:
        """The first stderr line containing ``text`` (AssertionError after ``timeout``)."""
        def found() -> str | None:
            return next((line for line in self.lines() if text in line), None)

        return wait_until(found, timeout, f"{text!r} on stderr")

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = DEADLINE) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout)  # stderr is read to its end
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.lines())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(DEADLINE)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


def run_worker(app: Path, url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A worker expected to exit on its own; asserts it printed no traceback."""
    proc = subprocess.run([sys.executable, "-m", "metafora", "--url", url, "worker", *args], cwd=app,
                          env=_env(app), capture_output=True, text=True, timeout=timeout, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _probe(port: int, path: str) -> int | None:
    """The status of ``path`` on the worker's info server (None while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return None


def _healthz(port: int) -> int | None:
    return _probe(port, "/healthz")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_readyz_turns_503_at_sigterm_before_the_claims_are_released(
        app: Path, sqlite_url: str, workers: list[Worker]) -> None:
    port = _free_port()
    worker = Worker(app, sqlite_url, "workmod:lingering", "--node-id", "w-ready", "--http",
                    f"127.0.0.1:{port}", "--shutdown-timeout", "100")
    workers.append(worker)
    with open_client(sqlite_url) as client:
        client.submit_task(Task("linger"))
        wait_until(lambda: any(m.endswith(".started") for m in marks(app)), DEADLINE, "linger started")
        assert wait_until(lambda: _probe(port, "/readyz"), DEADLINE, "/readyz answers") == 200
        worker.signal(signal.SIGTERM)
        wait_until(lambda: any(m.endswith(".stopping") for m in marks(app)), DEADLINE, "stop() reached it")
        # The handler is stopping and still holds its claim: not ready, but alive (not to be killed).
        assert _probe(port, "/readyz") == 503
        assert _probe(port, "/healthz") == 200
        assert client.get_task("linger").state is TaskState.CLAIMED
        (app / "gate").write_text("go")
        assert worker.wait() == 0, worker.stderr
        assert client.get_task("linger").state is TaskState.PENDING


def node_live(client: Client, node: str) -> bool:
    return node in client.nodes()


# -- every kind of handler, on SQLite and PostgreSQL ---------------------------------------------


def test_worker_runs_every_kind_of_handler(app: Path, sql_url: str, workers: list[Worker]) -> None:
    for name in KINDS:
        workers.append(Worker(app, sql_url, f"workmod:{name}", "--node-id", f"w-{name}",
                              "--labels", f"kind={name}", "--labels", "zone=test"))
    with open_client(sql_url) as client:
        for name in KINDS:
            client.submit_task(Task(f"t-{name}", selector={"kind": name}))
        for name in KINDS:
            wait_until(lambda n=name: client.get_task(f"t-{n}").state is TaskState.DONE, DEADLINE,
                       f"t-{name} done")
        assert {"w-plain", "w-step"} <= set(client.nodes())
    ran = marks(app)
    for name, what in KINDS.items():
        assert any(m.startswith(f"t-{name}.") and m.endswith(f".{what}") for m in ran), (name, ran)
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait() == 0, worker.stderr
        assert "Traceback" not in worker.stderr
        assert "stopped" in worker.stderr
    with open_client(sql_url) as client:
        assert not set(client.nodes()) & {f"w-{name}" for name in KINDS}  # deregistered


def test_sigterm_mid_task_hands_the_task_off(app: Path, sql_url: str, workers: list[Worker]) -> None:
    # --sticky-for 0: a scale-down's stop (a restart's holds the task for its id: test_cli_deploys)
    first = Worker(app, sql_url, "workmod:long", "--node-id", "w-first", "--shutdown-timeout", "20",
                   "--sticky-for", "0")
    workers.append(first)
    with open_client(sql_url) as client:
        wait_until(lambda: node_live(client, "w-first"), DEADLINE, "w-first registered")
        client.submit_task(Task("long-1"))
        wait_until(lambda: any(m.endswith(".started") for m in marks(app)), DEADLINE, "the handler started")
        held = client.get_task("long-1")
        assert (held.state, held.owner) == (TaskState.CLAIMED, "w-first")

        first.signal(signal.SIGTERM)
        assert first.wait() == 0, first.stderr
        assert "shutting down gracefully" in first.stderr
        assert f"long-1.{held.token}.released" in marks(app)  # stop() reached the handler
        after = client.get_task("long-1")
        assert after.state is TaskState.PENDING, after  # released at once: not failed, no lease wait
        assert after.error is None

        later = Worker(app, sql_url, "workmod:long", "--node-id", "w-later")
        workers.append(later)
        wait_until(lambda: client.get_task("long-1").owner == "w-later", DEADLINE, "w-later took it")
        taken = client.get_task("long-1")
        assert taken.token is not None and held.token is not None and taken.token > held.token
        later.signal(signal.SIGINT)
        assert later.wait() == 0, later.stderr
        assert client.get_task("long-1").state is TaskState.PENDING


# -- how it stops ---------------------------------------------------------------------------------


def test_second_signal_exits_at_once(app: Path, sqlite_url: str, workers: list[Worker]) -> None:
    worker = Worker(app, sqlite_url, "workmod:stubborn", "--node-id", "w-stubborn",
                    "--shutdown-timeout", "100")
    workers.append(worker)
    with open_client(sqlite_url) as client:
        wait_until(lambda: node_live(client, "w-stubborn"), DEADLINE, "w-stubborn registered")
        client.submit_task(Task("stuck"))
        wait_until(lambda: any(m.endswith(".started") for m in marks(app)), DEADLINE, "the handler started")
    worker.signal(signal.SIGTERM)
    worker.wait_line("shutting down gracefully")
    assert worker.proc.poll() is None  # the handler ignores stop(): shutdown waits for it
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 128 + signal.SIGTERM
    assert "exiting at once" in worker.stderr
    assert "Traceback" not in worker.stderr


def test_a_consumer_that_dies_after_starting_exits_4(app: Path, sqlite_url: str) -> None:
    proc = run_worker(app, sqlite_url, "workmod:plain", "--balancer", "workmod:BrokenBalancer")
    assert proc.returncode == 4, proc.stderr
    assert "the balancer broke" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("Error: the consumer ")


def test_store_unreachable_at_start_exits_3(app: Path) -> None:
    proc = run_worker(app, "postgresql://nobody:pw@127.0.0.1:1/none", "workmod:plain",
                      "--start-timeout", "0")
    assert proc.returncode == 3, proc.stderr
    assert "Error: cannot reach" in proc.stderr
    assert ":pw@" not in proc.stderr


# -- what MODULE:NAME may not be -------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "expected"), [
    ("nosuchmodule:work", "no module named 'nosuchmodule'"),
    ("workmod:missing", "'workmod' has no attribute 'missing'"),
    ("workmod", "must look like package.module:name"),
    ("workmod:NUMBER", "is an int (42), not a Handler class or a function"),
    ("workmod:INSTANCE", "a Handler instance"),
    ("workmod:Broken", "not a metafora Handler or AsyncHandler subclass"),
    ("workmod:two", "taking (task, other): cannot tell what it is"),
    ("workmod:one_async", "an async function of one parameter"),
    ("badsyntax:broken", "cannot import 'badsyntax': invalid syntax"),
    ("raises:x", "cannot import 'raises': RuntimeError: no config for this module"),
    ("needsdep:x", "No module named 'surely_not_installed_dep'"),
])
def test_bad_module_name_exits_2(app: Path, sqlite_url: str, spec: str, expected: str) -> None:
    proc = run_worker(app, sqlite_url, spec)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("Error: "), proc.stderr
    assert expected in proc.stderr
    assert not (app / "metafora.db").exists()  # refused before the store was touched


@pytest.mark.parametrize(("args", "expected"), [
    (("--kind", "handler", "workmod:plain"), "--kind handler needs a Handler or AsyncHandler subclass"),
    (("--balancer", "nosuch", "workmod:plain"), "--balancer must be one of fair, resource, sleep, dumb"),
    (("--balancer", "workmod:Counted", "workmod:plain"), "not a Balancer"),
    (("--labels", "novalue", "workmod:plain"), "--labels 'novalue' is not KEY=VALUE"),
    (("--weight", "0", "workmod:plain"), "--weight must be a positive number"),
    (("--weight", "inf", "workmod:plain"), "--weight must be a positive number"),
])
def test_bad_options_exit_2(app: Path, sqlite_url: str, args: tuple[str, ...], expected: str) -> None:
    proc = run_worker(app, sqlite_url, *args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr


def test_kind_override_and_env_variables(app: Path, sqlite_url: str, workers: list[Worker]) -> None:
    with socket.socket() as probe:  # a free port for the probes' server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = Worker(app, None, env={
        "METAFORA_URL": sqlite_url,
        "METAFORA_WORKER_TARGET": "workmod:two",
        "METAFORA_WORKER_KIND": "function",  # (task, other) is not recognised without it
        "METAFORA_WORKER_NODE_ID": "w-env",
        "METAFORA_WORKER_LABELS": "zone=eu gpu=1",
        "METAFORA_WORKER_BALANCER": "dumb",
        "METAFORA_WORKER_HTTP": f"127.0.0.1:{port}",
        "METAFORA_WORKER_WEIGHT": "2.5",
    })
    workers.append(worker)
    with open_client(sqlite_url) as client:
        client.submit_task(Task("by-env", selector={"zone": "eu", "gpu": "1"}))
        wait_until(lambda: client.get_task("by-env").state is TaskState.DONE, DEADLINE, "by-env done")
        assert "w-env" in client.nodes()
        assert {n.id: n.weight for n in client.node_infos()}["w-env"] == 2.5  # --weight passed on
    assert wait_until(lambda: _healthz(port), DEADLINE, "/healthz answers") == 200
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.stderr
    assert "metafora worker w-env on sqlite:" in worker.stderr
    assert "running workmod:two (function)" in worker.stderr
