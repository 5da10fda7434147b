"""The in-process dispatcher of pushed task commands: mailboxes read the store only when rung."""

from __future__ import annotations

import threading
from collections import Counter, deque

from metafora.statemachine.mailbox import CommandBell, Mailbox
from tests.helpers import wait_until


class Store:
    """A fake queue per task with counters of the calls the bell makes (store I/O)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[str, deque[str]] = {}
        self.takes: Counter[str] = Counter()
        self.looks = 0

    def put(self, task_id: str, raw: str) -> None:
        with self.lock:
            self.queues.setdefault(task_id, deque()).append(raw)

    def take(self, task_id: str, token: int | None) -> str | None:
        with self.lock:
            self.takes[task_id] += 1
            queue = self.queues.get(task_id)
            return queue.popleft() if queue else None

    def pending_ids(self) -> set[str]:
        with self.lock:
            self.looks += 1
            return {task_id for task_id, queue in self.queues.items() if queue}


def _bell(store: Store, safety: float = 3600.0) -> CommandBell:
    return CommandBell("test", store.take, store.pending_ids, safety)


def test_a_mailbox_looks_once_on_opening_then_only_when_rung() -> None:
    store = Store()
    store.put("t1", "queued-before-the-claim")
    bell = _bell(store)
    box = bell.new_mailbox("t1", 7)
    assert box.receive(0) == "queued-before-the-claim"
    assert box.receive(0) is None
    takes = store.takes["t1"]
    for _ in range(100):
        assert box.receive(0) is None
    assert store.takes["t1"] == takes  # no I/O while nothing arrived
    store.put("t1", "a")
    store.put("t1", "b")
    bell.ring("t1")
    assert [box.receive(0), box.receive(0), box.receive(0)] == ["a", "b", None]
    box.close()


def test_a_ring_wakes_a_blocked_receive() -> None:
    store = Store()
    bell = _bell(store)
    box = bell.new_mailbox("t1", 1)
    assert box.receive(0) is None
    got: list[str | None] = []
    waiter = threading.Thread(target=lambda: got.append(box.receive(None)), daemon=True)
    waiter.start()
    store.put("t1", "kill")
    bell.ring("t1")
    waiter.join(10)
    assert got == ["kill"]
    box.close()


def test_interrupt_and_close_end_a_blocked_receive_without_a_command() -> None:
    bell = _bell(Store())
    box = bell.new_mailbox("t1", 1)
    assert box.receive(0) is None
    got: list[str | None] = []
    waiter = threading.Thread(target=lambda: got.append(box.receive(None)), daemon=True)
    waiter.start()
    box.interrupt()
    waiter.join(10)
    assert got == [None]
    waiter = threading.Thread(target=lambda: got.append(box.receive(None)), daemon=True)
    waiter.start()
    box.close()
    waiter.join(10)
    assert got == [None, None]


def test_listeners_hear_rings_and_interrupts() -> None:
    bell = _bell(Store())
    box = bell.new_mailbox("t1", 1)
    heard: list[str] = []
    box.add_listener(lambda: heard.append("x"))
    bell.ring("t1")
    bell.ring("other")  # not this mailbox
    box.interrupt()
    assert heard == ["x", "x"]
    box.close()


def test_the_safety_net_is_one_look_per_node_not_one_per_task() -> None:
    store = Store()
    bell = _bell(store, safety=0.05)
    boxes = [bell.new_mailbox(f"t{i}", 1) for i in range(200)]
    for box in boxes:
        assert box.receive(0) is None  # the one look on opening
    store.put("t3", "pause")  # queued without a notification (a lost NOTIFY)
    wait_until(lambda: boxes[3].ready, 10, message="the safety net rang t3")
    assert boxes[3].receive(0) == "pause"
    looks = store.looks
    assert looks >= 1
    assert all(store.takes[f"t{i}"] == 1 for i in range(200) if i != 3)
    for box in boxes:
        box.close()
    wait_until(lambda: bell.open_count() == 0 and bell._thread is None, 10,
               message="the safety loop ends with the last mailbox")


def test_a_recheck_looks_at_once() -> None:
    store = Store()
    bell = _bell(store)  # the periodic net is an hour away
    box = bell.new_mailbox("t1", 1)
    assert box.receive(0) is None
    store.put("t1", "run")
    bell.recheck()
    wait_until(lambda: box.ready, 10, message="the recheck")
    assert box.receive(0) == "run"
    box.close()


def test_a_mailbox_without_push_looks_again_every_poll_interval() -> None:
    store = Store()
    box = Mailbox("t1", 1, store.take, poll_every=0.05)
    assert box.receive(0) is None
    store.put("t1", "pause")  # nobody rings: the fallback must look by itself
    got: list[str | None] = []
    wait_until(lambda: got.append(box.receive(0)) or got[-1] == "pause", 10,
               message="a polled look")
    store.put("t1", "run")
    assert box.receive(10) == "run"
    box.close()
