"""``Flag``: the cheap set-once event every running task carries (returned, finished)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from metafora.consumer.running import Flag


def test_a_flag_wakes_every_waiter_and_stays_set() -> None:
    flag = Flag()
    assert not flag.is_set()
    assert flag.wait(0.01) is False  # times out while unset
    woke: list[bool] = []
    ready = threading.Barrier(5)

    def waiter() -> None:
        ready.wait(10)
        woke.append(flag.wait(30))

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    ready.wait(10)
    flag.set()
    flag.set()  # again: nothing happens
    for t in threads:
        t.join(30)
    assert woke == [True] * 4
    assert flag.is_set() and flag.wait(0) and flag.wait()


def _race(flag: Flag) -> list[BaseException]:
    """Two setters and two waiters at once; the errors any of them raised."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,))
               for f in (flag.set, flag.set, lambda: flag.wait(30), lambda: flag.wait(30))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_racing_setters_and_waiters_never_raise_or_hang() -> None:
    for _ in range(200):
        flag = Flag()
        assert _race(flag) == []
        assert flag.wait(0)
