"""A node joining its store: ``Coordinator.init``, waiting for a store that cannot be reached.

A node starting beside a store that is restarting, or overloaded, waits for it (up to the
consumer's ``start_timeout``) instead of exiting. A retried attempt that meets ``NodeExists``
goes on retrying too: the attempt that seemed to fail may have registered this node, and that
registration expires with its lease.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from metafora.consumer.capacity import Capacity
from metafora.consumer.context import PartsContext
from metafora.consumer.handoff import Handoffs
from metafora.consumer.risk import RiskWatch
from metafora.contracts.coordinator import CoordinatorContext
from metafora.core import tracing
from metafora.core.errors import CoordinatorUnavailable, MetaforaError, NodeExists
from metafora.core.masking import mask_url
from metafora.core.task import Task

__all__ = ["NodeContext", "register"]


class NodeContext(CoordinatorContext):
    """What the store is told of this node and tells it back (the coordinator's
    :class:`~metafora.contracts.coordinator.CoordinatorContext`), answered by the consumer's parts."""

    def __init__(self, ctx: PartsContext, *, handoffs: Handoffs, risk: RiskWatch, capacity: Capacity) -> None:
        self._ctx, self._handoffs, self._risk, self._capacity = ctx, handoffs, risk, capacity

    def lost(self, task: Task) -> None:
        """A claim of this node was lost (its handler is told, its task let go)."""
        self._handoffs.lost(task)

    @property
    def logger(self) -> logging.Logger:
        """The store's logger for this node."""
        return logging.getLogger("metafora.coordinator").getChild(self._ctx.node_id)

    def renewed(self, seconds: float) -> None:
        """The node's lease was renewed, taking ``seconds``."""
        self._ctx.stats.renewal_latency.observe(seconds)
        tracing.record_renewal(self._ctx.node_id, seconds)
        self._risk.renewed()

    def renewal_failed(self, error: BaseException) -> None:
        """A renewal of the node's lease failed (the optional hook of
        :mod:`metafora.core.leases`): its handlers may be warned early."""
        self._risk.failed(error)

    @property
    def max_crashes(self) -> int | None:
        """The crash limit the store applies (None: off)."""
        return self._ctx.options.crash_limit

    @property
    def labels(self) -> Mapping[str, str]:
        """This node's placement labels (a copy)."""
        return dict(self._ctx.options.labels)

    @property
    def weight(self) -> float:
        """This node's weight."""
        return self._ctx.options.weight

    @property
    def capacity(self) -> int | None:
        """How many tasks this node may run at once now (None: no bound)."""
        return self._capacity.limit()


def register(node: NodeContext, ctx: PartsContext) -> bool:
    """``coordinator.init(node)``, retried with back-off for up to the ``start_timeout``
    option while the store is unreachable. False when ``stopping`` was set first; the last
    error when the time is up."""
    coordinator, clock, rng, log, stopping = ctx.coordinator, ctx.clock, ctx.rng, ctx.log, ctx.stopping
    start_timeout = ctx.options.start_timeout
    deadline = clock.monotonic() + start_timeout
    pause = 0.1
    retried = False
    while True:
        try:
            coordinator.init(node)
            return True
        except CoordinatorUnavailable as exc:
            error: MetaforaError = exc
        except NodeExists as exc:
            if not retried:
                raise
            error = exc
        left = deadline - clock.monotonic()
        if left <= 0:
            raise error
        log.warning("cannot register on %s yet (%s); retrying for up to %.0fs",
                    mask_url(coordinator.name, brief=True), error, left, extra={"action": "start"})
        if clock.wait(stopping, min(pause * rng.uniform(0.8, 1.2), left)):
            return False
        pause = min(pause * 2, 5.0)
        retried = True
