"""One node per offer: a fresh offer is tried first by the one node rendezvous hashing ranks
first for it, and by the others only if it is still unclaimed after a short delay.

Every node hears every offer (a submit's notification, a release, a lease that expired). If
every node raced for each one, a claim would cost one lost race per other node: store round
trips and CPU growing with the cluster (Metafora's thundering herd). Instead each node ranks
the offer over the live members it knows (:meth:`Preference.mine`: the same ranking on every
node, no messages, no store read) and

- tries it at once when it ranks first (the lowest latency, as when every node raced);
- otherwise holds it back for a short delay (:class:`OfferDelay`: twice the p99 of this node's
  recent claim latencies, clamped to ``[MIN_DELAY, MAX_DELAY]``) and then tries it like any
  offer that waited (narrowed to the still claimable where the store tells cheaply, one read
  for all that fell due together): a task is never left waiting longer than 1.5 times the
  delay (300 ms at most) because the node ranked first is dead, full, frozen, refusing, or only
  believed live by a stale view. Offers held within one half-delay fall due together (the
  hold is the delay to 1.5 times it), so a stream of single offers costs each other node one
  check per half-delay, not one per offer. A node leaving ends every hold at once. A
  task tried after its hold is not held again for a while (it is the others' turn).

Offers with placement (a selector, ``prefer`` or ``spread``: their own hold-back applies) and a
node alone are not held. A node's offers waiting for a free slot are taken its own first
(:class:`~metafora.consumer.offer_queues.Deferred`), so a full cluster drains each node's own
share in parallel and races only at the tail. Nothing here touches the store; the consumer's
loop owns it (not thread-safe).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from metafora.consumer.offer_queues import Deferred
from metafora.consumer.preference import Preference
from metafora.core.task import Task

__all__ = ["MAX_DELAY", "MIN_DELAY", "FirstOffers", "OfferDelay"]

MIN_DELAY = 0.01  # seconds: below it a loaded machine's scheduling would make every hold a race
MAX_DELAY = 0.2  # seconds: with its half-delay window, a full, frozen or dead first node keeps a
# task waiting 300 ms at most
START_DELAY = 0.05  # until a few claims were timed
_SAMPLES = 128  # claim latencies kept for the p99
_MIN_SAMPLES = 8
_FORGET = 60.0  # seconds a task tried after its hold is not held again


class OfferDelay:
    """The hold of an offer left to another node: twice the p99 of the last claim
    latencies this node observed, clamped (adaptive and bounded)."""

    def __init__(self) -> None:
        self._samples: list[float] = []
        self._next = 0  # ring position
        self._value = START_DELAY
        self._stale = 0  # samples noted since the value was computed

    def note(self, seconds: float) -> None:
        """One claim took ``seconds`` (its round trip to the store)."""
        if len(self._samples) < _SAMPLES:
            self._samples.append(seconds)
        else:
            self._samples[self._next] = seconds
            self._next = (self._next + 1) % _SAMPLES
        self._stale += 1

    @property
    def seconds(self) -> float:
        """The current delay (recomputed at most once per 16 claims: a sort of 128)."""
        if self._stale and len(self._samples) >= _MIN_SAMPLES and (
                self._stale >= 16 or len(self._samples) < _SAMPLES):
            ordered = sorted(self._samples)
            p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
            self._value = min(MAX_DELAY, max(MIN_DELAY, 2 * p99))
            self._stale = 0
        return self._value


class FirstOffers:
    """The offers this node leaves to the node ranked first for them, until their delay."""

    def __init__(self, ranking: Preference, delay: OfferDelay | None = None) -> None:
        self._ranking = ranking
        self.delay = delay if delay is not None else OfferDelay()
        self._heap: list[tuple[float, int, Task]] = []  # (due, order, task)
        self._held: set[str] = set()  # ids in the heap (an offer heard again is held once)
        self._order = 0
        self._tried: dict[str, float] = {}  # id -> when it was tried after its hold
        self._tried_order: deque[tuple[float, str]] = deque()  # (when, id), oldest first
        self._adopted: set[str] = set()  # checked still open after their hold: anyone's now
        self.held_total = 0  # offers ever held back (a counter for tests and probes)

    def __len__(self) -> int:
        return len(self._heap)

    def own(self, task: Task) -> bool:
        """Whether ``task`` is this node's to try first (ranked first, or not ranked at all:
        placement, or a node alone)."""
        if task.selector or task.prefer or task.spread is not None or self._ranking.alone:
            return True
        return task.id in self._adopted or self._ranking.mine(task.id)

    def others(self, taken: list[Task], deferred: Deferred, chunk: int) -> tuple[list[Task], list[Task]]:
        """``taken`` (from ``deferred``) split into this node's own and the others'; with any of
        the others', more of them from ``deferred`` up to ``chunk``: most were claimed by their
        first node while they waited here, and a chunk is checked in one read."""
        own = [t for t in taken if self.own(t)]
        if len(own) == len(taken):
            return own, []
        others = [t for t in taken if not self.own(t)]
        return own, others + deferred.take(chunk - len(others), own=False)

    def adopt(self, tasks: Sequence[Task]) -> None:
        """``tasks`` waited their hold and a check found them still open: this node takes them
        as its own (deferred among its own, not checked again at each free slot)."""
        self._adopted.update(t.id for t in tasks)

    def split(self, offers: Sequence[Task], now: float) -> list[Task]:
        """The offers to try now, in order; the others' are held back for the delay."""
        if self._ranking.alone or not offers:
            return list(offers)
        self._forget(now)
        out: list[Task] = []
        due = None
        for task in offers:
            if task.id in self._tried or self.own(task):
                out.append(task)
                continue
            if task.id in self._held:  # heard again (a notification, then a scan): held once
                continue
            self._held.add(task.id)
            if due is None:  # the end of the half-delay window after the delay: (D, 1.5 D]
                step = self.delay.seconds / 2
                due = (math.floor(now / step) + 3) * step
            self._order += 1
            heapq.heappush(self._heap, (due, self._order, task))
            self.held_total += 1
        return out

    def _forget(self, now: float) -> None:
        """Forget the tasks tried (and adopted) more than _FORGET ago, oldest first: a task
        offered again later (released, rebalanced) is its first node's again, and the record
        stays bounded by the tries of the last _FORGET seconds (no rebuild per offer)."""
        order = self._tried_order
        while order and now - order[0][0] >= _FORGET:
            when, task_id = order.popleft()
            if self._tried.get(task_id) == when:  # not tried again since
                del self._tried[task_id]
                self._adopted.discard(task_id)

    def due(self, now: float) -> list[Task]:
        """The held offers whose delay passed (highest priority first)."""
        out: list[Task] = []
        while self._heap and self._heap[0][0] <= now:
            task = heapq.heappop(self._heap)[2]
            self._held.discard(task.id)
            self._tried[task.id] = now
            self._tried_order.append((now, task.id))
            out.append(task)
        out.sort(key=lambda t: -t.priority)
        return out

    def next_due(self) -> float | None:
        """When :meth:`due` returns something next (None: nothing is held)."""
        return self._heap[0][0] if self._heap else None

    def flush(self, now: float) -> None:
        """A node left: every held offer is due now (some were left to it)."""
        if self._heap:
            self._heap = [(now, order, task) for _, order, task in self._heap]
            heapq.heapify(self._heap)
