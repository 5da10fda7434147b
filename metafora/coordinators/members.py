"""What balancers learn of the live nodes besides their counts: weights, capacities and
frozen flags.

A node publishes its weight (``Consumer(weight=...)``), its capacity (the most tasks it can
run now; see ``context_capacity``) and whether it is frozen with its registration.
:class:`~metafora.contracts.balancer.ClusterState` answers them through ``node_weights()``,
``node_capacities()`` and ``frozen_nodes()``, which a balancer asks right after
``active_task_count()``: a store answers them all from the SAME read by keeping what the
count read saw in a :class:`SeenWithCounts`, so a balancer pays no extra round trip.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from metafora.core.node import DEFAULT_WEIGHT, capacity_or_none, check_weight, weight_or_none

__all__ = [
    "SEEN_CLOCK",
    "SEEN_MAX_AGE",
    "SeenWithCounts",
    "context_capacity",
    "context_weight",
    "stored_capacity",
    "stored_weight",
]

log = logging.getLogger(__name__)

SEEN_MAX_AGE = 1.0
"""Seconds the weights and frozen set a count read saw answer the next ask (then read again)."""

SEEN_CLOCK: Callable[[], float] = time.monotonic
"""The monotonic clock :data:`SEEN_MAX_AGE` is counted on by a :class:`SeenWithCounts` made
without one (every store's). Read when one is made: a test sets a fake clock's ``monotonic``
here first, so that a slow moment between a count read and the asks after it (a loaded
machine) does not turn the asks into reads of their own."""


def context_weight(ctx: object) -> float:
    """The weight a coordinator context asks its node to publish (1.0 when it says none).

    ``getattr``: a context written before weights existed need not have the property.
    Raises :class:`~metafora.core.errors.ConfigError` for a weight that is not a positive number.
    """
    return check_weight(getattr(ctx, "weight", DEFAULT_WEIGHT), "weight")


def context_capacity(ctx: object) -> int | None:
    """The capacity a coordinator context asks its node to publish now: the most tasks it can
    run (None: no bound, or a context that does not say). Read at each heartbeat, so it is
    cheap; a value that is not a non-negative integer is taken as no bound."""
    return capacity_or_none(getattr(ctx, "capacity", None))


def stored_capacity(value: Any) -> int | None:
    """A capacity as read from the store (None: no bound, and for anything not a
    non-negative integer, which only a write around metafora leaves)."""
    return capacity_or_none(value)


def stored_weight(value: Any, node_id: str) -> float:
    """A weight as read from the store: 1.0 when missing, and when damaged (written around
    metafora: not a positive finite number), which is logged."""
    if value is None:
        return DEFAULT_WEIGHT
    weight = weight_or_none(value)
    if weight is not None:
        return weight
    log.warning("stored weight of node %r is not a positive number (%r): taken as 1.0",
                node_id, value)
    return DEFAULT_WEIGHT


class SeenWithCounts:
    """The weights, frozen nodes and claimable count the last count read saw, for the next
    ``node_weights()``, ``frozen_nodes()`` and ``claimable_count()`` (each answered once from
    it, within :data:`SEEN_MAX_AGE`).

    A store whose count read returns them too records them here (:meth:`seen`); the calls
    that follow it take them (:meth:`weights`, :meth:`frozen`) instead of reading again.
    None: nothing recent, read it. Thread-safe.
    """

    def __init__(self, max_age: float = SEEN_MAX_AGE,
                 monotonic: Callable[[], float] | None = None) -> None:
        self._max_age = max_age
        self._monotonic = SEEN_CLOCK if monotonic is None else monotonic
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[float, Any]] = {}  # what -> (when seen, value)

    def seen(self, weights: Mapping[str, float], frozen: frozenset[str],
             claimable: int | None = None, capacities: Mapping[str, int] | None = None) -> None:
        """What a read of the live nodes returned (``claimable``: the tasks claimable, when the
        read counted them too; ``capacities``: the nodes' published capacities)."""
        now = self._monotonic()
        kept = {"weights": dict(weights), "frozen": frozen, "claimable": claimable,
                "capacities": None if capacities is None else dict(capacities)}
        with self._lock:
            self._kept = {what: (now, value) for what, value in kept.items() if value is not None}

    def _take(self, what: str) -> Any:
        """``what`` as the last read saw it, once and while recent; else None."""
        with self._lock:
            seen = self._kept.pop(what, None)
        if seen is None or self._monotonic() - seen[0] > self._max_age:
            return None
        return seen[1]

    def capacities(self) -> dict[str, int] | None:
        """The capacities seen by the last read, once and while recent; else None."""
        found: dict[str, int] | None = self._take("capacities")
        return found

    def claimable(self) -> int | None:
        """The claimable count seen by the last read, once and while recent; else None."""
        found: int | None = self._take("claimable")
        return found

    def weights(self) -> dict[str, float] | None:
        """The weights seen by the last read, once and while recent; else None."""
        found: dict[str, float] | None = self._take("weights")
        return found

    def frozen(self) -> frozenset[str] | None:
        """The frozen nodes seen by the last read, once and while recent; else None."""
        found: frozenset[str] | None = self._take("frozen")
        return found
