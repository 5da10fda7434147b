"""The Consumer on the in-memory store: claims, commands, balancing, shutdown, failures."""

from __future__ import annotations

import logging
import threading
from datetime import datetime

import pytest

from metafora import (
    Balancer,
    BalancerContext,
    Consumer,
    Handler,
    Task,
    TaskState,
    commands,
    simple_handler,
)
from metafora.consumer.running import Running, RunningMap
from metafora.contracts.balancer import SelectorKey, selector_key
from metafora.coordinators.memory import MemoryCoordinator
from metafora.core.errors import ConfigError
from metafora.testing import FakeClock
from tests.helpers import Harness, wait_until


class Ledger:
    """Records every handler run (start/end) to prove exactly-once and no overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[tuple[str, str, int]] = []  # (task, node, token)
        self.active: set[str] = set()
        self.overlaps: list[str] = []

    def start(self, task: Task, node: str) -> None:
        with self.lock:
            if task.id in self.active:
                self.overlaps.append(task.id)
            self.active.add(task.id)
            self.runs.append((task.id, node, task.token))

    def end(self, task: Task) -> None:
        with self.lock:
            self.active.discard(task.id)

    def ids(self) -> list[str]:
        with self.lock:
            return sorted(r[0] for r in self.runs)

    def nodes_of(self, task_id: str) -> list[str]:
        with self.lock:
            return [r[1] for r in self.runs if r[0] == task_id]




def ledger_handler(ledger: Ledger, node: str, *, block: bool = False,
                   result: bool = True) -> object:
    def work(task: Task, stop: threading.Event) -> bool:
        ledger.start(task, node)
        try:
            if block:
                stop.wait(30)
                return False
            return result
        finally:
            ledger.end(task)

    return simple_handler(work)


def test_two_consumers_run_fifty_tasks_exactly_once(harness: Harness) -> None:
    ledger = Ledger()
    for node in ("a", "b"):
        harness.start(Consumer(harness.coordinator(node), ledger_handler(ledger, node)))
    for i in range(50):
        harness.client.submit_task(Task(f"t{i:02d}"))
    wait_until(lambda: len(harness.client.tasks("done")) == 50, message="50 tasks done")
    assert ledger.ids() == [f"t{i:02d}" for i in range(50)]
    assert ledger.overlaps == []
    assert not harness.errors


def test_freeze_stops_claiming_and_unfreeze_resumes(harness: Harness) -> None:
    ledger = Ledger()
    a = harness.start(Consumer(harness.coordinator("a"), ledger_handler(ledger, "a")))
    harness.client.submit_command("a", commands.freeze())
    wait_until(lambda: a.frozen, message="a frozen")
    harness.client.submit_task(Task("held"))
    b = harness.start(Consumer(harness.coordinator("b"), ledger_handler(ledger, "b")))
    harness.client.submit_command("b", commands.freeze())
    wait_until(lambda: b.frozen, message="b frozen")
    harness.client.submit_task(Task("waits"))
    # Both frozen: nothing may run. The store says pending; the nodes say frozen.
    assert harness.client.get_task("waits").state is TaskState.PENDING
    harness.client.submit_command("a", commands.unfreeze())
    wait_until(lambda: harness.client.get_task("waits").state is TaskState.DONE,
               message="task runs after unfreeze")
    assert ledger.nodes_of("waits") == ["a"]
    assert ledger.nodes_of("held") in (["a"], ["b"])
    assert not a.frozen and b.frozen


def test_stop_task_moves_the_task(harness: Harness) -> None:
    ledger = Ledger()
    a = harness.start(Consumer(harness.coordinator("a"), ledger_handler(ledger, "a", block=True),
                               release_backoff=30))
    harness.client.submit_task(Task("mover"))
    wait_until(lambda: ledger.nodes_of("mover") == ["a"], message="a runs the task")
    harness.start(Consumer(harness.coordinator("b"), ledger_handler(ledger, "b", block=True)))
    harness.client.submit_command("a", commands.stop_task("mover"))
    wait_until(lambda: ledger.nodes_of("mover") == ["a", "b"], message="task moved to b")
    assert "mover" in a.ignores()
    assert ledger.overlaps == []
    info = harness.client.get_task("mover")
    assert info.owner == "b" and info.token > ledger.runs[0][2]


def test_shutdown_releases_claims_at_once(harness: Harness) -> None:
    ledger = Ledger()
    coord = harness.coordinator("a")
    consumer = Consumer(coord, ledger_handler(ledger, "a", block=True))
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    for i in range(3):
        harness.client.submit_task(Task(f"s{i}"))
    wait_until(lambda: len(consumer.tasks()) == 3, message="3 running")
    consumer.shutdown(timeout=5)
    thread.join(5)
    assert not thread.is_alive()
    assert [i.state for i in harness.client.tasks()] == [TaskState.PENDING] * 3
    assert harness.client.nodes() == []


def test_handler_exception_marks_task_failed(harness: Harness) -> None:
    def boom(task: Task, stop: threading.Event) -> bool:
        raise RuntimeError(f"cannot do {task.id}")

    harness.start(Consumer(harness.coordinator("a"), simple_handler(boom)))
    harness.client.submit_task(Task("bad"))
    info = wait_until(lambda: (i := harness.client.get_task("bad")).state is TaskState.FAILED and i,
                      message="task failed")
    assert info.error == "RuntimeError: cannot do bad"


def test_handler_func_exception_marks_task_failed(harness: Harness) -> None:
    def factory(task: Task) -> Handler:
        raise ValueError("no handler for you")

    harness.start(Consumer(harness.coordinator("a"), factory))
    harness.client.submit_task(Task("x"))
    wait_until(lambda: harness.client.get_task("x").state is TaskState.FAILED, message="failed")
    assert harness.client.get_task("x").error == "ValueError: no handler for you"


class Stubborn(Handler):
    """Ignores stop() until released by the test."""

    def __init__(self, started: threading.Event, gate: threading.Event) -> None:
        self.started, self.gate = started, gate

    def run(self) -> bool:
        self.started.set()
        self.gate.wait(30)
        return True

    def stop(self) -> None:
        pass


def test_shutdown_abandons_a_handler_that_ignores_stop(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    started, gate = threading.Event(), threading.Event()
    consumer = Consumer(harness.coordinator("a"), lambda t: Stubborn(started, gate))
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    harness.client.submit_task(Task("stubborn"))
    assert started.wait(10)
    with caplog.at_level(logging.ERROR, logger="metafora.consumer"):
        consumer.shutdown(timeout=0.2)
    thread.join(5)
    assert not thread.is_alive()
    assert any("abandoning" in r.getMessage() for r in caplog.records)
    assert harness.client.get_task("stubborn").state is TaskState.PENDING
    gate.set()  # the abandoned thread finishes; its outcome must not be written
    assert harness.client.get_task("stubborn").state is TaskState.PENDING


def test_lost_claim_stops_the_handler(harness: Harness) -> None:
    ledger = Ledger()
    coord = harness.coordinator("a")
    consumer = harness.start(Consumer(coord, ledger_handler(ledger, "a", block=True),
                                      release_backoff=30))
    harness.client.submit_task(Task("fragile"))
    wait_until(consumer.tasks, message="running")
    assert [t.id for t in coord.expire_lease()] == ["fragile"]
    wait_until(lambda: not consumer.tasks(), message="handler stopped after lost claim")
    # Lost: the consumer must not write the outcome; the task is pending for anyone.
    assert harness.client.get_task("fragile").state in (TaskState.PENDING, TaskState.CLAIMED)


def test_max_tasks_limits_concurrency(harness: Harness) -> None:
    ledger = Ledger()
    consumer = harness.start(Consumer(harness.coordinator("a"),
                                      ledger_handler(ledger, "a", block=True), max_tasks=2))
    for i in range(5):
        harness.client.submit_task(Task(f"m{i}"))
    wait_until(lambda: len(consumer.tasks()) == 2, message="two running")
    assert len(harness.client.tasks("pending")) == 3
    harness.client.submit_command("a", commands.stop_task(consumer.tasks()[0].id))
    wait_until(lambda: len(ledger.runs) == 3, message="a freed slot is refilled")
    assert len(consumer.tasks()) == 2


def test_unknown_and_malformed_commands_do_not_crash(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger()
    coord = harness.coordinator("a")
    harness.start(Consumer(coord, ledger_handler(ledger, "a")))
    with caplog.at_level(logging.WARNING):
        coord.inject_raw_command('{"command": "reboot", "parameters": {}}')
        coord.inject_raw_command("not json")
        harness.client.submit_task(Task("after"))
        wait_until(lambda: harness.client.get_task("after").state is TaskState.DONE,
                   message="node still works")
    assert any("malformed command" in r.getMessage() for r in caplog.records)


class ScriptedBalancer(Balancer):
    """Refuses the first offer of each task until a deadline; releases on request."""

    def __init__(self, refuse_for: float = 0.0) -> None:
        self.refuse_for = refuse_for
        self.refused: set[str] = set()
        self.to_release: list[str] = []
        self.balanced = threading.Event()
        self.ctx: BalancerContext | None = None

    def init(self, ctx: BalancerContext) -> None:
        self.ctx = ctx

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        assert self.ctx is not None
        if self.refuse_for and task.id not in self.refused:
            self.refused.add(task.id)
            from datetime import timedelta

            return False, self.ctx.clock.now() + timedelta(seconds=self.refuse_for)
        return True, None

    def balance(self) -> list[str]:
        out, self.to_release = self.to_release, []
        self.balanced.set()
        return out


def test_balancer_refusal_is_ignored_until_its_deadline(harness: Harness) -> None:
    clock = FakeClock()
    ledger = Ledger()
    balancer = ScriptedBalancer(refuse_for=60)
    consumer = harness.start(Consumer(harness.coordinator("a"), ledger_handler(ledger, "a"),
                                      balancer, clock=clock, balance_every=3600))
    harness.client.submit_task(Task("later"))
    wait_until(lambda: consumer.ignores() == ["later"], message="task ignored")
    clock.advance(30)
    assert harness.client.get_task("later").state is TaskState.PENDING
    clock.advance(31)
    wait_until(lambda: harness.client.get_task("later").state is TaskState.DONE,
               message="claimed after the ignore deadline")
    assert consumer.ignores() == []


def test_periodic_balance_releases_and_backs_off(harness: Harness) -> None:
    clock = FakeClock()
    ledger = Ledger()
    balancer = ScriptedBalancer()
    consumer = harness.start(Consumer(
        harness.coordinator("a"), ledger_handler(ledger, "a", block=True), balancer,
        clock=clock, balance_every=10, balance_jitter=0.0, release_backoff=5,
    ))
    harness.client.submit_task(Task("busy"))
    wait_until(consumer.tasks, message="running")
    balancer.to_release = ["busy"]
    assert not balancer.balanced.is_set()
    clock.advance(10)
    wait_until(lambda: balancer.balanced.is_set() and not consumer.tasks(),
               message="released at the balance tick")
    wait_until(lambda: consumer.ignores() == ["busy"], message="released task is backed off")
    # The back-off is set before the release is written (so the release's offer is ignored):
    # the group commit may still be writing it.
    wait_until(lambda: harness.client.get_task("busy").state is TaskState.PENDING,
               message="the release written")
    clock.advance(7)  # past the back-off (5 s +- 20 %)
    wait_until(lambda: len(ledger.runs) == 2, message="re-claimed after back-off")


def test_only_runs_that_ended_on_their_own_count_as_run_times(harness: Harness) -> None:
    clock = FakeClock()
    stopped = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        if task.id == "moved":
            stop.wait(30)
            stopped.set()
            return False
        return True

    balancer = ScriptedBalancer()
    consumer = harness.start(Consumer(
        harness.coordinator("a"), simple_handler(work), balancer,
        clock=clock, balance_every=10, balance_jitter=0.0, release_backoff=3600))
    assert balancer.ctx is not None and balancer.ctx.runs is not None
    runs = balancer.ctx.runs
    harness.client.submit_task(Task("moved"))
    wait_until(consumer.tasks, message="running")
    balancer.to_release = ["moved"]
    clock.advance(10)
    wait_until(lambda: stopped.is_set() and not consumer.tasks(), message="released")
    harness.client.submit_task(Task("ends"))  # runs to its end: its run time counts
    wait_until(lambda: harness.client.get_task("ends").state is TaskState.DONE, message="done")
    wait_until(lambda: runs.recent(3600)[0] >= 1, message="the finished run recorded")
    assert runs.recent(3600)[0] == 1  # the released run did not count
    assert not harness.errors


def test_the_balancer_context_tallies_the_selectors_of_the_running_tasks(harness: Harness) -> None:
    # What FairBalancer.balance asks on every balance instead of building the list of tasks:
    # kept as tasks start and end, it must say what that list would.
    ends = {name: threading.Event() for name in ("plain", "gpu1", "gpu2", "eu")}

    def work(task: Task, stop: threading.Event) -> bool:
        ends[task.id].wait(30)
        return True

    balancer = ScriptedBalancer()
    consumer = harness.start(Consumer(harness.coordinator("a"), simple_handler(work), balancer,
                                      labels={"gpu": "1", "zone": "eu"}, balance_every=3600))
    ctx = balancer.ctx
    assert ctx is not None

    def tallied() -> frozenset[SelectorKey] | None:
        return ctx.held_selectors()

    def listed() -> frozenset[SelectorKey]:
        return frozenset(selector_key(rt.task.selector) for rt in ctx.tasks())

    assert tallied() == frozenset()
    harness.client.submit_task(Task("plain"))
    harness.client.submit_task(Task("gpu1", selector={"gpu": "1"}))
    harness.client.submit_task(Task("gpu2", selector={"gpu": "1"}))
    harness.client.submit_task(Task("eu", selector={"zone": "eu", "gpu": "1"}))
    wait_until(lambda: len(consumer.tasks()) == 4, message="four running")
    assert tallied() == listed() == {(), (("gpu", "1"),), (("gpu", "1"), ("zone", "eu"))}
    ends["gpu1"].set()  # one of two with that selector ends: the selector is still held
    wait_until(lambda: len(consumer.tasks()) == 3, message="gpu1 ended")
    assert tallied() == listed() == {(), (("gpu", "1"),), (("gpu", "1"), ("zone", "eu"))}
    ends["gpu2"].set()
    ends["plain"].set()
    wait_until(lambda: len(consumer.tasks()) == 1, message="two more ended")
    assert tallied() == listed() == {(("gpu", "1"), ("zone", "eu"))}
    ends["eu"].set()
    wait_until(lambda: not consumer.tasks(), message="all ended")
    assert tallied() == listed() == frozenset()
    assert not harness.errors


def test_the_running_map_keeps_its_selector_tally_through_every_change() -> None:
    def entry(task_id: str, selector: dict[str, str] | None = None) -> Running:
        return Running(Task(task_id, selector=selector or {}), simple_handler(lambda t, s: True)(
            Task(task_id)), datetime(2030, 1, 1))

    gpu: SelectorKey = (("gpu", "1"),)
    running = RunningMap()
    running["a"] = entry("a")
    running["g"] = entry("g", {"gpu": "1"})
    running["g"] = entry("g", {"zone": "eu"})  # replaced: the old entry's selector goes
    assert running.selectors() == {(), (("zone", "eu"),)}
    running.update({"h": entry("h", {"gpu": "1"})})
    running |= {"i": entry("i", {"gpu": "1"})}
    assert running.setdefault("j", entry("j")).task.id == "j"
    assert running.selectors() == {(), (("zone", "eu"),), gpu}
    del running["h"]
    assert running.pop("i").task.id == "i" and running.pop("nope", None) is None
    assert running.selectors() == {(), (("zone", "eu"),)}
    running.popitem()  # j: "a" is still plain
    assert running.selectors() == {(), (("zone", "eu"),)}
    with pytest.raises(KeyError):
        del running["nope"]
    with pytest.raises(KeyError):
        running.pop("nope")
    running.clear()
    assert running.selectors() == frozenset() and len(running) == 0


def test_balance_command_runs_the_balancer_even_when_frozen(harness: Harness) -> None:
    ledger = Ledger()
    balancer = ScriptedBalancer()
    consumer = harness.start(Consumer(harness.coordinator("a"),
                                      ledger_handler(ledger, "a", block=True), balancer,
                                      release_backoff=60))
    harness.client.submit_task(Task("x"))
    wait_until(consumer.tasks, message="running")
    harness.client.submit_command("a", commands.freeze())
    balancer.to_release = ["x"]
    harness.client.submit_command("a", commands.balance())
    wait_until(lambda: harness.client.get_task("x").state is TaskState.PENDING,
               message="balance released x")
    assert consumer.frozen


def test_run_twice_and_shutdown_before_run(harness: Harness) -> None:
    consumer = Consumer(harness.coordinator("lazy"), ledger_handler(Ledger(), "lazy"))
    consumer.shutdown()
    with pytest.raises(RuntimeError):
        consumer.run()


def test_bad_arguments_are_config_errors(harness: Harness) -> None:
    coord = harness.coordinator("x")
    with pytest.raises(ConfigError):
        Consumer(coord, ledger_handler(Ledger(), "x"), max_tasks=0)
    with pytest.raises(ConfigError):
        Consumer(coord, ledger_handler(Ledger(), "x"), balance_every=-1)
    with pytest.raises(ConfigError):
        Consumer("memory://nope", ledger_handler(Ledger(), "x"))  # type: ignore[arg-type]


class BrokenWatch(MemoryCoordinator):
    def watch(self, out: object) -> None:
        raise RuntimeError("watch exploded")


def test_a_dead_watch_stops_the_consumer(harness: Harness) -> None:
    base = harness.coordinator("w")
    coord = BrokenWatch(base._store, "w")
    consumer = Consumer(coord, ledger_handler(Ledger(), "w"))
    with pytest.raises(RuntimeError, match="watch exploded"):
        consumer.run()
    assert harness.client.nodes() == []


def test_duplicate_node_id_is_refused(harness: Harness) -> None:
    harness.start(Consumer(harness.coordinator("same"), ledger_handler(Ledger(), "same")))
    from metafora.core.errors import NodeExists

    with pytest.raises(NodeExists):
        Consumer(harness.coordinator("same"), ledger_handler(Ledger(), "same")).run()
