"""Counters and histograms a consumer keeps about itself (no third-party dependency).

:mod:`metafora.http` renders them in Prometheus text format through prometheus_client.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

__all__ = ["DEFAULT_BUCKETS", "ConsumerStats", "Histogram", "HistogramSnapshot"]

DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def incr(self, name: str, by: int = 1) -> None:
        """Add ``by`` (one) to the counter ``name``."""
        with self._lock:
            setattr(self, name, getattr(self, name) + by)

    def counters(self) -> dict[str, int]:
        """A consistent copy of the counters."""
        with self._lock:
            return {n: getattr(self, n) for n in _COUNTERS}
