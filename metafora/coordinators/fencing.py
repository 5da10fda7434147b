"""When a node stops its handlers: the self-fencing rule of every store with leases.

A node renews its lease every ``lease_ttl / 3``. The store keeps the lease for ``lease_ttl``
from when it *received* the renewal (etcd's leader) or stamped it (SQL: the database clock),
both later than when the node sent it. So a node that counts from the *start* of its last
good renewal, on its own monotonic clock, and stops its handlers ``margin`` seconds before
``lease_ttl`` has passed, stops them before the store lets anyone else claim their tasks;
the handlers get at least ``margin`` seconds to notice ``stop()``.

That is the one rule (:meth:`Fencing.fence_after`); the stores differ only in the margin
they give handlers, named here once each:

- :data:`SQL_FENCING`: a third of the TTL (the node fences at ``2/3 * lease_ttl``).
- :data:`ETCD_FENCING`: a quarter of the TTL, at least half a second (``lease_ttl`` is a
  whole number of seconds >= 2 there, so the floor counts at 2 s only).

The memory store has no lease to lose by the clock (``claim_time_left`` is None; a lost
lease is simulated by ``expire_lease``): it has no fencing rule.

Two optional seams serve the claim-at-risk warnings (:mod:`metafora.consumer.risk`): a
store with leases has ``lease_timing()`` (a :class:`LeaseTiming`), and tells its context of
every failed renewal through :func:`report_renewal_failure` (a context without the
``renewal_failed`` hook is left alone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["ETCD_FENCING", "SQL_FENCING", "Fencing", "LeaseTiming", "report_renewal_failure"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fencing:
    """The self-fencing rule with a store's margin: ``max(floor, lease_ttl * share)``."""

    share: float
    """The part of the TTL handlers get to stop."""
    floor: float = 0.0
    """The least margin, in seconds, whatever the TTL."""

    def margin(self, lease_ttl: float) -> float:
        """Seconds before the lease could expire at which the node stops its handlers."""
        return max(self.floor, lease_ttl * self.share)

    def fence_after(self, lease_ttl: float) -> float:
        """Seconds after the start of the last good renewal at which the node self-fences."""
        return lease_ttl - self.margin(lease_ttl)


SQL_FENCING = Fencing(share=1 / 3)
"""The SQL stores' margin: a third of the TTL."""

ETCD_FENCING = Fencing(share=1 / 4, floor=0.5)
"""etcd's margin: a quarter of the TTL, at least half a second."""


@dataclass(frozen=True)
class LeaseTiming:
    """When a node renews its lease and when it fences, in seconds after the start of its
    last good renewal (what a store with leases answers to ``lease_timing()``)."""

    renew_every: float
    """Seconds between renewals."""
    fence_after: float
    """Seconds after the start of the last good renewal at which the node self-fences."""

    @property
    def slack(self) -> float:
        """Seconds between the next renewal falling due and the fence (``fence_after -
        renew_every``; at least a tenth of ``fence_after`` for odd settings)."""
        return max(self.fence_after - self.renew_every, self.fence_after / 10)


def report_renewal_failure(ctx: object, error: BaseException) -> None:
    """Tell ``ctx`` (a coordinator context) that a renewal of the node's lease failed.

    Calls its optional ``renewal_failed(error)`` hook (the consumer's warns handlers early);
    a context without one is left alone, and a hook that raises is logged.
    """
    hook = getattr(ctx, "renewal_failed", None)
    if hook is None:
        return
    try:
        hook(error)
    except Exception:
        log.exception("the renewal_failed hook raised")
