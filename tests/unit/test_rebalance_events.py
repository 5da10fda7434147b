"""Event-driven balancing in the consumer (issue 15 item 4), on the memory store and a fake
clock: a burst of joins makes one balance within the dampening window, then one settling
balance, and nothing more until ``balance_every``."""

from __future__ import annotations

import threading
from datetime import datetime

from metafora import Task, simple_handler
from metafora.contracts.balancer import Balancer, BalancerContext
from metafora.testing import FakeClock, LocalCluster, wait_for


class Counting(Balancer):
    """Claims everything, releases nothing; counts balances and remembers membership calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.balances = 0
        self.seen: set[str] = set()
        self.lefts = 0
        self.ctx: BalancerContext | None = None

    def init(self, ctx: BalancerContext) -> None:
        self.ctx = ctx

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        return True, None

    def balance(self) -> list[str]:
        with self.lock:
            self.balances += 1
        return []

    def nodes_changed(self, left: bool) -> None:
        assert self.ctx is not None
        seen = set(self.ctx.cluster_state.active_task_count())
        with self.lock:
            self.seen = seen
            self.lefts += left

    def count(self) -> int:
        with self.lock:
            return self.balances


def idle(stop: threading.Event) -> bool:
    stop.wait(60)
    return False


def test_a_burst_of_joins_coalesces_into_one_balance_then_one_settling_balance() -> None:
    clock = FakeClock()
    counting = Counting()
    with LocalCluster() as cluster:
        a = cluster.add(simple_handler(lambda task, stop: idle(stop)), "a", counting,
                        balance_every=3600, balance_jitter=0.0, rebalance_window=10, clock=clock)
        # a's loop waits on the fake clock once it listens (joins before that are in its
        # first view of the cluster, not events).
        assert clock.wait_for_waiters(1, timeout=30)
        for node in ("b", "c", "d"):
            cluster.add(simple_handler(lambda task, stop: idle(stop)), node)
        wait_for(lambda: counting.seen == {"a", "b", "c", "d"}, 30, "a to see the three joins")
        assert counting.count() == 0  # dampened: nothing yet
        clock.advance(10)  # the window (5-10 s) has passed: one balance for the whole burst
        wait_for(lambda: counting.count() == 1, 30, "one balance")
        clock.advance(30)  # the settling balance (20-30 s after it)
        wait_for(lambda: counting.count() == 2, 30, "the settling balance")
        # and then only the timer: the next balance is balance_every away
        wait_for(lambda: a._balancing.next_balance - clock.monotonic() > 3000, 30, "the timer re-armed")
        assert counting.count() == 2
        assert counting.lefts == 0
        cluster.stop(cluster.consumers[-1])  # d leaves
        wait_for(lambda: counting.seen == {"a", "b", "c"}, 30, "a to see d leave")
        assert counting.lefts == 1
        clock.advance(10)
        wait_for(lambda: counting.count() == 3, 30, "a balance after the leave")
