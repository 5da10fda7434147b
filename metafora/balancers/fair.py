"""FairBalancer: keep every node near the cluster's average task count."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta

from metafora.balancer import BalancerContext, RunningTask
from metafora.balancers._base import ContextBalancer, seconds
from metafora.clock import Clock
from metafora.errors import ConfigError
from metafora.task import Task, matches

__all__ = ["FairBalancer"]

logger = logging.getLogger(__name__)

_EPS = 1e-9  # float slack: 1.1 * 10 is 11.000000000000002, which must not count as "above 11"
_REFUSED_KEEP = timedelta(seconds=60)  # how long a first refusal is remembered past its ignore
_REFUSED_PRUNE_AT = 1024  # prune remembered refusals once there are this many


class FairBalancer(ContextBalancer):
    """Releases random tasks while this node holds over ``threshold`` times the cluster average.

    The cluster's counts come from ``ctx.cluster_state.active_task_count()`` (live nodes that
    did not announce they are leaving: a node shutting down still holds its last tasks but
    takes none, so it is not averaged over); this node's own entry is always its local count
    (``ctx.task_count()``), which the store's view may lag.

    **Releasing** (:meth:`balance`): when this node holds more than ``threshold`` times the average,
    it releases just enough randomly chosen tasks (``rng``) to come down to
    :meth:`desired_count`, ``ceil(threshold * average)``: never to the average or below it,
    so the released tasks do not make another node the heaviest one (no ping-pong). Tasks
    already stopping are neither chosen nor counted as staying.

    **After a release** it refuses every claim for ``claim_delay`` (returning that deadline as
    the ignore time) so the released tasks go to other nodes, and it releases nothing more
    meanwhile: while released tasks wait to be claimed the cluster's counts are low and would
    make it release again.

    **Claiming** (:meth:`can_claim`): a node already above ``threshold`` times the average refuses
    a task the first time it is offered (ignoring it for ``refuse_for``) so that a lighter node
    takes it; offered again after that, nobody lighter took it (the others may be frozen or
    full), so it claims it rather than leave the task waiting. A node that is alone in the
    cluster never refuses a claim.

    **Placement**: a task with a selector is weighed against its *peers*, the live nodes
    whose labels match it (``ctx.cluster_state.node_labels()``), not against nodes that could
    never run it: :meth:`can_claim` compares this node with the task's peers, and
    :meth:`balance` takes the running tasks one selector at a time, releasing a task only
    when this node is above ``threshold`` times its peers' average (a task no other node
    could run is never released). Without selectors every node is a peer: the plain rule.

    ``node_task_count`` costs a store round trip, so :meth:`can_claim` reuses counts (and
    labels, read only for tasks with a selector) for up to ``counts_ttl`` seconds (0
    re-reads them every time); :meth:`balance` always re-reads. Errors from the store
    propagate to the caller.

    ``clock`` defaults to the context's; durations are seconds or timedeltas.
    """

    def __init__(
        self,
        threshold: float = 1.2,
        *,
        claim_delay: float | timedelta = 10.0,
        refuse_for: float | timedelta = 1.0,
        counts_ttl: float | timedelta = 1.0,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(clock)
        if (
            not isinstance(threshold, (int, float))
            or isinstance(threshold, bool)
            or not math.isfinite(threshold)
            or threshold < 1.0
        ):
            raise ConfigError(f"FairBalancer threshold must be a number >= 1.0, got {threshold!r}")
        self._threshold = float(threshold)
        self._claim_delay = timedelta(seconds=seconds(claim_delay, "claim_delay"))
        self._refuse_for = timedelta(seconds=seconds(refuse_for, "refuse_for"))
        self._counts_ttl = seconds(counts_ttl, "counts_ttl")
        self._rng = rng if rng is not None else random.Random()
        self._lock = threading.Lock()
        self._refuse_until: datetime | None = None
        self._joined = False  # a node joined since the last balance: it may release again
        self._refused: dict[str, datetime] = {}
        self._prune_at = _REFUSED_PRUNE_AT
        self._cache: tuple[float, dict[str, int]] | None = None
        self._labels_cache: tuple[float, dict[str, dict[str, str]]] | None = None

    @property
    def threshold(self) -> float:
        """How many times the cluster average a node may hold before it releases."""
        return self._threshold

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
            self._cache = None
            self._labels_cache = None

    # -- the arithmetic, pure and public so it can be checked on its own ---------------

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
        return own > self._threshold * self.average(counts) + _EPS

    def desired_count(self, counts: Mapping[str, int]) -> int:
        """How many tasks a node releases down to: ``ceil(threshold * average)``.

        Never below ``ceil(average)``: releasing under the average would only make the node
        that takes the tasks the next one to release them.
        """
        avg = self.average(counts)
        return max(_ceil(self._threshold * avg), _ceil(avg))

    # -- the Balancer interface ------------------------------------------------------

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Claim unless just released, or above the threshold and a lighter node may take it."""
        ctx, clock = self._context("can_claim")
        counts = self._peers(ctx, clock, task.selector, self._counts(ctx, clock, fresh=False),
                             fresh=False)
        if len(counts) < 2:
            return True, None  # alone: refusing would leave the task to nobody
        now = clock.now()
        with self._lock:
            if self._refuse_until is not None and now < self._refuse_until:
                return False, self._refuse_until
            if not self.overloaded(ctx.node_id, counts):
                self._refused.pop(task.id, None)
                return True, None
            until = self._refused.get(task.id)
            if until is not None and now >= until:
                del self._refused[task.id]
                logger.debug(
                    "claiming %s above the fair share: no lighter node took it",
                    task.id,
                    extra={"node_id": ctx.node_id, "task_id": task.id},
                )
                return True, None
            if until is None:
                until = now + self._refuse_for
                self._refused[task.id] = until
                self._prune(now)
            return False, until

    def balance(self) -> list[str]:
        """Ids of randomly chosen tasks to release to come down to :meth:`desired_count`."""
        ctx, clock = self._context("balance")
        now = clock.now()
        with self._lock:
            joined, self._joined = self._joined, False
            if self._refuse_until is not None and now < self._refuse_until and not joined:
                return []  # released tasks are still finding new owners; counts are in flux
        counts = self._counts(ctx, clock, fresh=True)
        releasable = [rt for rt in ctx.tasks() if rt.stopped is None]
        # One group per selector (one group, every node a peer, when no task has one).
        groups: dict[tuple[tuple[str, str], ...], list[RunningTask]] = {}
        for rt in releasable:
            groups.setdefault(tuple(sorted(rt.task.selector.items())), []).append(rt)
        chosen: list[str] = []
        target = 0
        for key in sorted(groups):
            peers = self._peers(ctx, clock, dict(key), counts, fresh=True)
            peers[ctx.node_id] = counts[ctx.node_id] - len(chosen)
            if not self.overloaded(ctx.node_id, peers):
                continue
            target = self.desired_count(peers)
            excess = min(len(groups[key]), len(releasable) - len(chosen) - target)
            if excess > 0:
                chosen += [rt.id for rt in self._rng.sample(groups[key], excess)]
        if not chosen:
            return []
        with self._lock:
            self._refuse_until = now + self._claim_delay
        logger.info(
            "releasing %d of %d tasks: holding %d, cluster average %.2f, target %d",
            len(chosen),
            len(releasable),
            counts[ctx.node_id],
            self.average(counts),
            target,
            extra={"node_id": ctx.node_id, "released": len(chosen)},
        )
        return chosen

    def nodes_changed(self, left: bool) -> None:
        """Forget cached counts; when a node left, stop refusing claims after a release.

        The refusal after a release protects a balance decision taken over the old
        membership; once a node has gone, its tasks are orphans that must find owners now,
        and the next balance re-reads the counts anyway. When a node joined, the next
        balance may release again even within ``claim_delay`` (the newcomer moved the
        average): otherwise a node that released just before a join would leave the
        newcomer idle until a periodic balance after the delay.
        """
        with self._lock:
            self._cache = None
            self._joined = self._joined or not left
            if left:
                if self._refuse_until is not None:
                    logger.debug("a node left: no longer refusing claims after the last release")
                self._refuse_until = None
                self._refused.clear()
                self._prune_at = _REFUSED_PRUNE_AT

    # -- internals ---------------------------------------------------------------------

    def _counts(self, ctx: BalancerContext, clock: Clock, *, fresh: bool) -> dict[str, int]:
        mono = clock.monotonic()
        with self._lock:
            cached = self._cache
        if fresh or cached is None or mono - cached[0] >= self._counts_ttl:
            others = dict(ctx.cluster_state.active_task_count())
            with self._lock:
                self._cache = (mono, others)
        else:
            others = cached[1]
        counts = dict(others)
        counts[ctx.node_id] = ctx.task_count()
        return counts

    def _peers(self, ctx: BalancerContext, clock: Clock, selector: Mapping[str, str],
               counts: dict[str, int], *, fresh: bool) -> dict[str, int]:
        """``counts`` of the nodes that could run a task with ``selector`` (and this node)."""
        if not selector:
            return dict(counts)
        mono = clock.monotonic()
        with self._lock:
            cached = self._labels_cache
        if fresh or cached is None or mono - cached[0] >= self._counts_ttl:
            labels = dict(ctx.cluster_state.node_labels())
            with self._lock:
                self._labels_cache = (mono, labels)
        else:
            labels = cached[1]
        # A node the store gave no labels for (just joined) counts as a peer.
        return {node: n for node, n in counts.items()
                if node == ctx.node_id or node not in labels or matches(selector, labels[node])}

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
            f"refuse_for={self._refuse_for.total_seconds()!r})"
        )


def _ceil(value: float) -> int:
    """``math.ceil`` that forgives float noise (11.000000000000002 -> 11)."""
    return max(0, math.ceil(value - _EPS))
