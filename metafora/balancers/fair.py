"""FairBalancer: keep every node near its fair share of the work, with the fewest moves."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from metafora.balancer import BalancerContext, RunningTask, SelectorKey, selector_key
from metafora.balancers._base import ContextBalancer
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
from metafora.durations import seconds
from metafora.errors import ConfigError
from metafora.node import capacity_or_none
from metafora.task import Task, matches

__all__ = ["DEFAULT_FAIR_THRESHOLD", "DEFAULT_SHORT_RUN", "DEFAULT_WARMUP", "DEFAULT_WARMUP_BACKLOG",
           "FairBalancer"]

logger = logging.getLogger(__name__)

_REFUSED_KEEP = timedelta(seconds=60)  # how long a first refusal is remembered past its ignore
_REFUSED_PRUNE_AT = 1024  # prune remembered refusals once there are this many
DEFAULT_FAIR_THRESHOLD = 1.1  # above 110 % of its share a node gives back (the band's edge)
DEFAULT_WARMUP = 3.0  # seconds the membership must hold still before a cold start claims its share
DEFAULT_WARMUP_BACKLOG = 100  # a cold start with less work does not wait
DEFAULT_SHORT_RUN = 1.0  # tasks whose runs end faster than this are short (see _short)
_WARMUP_MAX = 4  # a cold start never waits more than this many warmups in all
_PROBE = 200  # a cold node may hold 1/_PROBE of the work while it waits (at least one task)
_COLD_HELD = 10  # while the cluster holds less than 1/_COLD_HELD of its work, a start is cold
_SHORT_MIN_RUNS = 8  # short-task mode needs this many runs ended in the last window
_SHORT_WINDOW = 10  # the window, in short_run units
_SHORT_RECHECK = 0.25  # seconds a short-mode verdict is kept
MAX_REFUSALS = 5  # refuse_for periods an offer may wait for a lighter node before it is taken
_FAR_BELOW = 0.75  # a node under this share of its share claims on a cached snapshot (_far_below)
_FAR_BELOW_TTL = 10  # ... for at most this many counts_ttl


@dataclass(frozen=True)
class _Pool:
    """The peers of one selector other than this node: what :meth:`can_claim` needs per offer."""

    size: int  # peers other than this node
    held: int  # tasks they hold
    weight: float  # their total weight
    lightest: tuple[int, float] | None  # (held, weight) of the one holding least per weight
    others: tuple[tuple[int, float], ...] = ()  # (held, weight) of each
    _needs: dict[tuple[int, float], int] = field(default_factory=dict, compare=False)

    def under_need(self, work: int, whole: float, threshold: float, band: float) -> int:
        """What the under-loaded peers miss to reach their share rounded down, with ``work``
        shared over ``whole`` weight (computed once per snapshot and amount of work)."""
        key = (work, whole)
        need = self._needs.get(key)
        if need is None:
            need = 0
            for held, weight in self.others:
                peer = Standing("", held, work * weight / whole)
                if peer.under(threshold, band):
                    need += max(0, math.floor(peer.exact + EPS) - held)
            self._needs[key] = need
        return need


@dataclass
class _ColdStart:
    """A cold start in progress: when it began, the members seen last and since when."""

    began: float  # monotonic
    members: frozenset[str]
    quiet_since: float  # monotonic time of the last change of ``members``


@dataclass
class _Snapshot:
    """One read of the cluster: counts, weights, frozen nodes (labels on first need)."""

    at: float
    counts: dict[str, int]
    weights: dict[str, float]
    frozen: frozenset[str]
    claimable: int | None = None  # claimable in the store at the read (None: not told)
    labels: dict[str, dict[str, str]] | None = None
    pools: dict[SelectorKey, _Pool] = field(default_factory=dict)
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

    def pool(self, me: str, selector: Mapping[str, str]) -> _Pool:
        """The (cached) :class:`_Pool` of ``selector``."""
        key = selector_key(selector)
        found = self.pools.get(key)
        if found is None:
            # A full peer (at its published capacity) takes no more: it and its tasks are left
            # out, and the rest of the work is shared by the others (as capped_shares does).
            others = [(max(0, int(n)), self.weight(node)) for node, n in self.counts.items()
                      if node != me and self.is_peer(node, me, selector)
                      and not self.full(node, max(0, int(n)))]
            lightest = min(others, key=lambda hw: hw[0] / hw[1]) if others else None
            found = _Pool(len(others), sum(h for h, _ in others), sum(w for _, w in others),
                          lightest, tuple(others))
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

    **Claiming** (:meth:`can_claim`): a node claims up to its share plus ``slack``. The
    work it shares is what the store says its peers hold plus what is claimable, read
    together (``ClusterState.claimable_count``): a sum no claim changes, so a snapshot a
    second old still gives the right share; else the consumer's claimable count
    (``ctx.claimable_count()``); else Metafora's limit, ``threshold`` times the share of the
    tasks held. While a peer is *under-loaded*, a node that is not under-loaded itself
    leaves offers to it as long as no more is claimable than the under-loaded peers miss
    (and one that is under-loaded claims without slack): that is how released tasks reach
    the node they were released for, while at a cold start nobody stops short of its share
    to wait for the slowest node. A refused offer is ignored for
    ``refuse_for``; offered again while a lighter peer still has room below its share, it
    waits again (up to twice ``refuse_for`` at a time), but never more than five ``refuse_for`` in all:
    then nobody lighter took it (the others may be frozen, full or unable to run it), so it
    claims it rather than leave it waiting. A node alone among the task's peers never
    refuses.

    **Cold start** (``warmup``, ``warmup_backlog``): while the cluster holds less than a
    tenth of its work and at least ``warmup_backlog`` tasks are to share, a node that just
    started claims only a probe (1/200 of the work, at least one task) until the membership
    it sees has held still for ``warmup`` seconds (never more than four ``warmup`` in all):
    the nodes started with it register meanwhile and each then claims only its share, so a
    cluster started together claims each task once (Kafka delays a new group's first
    rebalance the same way; Metafora slept after each claim). A node joining a running
    cluster, or a small backlog, does not wait; nor does a node whose tasks are short.

    **Short tasks** (``short_run``): when the node's tasks end quickly (the median of at
    least 8 runs that ended on their own -- not released, lost or abandoned -- in the last
    ``10 * short_run`` seconds is under ``short_run``, and
    at most a quarter of what it runs is older than that window), completion evens the
    cluster on its own and refusing offers only slows it: the node claims every offer it has
    room for and releases nothing, at no store read. Its probe at a cold start is what
    tells it; offers refused before it knew are tried again at once
    (:meth:`refusals_lifted`). Long tasks keep every rule below; a move is their costly event.

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
    re-reads every time), and for up to ten ``counts_ttl`` while it shows this node under
    3/4 of its share (no read could then turn a claim into a refusal; a membership change
    drops it at once). :meth:`balance` first reads the counts the nodes published
    (``ClusterState.published_task_count``, one record per node): when they show nothing to
    release, it stops there, so an idle, even cluster reads no claims -- nor builds the list of
    this node's tasks, when the context says which selectors they have
    (``BalancerContext.held_selectors``; the consumer's does); otherwise it reads the exact
    counts and decides on those. Errors from the store propagate
    to the caller. ``clock`` defaults to the context's; durations are seconds or timedeltas.
    """

    def __init__(
        self,
        threshold: float = DEFAULT_FAIR_THRESHOLD,
        *,
        claim_delay: float | timedelta = 10.0,
        refuse_for: float | timedelta = 1.0,
        counts_ttl: float | timedelta = 1.0,
        band: float = DEFAULT_BAND,
        slack: int = 1,
        max_releases: int | None = 1000,
        min_age: float | timedelta = 1.0,
        both_sides: bool = True,
        warmup: float | timedelta = DEFAULT_WARMUP,
        warmup_backlog: int = DEFAULT_WARMUP_BACKLOG,
        short_run: float | timedelta = DEFAULT_SHORT_RUN,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(clock)
        self._threshold = check_threshold(threshold, "FairBalancer threshold")
        self._band = check_band(band, "FairBalancer band")
        self._slack = _count(slack, "FairBalancer slack", minimum=0)
        self._max_releases = (None if max_releases is None
                              else _count(max_releases, "FairBalancer max_releases", minimum=1))
        self._min_age = timedelta(seconds=seconds(min_age, "min_age", allow_zero=True))
        self._both_sides = bool(both_sides)
        self._warmup = seconds(warmup, "warmup", allow_zero=True)
        self._warmup_backlog = _count(warmup_backlog, "FairBalancer warmup_backlog", minimum=0)
        self._short_run = seconds(short_run, "short_run", allow_zero=True)
        self._cold: _ColdStart | None = None  # a cold start in progress
        self._short_seen: tuple[float, bool] | None = None  # (monotonic, short) last verdict
        self._claim_delay = timedelta(seconds=seconds(claim_delay, "claim_delay", allow_zero=True))
        self._refuse_for = timedelta(seconds=seconds(refuse_for, "refuse_for", allow_zero=True))
        self._counts_ttl = seconds(counts_ttl, "counts_ttl", allow_zero=True)
        self._rng = rng if rng is not None else random.Random()
        self._lock = threading.Lock()
        self._refuse_until: datetime | None = None
        self._joined = False  # a node joined since the last balance: it may release again
        self._refused: dict[str, tuple[datetime, datetime]] = {}  # id -> (until, first)
        self._refused_some = False  # an offer was refused since the tasks were last found short
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
        _, clock = self._context("init")
        with self._lock:
            mono = clock.monotonic()
            self._cold = (_ColdStart(mono, frozenset({ctx.node_id}), mono)
                          if self._warmup > 0 else None)
            self._short_seen = None
            self._refuse_until = None
            self._joined = False
            self._refused.clear()
            self._refused_some = False
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
        held = ctx.task_count()
        members = snap.members(ctx.node_id, held, selector or {})
        work = self._work(ctx, snap, snap.pool(ctx.node_id, selector or {}), held)
        claimable = max(0, (work or 0) - sum(m.held for m in members))
        group = standings(members, claimable)
        return next((s.share for s in group if s.node_id == ctx.node_id), 0)

    # -- the Balancer interface ------------------------------------------------------

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Claim unless warming up, just released, or above the share while a lighter node
        may take the task (see the class docstring)."""
        ok, until = self._can_claim(task)
        if not ok:
            self._refused_some = True
        return ok, until

    def refusals_lifted(self) -> bool:
        """True once the node's tasks turn out short after it refused offers: a cold start's
        wait (up to ``warmup`` after the membership held still) or a share's refusal would
        otherwise keep them waiting although completion evens the cluster now."""
        if not self._refused_some:
            return False
        ctx, clock = self._context("refusals_lifted")
        if not self._short(ctx, clock):
            return False
        self._refused_some = False
        return True

    def _can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        ctx, clock = self._context("can_claim")
        if self._short(ctx, clock):
            return True, None  # completion evens the cluster (see the class docstring)
        snap = self._snapshot(ctx, clock, fresh=False, selector=task.selector,
                              far_below=self._cold is None)
        now = clock.now()
        wait, ended = self._warming(ctx, clock, snap)
        if wait == 0.0:
            return True, None  # the cold start's probe
        if wait is not None:
            return False, now + timedelta(seconds=wait)
        if ended:  # peers registered during the wait: count them
            snap = self._snapshot(ctx, clock, fresh=True, selector=task.selector)
        pool = snap.pool(ctx.node_id, task.selector)
        if pool.size == 0:
            return True, None  # alone: refusing would leave the task to nobody
        with self._lock:
            if self._refuse_until is not None and now < self._refuse_until:
                return False, self._refuse_until
        above, room = self._limit(ctx, snap, pool)
        with self._lock:
            if not above:
                self._refused.pop(task.id, None)
                return True, None
            seen = self._refused.get(task.id)
            if seen is not None and now - seen[0] > 2 * self._refuse_for:
                # An old episode (refused at a cold start, then claimed elsewhere; offered
                # again now because it was released): a new refusal, not a long wait.
                seen = None
            if seen is None:
                until = now + self._refuse_for
                self._refused[task.id] = (until, now)
                self._prune(now)
                return False, until
            until, first = seen
            if now < until:
                return False, until
            waited = now - first
            if room and waited < MAX_REFUSALS * self._refuse_for:
                # A lighter peer still has room: it may be slow, not gone. Wait again (twice
                # refuse_for at most, so an offer is judged again soon after the counts
                # change), but never forever: it may also be full or unable to run it.
                until = now + min(2 * self._refuse_for, max(self._refuse_for, waited))
                self._refused[task.id] = (until, first)
                return False, until
            del self._refused[task.id]
        logger.debug("claiming %s above the fair share: no lighter node took it", task.id,
                     extra={"node_id": ctx.node_id, "task_id": task.id})
        return True, None

    def balance(self) -> list[str]:
        """Ids of randomly chosen tasks to release (see the class docstring)."""
        ctx, clock = self._context("balance")
        now = clock.now()
        with self._lock:
            joined, self._joined = self._joined, False
            if self._refuse_until is not None and now < self._refuse_until and not joined:
                return []  # released tasks are still finding new owners; counts are in flux
        if self._short(ctx, clock):
            return []  # short tasks: completion evens the cluster, a release only costs
        held = ctx.task_count()
        # The published counts first (one record per node): nothing to release on them, and
        # the claims are not read at all; something to release, and the exact counts decide.
        snap: _Snapshot | None = None
        keys = _held_selectors(ctx)
        if keys is not None:
            # The context tallies its tasks' selectors: whether anything is to be released
            # is decided on the counts alone, and the list of tasks (O(held)) is built only
            # when something is -- never on an even cluster.
            if not keys:
                return []  # no task held
            snap = self._snapshot(ctx, clock, fresh=True, selector={}, published=True)
            if not self._releases(ctx, snap, held, keys):
                return []
        live = [rt for rt in ctx.tasks() if rt.stopped is None]
        # One group per selector (one group, every node a peer, when no task has one).
        groups: dict[SelectorKey, list[RunningTask]] = {}
        for rt in live:
            if not self._young(rt, now):
                groups.setdefault(selector_key(rt.task.selector), []).append(rt)
        if not groups:
            return []
        if snap is None:
            snap = self._snapshot(ctx, clock, fresh=True, selector={}, published=True)
        chosen, why = self._plan(ctx, snap, held, live, groups)
        if chosen and snap.published:
            labels = snap.labels  # read once per balance: the exact pass reuses them
            snap = self._snapshot(ctx, clock, fresh=True, selector={})
            if snap.labels is None:
                snap.labels = labels
            chosen, why = self._plan(ctx, snap, held, live, groups)
        if not chosen:
            return []
        with self._lock:
            self._refuse_until = now + self._claim_delay
        logger.info("releasing %d of %d tasks: holding %d; %s", len(chosen), len(live), held,
                    ", ".join(f"{s.node_id} {s.held}/{s.exact:.1f}" for s in why),
                    extra={"node_id": ctx.node_id, "released": len(chosen)})
        return chosen

    def _releases(self, ctx: BalancerContext, snap: _Snapshot, held: int,
                  keys: frozenset[SelectorKey]) -> bool:
        """Whether :meth:`_plan` could choose anything on ``snap`` for tasks of the selectors
        ``keys`` (every selector this node's tasks have), without the tasks themselves.

        Until :meth:`_plan` chooses a task, each group is planned from ``held`` alone, as
        here; a plan that releases nothing for this node chooses nothing (its target is
        ``held``, and ``task_count()`` counts every task of ``tasks()``). And its
        groups are the selectors of ``keys`` that have tasks old enough to move, a subset:
        no release here is no release there, on the same counts.
        """
        if any(keys) and snap.labels is None:
            snap.labels = dict(ctx.cluster_state.node_labels())  # _plan reuses them
        claimable = snap.claimable or 0
        for key in keys:
            group = standings(snap.members(ctx.node_id, held, dict(key)), claimable)
            plan = release_plan(group, threshold=self._threshold, band=self._band,
                                both_sides=self._both_sides, claimable=claimable)
            if plan.for_node(ctx.node_id) > 0:
                return True
        return False

    def _plan(self, ctx: BalancerContext, snap: _Snapshot, held: int, live: list[RunningTask],
              groups: dict[SelectorKey, list[RunningTask]]) -> tuple[list[str], tuple[Standing, ...]]:
        """(ids to release on ``snap``'s counts, the standings that say why)."""
        if any(groups) and snap.labels is None:
            snap.labels = dict(ctx.cluster_state.node_labels())
        chosen: list[str] = []
        why: tuple[Standing, ...] = ()
        claimable = snap.claimable or 0  # pending work fills the under-loaded first
        for key in sorted(groups):
            group = standings(snap.members(ctx.node_id, held - len(chosen), dict(key)), claimable)
            plan = release_plan(group, threshold=self._threshold, band=self._band,
                                both_sides=self._both_sides, claimable=claimable)
            release = plan.for_node(ctx.node_id)
            if self._max_releases is not None:  # one bound for the whole balance
                release = min(release, self._max_releases - len(chosen))
            target = held - len(chosen) - release
            excess = min(len(groups[key]), len(live) - len(chosen) - target)
            if excess > 0:
                chosen += [rt.id for rt in self._rng.sample(groups[key], excess)]
                why = tuple(s for s in group
                            if s.node_id == ctx.node_id or s.node_id in plan.under)
        return chosen, why

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
            if self._cold is not None and not left:
                # A cold start waits for the membership to hold still: this is a change.
                self._cold.quiet_since = self._context("nodes_changed")[1].monotonic()
            if left:
                if self._refuse_until is not None:
                    logger.debug("a node left: no longer refusing claims after the last release")
                self._refuse_until = None
                self._refused.clear()
                self._prune_at = _REFUSED_PRUNE_AT

    # -- internals ---------------------------------------------------------------------

    def _warming(self, ctx: BalancerContext, clock: Clock,
                 snap: _Snapshot) -> tuple[float | None, bool]:
        """(seconds left of the cold-start wait, 0.0 to claim as the probe, or None; whether
        the wait just ended). See the class docstring's "Cold start"."""
        with self._lock:
            cold = self._cold
            if cold is None:
                return None, False
            mono = clock.monotonic()
            members = frozenset(snap.counts) | {ctx.node_id}
            if members != cold.members:
                cold.members, cold.quiet_since = members, mono
            end = min(cold.quiet_since + self._warmup, cold.began + _WARMUP_MAX * self._warmup)
        held = ctx.task_count()
        cluster_held = held + sum(max(0, int(n)) for node, n in snap.counts.items()
                                  if node != ctx.node_id)
        claimable = snap.claimable if snap.claimable is not None else ctx.claimable_count()
        work = cluster_held + max(0, claimable or 0)
        if (mono < end and work >= max(1, self._warmup_backlog)
                and cluster_held * _COLD_HELD < work):
            if held < max(1, work // _PROBE):
                return 0.0, False
            return end - mono, False
        with self._lock:
            self._cold = None
        return None, mono >= end

    def _short(self, ctx: BalancerContext, clock: Clock) -> bool:
        """Whether this node runs short tasks now (see the class docstring's "Short tasks");
        the verdict is kept a quarter of a second."""
        runs = ctx.runs
        if runs is None or self._short_run <= 0:
            return False
        mono = clock.monotonic()
        with self._lock:
            seen = self._short_seen
        if seen is not None and mono - seen[0] < _SHORT_RECHECK:
            return seen[1]
        window = _SHORT_WINDOW * self._short_run
        count, median = runs.recent(window)
        short = count >= _SHORT_MIN_RUNS and median is not None and median < self._short_run
        if short:
            now = clock.now()
            running = [rt for rt in ctx.tasks() if rt.stopped is None]
            old = sum(1 for rt in running if (now - rt.started).total_seconds() > window)
            short = 4 * old <= len(running)
        with self._lock:
            if short and self._cold is not None:
                self._cold = None  # nothing to wait for: completion evens short tasks
            # Too few runs yet is no verdict: the next run to end may decide (and
            # refusals_lifted asks right then), so it is not kept.
            self._short_seen = (mono, short) if count >= _SHORT_MIN_RUNS else None
        return short

    def _work(self, ctx: BalancerContext, snap: _Snapshot, pool: _Pool, held: int) -> int | None:
        """The work this node and its peers share: what they hold plus what is claimable.

        From the store's own claimable count when it gives one: counts and claimable read
        together add up to a total no claim changes, so a stale snapshot still gives the
        right share. Else from the consumer's claimable count; None when neither says.
        """
        if snap.claimable is not None:
            return pool.held + max(0, int(snap.counts.get(ctx.node_id, held))) + snap.claimable
        claimable = ctx.claimable_count()
        return None if claimable is None else pool.held + held + max(0, claimable)

    def _limit(self, ctx: BalancerContext, snap: _Snapshot, pool: _Pool) -> tuple[bool, bool]:
        """(whether claiming one more task would take this node above its limit, whether a
        lighter peer still has room below its share)."""
        held = ctx.task_count()
        weight = snap.weight(ctx.node_id)
        whole = pool.weight + weight
        work = self._work(ctx, snap, pool, held)
        if work is None:  # Metafora's rule: threshold times the share of what is held
            return held > self._threshold * (pool.held + held) * weight / whole + EPS, False
        mine = Standing(ctx.node_id, held, work * weight / whole)
        slack, room = self._slack, False
        if pool.lightest is not None:
            other_held, other_weight = pool.lightest
            lightest = Standing("", other_held, work * other_weight / whole)
            room = lightest.held < lightest.share
            if self._both_sides and lightest.under(self._threshold, self._band):
                # Leave the task to the under-loaded peers, unless more is claimable than they
                # miss: then taking it takes nothing from them (at a cold start every node but
                # the slowest stopped at the band's edge and waited for it).
                claimable = work - pool.held - held
                if not mine.under(self._threshold, self._band) and claimable <= pool.under_need(
                        work, whole, self._threshold, self._band):
                    return True, True
                slack = 0
        return held >= mine.share + slack, room

    def _snapshot(self, ctx: BalancerContext, clock: Clock, *, fresh: bool,
                  selector: Mapping[str, str], published: bool = False,
                  far_below: bool = False) -> _Snapshot:
        """The cached snapshot, re-read when ``fresh`` or older than ``counts_ttl``; with
        the labels when ``selector`` needs them. ``published``: read the counts the nodes
        published instead of the claims (never cached: see :meth:`balance`). ``far_below``:
        kept longer while it shows this node far below its share (see :meth:`_far_below`)."""
        mono = clock.monotonic()
        with self._lock:
            snap = self._snap
        if (not fresh and far_below and snap is not None
                and mono - snap.at < _FAR_BELOW_TTL * self._counts_ttl
                and self._far_below(ctx, snap, selector)):
            return snap
        if fresh or snap is None or mono - snap.at >= self._counts_ttl:
            state = ctx.cluster_state
            # A store whose published counts are its exact ones (the default) reads once.
            published = published and state.publishes_counts
            counts = dict(state.published_task_count() if published
                          else state.active_task_count())
            claimable = state.claimable_count()  # from the same read as the counts
            snap = _Snapshot(mono, counts, dict(state.node_weights()), state.frozen_nodes(),
                             None if claimable is None else max(0, int(claimable)),
                             capacities=dict(state.node_capacities()), published=published)
            if not published:
                with self._lock:
                    self._snap = snap
        if selector and snap.labels is None:
            snap.labels = dict(ctx.cluster_state.node_labels())
        return snap

    def _far_below(self, ctx: BalancerContext, snap: _Snapshot,
                   selector: Mapping[str, str]) -> bool:
        """Whether ``snap`` shows this node under ``_FAR_BELOW`` of its share of the work.

        Then the next offer is claimed whatever a fresh read would say, and reading the
        counts (a count of the claims: O(tasks held) in a SQL store) would only cost: in a
        start-up storm every node read them every second while it claimed, 100,000 rows a
        read. The work is what the counts and the claimable count add up to, which no claim
        changes (only submits and ends, seen at the next read, ``_FAR_BELOW_TTL`` ttls at
        most); membership changes drop the snapshot (:meth:`nodes_changed`).
        """
        if selector and snap.labels is None:
            return False
        pool = snap.pool(ctx.node_id, selector)
        if pool.size == 0:
            return False
        held = ctx.task_count()
        work = self._work(ctx, snap, pool, held)
        if work is None:
            return False
        weight = snap.weight(ctx.node_id)
        return held < _FAR_BELOW * work * weight / (pool.weight + weight)

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
        for task_id in [tid for tid, (until, _) in self._refused.items() if until < horizon]:
            del self._refused[task_id]
        self._prune_at = max(_REFUSED_PRUNE_AT, 2 * len(self._refused))

    def __repr__(self) -> str:
        return (
            f"FairBalancer(threshold={self._threshold!r}, "
            f"claim_delay={self._claim_delay.total_seconds()!r}, "
            f"refuse_for={self._refuse_for.total_seconds()!r}, band={self._band!r}, "
            f"slack={self._slack!r}, max_releases={self._max_releases!r}, "
            f"warmup={self._warmup!r}, short_run={self._short_run!r})"
        )


def _held_selectors(ctx: BalancerContext) -> frozenset[SelectorKey] | None:
    """``ctx.held_selectors()``; None (not told) from a context without that method (a
    stand-in written before it existed): the balance then builds the list of tasks."""
    method = getattr(ctx, "held_selectors", None)
    return None if method is None else method()


def _count(value: object, name: str, *, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``, else ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
