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
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ETCD_FENCING", "SQL_FENCING", "Fencing"]


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
