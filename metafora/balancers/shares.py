"""Fair shares: how much of the work each node should hold, and who gives back what.

Pure arithmetic over one snapshot of the cluster (no store, no clock, no lock), so every node
that reads the same counts computes the same plan, and the rules can be checked on their own.

**The share rule.** The work a node can run is what its *peers* hold plus what is claimable:
the peers of a task are the active nodes whose labels match its selector (every active node
for a task without one); frozen and leaving nodes are not active and do not count, neither
in the work nor among those sharing it. A node's *exact* share is that work times its weight
over its peers' total weight; its **share** is the exact share rounded up::

    share = ceil((held + claimable) * weight / total weight)

which, unweighted, is ``ceil((held + claimable) / peers)``. Rounding up means the shares add
up to at least the work (nothing is left without a taker) and a node with a weight gets a
share of at least one task as soon as there is any work; it overshoots by less than one task
per node. A claim may go ``slack`` tasks above the share.

**Capacity.** A node that cannot run more than ``capacity`` tasks (its ``max_tasks``, its
thread cap, or a capacity reduced after a failed start, as it publishes them) gets at most
that as its exact share, and the rest of the work is split among the others in proportion to
their weights (water-filling): so a full node is not *under-loaded* for want of a share it
cannot take, and nobody gives tasks back for it.

**Even, under, over.** A node is *even* when it holds within ``band`` of its exact share
(``exact * (1 - band) <= held <= exact * (1 + band)``) or within one task of it. A node is
*under-loaded* when it is not even and holds less than its exact share divided by the
threshold; it is *overloaded* (the old rule) when it holds more than the threshold times its
exact share.

**The release plan** ("balance from both sides", :func:`release_plan`): an overloaded node
gives back down to ``max(ceil(threshold * exact), share)`` as before; and when that does not
cover what the under-loaded nodes miss to reach their share (rounded down), the nodes holding
more than their exact share give back the rest, in proportion to that surplus and never below
their exact share rounded down (so they stay even). Only as many tasks move as fill the
under-loaded nodes: the fewest moves, and once they moved nobody is under-loaded and no node
holds more than it gave back down to, so the next plan moves nothing (no ping-pong).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from metafora.core.errors import ConfigError
from metafora.core.node import check_capacity, check_weight, finite_number
from metafora.core.task import matches

__all__ = [
    "DEFAULT_BAND",
    "EPS",
    "MAX_THRESHOLD",
    "Member",
    "ReleasePlan",
    "Standing",
    "capped_shares",
    "ceil_share",
    "check_band",
    "check_threshold",
    "exact_shares",
    "fair_share",
    "peers",
    "release_plan",
    "shares",
    "standings",
]

DEFAULT_BAND = 0.1  # a node within 10 % of its share is even (issue 28's target)
EPS = 1e-9  # float slack: 1.1 * 10 is 11.000000000000002, which must not round up to 12


def ceil_share(value: float) -> int:
    """``math.ceil`` that forgives float noise (11.000000000000002 -> 11), never below 0."""
    return max(0, math.ceil(value - EPS))


MAX_THRESHOLD = 10.0  # a ratio: 120 is surely meant as a percentage (1.2)


def check_threshold(value: object, name: str = "threshold") -> float:
    """``value`` as a float if it is a number from 1.0 to :data:`MAX_THRESHOLD`, else
    :class:`ConfigError` (a threshold is a ratio to the share: 1.2 is 20 % above it)."""
    number = finite_number(value)
    if number is None or not 1.0 <= number <= MAX_THRESHOLD:
        raise ConfigError(f"{name} must be a number from 1.0 to {MAX_THRESHOLD:g} (a ratio to "
                          f"the fair share: 1.2 is 20 % above it), got {value!r}")
    return number


def check_band(value: object, name: str = "band") -> float:
    """``value`` as a float if it is a number in [0, 1), else :class:`ConfigError`."""
    number = finite_number(value)
    if number is None or not 0.0 <= number < 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1), got {value!r}")
    return number


@dataclass(frozen=True)
class Member:
    """One node as a balancer sees it: what it holds, its weight, labels, whether it counts.

    ``labels`` None means unknown (a node that just joined): it is taken as able to run any
    task. ``active`` is False for a node that is frozen or leaving: it takes no work, so it
    is neither a peer nor part of the work.
    """

    node_id: str
    held: int
    weight: float = 1.0
    labels: Mapping[str, str] | None = field(default=None, compare=False)
    active: bool = True
    capacity: int | None = None  # the most tasks it can run (None: no bound)

    def __post_init__(self) -> None:
        if not isinstance(self.held, int) or isinstance(self.held, bool) or self.held < 0:
            raise ConfigError(f"held must be a non-negative integer, got {self.held!r}")
        object.__setattr__(self, "weight", check_weight(self.weight))
        if self.capacity is not None:
            object.__setattr__(self, "capacity", check_capacity(self.capacity))




def peers(members: Iterable[Member], selector: Mapping[str, str] | None = None) -> list[Member]:
    """The active members that could run a task with ``selector`` (all active ones if none)."""
    return [m for m in members if m.active
            and (not selector or m.labels is None or matches(selector, m.labels))]


def exact_shares(total: float, weights: Mapping[str, float]) -> dict[str, float]:
    """``total`` split in proportion to ``weights`` (each checked positive), unrounded."""
    checked = {node: check_weight(w) for node, w in weights.items()}
    whole = sum(checked.values())
    return {node: total * w / whole for node, w in checked.items()}


def shares(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """``total`` tasks split in proportion to ``weights``, each share rounded up.

    The shares add up to at least ``total``, and every node's share is at least 1 when
    ``total`` is; an unweighted split is ``ceil(total / len(weights))`` each.
    """
    if total < 0:
        raise ConfigError(f"total must be non-negative, got {total!r}")
    return {node: ceil_share(x) for node, x in exact_shares(total, weights).items()}


@dataclass(frozen=True)
class Standing:
    """Where one node stands against its exact share of its peers' work."""

    node_id: str
    held: int
    exact: float

    @property
    def share(self) -> int:
        """The exact share rounded up: what the node may hold without being above it."""
        return ceil_share(self.exact)

    @property
    def deficit(self) -> int:
        """Tasks missing to reach the share (0 when at or above it)."""
        return max(0, self.share - self.held)

    @property
    def surplus(self) -> int:
        """Tasks held above the share (0 when at or below it)."""
        return max(0, self.held - self.share)

    def even(self, band: float = DEFAULT_BAND) -> bool:
        """Within ``band`` of the exact share, or within one task of it."""
        if abs(self.held - self.exact) <= 1 + EPS:
            return True
        return self.exact * (1 - band) - EPS <= self.held <= self.exact * (1 + band) + EPS

    def even_floor(self, band: float = DEFAULT_BAND) -> int:
        """The fewest tasks this node may hold and still be even."""
        return ceil_share(min(self.exact - 1, self.exact * (1 - band)))

    def under(self, threshold: float, band: float = DEFAULT_BAND) -> bool:
        """Not even, and below its exact share divided by ``threshold``."""
        return not self.even(band) and self.held * threshold < self.exact - EPS

    def overloaded(self, threshold: float) -> bool:
        """Above ``threshold`` times its exact share (the rule of Metafora's FairBalancer)."""
        return self.held > threshold * self.exact + EPS

    def ceiling(self, threshold: float) -> int:
        """What an overloaded node gives back down to: ``max(ceil(threshold * exact), share)``."""
        return max(ceil_share(threshold * self.exact), self.share)


def standings(members: Iterable[Member], claimable: int = 0,
              selector: Mapping[str, str] | None = None) -> list[Standing]:
    """Each peer of ``selector`` against its exact share of the peers' held plus ``claimable``."""
    if claimable < 0:
        raise ConfigError(f"claimable must be non-negative, got {claimable!r}")
    group = peers(members, selector)
    if not group:
        return []
    exact = capped_shares(sum(m.held for m in group) + claimable, group)
    return [Standing(m.node_id, m.held, exact[m.node_id]) for m in group]


def capped_shares(total: float, group: Sequence[Member]) -> dict[str, float]:
    """``total`` split among ``group`` in proportion to weight, none above its capacity: a
    node whose part would exceed its capacity gets the capacity, and the rest is split among
    the others again (water-filling; what no node has room for is left unassigned)."""
    exact: dict[str, float] = {}
    rest = list(group)
    left = float(total)
    while rest:
        weight = sum(m.weight for m in rest)
        capped = [m for m in rest
                  if m.capacity is not None and left * m.weight / weight > m.capacity + EPS]
        if not capped:
            exact.update((m.node_id, left * m.weight / weight) for m in rest)
            break
        for m in capped:
            assert m.capacity is not None
            exact[m.node_id] = float(m.capacity)
            left -= m.capacity
        rest = [m for m in rest if m.node_id not in exact]
    return exact


def fair_share(node_id: str, members: Iterable[Member], claimable: int = 0, *,
               selector: Mapping[str, str] | None = None, slack: int = 0) -> int:
    """How many tasks ``node_id`` may hold: its share of what its peers hold plus
    ``claimable``, plus ``slack``; 0 if it is not an active peer of ``selector``."""
    if not isinstance(slack, int) or isinstance(slack, bool) or slack < 0:
        raise ConfigError(f"slack must be a non-negative integer, got {slack!r}")
    for standing in standings(members, claimable, selector):
        if standing.node_id == node_id:
            return standing.share + slack
    return 0


@dataclass(frozen=True)
class ReleasePlan:
    """How many tasks each node gives back in one balance, and why."""

    releases: Mapping[str, int]
    under: tuple[str, ...] = ()
    need: int = 0

    def for_node(self, node_id: str) -> int:
        """How many tasks ``node_id`` releases (0 if none)."""
        return self.releases.get(node_id, 0)


def release_plan(group: Sequence[Standing], *, threshold: float, band: float = DEFAULT_BAND,
                 max_releases: int | None = None, both_sides: bool = True,
                 claimable: int = 0) -> ReleasePlan:
    """Who gives back how many tasks so that every node of ``group`` ends even.

    1. an overloaded node releases down to :meth:`Standing.ceiling` (no node releases
       below its share, so a taker never becomes the next one to release);
    2. ``need`` is what the under-loaded nodes miss to reach their share rounded down;
       what step 1 does not cover is split among the other nodes in proportion to what
       they hold above their exact share rounded down (never below it: a giver stays
       within one task of its share, so even), adding up exactly (largest remainders,
       ties by node id: every node computes the same split);
    3. no node releases more than ``max_releases`` (None: no bound).

    ``both_sides=False`` stops after step 1: Metafora's rule, where only an overloaded node
    gives back and an under-loaded one waits for that. ``claimable`` tasks (pending, counted
    in the standings' exact shares) fill the under-loaded nodes first: only what they do not
    cover is released in step 2.

    A group of fewer than two nodes releases nothing (nobody could take the tasks).
    """
    if len(group) < 2:
        return ReleasePlan({})
    releases = {s.node_id: s.held - s.ceiling(threshold)
                for s in group if s.overloaded(threshold) and s.held > s.ceiling(threshold)}
    under = tuple(s.node_id for s in group if both_sides and s.under(threshold, band))
    # Fill an under-loaded node up to its share rounded down, not just to the band's edge:
    # the givers balance one after the other from snapshots a moment apart, and a node filled
    # only to the edge, short by a few tasks, would be under-loaded again (a trickle of moves).
    need = sum(max(0, math.floor(s.exact + EPS) - s.held) for s in group if s.node_id in under)
    extra = need - max(0, claimable) - sum(releases.values())
    if extra > 0:
        room = {s.node_id: s.held - releases.get(s.node_id, 0) - math.floor(s.exact + EPS)
                for s in group}
        for node, n in _split(extra, {node: r for node, r in room.items() if r > 0}).items():
            releases[node] = releases.get(node, 0) + n
    if max_releases is not None:
        releases = {node: min(n, max_releases) for node, n in releases.items()}
    return ReleasePlan({node: n for node, n in releases.items() if n > 0}, under, need)


def _split(amount: int, room: Mapping[str, int]) -> dict[str, int]:
    """``amount`` split in proportion to ``room`` (at most each node's room), adding up
    exactly: largest remainders first, ties by node id, so every node computes the same."""
    whole = sum(room.values())
    if whole <= amount:
        return dict(room)
    parts = {node: amount * r // whole for node, r in room.items()}
    left = amount - sum(parts.values())
    by_remainder = sorted(room, key=lambda node: (-(amount * room[node] % whole), node))
    for node in by_remainder[:left]:
        parts[node] += 1
    return parts
