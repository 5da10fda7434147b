"""Tick computation, the missed-tick policy and validation of metafora.consumer.schedule (no store),
and the Scheduler loop on the memory store driven by a fake clock."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from metafora import open_client, open_coordinator
from metafora.consumer.schedule import Scheduler
from metafora.coordinators.memory import drop_store
from metafora.core.durations import format_duration, whole_seconds
from metafora.core.errors import ConfigError, InvalidProps, InvalidTaskId
from metafora.core.schedule_model import (
    LATE_AFTER,
    MAX_CATCH_UP,
    Schedule,
    due,
    new_schedule,
    tick_id,
)
from metafora.testing import FakeClock, wait_for

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


def every(seconds: int, missed: str = "skip", cursor: datetime = T0) -> Schedule:
    return Schedule("s", seconds, None, {}, missed, False, cursor)


def cron(expr: str, missed: str = "skip", cursor: datetime = T0) -> Schedule:
    return Schedule("s", None, expr, {}, missed, False, cursor)


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("5m", 300), ("1h", 3600), ("1d", 86400),
                                               (" 2m ", 120), (7, 7), (timedelta(minutes=2), 120)])
def test_parse_duration(text: object, seconds: int) -> None:
    assert whole_seconds(text, "a schedule period") == seconds


@pytest.mark.parametrize("bad", ["", "5", "5 minutes", "1.5s", "0s", 0, -3, True, 1.5,
                                 timedelta(seconds=1.5)])
def test_parse_duration_refuses(bad: object) -> None:
    with pytest.raises(ConfigError):
        whole_seconds(bad, "a schedule period")


def test_format_duration() -> None:
    assert [format_duration(s) for s in (30, 90, 300, 3600, 86400, 172800)] == \
        ["30s", "90s", "5m", "1h", "1d", "2d"]


def test_every_ticks_at_multiples_of_the_period_since_the_epoch() -> None:
    s = every(300)
    assert s.next_tick(T0) == T0 + timedelta(minutes=5)
    assert s.next_tick(T0 + timedelta(seconds=1)) == T0 + timedelta(minutes=5)
    assert s.next_tick(T0 - timedelta(microseconds=1)) == T0
    assert s.last_tick(T0 + timedelta(minutes=7)) == T0 + timedelta(minutes=5)
    assert s.last_tick(T0) == T0


def test_cron_ticks_in_utc() -> None:
    s = cron("*/15 * * * *")
    assert s.next_tick(T0) == T0 + timedelta(minutes=15)
    assert s.next_tick(T0 + timedelta(seconds=30)) == T0 + timedelta(minutes=15)
    assert s.last_tick(T0 + timedelta(minutes=20)) == T0 + timedelta(minutes=15)
    assert s.last_tick(T0 + timedelta(minutes=15)) == T0 + timedelta(minutes=15)
    assert s.last_tick(T0 + timedelta(minutes=15, microseconds=500)) == T0 + timedelta(minutes=15)


def test_tick_ids() -> None:
    assert tick_id("report", T0 + timedelta(minutes=5)) == "report@2030-01-01T12:05:00Z"


def test_nothing_is_due_before_the_first_tick_or_while_paused() -> None:
    s = every(60)
    assert due(s, T0 + timedelta(seconds=59)) is None
    paused = Schedule("s", 60, None, {}, "skip", True, T0)
    assert due(paused, T0 + timedelta(hours=1)) is None


def test_on_time_ticks_are_all_made_whatever_the_policy() -> None:
    for policy in ("skip", "once", "all"):
        found = due(every(1, policy), T0 + timedelta(seconds=5.5))
        assert found is not None
        assert found.ticks == [T0 + timedelta(seconds=k) for k in range(1, 6)]
        assert found.cursor == T0 + timedelta(seconds=5) and found.dropped == 0


def test_missed_skip_drops_the_old_ticks_and_makes_the_recent_ones() -> None:
    now = T0 + timedelta(hours=1, seconds=30)
    found = due(every(60, "skip"), now)
    assert found is not None
    # 12:01 .. 13:00 are older than LATE_AFTER (30 s); 13:00:00 is exactly 30 s old: missed.
    assert found.ticks == []
    assert found.dropped == 60
    assert found.cursor == T0 + timedelta(hours=1)
    found = due(every(60, "skip"), T0 + timedelta(hours=1, seconds=10))
    assert found is not None and found.ticks == [T0 + timedelta(hours=1)] and found.dropped == 59


def test_missed_once_makes_one_task_for_the_latest_missed_tick() -> None:
    now = T0 + timedelta(hours=1, seconds=45)
    found = due(every(60, "once"), now)
    assert found is not None
    assert found.ticks == [T0 + timedelta(hours=1)] and found.dropped == 59
    assert found.cursor == T0 + timedelta(hours=1)


def test_missed_all_makes_each_missed_tick_up_to_the_bound() -> None:
    found = due(every(60, "all"), T0 + timedelta(minutes=10, seconds=45))
    assert found is not None
    assert found.ticks == [T0 + timedelta(minutes=k) for k in range(1, 11)] and found.dropped == 0
    found = due(every(1, "all"), T0 + timedelta(hours=1))
    assert found is not None
    late_edge = T0 + timedelta(hours=1) - LATE_AFTER
    missed = [t for t in found.ticks if t <= late_edge]
    assert len(missed) == MAX_CATCH_UP and missed[-1] == late_edge
    assert found.dropped == 3600 - 30 - MAX_CATCH_UP
    assert found.ticks == sorted(found.ticks) and found.cursor == T0 + timedelta(hours=1)


def test_missed_all_with_cron_is_bounded_too() -> None:
    found = due(cron("* * * * *", "all"), T0 + timedelta(days=1))
    assert found is not None
    assert len(found.ticks) == MAX_CATCH_UP + 1  # 100 missed, 1 on time (the last one)
    assert found.dropped >= 1


def test_ten_seconds_from_a_clock_started_before_the_cursor_can_hold_nine_ticks() -> None:
    # Issue 24's conformance flake had a second cause: its fake clock started a moment before
    # the store stamped the schedule's cursor; with a second boundary in between, ten
    # advances of 1 s reached nine ticks, not ten. Starting fake time at the cursor gives ten.
    cursor = T0 + timedelta(seconds=0.2)
    started_before = T0 - timedelta(seconds=0.3)
    found = due(every(1, cursor=cursor), started_before + timedelta(seconds=10))
    assert found is not None and len(found.ticks) == 9
    found = due(every(1, cursor=cursor), cursor + timedelta(seconds=10))
    assert found is not None and found.ticks == [T0 + timedelta(seconds=k) for k in range(1, 11)]


def test_new_schedule_validates() -> None:
    s = new_schedule("job", every="5m", props={"a": 1}, now=T0)
    assert (s.every, s.cron, s.cursor, s.paused) == (300, None, T0, False)
    assert new_schedule("job", cron="0 * * * *", now=T0).cron == "0 * * * *"
    with pytest.raises(ConfigError, match=r"unknown cron syntax '61 \* \* \* \*'"):
        new_schedule("job", cron="61 * * * *", now=T0)
    with pytest.raises(ConfigError, match="exactly one"):
        new_schedule("job", now=T0)
    with pytest.raises(InvalidTaskId):
        new_schedule("", every="5m", now=T0)
    with pytest.raises(InvalidProps):
        new_schedule("job", every="5m", props={"x": "y" * (1024 * 1024 + 1)}, now=T0)
    with pytest.raises(ConfigError, match=r"'0 0 31 2 \*' never matches a date"):
        new_schedule("job", cron="0 0 31 2 *", now=T0)
    with pytest.raises(InvalidProps, match="must not set expires_at"):
        new_schedule("job", every="5m", props={"expires_at": "2031-01-01T00:00:00Z"}, now=T0)
    with pytest.raises(InvalidProps, match="JSON object"):
        new_schedule("job", every="5m", props=[1], now=T0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="missed"):
        new_schedule("job", every="5m", missed="some", now=T0)


def test_scheduler_on_memory_makes_each_tick_once_and_wakes_on_a_push() -> None:
    clock = FakeClock(T0 + timedelta(seconds=0.5))
    url = "memory://sched-unit"
    drop_store("sched-unit/default")
    client = open_client(url, clock=clock)
    coords = [open_coordinator(url, f"n{i}", clock=clock) for i in range(3)]
    schedulers = [Scheduler(c, clock) for c in coords]
    threads = [threading.Thread(target=s.run, daemon=True) for s in schedulers]
    try:
        for t in threads:
            t.start()
        assert clock.wait_for_waiters(3)
        client.add_schedule("m", every="2s", props={"x": 1})  # pushed: no need to wait 30 s
        for _ in range(20):
            clock.advance(1.0)
            wait_for(lambda: clock.waiters() >= 3, timeout=30, what="schedulers idle")
        wait_for(lambda: len(client.tasks()) == 10, timeout=30, what="10 ticks")
        ids = [i.id for i in client.tasks()]
        assert ids == [tick_id("m", T0 + timedelta(seconds=2 * k)) for k in range(1, 11)]
        assert sum(s.made for s in schedulers) == 10
        client.pause_schedule("m")
        clock.advance(10.0)
        wait_for(lambda: clock.waiters() >= 3, timeout=30, what="schedulers idle")
        assert len(client.tasks()) == 10
    finally:
        for s in schedulers:
            s.stop()
        for t in threads:
            t.join(10)
        for c in coords:
            c.close()
        client.close()
        drop_store("sched-unit/default")


def test_a_schedule_that_cannot_be_evaluated_is_skipped_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(T0)
    drop_store("sched-broken/default")
    client = open_client("memory://sched-broken", clock=clock)
    coord = open_coordinator("memory://sched-broken", "n1", clock=clock)
    store = coord._store  # type: ignore[attr-defined]
    with store.cond:  # a row written around metafora: cron croniter refuses
        store.schedule_changed(Schedule("bad", None, "not a cron", {}, "skip", False, T0), "bad")
    client.add_schedule("good", every="1s")
    scheduler = Scheduler(coord, clock)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    try:
        thread.start()
        assert clock.wait_for_waiters(1)
        clock.advance(1.0)
        wait_for(lambda: len(client.tasks()) == 1, timeout=30, what="the good schedule's tick")
        assert thread.is_alive()
        assert [i.id for i in client.tasks()] == [tick_id("good", T0 + timedelta(seconds=1))]
        assert "schedule bad cannot be evaluated" in caplog.text
    finally:
        scheduler.stop()
        thread.join(10)
        coord.close()
        client.close()
        drop_store("sched-broken/default")
