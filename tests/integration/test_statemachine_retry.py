"""Re-running a finished stateful task (``Client.retry_task(id, reset_state, keep_cursor)``)
on every real store (SQLite, PostgreSQL, etcd; memory for parity): failed and killed tasks,
with and without the cursor, by hand and under a real Consumer."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest

from metafora import Consumer, Task, TaskState, open_coordinator
from metafora.core.errors import ConfigError, InvalidTaskState, TaskNotFound
from metafora.statemachine import (
    Commands,
    ErrorRecord,
    InvalidState,
    Message,
    State,
    StateCode,
    get_state,
    handler_func,
    state_store_for,
)
from metafora.testing import LocalCluster
from tests.integration.test_statemachine_stores import Nodes, nodes, url  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _finish_as(nodes: Nodes, code: StateCode, cursor: str | None = "p7") -> Task:  # noqa: F811
    """What the machine does when a task ends ``code``: the state stored, the task done."""
    a = nodes.coords.get("a") or nodes.node("a")
    if "t1" not in {t.id for t in nodes.client.tasks()}:
        nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    errors = (ErrorRecord(T0, "E: boom"),) if code is StateCode.FAILED else ()
    state_store_for(a).store(task, State(code, errors=errors, cursor=cursor))
    a.done(task)
    return task


@pytest.mark.parametrize("keep_cursor", [False, True], ids=["fresh", "keep-cursor"])
@pytest.mark.parametrize("code", [StateCode.FAILED, StateCode.KILLED], ids=["failed", "killed"])
def test_reset_state_makes_a_finished_stateful_task_pending_and_runnable(
    nodes: Nodes, code: StateCode, keep_cursor: bool  # noqa: F811
) -> None:
    old = _finish_as(nodes, code)
    assert nodes.client.get_task("t1").state is TaskState.DONE
    with pytest.raises(InvalidTaskState, match="reset_state"):
        nodes.client.retry_task("t1")  # done: without reset_state, refused as before
    before = get_state(nodes.client, "t1")
    assert before is not None and before.code is code and before.cursor == "p7"

    nodes.client.retry_task("t1", reset_state=True, keep_cursor=keep_cursor)

    info = nodes.client.get_task("t1")
    assert info.state is TaskState.PENDING and info.error is None and info.owner is None
    expected = State(cursor="p7" if keep_cursor else None)
    after = get_state(nodes.client, "t1")
    assert after == expected and after.errors == ()
    again = nodes.claim("a")  # claimable, and its owner reads the reset state (fenced)
    assert again.token > old.token
    assert state_store_for(nodes.coords["a"]).load(again) == expected


def test_reset_state_refuses_what_it_cannot_rerun(nodes: Nodes) -> None:  # noqa: F811
    with pytest.raises(TaskNotFound):
        nodes.client.retry_task("missing", reset_state=True)
    with pytest.raises(ConfigError, match="keep_cursor"):
        nodes.client.retry_task("missing", keep_cursor=True)
    _finish_as(nodes, StateCode.COMPLETED)
    with pytest.raises(InvalidTaskState, match="ended completed"):
        nodes.client.retry_task("t1", reset_state=True)
    assert nodes.client.get_task("t1").state is TaskState.DONE
    assert get_state(nodes.client, "t1") == State(StateCode.COMPLETED, cursor="p7")
    nodes.client.submit_task(Task("plain"))
    plain = nodes.claim("a", "plain")
    nodes.coords["a"].done(plain)
    with pytest.raises(InvalidTaskState, match="no state-machine state"):
        nodes.client.retry_task("plain", reset_state=True)
    nodes.client.submit_task(Task("running"))
    nodes.claim("a", "running")
    with pytest.raises(InvalidTaskState, match="claimed"):
        nodes.client.retry_task("running", reset_state=True)


def test_reset_state_of_a_failed_task_replaces_a_damaged_state(nodes: Nodes) -> None:  # noqa: F811
    a = nodes.node("a")
    nodes.client.submit_task(Task("t1"))
    task = nodes.claim("a")
    state_store_for(a).store(task, State(StateCode.FAILED, errors=(ErrorRecord(T0, "E: x"),)))
    a.fail(task, "InvalidState: stored state is damaged")  # as the consumer fails such a task
    _damage(nodes, "t1", task.token)
    with pytest.raises(InvalidState, match="damaged"):
        nodes.client.retry_task("t1", reset_state=True, keep_cursor=True)  # its cursor is lost
    assert nodes.client.get_task("t1").state is TaskState.FAILED  # nothing changed
    nodes.client.retry_task("t1", reset_state=True)
    assert nodes.client.get_task("t1").state is TaskState.PENDING
    assert get_state(nodes.client, "t1") == State()


def _damage(on: Nodes, task_id: str, token: int) -> None:
    store = state_store_for(on.client)
    if hasattr(store, "put_raw"):
        store.put_raw(task_id, token, '{"state": "nonsense"}')
        return
    # etcd: the state key written by hand, as another program might.
    from metafora.coordinators.etcd.driver import Put

    client: Any = on.client
    client.driver.txn([], [Put(client.keys.task(task_id).machine, b'{"token": 1, "state": 7}')])


class _EndsOnce:
    """Checkpoints ``p1``..``p3`` then ends ``code`` (kill, or an error the error handler
    gives up on); every later run records its starting cursor and completes."""

    def __init__(self, code: StateCode) -> None:
        self.code = code
        self.starts: list[str | None] = []
        self.lock = threading.Lock()

    def __call__(self, task: Task, cmds: Commands) -> Message:
        with self.lock:
            self.starts.append(cmds.cursor)
            first = len(self.starts) == 1
        if not first:
            return Message.complete()
        for page in (1, 2, 3):
            cmds.checkpoint(f"p{page}")
        if self.code is StateCode.KILLED:
            return Message.kill()
        raise RuntimeError("upstream gone")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("code", "keep_cursor"),
    [(StateCode.KILLED, True), (StateCode.FAILED, False)],
    ids=["killed-keep-cursor", "failed-fresh"],
)
def test_a_consumer_reruns_a_retried_stateful_task(url: str, code: StateCode,  # noqa: F811
                                                   keep_cursor: bool) -> None:
    stateful = _EndsOnce(code)
    with LocalCluster(url, shutdown_timeout=10.0) as cluster:
        cluster.client.tasks()  # the schema first, from one thread
        coord = open_coordinator(url, node_id="a")
        give_up = lambda task, state, now: Message.error("giving up")  # noqa: E731
        cluster.start(Consumer(coord, handler_func(stateful, coord, error_handler=give_up,
                                                   poll_interval=0.05)))
        cluster.client.submit_task(Task("t1"))
        cluster.wait_for_state("t1", TaskState.DONE, timeout=30)
        ended = get_state(url, "t1")
        assert ended is not None and ended.code is code and ended.cursor == "p3"

        cluster.client.retry_task("t1", reset_state=True, keep_cursor=keep_cursor)
        cluster.wait_for_state("t1", TaskState.DONE, timeout=30)
        final = get_state(url, "t1")
        assert final is not None and final.code is StateCode.COMPLETED
        assert stateful.starts == [None, "p3" if keep_cursor else None]
        assert not cluster.errors
