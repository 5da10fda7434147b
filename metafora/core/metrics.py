"""Counters and histograms a consumer keeps about itself (no third-party dependency).

:mod:`metafora.consumer.http` renders them in Prometheus text format through prometheus_client.
"""

from __future__ import annotations

import bisect
import enum
import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["DEFAULT_BUCKETS", "GATE_BUCKETS", "ConsumerStats", "GateOutcome", "GateStats", "Histogram",
           "HistogramSnapshot", "StatsUser"]

DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Buckets of ``metafora_gate_item_seconds``: an item may be an HTTP call of many seconds."""


@dataclass(frozen=True)
class HistogramSnapshot:
    """Cumulative bucket counts (``le`` upper bounds, +Inf last), total count and sum."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    total: float


class Histogram:
    """A thread-safe fixed-bucket histogram of seconds."""

    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self._bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Record one observation."""
        with self._lock:
            self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        """A consistent copy with cumulative counts."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return HistogramSnapshot(tuple(cumulative), running, total)


class GateOutcome(enum.Enum):
    """The ``outcome`` label of ``metafora_gate_items_total`` (a fixed, small set)."""

    DONE = "done"
    """The processor answered (the item completed, or moved to a higher gate)."""
    FAILED = "failed"
    """The item failed: a permanent error, or its retries ran out."""
    RETRIED = "retried"
    """An attempt failed with a retryable error and the item is tried again."""


class GateStats:
    """What the gate handlers of a node count: items by outcome and the seconds each item
    took, from its first attempt to its outcome (a batch: the batch's call, for each of its
    items). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items = dict.fromkeys(GateOutcome, 0)
        self.item_seconds = Histogram(GATE_BUCKETS)

    def count(self, outcome: GateOutcome, by: int = 1) -> None:
        """Add ``by`` items of ``outcome``."""
        with self._lock:
            self._items[outcome] += by

    def items(self) -> dict[GateOutcome, int]:
        """A consistent copy of the item counts, every outcome present."""
        with self._lock:
            return dict(self._items)


_COUNTERS = ("claims", "releases", "done", "failed", "lost", "races_lost")


@dataclass
class ConsumerStats:
    """What a consumer counts: every claim, release, done, failure, lost claim and lost race."""

    claims: int = 0
    releases: int = 0
    done: int = 0
    failed: int = 0
    lost: int = 0
    races_lost: int = 0  # offers tried and not won (another node took them first)
    balance_turns: int = 0  # periodic and membership balance turns, run or skipped (frozen)
    claim_latency: Histogram = field(default_factory=Histogram)
    renewal_latency: Histogram = field(default_factory=Histogram)
    gates: GateStats | None = None  # set when the node runs gated partitions (StatsUser)
    loop_errors: dict[str, int] = field(default_factory=dict)
    """Errors of each background loop (``prune``, ``schedules``...): logged, retried, counted."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def loop_error(self, loop: str) -> None:
        """Count one error of the background loop ``loop``."""
        with self._lock:
            self.loop_errors[loop] = self.loop_errors.get(loop, 0) + 1

    def loop_error_counts(self) -> dict[str, int]:
        """A consistent copy of :attr:`loop_errors`."""
        with self._lock:
            return dict(self.loop_errors)

    def incr(self, name: str, by: int = 1) -> None:
        """Add ``by`` (one) to the counter ``name``."""
        with self._lock:
            setattr(self, name, getattr(self, name) + by)

    def counters(self) -> dict[str, int]:
        """A consistent copy of the counters."""
        with self._lock:
            return {n: getattr(self, n) for n in _COUNTERS}


@runtime_checkable
class StatsUser(Protocol):
    """A handler func that counts into the consumer's stats: the consumer calls
    :meth:`attach_stats` once, before any task runs (the older hook:
    :class:`~metafora.contracts.binding.BindsToNode` gives the stats too)."""

    def attach_stats(self, stats: ConsumerStats) -> None:
        """Count into ``stats`` from now on."""
        ...
