"""A node's lease: the rules every store shares; each store states its own bounds.

**The TTL.** ``lease_ttl`` (a store URL option, seconds) is read by one rule,
:func:`read_lease_ttl`, within the bounds (a :class:`LeaseTTL`) that each store states on its
backend object (:attr:`metafora.contracts.backends.StoreBackend.lease_ttl`):

==========  =======  =========  =============  =====================================
store       default  least      most           why
==========  =======  =========  =============  =====================================
``sql``     30       1          86,400         SQLite and PostgreSQL: any seconds
``etcd``    30       2          (none)         whole seconds; etcd's least TTL ~1.5 s
``memory``  30       0.1        (none)         accepted for parity, not used
==========  =======  =========  =============  =====================================

**Renewal.** A node renews its lease every ``lease_ttl / 3`` (:func:`renew_every`), on
every store with leases.

**Fencing.** The store keeps the lease for ``lease_ttl``
from when it *received* the renewal (etcd's leader) or stamped it (SQL: the database clock),
both later than when the node sent it. So a node that counts from the *start* of its last
good renewal, on its own monotonic clock, and stops its handlers ``margin`` seconds before
``lease_ttl`` has passed, stops them before the store lets anyone else claim their tasks;
the handlers get at least ``margin`` seconds to notice ``stop()``.

That is the one rule (:meth:`Fencing.fence_after`); the stores differ only in the margin
they give handlers, each stating its own (:attr:`metafora.contracts.backends.StoreBackend.fencing`):

- SQL: a third of the TTL (the node fences at ``2/3 * lease_ttl``).
- etcd: a quarter of the TTL, at least half a second (``lease_ttl`` is a whole number of
  seconds >= 2 there, so the floor counts at 2 s only).

The memory store has no lease to lose by the clock (``claim_time_left`` is None; a lost
lease is simulated by ``expire_lease``): it has no fencing rule.

Two optional seams serve the claim-at-risk warnings (:mod:`metafora.consumer.risk`): a
store with leases has ``lease_timing()`` (a :class:`LeaseTiming`), and tells its context of
every failed renewal through :func:`report_renewal_failure` (a context without the
``renewal_failed`` hook is left alone).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Final

from metafora.core.config import OptionReader
from metafora.core.errors import ConfigError

__all__ = [
    "RENEWALS_PER_TTL",
    "Fencing",
    "LeaseTTL",
    "LeaseTiming",
    "read_lease_ttl",
    "renew_every",
    "report_renewal_failure",
]

log = logging.getLogger("metafora.leases")  # its name before the move (users' log config names it)


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


RENEWALS_PER_TTL: Final = 3
"""How many times a node renews its lease in one ``lease_ttl``."""


def renew_every(lease_ttl: float) -> float:
    """Seconds between a node's lease renewals: a third of ``lease_ttl``."""
    return lease_ttl / RENEWALS_PER_TTL


@dataclass(frozen=True)
class LeaseTTL:
    """A store's bounds on ``lease_ttl`` (a row of the table in the module docstring)."""

    minimum: float
    maximum: float | None = None
    whole: bool = False
    """Whole seconds only (etcd grants leases in whole seconds)."""
    default: float = 30.0


def read_lease_ttl(reader: OptionReader, bounds: LeaseTTL, store: str) -> float:
    """The ``lease_ttl`` option of a store URL within the ``bounds`` of the store named
    ``store``, its default when absent; ConfigError naming the bound it breaks."""
    ttl = reader.number("lease_ttl", bounds.default, minimum=bounds.minimum, maximum=bounds.maximum)
    if bounds.whole and ttl != math.floor(ttl):
        raise ConfigError(f"option 'lease_ttl' must be a whole number of seconds for {store}, got {ttl:g}")
    return ttl


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
