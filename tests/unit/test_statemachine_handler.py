"""The state machine handler on the memory store: Commands, the run loop, errors, fencing.

Each test claims a task by hand on a memory coordinator and runs the machine's
``run()`` in a thread; time-based behaviour (sleep, back-off) is driven by a FakeClock.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.contracts.client import Client
from metafora.coordinators.memory import MemoryCoordinator, drop_store
from metafora.coordinators.memory.states import MemoryStateStore, MemoryTaskCommands
from metafora.core.errors import ClaimLost, ConfigError, CoordinatorUnavailable, StoreError
from metafora.statemachine import (
    Commands,
    ErrorPolicy,
    ErrorRecord,
    InvalidState,
    Message,
    State,
    StateCode,
    StatefulHandler,
    StatefulTaskHandler,
    StateStore,
    handler_func,
)
from metafora.testing import FakeClock, RecordingContext
from tests.helpers import wait_until


@dataclass
class Env:
    url: str
    client: Client
    coord: MemoryCoordinator
    ctx: RecordingContext
    states: MemoryStateStore
    commands: MemoryTaskCommands
    clock: FakeClock

    def claim(self, task_id: str = "t1", coord: MemoryCoordinator | None = None) -> Task:
        if task_id not in {t.id for t in self.client.tasks()}:
            self.client.submit_task(Task(task_id))
        claimed = (coord or self.coord).claim(Task(task_id))
        assert claimed is not None
        return claimed

    def machine(self, stateful: StatefulHandler, task: Task, **kwargs: Any) -> StatefulTaskHandler:
        kwargs.setdefault("clock", self.clock)
        kwargs.setdefault("poll_interval", 0.02)
        kwargs.setdefault("store_retry_delay", 0.0)
        make = handler_func(stateful, self.coord, **kwargs)
        return make(task)

    def node(self, node_id: str) -> MemoryCoordinator:
        coord = open_coordinator(self.url, node_id=node_id)
        assert isinstance(coord, MemoryCoordinator)
        coord.init(RecordingContext())
        return coord


@pytest.fixture
def env() -> Iterator[Env]:
    name = f"sm-{uuid.uuid4().hex[:8]}"
    url = f"memory://{name}"
    client = open_client(url)
    coord = open_coordinator(url, node_id="a")
    assert isinstance(coord, MemoryCoordinator)
    ctx = RecordingContext()
    coord.init(ctx)
    yield Env(url, client, coord, ctx, MemoryStateStore.of(coord), MemoryTaskCommands.of(coord),
              FakeClock())
    coord.close()
    client.close()
    drop_store(f"{name}/metafora")


class Running:
    """``handler.run()`` in a thread; ``result()`` joins it (bounded)."""

    def __init__(self, handler: StatefulTaskHandler) -> None:
        self.handler = handler
        self.value: bool | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.value = self.handler.run()
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = 10.0) -> bool:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run() did not return"
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()


def code_of(env: Env, task_id: str = "t1") -> StateCode | None:
    state = env.states.get(task_id)
    return None if state is None else state.code


def returns(message: Message) -> StatefulHandler:
    return lambda task, cmds: message


# -- terminal outcomes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "code"),
    [(Message.complete(), StateCode.COMPLETED), (Message.kill(), StateCode.KILLED)],
)
def test_terminal_message_finishes_the_task(env: Env, message: Message, code: StateCode) -> None:
    handler = env.machine(returns(message), env.claim())
    assert handler.run() is True
    assert code_of(env) is code
    assert handler.state is not None and handler.state.code is code


def test_release_returns_false_and_keeps_the_state(env: Env) -> None:
    handler = env.machine(returns(Message.release()), env.claim())
    assert handler.run() is False
    assert env.states.get("t1") == State()  # only the fresh state, stored as the machine started


def test_a_task_already_terminal_is_done_without_running(env: Env) -> None:
    task = env.claim()
    env.states.store(task, State(StateCode.KILLED))
    called = threading.Event()

    def never(task: Task, cmds: Commands) -> Message:
        called.set()
        return Message.complete()

    assert env.machine(never, task).run() is True
    assert not called.is_set()


def test_checkpoints_persist_the_cursor_and_call_again(env: Env) -> None:
    seen: list[str | None] = []

    def count(task: Task, cmds: Commands) -> Message:
        seen.append(cmds.cursor)
        n = int(cmds.cursor or 0)
        if n == 3:
            return Message.complete()
        return Message.checkpoint(str(n + 1))

    assert env.machine(count, env.claim()).run() is True
    assert seen == [None, "1", "2", "3"]
    assert env.states.get("t1") == State(StateCode.COMPLETED, cursor="3")


# -- Commands --------------------------------------------------------------------------


def test_poll_get_cursor_and_checkpoint(env: Env) -> None:
    task = env.claim()
    env.states.store(task, State(cursor="41"))
    results: dict[str, Any] = {}
    in_get = threading.Event()

    def handler(task: Task, cmds: Commands) -> Message:
        results["cursor"] = cmds.cursor
        results["first_poll"] = cmds.poll()
        cmds.checkpoint("42")
        results["stored"] = env.states.get("t1")
        in_get.set()
        results["got"] = cmds.get(timeout=30)
        results["fifo"] = [cmds.poll(), cmds.poll()]
        results["timed_out"] = cmds.get(timeout=5)
        return Message.complete()

    running = Running(env.machine(handler, task))
    in_get.wait(5)
    env.commands.send("t1", Message.pause())
    env.commands.send("t1", Message.sleep("2031-01-01T00:00:00Z"))
    env.commands.send("t1", Message.kill())
    wait_until(lambda: "fifo" in results, message="commands read")

    def advanced_until_done() -> bool:
        env.clock.advance(1)  # get(timeout=5) counts on the fake clock
        return not running.alive

    wait_until(advanced_until_done, message="get(timeout) to time out on the fake clock")
    assert running.result() is True
    assert results["cursor"] == "41"
    assert results["first_poll"] is None
    assert results["stored"] == State(cursor="42")
    assert results["got"] == Message.pause()
    assert results["fifo"] == [Message.sleep("2031-01-01T00:00:00Z"), Message.kill()]
    assert results["timed_out"] is None
    assert env.states.get("t1") == State(StateCode.COMPLETED, cursor="42")


def test_poll_answers_release_after_stop(env: Env) -> None:
    started = threading.Event()
    polls: list[Message | None] = []

    def handler(task: Task, cmds: Commands) -> Message:
        started.set()
        message = cmds.get()  # waits until stop()
        polls.append(message)
        polls.append(cmds.poll())
        assert message is not None
        return message

    running = Running(env.machine(handler, env.claim()))
    started.wait(5)
    running.handler.stop()
    running.handler.stop()  # idempotent
    assert running.result() is False
    assert polls == [Message.release(), Message.release()]
    assert env.client.get_task("t1").state is TaskState.CLAIMED  # the consumer releases it


def test_a_handler_that_never_polls_is_stopped_at_its_next_return(env: Env) -> None:
    calls = threading.Semaphore(0)
    proceed = threading.Event()

    def busy(task: Task, cmds: Commands) -> Message:
        calls.release()
        proceed.wait(5)
        return Message.checkpoint(str(int(cmds.cursor or 0) + 1))

    running = Running(env.machine(busy, env.claim()))
    assert calls.acquire(timeout=5)
    running.handler.stop()
    proceed.set()
    assert running.result() is False
    assert env.states.get("t1") == State(cursor="1")  # the last checkpoint was kept


def test_a_command_is_applied_between_handler_calls(env: Env) -> None:
    calls: list[int] = []
    first = threading.Event()
    go = threading.Event()

    def stubborn(task: Task, cmds: Commands) -> Message:  # never polls
        calls.append(1)
        first.set()
        go.wait(5)
        if len(calls) == 2:
            return Message.complete()
        return Message.checkpoint()

    running = Running(env.machine(stubborn, env.claim()))
    first.wait(5)
    env.commands.send("t1", Message.pause())
    go.set()
    wait_until(lambda: code_of(env) is StateCode.PAUSED, message="paused")
    assert calls == [1]
    env.commands.send("t1", Message.run())
    assert running.result() is True
    assert calls == [1, 1]


def test_malformed_stored_command_is_dropped_not_delivered(env: Env) -> None:
    env.commands.inject_raw("t1", '{"message": "explode"}')
    env.commands.inject_raw("t1", '{"message": "complete"}')  # not an operator command
    env.commands.inject_raw("t1", "not json")
    env.commands.send("t1", Message.kill())
    handler = env.machine(returns(Message.pause()), env.claim())
    assert handler.run() is True  # the kill got through; the garbage did not
    assert code_of(env) is StateCode.KILLED


# -- paused and sleeping -----------------------------------------------------------------


def test_pause_keeps_the_claim_until_resumed(env: Env) -> None:
    calls: list[int] = []

    def handler(task: Task, cmds: Commands) -> Message:
        calls.append(1)
        return Message.pause() if len(calls) == 1 else Message.complete()

    running = Running(env.machine(handler, env.claim()))
    wait_until(lambda: code_of(env) is StateCode.PAUSED, message="paused")
    assert env.client.get_task("t1").state is TaskState.CLAIMED
    env.commands.send("t1", Message.pause())  # pause while paused: stays paused
    wait_until(lambda: env.commands.pending("t1") == 0, message="pause taken")
    assert running.alive and calls == [1]
    env.commands.send("t1", Message.run())
    assert running.result() is True
    assert calls == [1, 1]


def test_sleep_wakes_at_until_on_the_fake_clock(env: Env) -> None:
    until = env.clock.now() + timedelta(minutes=10)
    calls: list[int] = []

    def handler(task: Task, cmds: Commands) -> Message:
        calls.append(1)
        return Message.sleep(until) if len(calls) == 1 else Message.complete()

    running = Running(env.machine(handler, env.claim()))
    wait_until(lambda: code_of(env) is StateCode.SLEEPING, message="sleeping")
    assert env.states.get("t1") == State(StateCode.SLEEPING, until=until)
    env.clock.advance(timedelta(minutes=9))
    assert running.alive
    env.clock.advance(timedelta(minutes=1))
    assert running.result() is True
    assert calls == [1, 1]


def test_sleep_is_cut_short_by_a_command(env: Env) -> None:
    until = env.clock.now() + timedelta(days=1)
    running = Running(env.machine(returns(Message.sleep(until)), env.claim()))
    wait_until(lambda: code_of(env) is StateCode.SLEEPING, message="sleeping")
    env.commands.send("t1", Message.kill())
    assert running.result() is True
    assert code_of(env) is StateCode.KILLED


def test_a_sleeping_task_resumes_sleeping_on_its_next_owner(env: Env) -> None:
    task = env.claim()
    until = env.clock.now() + timedelta(hours=1)
    env.states.store(task, State(StateCode.SLEEPING, until=until, cursor="9"))
    running = Running(env.machine(returns(Message.complete()), task))
    env.clock.advance(timedelta(minutes=30))
    running.handler.stop()
    assert running.result() is False
    assert env.states.get("t1") == State(StateCode.SLEEPING, until=until, cursor="9")


# -- errors ----------------------------------------------------------------------------


def test_raise_faults_backs_off_and_recovers(env: Env) -> None:
    attempts: list[str | None] = []

    def flaky(task: Task, cmds: Commands) -> Message:
        attempts.append(cmds.cursor)
        if len(attempts) < 3:
            raise ConnectionError(f"try {len(attempts)}")
        return Message.complete()

    policy = ErrorPolicy(max_errors=5, base_delay=10, max_delay=100, jitter=0)
    running = Running(env.machine(flaky, env.claim(), error_handler=policy))
    start = env.clock.now()
    wait_until(lambda: code_of(env) is StateCode.SLEEPING, message="first back-off")
    assert env.states.get("t1") is not None
    state = env.states.get("t1")
    assert state is not None and state.until == start + timedelta(seconds=10)
    assert [e.text for e in state.errors] == ["ConnectionError: try 1"]
    env.clock.advance(10)
    wait_until(lambda: (s := env.states.get("t1")) is not None and len(s.errors) == 2,
               message="second error")
    state = env.states.get("t1")
    assert state is not None and state.until == start + timedelta(seconds=30)  # 10 + 2 * 10
    env.clock.advance(20)
    assert running.result() is True
    final = env.states.get("t1")
    assert final is not None and final.code is StateCode.COMPLETED
    assert len(final.errors) == 2  # kept for the operator
    assert len(attempts) == 3


def test_too_many_errors_fail_the_task(env: Env) -> None:
    def broken(task: Task, cmds: Commands) -> Message:
        raise KeyError("missing")

    policy = ErrorPolicy(max_errors=2, base_delay=1, max_delay=1, jitter=0)
    running = Running(env.machine(broken, env.claim(), error_handler=policy))
    wait_until(lambda: code_of(env) is StateCode.SLEEPING, message="back-off")
    env.clock.advance(1)
    assert running.result() is True  # finished: the state says failed
    final = env.states.get("t1")
    assert final is not None and final.code is StateCode.FAILED
    assert [e.text.split(":")[0] for e in final.errors] == ["KeyError", "KeyError", "ExceededErrorRate"]


def test_error_handler_may_retry_at_once_with_run(env: Env) -> None:
    attempts: list[int] = []

    def flaky(task: Task, cmds: Commands) -> Message:
        attempts.append(1)
        if len(attempts) == 1:
            return Message.error("soft failure")
        return Message.complete()

    handler = env.machine(flaky, env.claim(), error_handler=lambda t, s, now: Message.run())
    assert handler.run() is True
    assert len(attempts) == 2


class _QuotaExceeded(Exception):
    """A user's own error type, told apart by a custom error handler."""


def test_a_custom_error_handler_sees_the_exception_raised_in_this_run(env: Env) -> None:
    raised = _QuotaExceeded("quota of 3 exceeded")
    seen: list[tuple[type[BaseException] | None, BaseException | None, str]] = []

    def quota(task: Task, cmds: Commands) -> Message:
        raise raised

    def by_type(task: Task, state: State, now: Any) -> Message:
        last = state.errors[-1]
        seen.append((last.exception_type, last.exception, last.text))
        if isinstance(last.exception, _QuotaExceeded):
            return Message.kill()
        return Message.run()

    assert env.machine(quota, env.claim(), error_handler=by_type).run() is True
    assert seen == [(_QuotaExceeded, raised, "_QuotaExceeded: quota of 3 exceeded")]
    final = env.states.get("t1")
    assert final is not None and final.code is StateCode.KILLED
    # Read back from the store, an error has its text only.
    assert final.errors[-1].text == "_QuotaExceeded: quota of 3 exceeded"
    assert final.errors[-1].exception is None and final.errors[-1].exception_type is None


def test_errors_read_back_from_the_store_reach_the_error_handler_as_text(env: Env) -> None:
    calls = 0

    def flaky(task: Task, cmds: Commands) -> Message:
        nonlocal calls
        calls += 1
        if calls == 1:
            return Message.error(TimeoutError("slow upstream"))
        return Message.complete()

    seen: list[list[tuple[str, type[BaseException] | None]]] = []

    def record(task: Task, state: State, now: Any) -> Message:
        seen.append([(e.text, e.exception_type) for e in state.errors])
        return Message.run()

    earlier = ErrorRecord(env.clock.now(), "OSError: disk full")  # an earlier run's error
    task = env.claim()
    env.states.store(task, State(errors=(earlier,)))
    assert env.machine(flaky, task, error_handler=record).run() is True
    assert seen == [[("OSError: disk full", None), ("TimeoutError: slow upstream", TimeoutError)]]


def test_a_broken_error_handler_falls_back_to_the_default_policy(env: Env) -> None:
    def bad_handler(task: Task, state: State, now: Any) -> Message:
        raise RuntimeError("bug in error handler")

    def ignored_answer(task: Task, state: State, now: Any) -> Message:
        return Message.complete()  # a fault ignores complete

    for error_handler in (bad_handler, ignored_answer):
        task_id = f"t-{error_handler.__name__}"
        running = Running(env.machine(lambda t, c: Message.error("x"), env.claim(task_id),
                                      error_handler=error_handler))
        wait_until(lambda: code_of(env, task_id) is StateCode.SLEEPING,  # noqa: B023
                   message="default policy backs off")
        running.handler.stop()
        assert running.result() is False


def test_a_non_message_return_is_an_error(env: Env) -> None:
    handler = env.machine(lambda t, c: True, env.claim(),  # type: ignore[arg-type, return-value]
                          error_handler=lambda t, s, now: Message.kill())
    assert handler.run() is True
    final = env.states.get("t1")
    assert final is not None and final.code is StateCode.KILLED
    assert "not a Message" in final.errors[-1].text


def test_kill_and_pause_reach_a_faulted_task(env: Env) -> None:
    task = env.claim()
    env.states.store(task, State(StateCode.FAULT, errors=(ErrorRecord(env.clock.now(), "E: x"),)))
    env.commands.send("t1", Message.pause())
    running = Running(env.machine(returns(Message.complete()), task))
    wait_until(lambda: code_of(env) is StateCode.PAUSED, message="fault -> paused")
    env.commands.send("t1", Message.kill())
    assert running.result() is True
    assert code_of(env) is StateCode.KILLED


# -- store failures and fencing ----------------------------------------------------------


class FlakyStore(StateStore):
    """Wraps a store; the next ``fail`` calls of ``op`` raise ``error``."""

    def __init__(self, inner: StateStore, op: str, fail: int,
                 error: Exception | None = None) -> None:
        self.inner = inner
        self.op = op
        self.fail = fail
        self.error = error or CoordinatorUnavailable("store down")
        self.calls = 0

    def _maybe(self, op: str) -> None:
        if op == self.op:
            self.calls += 1
            if self.fail > 0:
                self.fail -= 1
                raise self.error

    def load(self, task: Task) -> State:
        self._maybe("load")
        return self.inner.load(task)

    def store(self, task: Task, state: State) -> None:
        self._maybe("store")
        self.inner.store(task, state)

    def get(self, task_id: str) -> State | None:
        return self.inner.get(task_id)


def test_transient_store_errors_are_retried(env: Env) -> None:
    flaky = FlakyStore(env.states, "store", 2, StoreError("blip"))
    handler = env.machine(returns(Message.complete()), env.claim(), state_store=flaky,
                          clock=None, store_attempts=3)
    assert handler.run() is True
    assert flaky.calls == 4  # the fresh state (two blips, then stored), then completed
    assert code_of(env) is StateCode.COMPLETED


def test_a_store_that_stays_down_releases_never_completes(env: Env) -> None:
    flaky = FlakyStore(env.states, "store", 100)
    handler = env.machine(returns(Message.complete()), env.claim(), state_store=flaky,
                          clock=None, store_attempts=3)
    assert handler.run() is False  # released: another owner will try again
    assert flaky.calls == 3
    assert env.states.get("t1") is None
    assert env.client.get_task("t1").state is TaskState.CLAIMED


def test_a_load_that_keeps_failing_releases(env: Env) -> None:
    flaky = FlakyStore(env.states, "load", 100)
    handler = env.machine(returns(Message.complete()), env.claim(), state_store=flaky,
                          clock=None, store_attempts=2)
    assert handler.run() is False
    assert flaky.calls == 2


def test_a_failed_checkpoint_releases_the_task(env: Env) -> None:
    flaky = FlakyStore(env.states, "store", 100)
    raised: list[BaseException] = []

    def handler(task: Task, cmds: Commands) -> Message:
        try:
            cmds.checkpoint("5")
        except CoordinatorUnavailable as exc:
            raised.append(exc)
            raise
        return Message.complete()

    task = env.claim()
    env.states.store(task, State(cursor="0"))  # not fresh: the machine writes nothing as it starts
    machine = env.machine(handler, task, state_store=flaky, clock=None, store_attempts=2)
    assert machine.run() is False
    assert "could not checkpoint task 't1'" in str(raised[0])
    assert env.states.get("t1") == State(cursor="0")


def test_a_corrupt_stored_state_fails_the_run_with_the_reason(env: Env) -> None:
    task = env.claim()
    env.states.put_raw("t1", task.token, '{"state": "sleeping"}')
    with pytest.raises(InvalidState, match="needs 'until'"):
        env.machine(returns(Message.complete()), task).run()


def test_zombie_write_is_refused_after_the_claim_moves(env: Env) -> None:
    old = env.claim()
    env.states.store(old, State(cursor="1"))
    env.coord.expire_lease()  # a's lease is gone: the task is claimable again
    b = env.node("b")
    try:
        new = env.claim(coord=b)
        assert new.token > old.token
        with pytest.raises(ClaimLost):
            env.states.store(old, State(cursor="zombie"))
        with pytest.raises(ClaimLost):
            env.states.load(old)
        with pytest.raises(ClaimLost):
            env.commands.receive("t1", 0, token=old.token)
        env.states.store(new, State(cursor="2"))
        assert env.states.get("t1") == State(cursor="2")
        assert env.states.token_of("t1") == new.token
    finally:
        b.close()


def test_a_zombie_handler_is_stopped_by_its_refused_checkpoint(env: Env) -> None:
    inside = threading.Event()
    go = threading.Event()
    outcome: list[BaseException] = []

    def handler(task: Task, cmds: Commands) -> Message:
        inside.set()
        go.wait(5)
        try:
            cmds.checkpoint("zombie")
        except ClaimLost as exc:
            outcome.append(exc)
            return Message.complete()  # ignored: the machine knows the claim is gone
        return Message.complete()

    running = Running(env.machine(handler, env.claim()))
    inside.wait(5)
    env.coord.expire_lease()  # RecordingContext does not stop the handler: it is a zombie
    b = env.node("b")
    try:
        env.claim(coord=b)
        go.set()
        assert running.result() is False
        assert outcome and isinstance(outcome[0], ClaimLost)
        assert env.states.get("t1") == State()  # the fresh state from its start; nothing later
    finally:
        b.close()


def test_a_lost_claim_stops_a_paused_task(env: Env) -> None:
    # A paused task does not poll its queue: its node's coordinator reports the lost claim
    # (ctx.lost), and the consumer calls stop(), which wakes the mailbox at once.
    handler = env.machine(returns(Message.pause()), env.claim())
    running = Running(handler)
    wait_until(lambda: code_of(env) is StateCode.PAUSED, message="paused")
    lost = env.coord.expire_lease()
    assert [t.id for t in lost] == ["t1"]
    handler.stop()
    assert running.result() is False


def test_a_paused_zombie_sent_a_command_finds_its_claim_lost(env: Env) -> None:
    # Nobody told the machine (no consumer): the command rings its mailbox, and the fenced
    # take refuses the zombie, which stops without taking its successor's command.
    running = Running(env.machine(returns(Message.pause()), env.claim()))
    wait_until(lambda: code_of(env) is StateCode.PAUSED, message="paused")
    env.coord.expire_lease()
    env.commands.send("t1", Message.run())
    assert running.result() is False
    assert env.commands.pending("t1") == 1


def test_handler_func_validates_its_options(env: Env) -> None:
    with pytest.raises(ConfigError, match="poll_interval"):
        handler_func(returns(Message.complete()), env.coord, poll_interval=0)
    with pytest.raises(ConfigError, match="store_attempts"):
        handler_func(returns(Message.complete()), env.coord, store_attempts=0)
    with pytest.raises(ConfigError, match="callable"):
        handler_func("nope", env.coord)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pass a coordinator"):
        handler_func(returns(Message.complete()), None)
    with pytest.raises(ConfigError, match="no state store"):
        handler_func(returns(Message.complete()), object())  # type: ignore[arg-type]



# -- graceful handoff (issue 15 item 5) ---------------------------------------------------


def test_handoff_saves_the_cursor_and_releases(env: Env) -> None:
    started = threading.Event()

    def handler(task: Task, cmds: Commands) -> Message:
        started.set()
        message = cmds.get()  # waits until stop()
        assert message == Message.release()
        return cmds.handoff("42")

    task = env.claim()
    running = Running(env.machine(handler, task))
    started.wait(5)
    running.handler.stop()
    assert running.result() is False  # released
    state = env.states.get("t1")
    assert state is not None and state.cursor == "42" and state.code is StateCode.RUNNABLE


def test_the_handoff_checkpoint_is_retried_although_stopping(env: Env) -> None:
    """Other store calls give up once stop() was called; the handoff is why it stops."""
    flaky = FlakyStore(env.states, "store", 1)  # the handoff's first write fails
    started = threading.Event()

    def handler(task: Task, cmds: Commands) -> Message:
        started.set()
        cmds.get()
        return cmds.handoff("7")

    task = env.claim()
    env.states.store(task, State(cursor="0"))  # not fresh: the first store call is the handoff
    running = Running(env.machine(handler, task, state_store=flaky, clock=None, store_attempts=3))
    started.wait(5)
    running.handler.stop()
    assert running.result() is False
    assert flaky.calls == 2
    state = env.states.get("t1")
    assert state is not None and state.cursor == "7"
