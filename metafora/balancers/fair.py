"""FairBalancer: keep every node near its fair share of the work, with the fewest moves."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from metafora.balancer import BalancerContext, RunningTask
from metafora.balancers._base import ContextBalancer, seconds
from metafora.balancers.shares import (
    DEFAULT_BAND,
    EPS,
    Member,
    Standing,
    ceil_share,
    check_band,
    check_threshold,
    release_plan,
    standings,
)
from metafora.clock import Clock
from metafora.errors import ConfigError
from metafora.task import Task, matches

__all__ = ["FairBalancer"]

logger = logging.getLogger(__name__)

_REFUSED_KEEP = timedelta(seconds=60)  # how long a first refusal is remembered past its ignore
_REFUSED_PRUNE_AT = 1024  # prune remembered refusals once there are this many
_SelectorKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class _Pool:
    """The peers of one selector other than this node: what :meth:`can_claim` needs per offer."""

    size: int  # peers other than this node
    held: int  # tasks they hold
    weight: float  # their total weight
    lightest: tuple[int, float] | None  # (held, weight) of the one holding least per weight


@dataclass
class _Snapshot:
    """One read of the cluster: counts, weights, frozen nodes (labels on first need)."""

    at: float
    counts: dict[str, int]
    weights: dict[str, float]
    frozen: frozenset[str]
    labels: dict[str, dict[str, str]] | None = None
    pools: dict[_SelectorKey, _Pool] = field(default_factory=dict)

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
        return [Member(node, max(0, int(n)), self.weight(node))
                for node, n in counts.items() if self.is_peer(node, me, selector)]

    def pool(self, me: str, selector: Mapping[str, str]) -> _Pool:
        """The (cached) :class:`_Pool` of ``selector``."""
        key = tuple(sorted(selector.items()))
        found = self.pools.get(key)
        if found is None:
            others = [(max(0, int(n)), self.weight(node)) for node, n in self.counts.items()
                      if node != me and self.is_peer(node, me, selector)]
            lightest = min(others, key=lambda hw: hw[0] / hw[1]) if others else None
            found = _Pool(len(others), sum(h for h, _ in others), sum(w for _, w in others),
                          lightest)
            self.pools[key] = found
        return found


class FairBalancer(ContextBalancer):
    """Keeps each node near its fair share of the work, balancing from both sides.

    **Shares** (see :mod:`metafora.balancers.shares`): a node's share is
    ``ceil((held + claimable) * weight / total weight)`` over the *active* nodes that could
    run the work: nodes that announced they are leaving (``active_task_count``) and frozen
    nodes (``frozen_nodes``) do not count; weights come from ``node_weights`` (1.0 each by
    default); a task with a selector is weighed against its *peers*, the nodes whose labels
    match it (``node_labels``). This node's own count is always its local count
    (``ctx.task_count()``), which the store's view may lag.

    **Claiming** (:meth:`can_claim`): when the consumer tells how many tasks are claimable
    (``ctx.claimable_count()``), a node refuses a task the first time it is offered if taking
    it would bring it above its share plus ``slack`` (no slack while a peer is under-loaded,
    so released tasks go to that peer), ignoring it for ``refuse_for``; a node that starts a
    little later then still finds its share pending. When the consumer does not tell, the
    limit is Metafora's: ``threshold`` times the share of the tasks held. Offered again after
    its ignore, nobody lighter took the task (the others may be frozen or full), so it claims
    it rather than leave it waiting. A node alone among the task's peers never refuses.

    **Releasing** (:meth:`balance`, see :func:`~metafora.balancers.shares.release_plan`): a
    node above ``threshold`` times its exact share gives back down to
    ``ceil(threshold * share)``, never below its share; and when another node is
    *under-loaded* (not within ``band`` of its share or one task of it, and below its share
    divided by ``threshold``), the nodes above their share also give back, in proportion to
    what they hold above it, until the under-loaded nodes would be even: only as many tasks
    as that takes, at most ``max_releases`` per balance. A node within the band does not
    trigger anything (hysteresis: nothing ping-pongs), and the steady state moves nothing.
    ``both_sides=False`` keeps only the first rule (Metafora's). Randomly chosen tasks
    (``rng``) are released; tasks already stopping are neither chosen nor counted as
    staying, and a task started less than ``min_age`` ago is not chosen (it stays: moving a
    task that just started wastes its start). Tasks of a selector are released only among
    their peers (a task no other node could run is never released).

    **After a release** it refuses every claim for ``claim_delay`` (returning that deadline
    as the ignore time) so the released tasks go to other nodes, and releases nothing more
    meanwhile unless a node joined: while released tasks wait to be claimed the cluster's
    counts are low and would make it release again. A node leaving ends that window: its
    tasks are orphans, taken at once.

    Counts, weights and frozen nodes are one snapshot: :meth:`can_claim` reuses it (and the
    labels, read only for tasks with a selector) for up to ``counts_ttl`` seconds (0
    re-reads every time); :meth:`balance` always re-reads. Errors from the store propagate
    to the caller. ``clock`` defaults to the context's; durations are seconds or timedeltas.
    """

    def __init__(
        self,
        threshold: float = 1.2,
        *,
        claim_delay: float | timedelta = 10.0,
        refuse_for: float | timedelta = 1.0,
        counts_ttl: float | timedelta = 1.0,
        band: float = DEFAULT_BAND,
        slack: int = 1,
        max_releases: int | None = 1000,
        min_age: float | timedelta = 1.0,
        both_sides: bool = True,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(clock)
        self._threshold = check_threshold(threshold, "FairBalancer threshold")
        self._band = check_band(band, "FairBalancer band")
        self._slack = _count(slack, "FairBalancer slack", minimum=0)
        self._max_releases = (None if max_releases is None
                              else _count(max_releases, "FairBalancer max_releases", minimum=1))
        self._min_age = timedelta(seconds=seconds(min_age, "min_age"))
        self._both_sides = bool(both_sides)
        self._claim_delay = timedelta(seconds=seconds(claim_delay, "claim_delay"))
        self._refuse_for = timedelta(seconds=seconds(refuse_for, "refuse_for"))
        self._counts_ttl = seconds(counts_ttl, "counts_ttl")
        self._rng = rng if rng is not None else random.Random()
        self._lock = threading.Lock()
        self._refuse_until: datetime | None = None
        self._joined = False  # a node joined since the last balance: it may release again
        self._refused: dict[str, datetime] = {}
        self._prune_at = _REFUSED_PRUNE_AT
        self._snap: _Snapshot | None = None

    @property
    def threshold(self) -> float:
        """How many times its share a node may hold before it releases."""
        return self._threshold

    @property
    def band(self) -> float:
        """The hysteresis band: a node within this fraction of its share is even."""
        return self._band

    @property
    def slack(self) -> int:
        """How many tasks above its share a node may claim on a first offer."""
        return self._slack

    @property
    def max_releases(self) -> int | None:
        """The most tasks one balance releases (None: no bound)."""
        return self._max_releases

    @property
    def refusing_until(self) -> datetime | None:
        """Until when claims are refused after the last release (None if never released)."""
        with self._lock:
            return self._refuse_until

    def init(self, ctx: BalancerContext) -> None:
        """Keep ``ctx`` and forget any state from a previous context."""
        super().init(ctx)
        with self._lock:
            self._refuse_until = None
            self._joined = False
            self._refused.clear()
            self._prune_at = _REFUSED_PRUNE_AT
            self._snap = None

    # -- the unweighted arithmetic of the old rule, public so it can be checked on its own ---

    @staticmethod
    def average(counts: Mapping[str, int]) -> float:
        """Mean tasks per node (0.0 for an empty cluster)."""
        return sum(counts.values()) / len(counts) if counts else 0.0

    def overloaded(self, node_id: str, counts: Mapping[str, int]) -> bool:
        """Whether ``node_id`` holds more than ``threshold`` times the average of ``counts``.

        Never true for a node alone in the cluster (nobody could take its tasks).
        """
        if len(counts) < 2:
            return False
        own = counts.get(node_id, 0)
        return own > self._threshold * self.average(counts) + EPS

    def desired_count(self, counts: Mapping[str, int]) -> int:
        """How many tasks an overloaded node releases down to: ``ceil(threshold * average)``.

        Never below ``ceil(average)``: releasing under the average would only make the node
        that takes the tasks the next one to release them.
        """
        avg = self.average(counts)
        return max(ceil_share(self._threshold * avg), ceil_share(avg))

    def share(self, selector: Mapping[str, str] | None = None) -> int:
        """This node's share now of the work it can run (``selector``: of such tasks),
        counting what the consumer says is claimable; from the cached snapshot."""
        ctx, clock = self._context("share")
        snap = self._snapshot(ctx, clock, fresh=False, selector=selector or {})
        claimable = ctx.claimable_count() or 0
        group = standings(snap.members(ctx.node_id, ctx.task_count(), selector or {}), claimable)
        return next((s.share for s in group if s.node_id == ctx.node_id), 0)

    # -- the Balancer interface ------------------------------------------------------

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Claim unless just released, or above the share and a lighter node may take it."""
        ctx, clock = self._context("can_claim")
        snap = self._snapshot(ctx, clock, fresh=False, selector=task.selector)
        pool = snap.pool(ctx.node_id, task.selector)
        if pool.size == 0:
            return True, None  # alone: refusing would leave the task to nobody
        now = clock.now()
        with self._lock:
            if self._refuse_until is not None and now < self._refuse_until:
                return False, self._refuse_until
        above = self._above_share(ctx, snap, pool)
        with self._lock:
            if not above:
                self._refused.pop(task.id, None)
                return True, None
            until = self._refused.get(task.id)
            if until is not None and now >= until:
                del self._refused[task.id]
                logger.debug("claiming %s above the fair share: no lighter node took it",
                             task.id, extra={"node_id": ctx.node_id, "task_id": task.id})
                return True, None
            if until is None:
                until = now + self._refuse_for
                self._refused[task.id] = until
                self._prune(now)
            return False, until

    def balance(self) -> list[str]:
        """Ids of randomly chosen tasks to release (see the class docstring)."""
        ctx, clock = self._context("balance")
        now = clock.now()
        with self._lock:
            joined, self._joined = self._joined, False
            if self._refuse_until is not None and now < self._refuse_until and not joined:
                return []  # released tasks are still finding new owners; counts are in flux
        snap = self._snapshot(ctx, clock, fresh=True, selector={})
        held = ctx.task_count()
        live = [rt for rt in ctx.tasks() if rt.stopped is None]
        # One group per selector (one group, every node a peer, when no task has one).
        groups: dict[_SelectorKey, list[RunningTask]] = {}
        for rt in live:
            if not self._young(rt, now):
                groups.setdefault(tuple(sorted(rt.task.selector.items())), []).append(rt)
        if any(groups) and snap.labels is None:
            snap.labels = dict(ctx.cluster_state.node_labels())
        chosen: list[str] = []
        why: tuple[Standing, ...] = ()
        for key in sorted(groups):
            group = standings(snap.members(ctx.node_id, held - len(chosen), dict(key)))
            plan = release_plan(group, threshold=self._threshold, band=self._band,
                                both_sides=self._both_sides)
            release = plan.for_node(ctx.node_id)
            if self._max_releases is not None:  # one bound for the whole balance
                release = min(release, self._max_releases - len(chosen))
            target = held - len(chosen) - release
            excess = min(len(groups[key]), len(live) - len(chosen) - target)
            if excess > 0:
                chosen += [rt.id for rt in self._rng.sample(groups[key], excess)]
                why = tuple(s for s in group
                            if s.node_id == ctx.node_id or s.node_id in plan.under)
        if not chosen:
            return []
        with self._lock:
            self._refuse_until = now + self._claim_delay
        logger.info("releasing %d of %d tasks: holding %d; %s", len(chosen), len(live), held,
                    ", ".join(f"{s.node_id} {s.held}/{s.exact:.1f}" for s in why),
                    extra={"node_id": ctx.node_id, "released": len(chosen)})
        return chosen

    def nodes_changed(self, left: bool) -> None:
        """Forget the cached snapshot; when a node left, stop refusing claims after a release.

        The refusal after a release protects a balance decision taken over the old
        membership; once a node has gone, its tasks are orphans that must find owners now,
        and the next balance re-reads the counts anyway. When a node joined, the next
        balance may release again even within ``claim_delay`` (the newcomer changed the
        shares): otherwise a node that released just before a join would leave the
        newcomer idle until a periodic balance after the delay.
        """
        with self._lock:
            self._snap = None
            self._joined = self._joined or not left
            if left:
                if self._refuse_until is not None:
                    logger.debug("a node left: no longer refusing claims after the last release")
                self._refuse_until = None
                self._refused.clear()
                self._prune_at = _REFUSED_PRUNE_AT

    # -- internals ---------------------------------------------------------------------

    def _above_share(self, ctx: BalancerContext, snap: _Snapshot, pool: _Pool) -> bool:
        """Whether claiming one more task would take this node above its limit."""
        held = ctx.task_count()
        weight = snap.weight(ctx.node_id)
        whole = pool.weight + weight
        claimable = ctx.claimable_count()
        if claimable is None:  # Metafora's rule: threshold times the share of what is held
            return held > self._threshold * (pool.held + held) * weight / whole + EPS
        work = pool.held + held + max(0, claimable)
        slack = self._slack
        if self._both_sides and pool.lightest is not None:
            other_held, other_weight = pool.lightest
            lightest = Standing("", other_held, work * other_weight / whole)
            if lightest.under(self._threshold, self._band):
                slack = 0  # a peer is under-loaded: leave the offered task to it
        return held >= ceil_share(work * weight / whole) + slack

    def _snapshot(self, ctx: BalancerContext, clock: Clock, *, fresh: bool,
                  selector: Mapping[str, str]) -> _Snapshot:
        """The cached snapshot, re-read when ``fresh`` or older than ``counts_ttl``; with
        the labels when ``selector`` needs them."""
        mono = clock.monotonic()
        with self._lock:
            snap = self._snap
        if fresh or snap is None or mono - snap.at >= self._counts_ttl:
            state = ctx.cluster_state
            counts = dict(state.active_task_count())
            snap = _Snapshot(mono, counts, dict(state.node_weights()), state.frozen_nodes())
            with self._lock:
                self._snap = snap
        if selector and snap.labels is None:
            snap.labels = dict(ctx.cluster_state.node_labels())
        return snap

    def _young(self, rt: RunningTask, now: datetime) -> bool:
        """Started less than ``min_age`` ago (a start ahead of this clock is not judged)."""
        return timedelta(0) <= now - rt.started < self._min_age

    def _prune(self, now: datetime) -> None:
        """Forget old first refusals (caller holds the lock).

        Once the map has grown to twice its size after the last pruning, not on every
        refusal past a fixed size: a storm refuses tens of thousands of offers within the
        horizon, and walking them all per refusal made ``can_claim`` quadratic.
        """
        if len(self._refused) < self._prune_at:
            return
        horizon = now - max(_REFUSED_KEEP, 10 * self._refuse_for)
        for task_id in [tid for tid, until in self._refused.items() if until < horizon]:
            del self._refused[task_id]
        self._prune_at = max(_REFUSED_PRUNE_AT, 2 * len(self._refused))

    def __repr__(self) -> str:
        return (
            f"FairBalancer(threshold={self._threshold!r}, "
            f"claim_delay={self._claim_delay.total_seconds()!r}, "
            f"refuse_for={self._refuse_for.total_seconds()!r}, band={self._band!r}, "
            f"slack={self._slack!r}, max_releases={self._max_releases!r})"
        )


def _count(value: object, name: str, *, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``, else ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
