"""FairBalancer: keep every node near its fair share of the work, with the fewest moves."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta

from metafora.balancers._base import ContextBalancer
from metafora.balancers._fair_counts import Counts, Pool, Snapshot, work_of
from metafora.balancers._fair_pace import MAX_REFUSALS, Pace, Refusals
from metafora.balancers.shares import (
    DEFAULT_BAND,
    EPS,
    Standing,
    ceil_share,
    check_band,
    check_threshold,
    release_plan,
    standings,
)
from metafora.contracts.balancer import BalancerContext, RunningTask, SelectorKey, selector_key
from metafora.core.clock import Clock
from metafora.core.durations import seconds
from metafora.core.errors import ConfigError
from metafora.core.task import Task

__all__ = ["DEFAULT_FAIR_THRESHOLD", "DEFAULT_SHORT_RUN", "DEFAULT_WARMUP", "DEFAULT_WARMUP_BACKLOG",
           "MAX_REFUSALS", "FairBalancer"]

logger = logging.getLogger(__name__)

DEFAULT_FAIR_THRESHOLD = 1.1  # above 110 % of its share a node gives back (the band's edge)
DEFAULT_WARMUP = 3.0  # seconds the membership must hold still before a cold start claims its share
DEFAULT_WARMUP_BACKLOG = 100  # a cold start with less work does not wait
DEFAULT_SHORT_RUN = 1.0  # tasks whose runs end faster than this are short (Pace.short)


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
        self._pace = Pace(seconds(warmup, "warmup", allow_zero=True),
                          _count(warmup_backlog, "FairBalancer warmup_backlog", minimum=0),
                          seconds(short_run, "short_run", allow_zero=True))
        self._claim_delay = timedelta(seconds=seconds(claim_delay, "claim_delay", allow_zero=True))
        self._refused = Refusals(timedelta(seconds=seconds(refuse_for, "refuse_for", allow_zero=True)))
        self._counts = Counts(seconds(counts_ttl, "counts_ttl", allow_zero=True))
        self._rng = rng if rng is not None else random.Random()
        self._lock = threading.Lock()
        self._refuse_until: datetime | None = None
        self._joined = False  # a node joined since the last balance: it may release again
        self._refused_some = False  # an offer was refused since the tasks were last found short

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
        self._pace.start(ctx.node_id, clock.monotonic())
        self._counts.drop()
        with self._lock:
            self._refuse_until = None
            self._joined = False
            self._refused.clear()
            self._refused_some = False

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
        snap = self._counts.read(ctx, clock, fresh=False, selector=selector or {})
        held = ctx.task_count()
        members = snap.members(ctx.node_id, held, selector or {})
        work = work_of(ctx, snap, snap.pool(ctx.node_id, selector or {}), held)
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
        if not self._pace.short(ctx, clock):
            return False
        self._refused_some = False
        return True

    def _can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        ctx, clock = self._context("can_claim")
        if self._pace.short(ctx, clock):
            return True, None  # completion evens the cluster (see the class docstring)
        snap = self._counts.read(ctx, clock, fresh=False, selector=task.selector,
                                 far_below=not self._pace.cold)
        now = clock.now()
        wait, ended = self._pace.warming(ctx, clock, snap)
        if wait == 0.0:
            return True, None  # the cold start's probe
        if wait is not None:
            return False, now + timedelta(seconds=wait)
        if ended:  # peers registered during the wait: count them
            snap = self._counts.read(ctx, clock, fresh=True, selector=task.selector)
        pool = snap.pool(ctx.node_id, task.selector)
        if pool.size == 0:
            return True, None  # alone: refusing would leave the task to nobody
        with self._lock:
            if self._refuse_until is not None and now < self._refuse_until:
                return False, self._refuse_until
        above, room = self._limit(ctx, snap, pool)
        with self._lock:
            if not above:
                self._refused.forget(task.id)
                return True, None
            until = self._refused.refuse(task.id, now, room)
        if until is not None:
            return False, until
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
        if self._pace.short(ctx, clock):
            return []  # short tasks: completion evens the cluster, a release only costs
        held = ctx.task_count()
        # The published counts first (one record per node): nothing to release on them, and
        # the claims are not read at all; something to release, and the exact counts decide.
        snap: Snapshot | None = None
        keys = _held_selectors(ctx)
        if keys is not None:
            # The context tallies its tasks' selectors: whether anything is to be released
            # is decided on the counts alone, and the list of tasks (O(held)) is built only
            # when something is -- never on an even cluster.
            if not keys:
                return []  # no task held
            snap = self._counts.read(ctx, clock, fresh=True, selector={}, published=True)
            if not self._releases(ctx, snap, held, keys):
                return []
        live = [rt for rt in ctx.tasks() if rt.stopped is None]
        # One group per selector (one group, every node a peer, when no task has one).
        groups: dict[SelectorKey, list[RunningTask]] = {}
        for rt in live:
            if not _young(rt, now, self._min_age):
                groups.setdefault(selector_key(rt.task.selector), []).append(rt)
        if not groups:
            return []
        if snap is None:
            snap = self._counts.read(ctx, clock, fresh=True, selector={}, published=True)
        chosen, why = self._plan(ctx, snap, held, live, groups)
        if chosen and snap.published:
            labels = snap.labels  # read once per balance: the exact pass reuses them
            snap = self._counts.read(ctx, clock, fresh=True, selector={})
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

    def _releases(self, ctx: BalancerContext, snap: Snapshot, held: int,
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

    def _plan(self, ctx: BalancerContext, snap: Snapshot, held: int, live: list[RunningTask],
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
        self._counts.drop()
        if not left and self._pace.cold:
            # A cold start waits for the membership to hold still: this is a change.
            self._pace.joined(self._context("nodes_changed")[1].monotonic())
        with self._lock:
            self._joined = self._joined or not left
            if left:
                if self._refuse_until is not None:
                    logger.debug("a node left: no longer refusing claims after the last release")
                self._refuse_until = None
                self._refused.clear()

    # -- internals ---------------------------------------------------------------------

    def _limit(self, ctx: BalancerContext, snap: Snapshot, pool: Pool) -> tuple[bool, bool]:
        """(whether claiming one more task would take this node above its limit, whether a
        lighter peer still has room below its share)."""
        held = ctx.task_count()
        weight = snap.weight(ctx.node_id)
        whole = pool.weight + weight
        work = work_of(ctx, snap, pool, held)
        if work is None:  # Metafora's rule: threshold times the share of what is held
            return held > self._threshold * (pool.held + held) * weight / whole + EPS, False
        mine = Standing(ctx.node_id, held, work * weight / whole)
        slack, room, claimable = self._slack, False, work - pool.held - held
        if pool.lightest is not None:
            other_held, other_weight = pool.lightest
            lightest = Standing("", other_held, work * other_weight / whole)
            room = lightest.held < lightest.share
            if self._both_sides and lightest.under(self._threshold, self._band):
                # Leave the task to the under-loaded peers, unless more is claimable than they
                # miss (at a cold start every node but the slowest waited at the band's edge).
                if not mine.under(self._threshold, self._band) and claimable <= pool.under_need(
                        work, whole, self._threshold, self._band):
                    return True, True
                slack = 0
            # Slack is for a misjudged share, not a race's spread (issue 49: 26/26/25/23, even to the band)
            if slack and room and held >= mine.share and pool.owed(work, whole, claimable):
                return True, True
        return held >= mine.share + slack, room

    def __repr__(self) -> str:
        return (
            f"FairBalancer(threshold={self._threshold!r}, "
            f"claim_delay={self._claim_delay.total_seconds()!r}, "
            f"refuse_for={self._refused.refuse_for.total_seconds()!r}, band={self._band!r}, "
            f"slack={self._slack!r}, max_releases={self._max_releases!r}, "
            f"warmup={self._pace.warmup!r}, short_run={self._pace.short_run!r})"
        )


def _young(rt: RunningTask, now: datetime, min_age: timedelta) -> bool:
    """Started less than ``min_age`` ago (a start ahead of this clock is not judged)."""
    return timedelta(0) <= now - rt.started < min_age


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
