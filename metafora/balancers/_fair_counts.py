"""What a :class:`~metafora.balancers.fair.FairBalancer` reads of the cluster: one snapshot of
the counts, weights, capacities and frozen nodes (labels on first need), the peers of each
selector, the work they share, and the cache that keeps a snapshot ``counts_ttl`` seconds."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from metafora.balancers.shares import EPS, Member, Standing
from metafora.contracts.balancer import BalancerContext, SelectorKey, selector_key
from metafora.core.clock import Clock
from metafora.core.node import capacity_or_none
from metafora.core.task import matches

__all__ = ["Counts", "Pool", "Snapshot", "work_of"]

_FAR_BELOW = 0.75  # a node under this share of its share claims on a cached snapshot (far_below)
_FAR_BELOW_TTL = 10  # ... for at most this many counts_ttl


@dataclass(frozen=True)
class Pool:
    """The peers of one selector other than this node: what ``FairBalancer.can_claim`` needs
    per offer."""

    size: int  # peers other than this node
    held: int  # tasks they hold
    weight: float  # their total weight
    lightest: tuple[int, float] | None  # (held, weight) of the one holding least per weight
    others: tuple[tuple[int, float], ...] = ()  # (held, weight) of each
    _needs: dict[tuple[int, float, bool], int] = field(default_factory=dict, compare=False)

    def under_need(self, work: int, whole: float, threshold: float, band: float) -> int:
        """What the under-loaded peers miss to reach their share rounded down, with ``work``
        shared over ``whole`` weight (computed once per snapshot and amount of work)."""
        return self._need(work, whole, lambda peer: peer.under(threshold, band))

    def owed(self, work: int, whole: float, claimable: int) -> bool:
        """Whether the peers below their exact share (rounded down) miss at least what is
        ``claimable``: a task above this node's share is theirs."""
        need = self._need(work, whole, None)
        return need > 0 and claimable <= need

    def _need(self, work: int, whole: float, counted: Callable[[Standing], bool] | None) -> int:
        """What the peers ``counted`` (None: all) miss to reach their share rounded down,
        cached per amount of work (a balancer's threshold and band never change)."""
        key = (work, whole, counted is None)
        need = self._needs.get(key)
        if need is None:
            need = 0
            for held, weight in self.others:
                peer = Standing("", held, work * weight / whole)
                if counted is None or counted(peer):
                    need += max(0, math.floor(peer.exact + EPS) - held)
            self._needs[key] = need
        return need


@dataclass
class Snapshot:
    """One read of the cluster: counts, weights, frozen nodes (labels on first need)."""

    at: float
    counts: dict[str, int]
    weights: dict[str, float]
    frozen: frozenset[str]
    claimable: int | None = None  # claimable in the store at the read (None: not told)
    labels: dict[str, dict[str, str]] | None = None
    pools: dict[SelectorKey, Pool] = field(default_factory=dict)
    capacities: dict[str, int] = field(default_factory=dict)  # published capacities
    published: bool = False  # counts the nodes published (a moment late), not the claims

    def capacity(self, node: str) -> int | None:
        """The most tasks ``node`` said it can run (None: no bound, or not a valid number)."""
        return capacity_or_none(self.capacities.get(node))

    def full(self, node: str, held: int) -> bool:
        """Whether ``node`` holds as many tasks as it can run: it takes no more."""
        c = self.capacity(node)
        return c is not None and held >= c

    def weight(self, node: str) -> float:
        """The node's published weight; 1.0 if none or not a positive finite number."""
        w = self.weights.get(node, 1.0)
        ok = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
        return float(w) if ok else 1.0

    def is_peer(self, node: str, me: str, selector: Mapping[str, str]) -> bool:
        """Whether ``node`` counts for a task with ``selector`` (this node always does)."""
        if node == me:
            return True
        if node in self.frozen:
            return False
        if not selector or self.labels is None or node not in self.labels:
            return True  # a node the store gave no labels for (just joined) counts
        return matches(selector, self.labels[node])

    def members(self, me: str, held: int, selector: Mapping[str, str]) -> list[Member]:
        """The peers of ``selector`` as :class:`Member`, this node holding ``held``."""
        counts = {**self.counts, me: held}
        return [Member(node, max(0, int(n)), self.weight(node), capacity=self.capacity(node))
                for node, n in counts.items() if self.is_peer(node, me, selector)]

    def pool(self, me: str, selector: Mapping[str, str]) -> Pool:
        """The (cached) :class:`Pool` of ``selector``."""
        key = selector_key(selector)
        found = self.pools.get(key)
        if found is None:
            # A full peer (at its published capacity) takes no more: it and its tasks are left
            # out, and the rest of the work is shared by the others (as capped_shares does).
            others = [(max(0, int(n)), self.weight(node)) for node, n in self.counts.items()
                      if node != me and self.is_peer(node, me, selector)
                      and not self.full(node, max(0, int(n)))]
            lightest = min(others, key=lambda hw: hw[0] / hw[1]) if others else None
            found = Pool(len(others), sum(h for h, _ in others), sum(w for _, w in others),
                          lightest, tuple(others))
            self.pools[key] = found
        return found


def work_of(ctx: BalancerContext, snap: Snapshot, pool: Pool, held: int) -> int | None:
    """The work this node and its peers share: what they hold plus what is claimable.

    From the store's own claimable count when it gives one: counts and claimable read
    together add up to a total no claim changes, so a stale snapshot still gives the
    right share. Else from the consumer's claimable count; None when neither says.
    """
    if snap.claimable is not None:
        return pool.held + max(0, int(snap.counts.get(ctx.node_id, held))) + snap.claimable
    claimable = ctx.claimable_count()
    return None if claimable is None else pool.held + held + max(0, claimable)


class Counts:
    """The snapshot a balancer decides on, re-read when older than ``ttl`` seconds (0: every
    time) and kept longer while it shows this node far below its share."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None

    def drop(self) -> None:
        """Forget the cached snapshot (the membership changed)."""
        with self._lock:
            self._snap = None

    def read(self, ctx: BalancerContext, clock: Clock, *, fresh: bool,
             selector: Mapping[str, str], published: bool = False,
             far_below: bool = False) -> Snapshot:
        """The cached snapshot, re-read when ``fresh`` or older than ``ttl``; with the labels
        when ``selector`` needs them. ``published``: read the counts the nodes published
        instead of the claims (never cached: see ``FairBalancer.balance``). ``far_below``:
        kept longer while it shows this node far below its share (see :meth:`_far_below`)."""
        mono = clock.monotonic()
        with self._lock:
            snap = self._snap
        if (not fresh and far_below and snap is not None
                and mono - snap.at < _FAR_BELOW_TTL * self.ttl
                and self._far_below(ctx, snap, selector)):
            return snap
        if fresh or snap is None or mono - snap.at >= self.ttl:
            state = ctx.cluster_state
            # A store whose published counts are its exact ones (the default) reads once.
            published = published and state.publishes_counts
            counts = dict(state.published_task_count() if published
                          else state.active_task_count())
            claimable = state.claimable_count()  # from the same read as the counts
            snap = Snapshot(mono, counts, dict(state.node_weights()), state.frozen_nodes(),
                            None if claimable is None else max(0, int(claimable)),
                            capacities=dict(state.node_capacities()), published=published)
            if not published:
                with self._lock:
                    self._snap = snap
        if selector and snap.labels is None:
            snap.labels = dict(ctx.cluster_state.node_labels())
        return snap

    @staticmethod
    def _far_below(ctx: BalancerContext, snap: Snapshot, selector: Mapping[str, str]) -> bool:
        """Whether ``snap`` shows this node under ``_FAR_BELOW`` of its share of the work.

        Then the next offer is claimed whatever a fresh read would say, and reading the
        counts (a count of the claims: O(tasks held) in a SQL store) would only cost: in a
        start-up storm every node read them every second while it claimed, 100,000 rows a
        read. The work is what the counts and the claimable count add up to, which no claim
        changes (only submits and ends, seen at the next read, ``_FAR_BELOW_TTL`` ttls at
        most); membership changes drop the snapshot (:meth:`drop`).
        """
        if selector and snap.labels is None:
            return False
        pool = snap.pool(ctx.node_id, selector)
        if pool.size == 0:
            return False
        held = ctx.task_count()
        work = work_of(ctx, snap, pool, held)
        if work is None:
            return False
        weight = snap.weight(ctx.node_id)
        return held < _FAR_BELOW * work * weight / (pool.weight + weight)
