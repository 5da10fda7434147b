"""A node joining its store: ``Coordinator.init``, waiting for a store that cannot be reached.

A node starting beside a store that is restarting, or overloaded, waits for it (up to the
consumer's ``start_timeout``) instead of exiting. A retried attempt that meets ``NodeExists``
goes on retrying too: the attempt that seemed to fail may have registered this node, and that
registration expires with its lease.
"""

from __future__ import annotations

import random
import threading

from metafora.clock import Clock
from metafora.consumer.running import NodeLog
from metafora.coordinator import Coordinator, CoordinatorContext
from metafora.errors import CoordinatorUnavailable, MetaforaError, NodeExists
from metafora.masking import mask_url

__all__ = ["register"]


def register(coordinator: Coordinator, ctx: CoordinatorContext, *, start_timeout: float,
             stopping: threading.Event, clock: Clock, rng: random.Random, log: NodeLog) -> bool:
    """``coordinator.init(ctx)``, retried with back-off for up to ``start_timeout`` seconds
    while the store is unreachable. False when ``stopping`` was set first; the last error
    when the time is up."""
    deadline = clock.monotonic() + start_timeout
    pause = 0.1
    retried = False
    while True:
        try:
            coordinator.init(ctx)
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
