"""What the consumer's parts share: one small value instead of a dozen loose arguments.

Every part of :class:`~metafora.consumer.Consumer` (the offer router, the finisher, the
handoffs, the rebalancer, the launcher, the status, the shutdown, the risk watch) reads the
same store, options, running map and its lock, stop flags, stats, clock, randomness and log;
the consumer builds one :class:`PartsContext` and hands it to each. A part's constructor then
names only what is its own (the balancer, the capacity, another part), so no part reaches
into the consumer's private attributes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from metafora.consumer.events import Event
from metafora.consumer.options import ConsumerOptions
from metafora.consumer.running import NodeLog, RunningMap
from metafora.contracts.coordinator import Coordinator
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.metrics import ConsumerStats

__all__ = ["PartsContext"]


@dataclass(frozen=True)
class PartsContext:
    """The consumer's shared state, as its parts see it (the parts never rebind a field)."""

    coordinator: Coordinator
    """The node's store."""
    options: ConsumerOptions
    """The consumer's options, checked once."""
    log: NodeLog
    """The node's logger (every record carries the node id)."""
    post: Callable[[Event], None]
    """Puts an event on the consumer's loop and wakes it."""
    running: RunningMap = field(default_factory=RunningMap)
    """The tasks running on this node, by id; read and changed under ``lock``."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Guards ``running`` and what the parts keep beside it."""
    stopping: threading.Event = field(default_factory=threading.Event)
    """Set once the consumer shuts down: claim nothing more."""
    wake: threading.Event = field(default_factory=threading.Event)
    """Wakes the consumer's loop before its next deadline."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the consumer stopped."""
    stats: ConsumerStats = field(default_factory=ConsumerStats)
    """The node's counters and histograms (``/metrics``)."""
    clock: Clock = SYSTEM_CLOCK
    """Time, injectable (see :mod:`metafora.testing`)."""
    rng: random.Random = field(default_factory=random.Random)
    """Randomness, injectable (jitter, shuffles)."""

    @property
    def node_id(self) -> str:
        """This node's id (the coordinator's)."""
        return self.coordinator.node_id
