"""The Consumer when the store or the plugins misbehave: retries, never a crash, nothing lost."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from datetime import datetime

import pytest

from metafora import Balancer, BalancerContext, Consumer, Task, TaskState
from metafora.contracts.coordinator import CoordinatorContext
from metafora.coordinators.memory import MemoryCoordinator
from metafora.core import commands
from metafora.core.commands import Command
from metafora.core.errors import CoordinatorUnavailable, StoreError
from tests.helpers import Harness, wait_until
from tests.unit.test_consumer import Ledger, ledger_handler


class FlakyCoordinator(MemoryCoordinator):
    """A memory coordinator whose store 'goes away' for the first few calls of some methods."""

    def __init__(self, base: MemoryCoordinator, failures: dict[str, int]) -> None:
        super().__init__(base._store, base.node_id)
        self.failures = dict(failures)
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def _maybe_fail(self, name: str) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.failures.get(name, 0) > 0:
                self.failures[name] -= 1
                raise CoordinatorUnavailable(f"store away during {name}")

    def claim(self, task: Task) -> Task | None:
        self._maybe_fail("claim")
        return super().claim(task)

    def done(self, task: Task) -> None:
        self._maybe_fail("done")
        super().done(task)

    def command(self, timeout: float | None = None) -> Command | None:
        self._maybe_fail("command")
        return super().command(timeout)

    def init(self, ctx: CoordinatorContext) -> None:
        self._maybe_fail("init")
        super().init(ctx)



def test_claim_and_done_are_retried_while_the_store_is_away(harness: Harness) -> None:
    ledger = Ledger()
    coord = FlakyCoordinator(harness.coordinator("a"), {"claim": 2, "done": 3, "command": 2})
    harness.start(Consumer(coord, ledger_handler(ledger, "a"), refuse_retry=0.01))
    harness.client.submit_task(Task("patient"))
    wait_until(lambda: harness.client.get_task("patient").state is TaskState.DONE,
               message="done despite store errors")
    assert coord.calls["claim"] >= 3 and coord.calls["done"] == 4
    assert ledger.ids() == ["patient"]
    harness.client.submit_command("a", commands.freeze())
    wait_until(lambda: harness.consumers[0].frozen, message="commands flow after errors")


def test_a_store_unreachable_at_start_is_waited_for(harness: Harness) -> None:
    ledger = Ledger()
    coord = FlakyCoordinator(harness.coordinator("a"), {"init": 3})
    harness.start(Consumer(coord, ledger_handler(ledger, "a"), start_timeout=60))
    harness.client.submit_task(Task("late"))
    wait_until(lambda: harness.client.get_task("late").state is TaskState.DONE,
               message="the node registered once the store answered")
    assert coord.calls["init"] == 4


def test_a_store_unreachable_past_start_timeout_is_raised(harness: Harness) -> None:
    coord = FlakyCoordinator(harness.coordinator("a"), {"init": 1000})
    consumer = Consumer(coord, ledger_handler(Ledger(), "a"), start_timeout=0.3)
    with pytest.raises(CoordinatorUnavailable, match="store away during init"):
        consumer.run()
    assert coord.calls["init"] >= 2


def test_shutdown_ends_the_wait_for_an_unreachable_store(harness: Harness) -> None:
    coord = FlakyCoordinator(harness.coordinator("a"), {"init": 1000})
    consumer = Consumer(coord, ledger_handler(Ledger(), "a"), start_timeout=600)
    runner = threading.Thread(target=consumer.run)
    runner.start()
    wait_until(lambda: coord.calls.get("init", 0) >= 2, message="retrying")
    consumer.shutdown()
    runner.join(10)
    assert not runner.is_alive()


def test_start_timeout_zero_raises_at_once(harness: Harness) -> None:
    coord = FlakyCoordinator(harness.coordinator("a"), {"init": 1})
    with pytest.raises(CoordinatorUnavailable):
        Consumer(coord, ledger_handler(Ledger(), "a"), start_timeout=0).run()
    assert coord.calls["init"] == 1


class BrokenBalancer(Balancer):
    def __init__(self) -> None:
        self.calls = 0

    def init(self, ctx: BalancerContext) -> None:
        pass

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("balancer bug")
        return True, None

    def balance(self) -> list[str]:
        raise RuntimeError("balance bug")


def test_a_broken_balancer_is_logged_and_survived(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger()
    with caplog.at_level(logging.ERROR, logger="metafora.consumer"):
        harness.start(Consumer(harness.coordinator("a"), ledger_handler(ledger, "a"),
                               BrokenBalancer(), refuse_retry=0.01))
        harness.client.submit_task(Task("t"))
        harness.client.submit_command("a", commands.balance())
        wait_until(lambda: harness.client.get_task("t").state is TaskState.DONE,
                   message="claimed on the re-offer")
        wait_until(lambda: any("balancer failed:" in r.getMessage() for r in caplog.records),
                   message="balance error logged")
    assert any("can_claim" in r.getMessage() for r in caplog.records)


def test_stop_task_for_a_task_not_here_is_a_warning(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.start(Consumer(harness.coordinator("a"), ledger_handler(Ledger(), "a")))
    with caplog.at_level(logging.WARNING, logger="metafora.consumer"):
        harness.client.submit_command("a", commands.stop_task("elsewhere"))
        wait_until(lambda: any("not running here" in r.getMessage() for r in caplog.records),
                   message="warning logged")


def test_shutdown_from_a_signal_handler_in_the_run_thread(harness: Harness) -> None:
    ledger = Ledger()
    consumer = Consumer(harness.coordinator("a"), ledger_handler(ledger, "a", block=True))
    previous = signal.signal(signal.SIGUSR1, lambda *_: consumer.shutdown(timeout=5))

    def kill_when_running() -> None:
        wait_until(lambda: ledger.ids() == ["one"], message="task running")
        os.kill(os.getpid(), signal.SIGUSR1)

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    harness.client.submit_task(Task("one"))
    try:
        consumer.run()  # on the main thread, like a daemon's main()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    killer.join(5)
    assert harness.client.get_task("one").state is TaskState.PENDING
    assert harness.client.nodes() == []


class SlowDone(MemoryCoordinator):
    """done() blocks until the test lets it go: a done write in flight at shutdown."""

    def __init__(self, base: MemoryCoordinator) -> None:
        super().__init__(base._store, base.node_id)
        self.entered = threading.Event()
        self.go = threading.Event()

    def done(self, task: Task) -> None:
        self.entered.set()
        self.go.wait(30)
        super().done(task)


def test_shutdown_waits_for_an_outcome_being_written(harness: Harness) -> None:
    coord = SlowDone(harness.coordinator("a"))
    consumer = Consumer(coord, ledger_handler(Ledger(), "a"))
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    harness.client.submit_task(Task("finishing"))
    assert coord.entered.wait(10)
    stopper = threading.Thread(target=consumer.shutdown, kwargs={"timeout": 10}, daemon=True)
    stopper.start()
    wait_until(lambda: consumer.info()["stopping"], message="shutdown started")
    assert thread.is_alive()  # still waiting for the done write, not closing the store under it
    coord.go.set()
    stopper.join(10)
    thread.join(10)
    assert harness.client.get_task("finishing").state is TaskState.DONE


class OddClaim(MemoryCoordinator):
    """claim_many fails once with an unexpected store error (not a network fault)."""

    def __init__(self, base: MemoryCoordinator) -> None:
        super().__init__(base._store, base.node_id)
        self.failed = False

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        if not self.failed:
            self.failed = True
            raise StoreError("the store failed: odd")
        return super().claim_many(tasks, limit)


def test_an_odd_store_error_on_claim_does_not_take_the_node_down(harness: Harness) -> None:
    ledger = Ledger()
    harness.start(Consumer(OddClaim(harness.coordinator("a")), ledger_handler(ledger, "a"),
                           refuse_retry=0.01))
    harness.client.submit_task(Task("survivor"))
    wait_until(lambda: harness.client.get_task("survivor").state is TaskState.DONE,
               message="claimed on the retry")
    assert not harness.errors and harness.consumers[0].healthy()
