"""metafora.core.heap: the collector paused around bulk work, nested and across threads."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from metafora.core.heap import BULK, gc_paused


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
