"""metafora.core.heap: the collector paused around bulk work, nested and across threads; paced
while consumers run."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from metafora.core.heap import BULK, DEFAULT, STEADY, gc_paced, gc_paused


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_pauses_and_restores() -> None:
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_small_work_does_not_pause() -> None:
    with gc_paused(BULK - 1):
        assert gc.isenabled()
    with gc_paused(BULK):
        assert not gc.isenabled()


def test_nested_pauses_end_with_the_outermost() -> None:
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_process_turned_off_stays_off() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_restored_after_an_error() -> None:
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("bulk work failed")
    assert gc.isenabled()


def test_overlapping_pauses_of_two_threads() -> None:
    """The first thread's pause ends while the second's lasts: still paused; on when both end."""
    entered, second_may_end = threading.Event(), threading.Event()

    def second() -> None:
        with gc_paused():
            entered.set()
            second_may_end.wait(30)

    thread = threading.Thread(target=second)
    with gc_paused():
        thread.start()
        assert entered.wait(30)
    assert not gc.isenabled()  # the other thread's pause still holds
    second_may_end.set()
    thread.join(30)
    assert gc.isenabled()


@pytest.fixture
def _default_thresholds() -> Iterator[None]:
    was = gc.get_threshold()
    gc.set_threshold(*DEFAULT)
    yield
    gc.set_threshold(*was)


@pytest.mark.usefixtures("_default_thresholds")
def test_paced_while_consumers_run_and_the_defaults_back_after_the_last() -> None:
    with gc_paced():
        assert gc.get_threshold() == STEADY
        with gc_paced():  # a second consumer of the process
            assert gc.get_threshold() == STEADY
        assert gc.get_threshold() == STEADY  # the first still runs
    assert gc.get_threshold() == DEFAULT
    with pytest.raises(RuntimeError), gc_paced():
        raise RuntimeError("the consumer failed")
    assert gc.get_threshold() == DEFAULT


@pytest.mark.usefixtures("_default_thresholds")
def test_thresholds_the_process_chose_are_left_alone() -> None:
    gc.set_threshold(5000, 20, 20)
    with gc_paced():
        assert gc.get_threshold() == (5000, 20, 20)
    assert gc.get_threshold() == (5000, 20, 20)
    gc.set_threshold(*DEFAULT)
    with gc_paced():
        gc.set_threshold(1000, 10, 10)  # changed by the process meanwhile: kept
    assert gc.get_threshold() == (1000, 10, 10)


def test_a_consumer_runs_paced(tmp_path: Any) -> None:
    """Consumer.run paces the collector for its run (the thresholds as its handler sees them)."""
    from metafora import Consumer, Task, open_client, open_coordinator, simple_handler

    url = f"sqlite:///{tmp_path / 'pace.db'}"
    seen: list[tuple[int, int, int]] = []
    ran = threading.Event()
    with open_client(url) as client:
        client.submit_task(Task("t1"))
    was = gc.get_threshold()
    gc.set_threshold(*DEFAULT)
    try:
        def run(task: Task, stop: threading.Event) -> bool:
            seen.append(gc.get_threshold())
            ran.set()
            return True

        consumer = Consumer(open_coordinator(url, node_id="n1"), simple_handler(run))
        runner = threading.Thread(target=consumer.run)
        runner.start()
        try:
            assert ran.wait(30)
        finally:
            consumer.shutdown()
            runner.join(30)
        assert not runner.is_alive()
        assert seen == [STEADY]
        assert gc.get_threshold() == DEFAULT
    finally:
        gc.set_threshold(*was)
