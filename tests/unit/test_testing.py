"""The fake clock: waits end when fake time reaches their deadline, never by sleeping."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from metafora.testing import FakeClock


def test_advance_moves_both_clocks() -> None:
    clock = FakeClock()
    start, mono = clock.now(), clock.monotonic()
    clock.advance(timedelta(seconds=90))
    assert clock.now() - start == timedelta(seconds=90)
    assert clock.monotonic() - mono == 90
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_wait_returns_at_fake_deadline_without_setting_the_event() -> None:
    clock = FakeClock()
    event = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(clock.wait(event, 10)))
    waiter.start()
    assert clock.wait_for_waiters(1)
    clock.advance(9)
    assert waiter.is_alive()
    clock.advance(1)
    waiter.join(5)
    assert result == [False] and not event.is_set()


def test_wait_returns_when_event_set() -> None:
    clock = FakeClock()
    event = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(clock.wait(event, None)))
    waiter.start()
    assert clock.wait_for_waiters(1)
    event.set()
    waiter.join(5)
    assert result == [True] and clock.waiters() == 0
    assert clock.wait(event, 0) is True
    assert clock.wait(threading.Event(), 0) is False


def test_file_ledger_finds_overlaps_and_counts(tmp_path: object) -> None:
    import os

    from metafora import Task
    from metafora.testing import FileLedger

    ledger = FileLedger(os.path.join(str(tmp_path), "ledger.jsonl"))
    assert ledger.runs() == []
    a, b = Task("t", {}, 1), Task("t", {}, 2)
    ledger.start(a, "n1")
    ledger.end(a, "n1", "release")
    ledger.start(b, "n2")
    ledger.end(b, "n2", "done")
    assert ledger.overlaps() == [] and ledger.completed() == {"t": 1}
    c = Task("u", {}, 3)
    ledger.start(c, "dead")          # killed: no end
    ledger.start(Task("u", {}, 4), "n2")
    assert len(ledger.overlaps()) == 1
    assert ledger.overlaps(died={"dead": 0.0}) == []


def test_the_pytest11_entry_point_names_the_plugin_in_metafora_testing() -> None:
    import configparser
    import importlib
    from pathlib import Path

    from metafora import testing
    from metafora.testing import pytest_plugin

    hooks = {n for n in dir(pytest_plugin) if n.startswith("pytest_")}
    assert {"pytest_addoption", "pytest_configure", "pytest_generate_tests"} <= hooks
    assert testing.FakeClock is importlib.import_module("metafora.testing.clock").FakeClock
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).parents[2] / "setup.cfg")
    entry = setup["options.entry_points"]["pytest11"].strip()
    assert entry == "metafora = metafora.testing.pytest_plugin"
