"""The ``metafora`` CLI in-process (click's CliRunner) on memory:// stores.

A memory store is shared by everything in one process, so a consumer started in a thread
here is a live node the CLI can see and command.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner, Result

from metafora import Consumer, Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.cli import (
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ExitCode,
    _common,
    cli,
)
from metafora.contracts.client import Client
from metafora.coordinators.memory import drop_store
from metafora.core.durations import parse_duration
from metafora.core.errors import CoordinatorUnavailable
from metafora.testing import RecordingContext
from tests.helpers import wait_until

SECRET = "s3cr3t-pw"


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def url() -> Iterator[str]:
    """A fresh memory:// store for one test."""
    name = f"cli-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


@pytest.fixture
def client(url: str) -> Iterator[Client]:
    with open_client(url) as c:
        yield c


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    """Invoke the CLI; never let an exception escape as anything but SystemExit."""
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=True)
    assert "Traceback" not in result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def on(url: str, *args: str) -> Result:
    return run("--url", url, *args)


class _Node:
    """A consumer running in a thread; its handler waits until stopped (then releases)."""

    def __init__(self, url: str, node_id: str) -> None:
        self.started: list[Task] = []
        self.stopped: list[str] = []

        def work(task: Task, stop: threading.Event) -> bool:
            self.started.append(task)
            stop.wait(30)
            self.stopped.append(task.id)
            return False

        self.consumer = Consumer(open_coordinator(url, node_id=node_id), simple_handler(work),
                                 shutdown_timeout=5)
        self.thread = threading.Thread(target=self.consumer.run, daemon=True, name=f"test-{node_id}")
        self.thread.start()
        with open_client(url) as c:
            wait_until(lambda: node_id in c.nodes(), message=f"{node_id} registered")

    def close(self) -> None:
        self.consumer.shutdown(timeout=5)
        self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.fixture
def node(url: str) -> Iterator[_Node]:
    n = _Node(url, "n1")
    yield n
    n.close()


def _fail(url: str, task_id: str) -> None:
    """Make ``task_id`` failed by claiming and failing it by hand."""
    coord = open_coordinator(url, node_id=f"failer-{uuid.uuid4().hex[:4]}")
    coord.init(RecordingContext())
    try:
        claimed = coord.claim(Task(task_id))
        assert claimed is not None
        coord.fail(claimed, RuntimeError("boom"))
    finally:
        coord.close()


# -- exit codes and the root command --------------------------------------------------------


def test_exit_codes_are_named() -> None:
    assert (EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNAVAILABLE) == (0, 1, 2, 3)
    assert EXIT_INTERNAL == ExitCode.INTERNAL == 70


def test_help_shows_the_env_var_and_default() -> None:
    result = run("--help")
    assert result.exit_code == 0
    assert "METAFORA_URL" in result.output
    assert "sqlite:///metafora.db" in result.output
    for command in ("submit", "delete", "retry", "tasks", "show", "nodes", "freeze", "unfreeze",
                    "balance", "stop", "purge", "demo", "top", "pause", "resume", "kill", "sleep",
                    "state"):
        assert command in result.output


def test_every_command_has_help() -> None:
    for command in ("submit", "delete", "retry", "tasks", "show", "nodes", "freeze", "unfreeze",
                    "balance", "stop", "purge", "demo", "top", "pause", "resume", "kill", "sleep",
                    "state"):
        result = run(command, "--help")
        assert result.exit_code == 0, command
        assert "Usage: " in result.output


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0
    assert "metafora" in result.output


def test_url_comes_from_the_environment_at_call_time(url: str, client: Client) -> None:
    result = run("submit", "from-env", env={"METAFORA_URL": url})
    assert result.exit_code == 0, result.output
    assert client.get_task("from-env").state is TaskState.PENDING
    # --url wins over the environment
    other = f"memory://cli-{uuid.uuid4().hex[:8]}"
    try:
        result = run("--url", other, "submit", "from-flag", env={"METAFORA_URL": url})
        assert result.exit_code == 0
        assert [t.id for t in client.tasks()] == ["from-env"]
    finally:
        drop_store(f"{other[len('memory://'):]}/metafora")


def test_unknown_command_and_option_are_usage_errors(url: str) -> None:
    assert run("frobnicate").exit_code == EXIT_USAGE
    assert on(url, "tasks", "--bogus").exit_code == EXIT_USAGE
    assert run("--log-level", "loud", "tasks").exit_code == EXIT_USAGE


def test_unknown_scheme_is_usage_error_and_hides_password() -> None:
    result = run("--url", f"foo://user:{SECRET}@host/x", "tasks")
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith("Error: ")
    assert "unknown store scheme" in result.stderr
    assert SECRET not in result.output


def test_bad_store_option_is_usage_error(url: str) -> None:
    result = on(f"{url}?lease_tt=3", "tasks")
    assert result.exit_code == EXIT_USAGE
    assert "lease_tt" in result.stderr


def test_malformed_url_is_usage_error_and_hides_password() -> None:
    result = run("--url", f"postgresql://user:{SECRET}@host:notaport/db", "tasks")
    assert result.exit_code == EXIT_USAGE
    assert SECRET not in result.output


def test_store_unavailable_exits_3_without_password(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(url: str) -> Client:
        raise CoordinatorUnavailable(f"cannot reach {url} (connection refused)")

    monkeypatch.setattr(_common, "open_client", unreachable)
    result = run("--url", f"postgresql://user:{SECRET}@127.0.0.1:1/db", "tasks")
    assert result.exit_code == EXIT_UNAVAILABLE
    assert result.stderr.startswith("Error: cannot reach")
    assert SECRET not in result.output  # scrubbed by the CLI even when a message leaks it


def test_unreachable_postgresql_exits_3_without_password() -> None:
    pytest.importorskip("psycopg")  # the postgres extra (in dev: CI=true fails this skip)
    for args in (("tasks",), ("submit", "x"), ("nodes",), ("freeze", "--all")):
        result = run("--url", f"postgresql://user:{SECRET}@127.0.0.1:1/db?connect_timeout=1", *args)
        assert result.exit_code == EXIT_UNAVAILABLE, (args, result.output)
        assert result.stderr.startswith("Error: ")
        assert SECRET not in result.output


def test_unexpected_error_exits_70_without_traceback_or_password(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from metafora.coordinators.memory import MemoryClient

    def broken(self: MemoryClient, state: object = None) -> list[object]:
        raise RuntimeError(f"driver exploded at {url}?pw={SECRET}")

    monkeypatch.setattr(MemoryClient, "tasks", broken)
    result = run("--url", url.replace("memory://", f"memory://u:{SECRET}@"), "tasks")
    assert result.exit_code == EXIT_INTERNAL
    assert SECRET not in result.output  # the driver's message named it; the CLI scrubbed it
    result = on(url, "tasks")
    assert result.exit_code == EXIT_INTERNAL
    assert "unexpected RuntimeError" in result.stderr
    assert "--log-level debug" in result.stderr


# -- submit ---------------------------------------------------------------------------------


def test_submit_with_props(url: str, client: Client) -> None:
    result = on(url, "submit", "t1", "--props", '{"a": 1, "b": "x"}', "--prop", "b=2",
                "--prop", "name=bob", "--prop", "ok=true", "--prop", 'tags=["x","y"]',
                "--prop", "eq=a=b", "--prop", "nan=NaN", "--prop", "empty=")
    assert result.exit_code == EXIT_OK, result.output
    assert result.stdout.strip() == "submitted task t1"
    props = client.get_task("t1").props
    assert props == {"a": 1, "b": 2, "name": "bob", "ok": True, "tags": ["x", "y"], "eq": "a=b",
                     "nan": "NaN", "empty": ""}


def test_submit_launch_and_expiry_times(url: str, client: Client) -> None:
    result = on(url, "submit", "later", "--launch-at", "+1h", "--expires-at", "2099-01-01T00:00:00")
    assert result.exit_code == EXIT_OK, result.output
    task = client.get_task("later").task()
    assert task.launch_at is not None
    assert task.launch_at > datetime.now(UTC) + timedelta(minutes=59)
    assert task.expires_at == datetime(2099, 1, 1, tzinfo=UTC)
    assert on(url, "submit", "now", "--launch-at", "now").exit_code == EXIT_OK


@pytest.mark.parametrize("when", ["yesterday", "+soon", "2024-13-45"])
def test_submit_bad_time_is_usage_error(url: str, client: Client, when: str) -> None:
    result = on(url, "submit", "t", "--launch-at", when)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith("Error: ")
    assert client.tasks() == []


def test_submit_duplicate_is_refused(url: str) -> None:
    assert on(url, "submit", "dup").exit_code == EXIT_OK
    result = on(url, "submit", "dup")
    assert result.exit_code == EXIT_REFUSED
    assert "already exists" in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("submit", "bad\x01id"), "control character"),
        (("submit", "x" * 300), "limit is 256"),
        (("submit", "   "), "blank"),
        (("submit", "t", "--props", "{not json"), "not valid JSON"),
        (("submit", "t", "--props", "[1, 2]"), "JSON object"),
        (("submit", "t", "--props", '"text"'), "JSON object"),
        (("submit", "t", "--props", '{"x": NaN}'), "not valid JSON"),
        (("submit", "t", "--prop", "novalue"), "KEY=VALUE"),
        (("submit", "t", "--prop", "=v"), "KEY=VALUE"),
        (("submit", "t", "--props", '{"launch_at": 5}'), "launch_at"),
        (("delete", "bad\x02"), "control character"),
        (("retry", "x" * 300), "limit is 256"),
        (("show", "bad\x7f"), "control character"),
        (("tasks", "--state", "sleeping"), "sleeping"),
        (("stop", "n1", "bad\x03task"), "control character"),
        (("stop", "n1", ""), "empty"),
        (("stop", "bad\x04node", "t"), "node id"),
        (("freeze", "bad\x05node"), "node id"),
        (("purge", "--older-than", "soon"), "duration"),
        (("freeze",), "--all"),
        (("freeze", "n1", "--all"), "--all"),
        (("demo", "--nodes", "1"), "--nodes"),
    ],
)
def test_bad_input_is_a_usage_error_without_traceback(url: str, client: Client, args: tuple[str, ...],
                                                      needle: str) -> None:
    result = on(url, *args)
    assert result.exit_code == EXIT_USAGE, result.output
    assert "Error: " in result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.output
    assert client.tasks() == []  # nothing was written


# -- delete, retry, show, tasks, purge ---------------------------------------------------------


def test_delete(url: str, client: Client) -> None:
    client.submit_task(Task("d1"))
    result = on(url, "delete", "d1")
    assert result.exit_code == EXIT_OK
    assert "deleted task d1" in result.stdout
    assert client.tasks() == []
    result = on(url, "delete", "d1")
    assert result.exit_code == EXIT_REFUSED
    assert result.stderr.startswith("Error: ")


def test_retry(url: str, client: Client) -> None:
    client.submit_task(Task("r1"))
    result = on(url, "retry", "r1")
    assert result.exit_code == EXIT_REFUSED  # pending: nothing to retry
    assert "pending" in result.stderr
    _fail(url, "r1")
    assert client.get_task("r1").state is TaskState.FAILED
    result = on(url, "retry", "r1")
    assert result.exit_code == EXIT_OK, result.output
    info = client.get_task("r1")
    assert info.state is TaskState.PENDING
    assert info.error is None
    assert on(url, "retry", "missing").exit_code == EXIT_REFUSED


def test_tasks_table_and_json(url: str, client: Client) -> None:
    result = on(url, "tasks")
    assert result.exit_code == EXIT_OK
    assert "no tasks" in result.stdout
    client.submit_task(Task("a", {"n": 1}))
    client.submit_task(Task("b"))
    _fail(url, "b")
    result = on(url, "tasks")
    assert result.exit_code == EXIT_OK
    for text in ("id", "state", "owner", "token", "claimed_at", "error", "a", "pending", "failed",
                 "RuntimeError: boom", "2 tasks"):
        assert text in result.stdout
    result = on(url, "tasks", "--json")
    assert result.exit_code == EXIT_OK
    data = json.loads(result.stdout)
    assert [d["id"] for d in data] == ["a", "b"]
    assert data[0]["props"] == {"n": 1}
    assert data[1]["state"] == "failed"
    assert data[1]["error"] == "RuntimeError: boom"
    assert set(data[0]) >= {"id", "props", "state", "owner", "token", "claimed_at", "error"}
    result = on(url, "tasks", "--state", "FAILED", "--json")
    assert [d["id"] for d in json.loads(result.stdout)] == ["b"]
    result = on(url, "tasks", "--state", "done")
    assert "no done tasks" in result.stdout
    assert json.loads(on(url, "tasks", "--state", "done", "--json").stdout) == []


def test_tasks_table_does_not_interpret_markup(url: str, client: Client) -> None:
    client.submit_task(Task("[bold]x[/bold]"))
    result = on(url, "tasks")
    assert "[bold]x[/bold]" in result.stdout


def test_show(url: str, client: Client) -> None:
    client.submit_task(Task("s1", {"k": "v"}))
    result = on(url, "show", "s1")
    assert result.exit_code == EXIT_OK
    assert "s1" in result.stdout
    assert '{"k": "v"}' in result.stdout
    data = json.loads(on(url, "show", "s1", "--json").stdout)
    assert data["id"] == "s1"
    assert data["state"] == "pending"
    assert data["props"] == {"k": "v"}
    result = on(url, "show", "nope")
    assert result.exit_code == EXIT_REFUSED
    assert "nope" in result.stderr


def test_purge(url: str, client: Client) -> None:
    client.submit_task(Task("p1"))
    client.submit_task(Task("p2"))
    _fail(url, "p1")
    result = on(url, "purge", "--older-than", "1h")
    assert result.exit_code == EXIT_OK
    assert "purged 0 tasks" in result.stdout
    result = on(url, "purge")
    assert result.exit_code == EXIT_OK
    assert "purged 1 task" in result.stdout
    assert [t.id for t in client.tasks()] == ["p2"]
    assert on(url, "purge", "--older-than", "90").exit_code == EXIT_OK
    assert on(url, "purge", "--older-than", "-5").exit_code == EXIT_USAGE


# -- nodes and node commands ----------------------------------------------------------------


def test_nodes_table_and_json(url: str, client: Client, node: _Node) -> None:
    client.submit_task(Task("w1"))
    wait_until(lambda: client.node_task_count().get("n1") == 1, message="n1 holds w1")
    result = on(url, "nodes")
    assert result.exit_code == EXIT_OK
    assert "n1" in result.stdout
    assert "1 node, 1 claimed task" in result.stdout
    data = json.loads(on(url, "nodes", "--json").stdout)
    assert data[0]["node"] == "n1"
    assert data[0]["tasks"] == 1


def test_nodes_empty(url: str) -> None:
    assert "no live nodes" in on(url, "nodes").stdout
    assert json.loads(on(url, "nodes", "--json").stdout) == []


def test_freeze_and_unfreeze_a_node(url: str, client: Client, node: _Node) -> None:
    result = on(url, "freeze", "n1")
    assert result.exit_code == EXIT_OK, result.output
    assert "sent freeze to node n1" in result.stdout
    wait_until(lambda: node.consumer.frozen, message="n1 frozen")
    client.submit_task(Task("while-frozen"))
    result = on(url, "unfreeze", "n1")
    assert result.exit_code == EXIT_OK
    wait_until(lambda: not node.consumer.frozen, message="n1 unfrozen")
    wait_until(lambda: client.get_task("while-frozen").owner == "n1", message="claimed after unfreeze")


def test_all_nodes(url: str, client: Client, node: _Node) -> None:
    other = _Node(url, "n2")
    try:
        result = on(url, "freeze", "--all")
        assert result.exit_code == EXIT_OK
        assert "sent freeze to 2 nodes" in result.stdout
        wait_until(lambda: node.consumer.frozen and other.consumer.frozen, message="both frozen")
        assert on(url, "balance", "--all").exit_code == EXIT_OK
        assert on(url, "unfreeze", "--all").exit_code == EXIT_OK
        wait_until(lambda: not node.consumer.frozen and not other.consumer.frozen, message="both thawed")
    finally:
        other.close()


def test_all_with_no_nodes_is_not_an_error(url: str) -> None:
    result = on(url, "balance", "--all")
    assert result.exit_code == EXIT_OK
    assert "no live nodes" in result.stderr


def test_command_to_unknown_node_is_refused(url: str) -> None:
    for verb in ("freeze", "unfreeze", "balance"):
        result = on(url, verb, "ghost")
        assert result.exit_code == EXIT_REFUSED
        assert "ghost" in result.stderr


def test_balance_a_node(url: str, node: _Node) -> None:
    result = on(url, "balance", "n1")
    assert result.exit_code == EXIT_OK
    assert "sent balance to node n1" in result.stdout


def test_stop_a_running_task(url: str, client: Client, node: _Node) -> None:
    client.submit_task(Task("long"))
    wait_until(lambda: node.started, message="the task started")
    result = on(url, "stop", "n1", "long")
    assert result.exit_code == EXIT_OK, result.output
    assert "asked node n1 to stop task long" in result.stdout
    wait_until(lambda: "long" in node.stopped, message="the handler was stopped")


def test_stop_refusals(url: str, client: Client, node: _Node) -> None:
    result = on(url, "stop", "n1", "missing")
    assert result.exit_code == EXIT_REFUSED
    assert "missing" in result.stderr
    client.submit_task(Task("elsewhere"))
    wait_until(lambda: client.get_task("elsewhere").owner == "n1", message="claimed by n1")
    result = on(url, "stop", "n2", "elsewhere")
    assert result.exit_code == EXIT_REFUSED
    assert result.stderr == "Error: no live node 'n2'\n"  # not "not running there"


def test_top_renders_a_frame(url: str, client: Client, node: _Node) -> None:
    client.submit_task(Task("t-top"))
    result = on(url, "top", "--frames", "1")
    assert result.exit_code == EXIT_OK, result.output
    assert "n1" in result.stdout


def test_demo_refuses_a_memory_store(url: str) -> None:
    result = on(url, "demo", "--url", url)
    assert result.exit_code == EXIT_USAGE
    assert "separate processes" in result.stderr
    # the root --url, given on the command line, is the demo's store too
    result = on(url, "demo")
    assert result.exit_code == EXIT_USAGE


def test_scrub() -> None:
    url = "postgresql://u:p%40ss@h/db"
    assert _common.scrub("x p%40ss y p@ss", url) == "x *** y ***"
    assert _common.scrub("nothing", None) == "nothing"
    assert _common.scrub("keep", "sqlite:///x.db") == "keep"


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("1.5m", 90), ("2h", 7200), ("7d", 604800),
                                                ("250ms", 0.25), (" 3 s ", 3)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "-1", "1w", "abc", "1e999"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
