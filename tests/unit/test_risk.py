"""The claim-at-risk warning rule (metafora.consumer.risk), on a fake clock.

A lease is simulated by its last good renewal on a FakeClock: renewals every
``renew_every`` while they succeed, none (hanging or failing) once the store goes away.
The rule must warn strictly before the fence, once per episode, earlier when a renewal is
reported failed, never while renewals succeed, and say "recovered" when one gets through;
``next_look`` must predict the warning point, so one timer per node suffices.
Also: the state machine's at-risk notice (memory store) and what tasks carry.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.consumer.risk import Change, RiskEpisode, RiskRule
from metafora.coordinators.etcd.config import ETCD_FENCING
from metafora.coordinators.memory import MemoryCoordinator, drop_store
from metafora.coordinators.sql.options import SQL_FENCING
from metafora.core.leases import LeaseTiming
from metafora.statemachine import AsyncCommands, Commands, Message, MessageKind, StateCode, handler_func
from metafora.statemachine.aio import AsyncStatefulTaskHandler
from metafora.testing import FakeClock, RecordingContext
from tests.helpers import wait_until

SQL_TTL = 3.0
SQL = LeaseTiming(renew_every=SQL_TTL / 3, fence_after=SQL_FENCING.fence_after(SQL_TTL))
ETCD = LeaseTiming(renew_every=2 / 3, fence_after=ETCD_FENCING.fence_after(2))


class Lease:
    """A node's lease on a fake clock: time left to the fence since the last good renewal."""

    def __init__(self, clock: FakeClock, timing: LeaseTiming) -> None:
        self.clock = clock
        self.timing = timing
        self.renewed_at = clock.monotonic()

    def left(self) -> float:
        return max(0.0, self.renewed_at + self.timing.fence_after - self.clock.monotonic())

    def renew(self) -> None:
        self.renewed_at = self.clock.monotonic()


def _run(timing: LeaseTiming, *, outage: tuple[float, float], failing: bool,
         until: float, step: float = 0.01) -> list[tuple[float, Change, float]]:
    """Step a lease (renewing on time except during ``outage``, retrying every 0.1 s in it)
    and the rule; the changes as (time, change, left). ``failing``: renewals in the outage
    are reported failed (a frozen store's just hang)."""
    clock = FakeClock()
    lease = Lease(clock, timing)
    episode = RiskEpisode(RiskRule(timing))
    start = clock.monotonic()
    changes: list[tuple[float, Change, float]] = []
    next_renew = start + timing.renew_every
    reported = False
    fenced = False
    while clock.monotonic() - start < until:
        clock.advance(step)
        now = clock.monotonic() - start
        if not fenced and clock.monotonic() >= next_renew:
            if outage[0] <= now < outage[1]:  # fails (or hangs): retried soon, as the leases do
                reported = failing
                next_renew = clock.monotonic() + 0.1
            else:
                lease.renew()
                reported = False
                next_renew = clock.monotonic() + timing.renew_every
        left = lease.left()
        if left == 0.0:
            fenced = True
        change = episode.step(left, reported)
        if change is not None:
            changes.append((now, change, left))
    return changes


@pytest.mark.parametrize("timing", [SQL, ETCD], ids=["sql", "etcd"])
def test_no_warning_while_renewals_succeed(timing: LeaseTiming) -> None:
    assert _run(timing, outage=(0.0, 0.0), failing=False, until=30.0) == []


@pytest.mark.parametrize("timing", [SQL, ETCD], ids=["sql", "etcd"])
@pytest.mark.parametrize("failing", [False, True], ids=["frozen", "cut-off"])
def test_warns_once_before_the_fence(timing: LeaseTiming, failing: bool) -> None:
    changes = _run(timing, outage=(1.5, 99.0), failing=failing, until=10.0)
    assert [c for _, c, _ in changes] == [Change.WARN, Change.LOST]
    (warned, _, left), (lost, _, _) = changes
    # A failure reported warns as the due renewal fails; a hanging one at half the slack.
    expected = timing.slack if failing else timing.slack / 2
    assert left == pytest.approx(expected, abs=0.02)
    assert lost - warned == pytest.approx(expected, abs=0.03)
    assert left > 0.0  # strictly before the fence


@pytest.mark.parametrize("failing", [False, True], ids=["frozen", "cut-off"])
def test_recovered_when_a_renewal_gets_through(failing: bool) -> None:
    # The store is back before the fence: one warning, one recovery, no loss.
    back = 1.0 + SQL.renew_every + SQL.slack * 0.75
    changes = _run(SQL, outage=(1.5, back), failing=failing, until=10.0)
    assert [c for _, c, _ in changes] == [Change.WARN, Change.RECOVERED]
    assert changes[1][2] > SQL.slack


def test_next_look_predicts_the_warning() -> None:
    """One timer per node: sleeping ``next_look`` seconds lands on the warning point."""
    clock = FakeClock()
    lease = Lease(clock, SQL)
    episode = RiskEpisode(RiskRule(SQL))
    looks = 0
    while True:
        change = episode.step(lease.left(), False)
        looks += 1
        if change is not None:
            break
        wait = episode.next_look(lease.left(), False)
        assert wait is not None
        clock.advance(wait + 0.001)
    assert change is Change.WARN
    assert looks == 2  # the first look after the renewal, then the warning point
    assert lease.left() == pytest.approx(SQL.slack / 2, abs=0.002)
    assert episode.next_look(lease.left(), False) == pytest.approx(lease.left())  # the fence
    clock.advance(lease.left())
    assert episode.step(lease.left(), False) is Change.LOST
    assert episode.next_look(0.0, False) is None


def test_rule_points() -> None:
    rule = RiskRule(SQL)
    assert SQL.slack == pytest.approx(1.0)
    assert rule.warn_left(True) == pytest.approx(1.0)
    assert rule.warn_left(False) == pytest.approx(0.5)
    assert not rule.at_risk(0.0, True)  # fenced already: no warning
    assert rule.at_risk(0.9, True) and not rule.at_risk(0.9, False)
    odd = LeaseTiming(renew_every=2.0, fence_after=1.0)  # renewing slower than fencing
    assert odd.slack == pytest.approx(0.1)


def test_a_task_carries_no_claim_unless_a_consumer_handed_it_out() -> None:
    task = Task("t1", {"a": 1}, 3)
    assert task.valid_until() is None
    assert task.at_risk() is False
    assert pickle.loads(pickle.dumps(task)) == task


# -- the state machine's notice --------------------------------------------------------------


@pytest.fixture
def coord() -> Iterator[MemoryCoordinator]:
    url = f"memory://risk-{uuid.uuid4().hex[:8]}"
    with open_client(url) as client:
        client.submit_task(Task("t1"))
    coordinator = open_coordinator(url, node_id="a")
    assert isinstance(coordinator, MemoryCoordinator)
    coordinator.init(RecordingContext())
    yield coordinator
    coordinator.close()
    drop_store(url.removeprefix("memory://"))


def test_stateful_handler_is_asked_for_a_checkpoint_once(coord: MemoryCoordinator) -> None:
    clock = FakeClock()
    waiting = threading.Event()
    seen: list[Message | None] = []
    risk: list[object] = []

    def step(task: Task, cmds: Commands) -> Message:
        page = int(cmds.cursor or 0)
        waiting.set()
        message = cmds.get()  # blocks until the notice
        seen.append(message)
        risk.append(cmds.at_risk)
        assert message is not None and message.kind is MessageKind.CHECKPOINT
        cmds.checkpoint(str(page + 7))  # the answer: save the position
        seen.append(cmds.poll())  # once per episode: nothing more
        return Message.complete()

    task = coord.claim(Task("t1"))
    assert task is not None
    machine = handler_func(step, coord, clock=clock, poll_interval=0.02)(task)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(machine.run()))
    thread.start()
    assert waiting.wait(10)
    until = clock.now() + timedelta(seconds=1)
    machine.at_risk(until)  # type: ignore[union-attr]
    thread.join(10)
    assert result == [True]
    assert seen[1] is None and risk == [until]
    state = machine.state  # type: ignore[union-attr]
    assert state.code is StateCode.COMPLETED and state.cursor == "7"
    machine.recovered(until)  # type: ignore[union-attr]
    assert wait_until(lambda: machine.risk_until is None, 1)  # type: ignore[union-attr]


def test_async_stateful_handler_is_asked_for_a_checkpoint(coord: MemoryCoordinator) -> None:
    waiting = threading.Event()
    seen: list[Message | None] = []

    async def step(task: Task, cmds: AsyncCommands) -> Message:
        waiting.set()
        message = await cmds.get()  # waits until the notice
        seen.append(message)
        await cmds.checkpoint("42")
        seen.append(await cmds.get(timeout=0.05))  # once per episode: a timeout now
        return Message.complete()

    task = coord.claim(Task("t1"))
    assert task is not None
    handler = handler_func(step, coord, poll_interval=0.02)(task)
    assert isinstance(handler, AsyncStatefulTaskHandler)
    result: list[bool] = []
    loop = asyncio.new_event_loop()

    def run() -> None:
        result.append(loop.run_until_complete(handler.run()))

    thread = threading.Thread(target=run)
    thread.start()
    assert waiting.wait(10)
    until = datetime.now(UTC) + timedelta(seconds=1)
    loop.call_soon_threadsafe(handler.at_risk, until)  # as the consumer calls it: on the loop
    thread.join(10)
    loop.close()
    assert result == [True]
    assert seen[0] is not None and seen[0].kind is MessageKind.CHECKPOINT and seen[1] is None
    assert handler.machine.state is not None and handler.machine.state.cursor == "42"
