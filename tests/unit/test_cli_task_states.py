"""``metafora pause|resume|kill|sleep|state``: task commands to state machines, via CliRunner."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result

from metafora import Consumer, Task, open_client, open_coordinator
from metafora.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, cli
from metafora.contracts.client import Client
from metafora.coordinators.memory import drop_store
from metafora.statemachine import Commands, Message, StateCode, commands_for, handler_func
from tests.helpers import wait_until


@pytest.fixture
def url() -> Iterator[str]:
    name = f"cli-sm-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


@pytest.fixture
def client(url: str) -> Iterator[Client]:
    with open_client(url) as c:
        yield c


def on(url: str, *args: str) -> Result:
    result = CliRunner().invoke(cli, ["--url", url, *args])
    assert "Traceback" not in result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


@pytest.fixture
def machine_node(url: str) -> Iterator[Consumer]:
    """A node whose tasks are state machines that wait for commands."""

    def wait_for_orders(task: Task, cmds: Commands) -> Message:
        while True:
            message = cmds.get(timeout=30)
            if message is not None:
                return message

    coord = open_coordinator(url, node_id="sm1")
    consumer = Consumer(coord, handler_func(wait_for_orders, coord, poll_interval=0.05),
                        shutdown_timeout=5)
    thread = threading.Thread(target=consumer.run, daemon=True, name="test-sm1")
    thread.start()
    with open_client(url) as c:
        wait_until(lambda: "sm1" in c.nodes(), message="sm1 registered")
    yield consumer
    consumer.shutdown(timeout=5)
    thread.join(15)


def _state(url: str, task_id: str) -> str | None:
    data = json.loads(on(url, "state", task_id, "--json").stdout)
    return None if data is None else str(data["state"])


def test_commands_to_a_task_no_state_machine_runs_are_refused(url: str, client: Client) -> None:
    """Issue 18: they reported success and did nothing."""
    client.submit_task(Task("plain"))
    for args in (("pause",), ("resume",), ("kill",), ("sleep", "--until", "+1h")):
        result = on(url, args[0], "plain", *args[1:])
        assert result.exit_code == EXIT_REFUSED, result.output
        assert result.stderr.startswith("Error: task 'plain' is not run by a state machine"), result.stderr
        assert "--queue" in result.stderr
    channel = commands_for(client)
    try:
        assert channel.pending("plain") == 0  # nothing was sent
    finally:
        channel.close()


def test_commands_queue_for_a_pending_task(url: str, client: Client) -> None:
    client.submit_task(Task("t1"))
    for verb in ("pause", "resume", "kill"):
        result = on(url, verb, "t1", "--queue")
        assert result.exit_code == EXIT_OK, result.output
        assert f"sent {verb} to task t1" in result.stdout
    result = on(url, "sleep", "t1", "--until", "+1h", "--queue")
    assert result.exit_code == EXIT_OK, result.output
    channel = commands_for(client)
    try:
        assert channel.pending("t1") == 4
    finally:
        channel.close()
    assert "has no state yet" in on(url, "state", "t1").stdout
    assert json.loads(on(url, "state", "t1", "--json").stdout) is None


def test_pause_resume_kill_a_running_machine(url: str, client: Client, machine_node: Consumer) -> None:
    client.submit_task(Task("job"))
    wait_until(lambda: client.get_task("job").owner == "sm1", message="sm1 runs job")
    # The machine stores the fresh state as it starts: the CLI then knows a machine runs it.
    wait_until(lambda: _state(url, "job") == StateCode.RUNNABLE.value, message="job's state stored")
    assert on(url, "pause", "job").exit_code == EXIT_OK
    wait_until(lambda: _state(url, "job") == StateCode.PAUSED.value, message="job paused")
    result = on(url, "state", "job")
    assert result.exit_code == EXIT_OK
    assert "paused" in result.stdout
    assert on(url, "resume", "job").exit_code == EXIT_OK
    wait_until(lambda: _state(url, "job") == StateCode.RUNNABLE.value, message="job resumed")
    assert on(url, "kill", "job").exit_code == EXIT_OK
    wait_until(lambda: _state(url, "job") == StateCode.KILLED.value, message="job killed")


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("pause", "missing"), EXIT_REFUSED, "missing"),
        (("pause", "bad\x01"), EXIT_USAGE, "control character"),
        (("kill", "x" * 300), EXIT_USAGE, "256"),
        (("sleep", "t"), EXIT_USAGE, "--until"),
        (("sleep", "t", "--until", "whenever"), EXIT_USAGE, "ISO-8601"),
        (("state", "bad\x02"), EXIT_USAGE, "control character"),
        (("state", "missing"), EXIT_REFUSED, "missing"),
    ],
)
def test_bad_task_commands(url: str, args: tuple[str, ...], code: int, needle: str) -> None:
    result = on(url, *args)
    assert result.exit_code == code, result.output
    assert needle in result.stderr


def test_commands_to_a_finished_task_are_refused(url: str, client: Client) -> None:
    from metafora.testing import RecordingContext

    client.submit_task(Task("over"))
    coord = open_coordinator(url, node_id="finisher")
    coord.init(RecordingContext())
    try:
        claimed = coord.claim(Task("over"))
        assert claimed is not None
        coord.done(claimed)
    finally:
        coord.close()
    result = on(url, "pause", "over")
    assert result.exit_code == EXIT_REFUSED
    assert "done" in result.stderr
