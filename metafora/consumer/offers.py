"""Offer routing: which offers this node claims, when, and in what order.

The claim pipeline of one offer: placement (a selector this node does not match: not ours)
-> already running or ignored? -> a free slot (``max_tasks``, the thread cap, a capacity
reduced by a failed start: :mod:`metafora.consumer.capacity`; else deferred: :class:`Deferred`) -> soft
placement hold-back (:class:`Placement`) -> ``Balancer.can_claim`` (a refusal ignores the
offer until a deadline: :class:`Ignores`) -> claimed in bursts with ``claim_many``. A wave
of offers is split first by rendezvous preference (:mod:`metafora.consumer.preference`), and
offers go highest ``Task.priority`` first.

Everything here runs on the consumer's loop thread, except :meth:`OfferRouter.back_off` and
:meth:`OfferRouter.ignore` (a handler's end, a handoff), which take the consumer's lock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from metafora.consumer.capacity import Capacity
from metafora.consumer.context import PartsContext
from metafora.consumer.events import Signal
from metafora.consumer.first_offer import FirstOffers
from metafora.consumer.offer_queues import (
    DEFER_AFTER,
    DEFER_LOSS,
    OVERFETCH,
    Deferred,
    GroupWaits,
    Ignores,
    Spares,
    by_priority,
)
from metafora.consumer.outcomes import OutcomeWriter
from metafora.consumer.placement import Placement
from metafora.consumer.preference import Preference
from metafora.consumer.running import Running
from metafora.contracts.balancer import Balancer
from metafora.contracts.coordinator import Coordinator
from metafora.core import tracing
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import CoordinatorClosed, MetaforaError
from metafora.core.task import Task, matches

# Deferred, Ignores, Spares, by_priority and their constants live in offer_queues (named here too).
__all__ = ["DEFER_AFTER", "DEFER_LOSS", "OVERFETCH", "Deferred", "FusedClaims", "Ignores", "OfferRouter",
           "Placement", "Spares", "by_priority"]

WAVE = 100  # offers in one pass of the loop that make a wave (split by rendezvous preference)
MAX_HOLD = 10  # a held-back offer is tried at most this many rendezvous_waits after it was held
DEFAULT_CLAIM_BURST = 32  # offers per claim_many when the coordinator names no claim_burst
FUSED_OUTCOMES = 256  # queued outcomes sent along with one claim (finish_and_claim)
FUSE_LINGER = 0.005  # seconds an outcome waits for a due claim to take it along
FRESH_CHUNK = 500  # a long offer list is walked this many at a time (see OfferRouter.offer)
FRESH_LOSS = 0.2  # from this moving share of offers lost to races, each chunk is re-checked
DEFER_FOR = (1.0, 3.0)  # seconds a contested chunk is put off (drawn per chunk)


def _not_wired(task: Task) -> None:
    raise RuntimeError("OfferRouter.starts_with was not called: nothing starts a claimed task")


class OfferRouter:
    """Walks offers through the claim pipeline and keeps what waits: deferred, ignored, held.

    It reads the consumer's shared state from ``ctx`` (:class:`PartsContext`: the running map
    and its lock, ``post`` to tell the loop that a slot is free while offers wait);
    :meth:`starts_with` names what starts the handler of a claimed task.
    """

    def __init__(self, ctx: PartsContext, balancer: Balancer, *, capacity: Capacity) -> None:
        coordinator, options, clock = ctx.coordinator, ctx.options, ctx.clock
        self._coord = coordinator
        self._balancer = balancer
        self._options = options
        self._running: Mapping[str, Running] = ctx.running
        self._lock = ctx.lock
        self.capacity = capacity
        self._stopping = ctx.stopping
        self._wake = ctx.wake
        self._start: Callable[[Task], None] = _not_wired
        self._post = ctx.post
        self._stats = ctx.stats
        self._clock = clock
        self._rng = ctx.rng
        self._log = ctx.log
        self.frozen = False  # claims nothing new (set by the freeze commands)
        self._claims = FusedClaims(coordinator)
        self.approved = 0  # offers the balancer approved in this pass, not claimed yet
        self.spares = Spares()
        self.ignores = Ignores()
        self.deferred = Deferred()
        self._releases: dict[str, int] = {}
        self._grouped = GroupWaits()
        hold = options.rendezvous_wait
        self._preference = Preference(coordinator.node_id, hold=hold, max_hold=MAX_HOLD * hold,
                                      wave=WAVE)
        self._first = FirstOffers(self._preference)  # one node per offer
        self._placement = Placement(coordinator, options, clock)
        # Offers approved by the balancer are claimed this many per claim_many call.
        self._claim_burst = max(1, int(getattr(coordinator, "claim_burst", DEFAULT_CLAIM_BURST)))

    def starts_with(self, start: Callable[[Task], None]) -> None:
        """Claimed tasks are started by ``start`` (the launcher, built after this router: it
        backs off through it)."""
        self._start = start

    # -- waves and deadlines (the loop) ---------------------------------------------

    def arrange(self, offers: list[Task]) -> None:
        """Order one pass's offers in place: shuffled, then highest priority first."""
        # Every node hears the same offers in the same order; shuffling them makes nodes
        # try different tasks first, so fewer claims are lost to a race (one round trip each).
        self._rng.shuffle(offers)
        # Higher priority first; the sort is stable, so each priority stays shuffled.
        offers.sort(key=by_priority)

    def offer_wave(self, offers: list[Task]) -> None:
        """A wave: this node tries its own share first, holds the others' back (first_offer)."""
        now = self._clock.monotonic()
        self.offer(*self._first.split(self._preference.split(offers, now), now))

    def freeze(self, frozen: bool) -> None:
        """Claim nothing new (True) or claim again (False)."""
        self.frozen = frozen
        if frozen and self._claims.writer is not None:  # no claim will take queued outcomes along
            self._claims.writer.nudge()

    def members(self, members: set[str]) -> None:
        """The live nodes changed (one left: what was left to it is tried now)."""
        if self._preference.members(members):
            self._first.flush(self._clock.monotonic())

    def next_due(self) -> float | None:
        """The earliest time a held-back or ignored offer is due, or None."""
        with self._lock:
            times = (self.ignores.next_due(), self.capacity.retry_at)
        return min((t for t in (self._preference.next_due(), self._first.next_due(), *times)
                    if t is not None), default=None)

    def release_held(self, now: float) -> None:
        """Offers held back for their preferred node that are due: try those still claimable
        (most were taken meanwhile; ``claimable``, SQL, tells which in one read: first offers'),
        unless this node's own offers wait for a slot (:meth:`Deferred.behind_own`)."""
        for held, check in ((self._preference.due(now, 1000), False), (self._first.due(now), True)):
            with self._lock:
                behind = bool(held) and self.deferred.behind_own(held, self._running)
            if behind:
                self.retry_deferred()  # a slot may be free: this node's own offers first
            elif held:
                self.offer(*held, waited=True, check=check)

    def _still_open(self, tasks: list[Task], what: str, *, check: bool = False) -> list[Task]:
        """Those of ``tasks`` still claimable, as far as the store tells cheaply: its local
        view, then (for a wave, or when ``check``) one read per 500 where it has one
        (``claimable``, SQL)."""
        tasks = [t for t in tasks if not self._coord.seen_taken(t)]
        claimable = getattr(self._coord, "claimable", None)
        if tasks and (check or len(tasks) >= WAVE) and claimable is not None:
            try:
                return list(claimable(tasks))
            except CoordinatorClosed:
                raise
            except MetaforaError as exc:  # then try them all: a claim skips the taken ones
                self._log.warning("could not check %d %s offers: %s", len(tasks), what, exc,
                                  extra={"action": "claim"})
        return tasks

    def expire_ignores(self, now: float) -> None:
        """Offer again the ignored tasks whose deadline has passed."""
        with self._lock:
            due = self.ignores.pop_due(now)
            retry = self.capacity.retry_due(now, len(self._running))
        with self._lock:  # offers that waited on a full group: most were taken meanwhile
            grouped = self._grouped.forget(due)
        # A storm's refused offers come back by the thousand, most taken by others meanwhile:
        # judging and claiming each again would be the node's main work. Each chunk is
        # narrowed as it is reached (see offer), not the whole list first: walking it takes
        # long enough for others to take much of what a read up front called open.
        due.sort(key=by_priority)
        self.offer(*due, waited=True, check=grouped > 0)
        if retry:  # a reduced capacity rose: try a waiting offer
            self.retry_deferred()

    def forgive_refusals(self, now: float) -> None:
        """Offers the balancer refused may be claimable now (a node left: they may be its
        orphans; the balancer lifted its refusals): try them now.

        Our own release back-offs stay (they stop a released task from coming back).
        """
        with self._lock:
            for task_id, (due, task) in self.ignores.items():
                if task_id not in self._releases and due > now:
                    self.ignores.put(task, now)

    def retry_deferred(self) -> None:
        """A slot may be free: re-offer deferred tasks, unless frozen."""
        if self.deferred and not self.frozen:
            self.redo_deferred()

    def redo_deferred(self) -> None:
        """Re-offer deferred tasks, a few per free slot (highest priority first, then
        oldest; see ``OVERFETCH``).

        Not the whole map: with a backlog far beyond ``max_tasks`` that would re-walk it
        after every finished task (quadratic). Slots still free after a round (offers refused
        or lost to a race) take another round; the map shrinks every round (offers go back
        only when a claim filled every free slot, which ends the rounds). Other nodes' offers
        come after this node's own, checked a chunk at a time (:meth:`FirstOffers.others`).
        """
        while True:
            with self._lock:
                if self.frozen or not self.deferred or self._stopping.is_set():
                    return
                slots = self.free_slots()
                if slots is not None and slots <= 0:
                    return
                taken = self.deferred.take(None if slots is None else self.spares.offers_for(slots))
                waiting, others = self._first.others(taken, self.deferred, FRESH_CHUNK)
            self.offer(*waiting)
            if others:  # checked once; those still open are this node's own from now on
                self._first.adopt(others := self._still_open(others, "deferred", check=True))
                self.offer(*others)

    # -- the pipeline -----------------------------------------------------------------

    def offer(self, *tasks: Task, waited: bool = False, check: bool = False) -> None:
        """The claim pipeline: ignored? -> balancer.can_claim -> claim (batched) -> handler.

        Offers are walked ``FRESH_CHUNK`` at a time, and while claims lose races (the moving
        share of :class:`Spares` at ``FRESH_LOSS`` or more) each chunk is first narrowed to
        the offers still claimable (:meth:`_still_open`: the local view, and one read per
        chunk of ``WAVE`` or more where the store has one). A start-up backlog or a rescan
        queues tens of thousands of offers, and walking them takes seconds while other nodes
        take most: tried stale, a node lagging behind its share won a few tasks per claim of
        256 while the rest of the cluster, at its share, waited for it. Offers that ``waited``
        (refused, held back) are narrowed whatever the share lost, ``check``: even a chunk
        under ``WAVE`` is read. While most claims lose (:meth:`Spares.contested`), each chunk
        of a long fresh list is put off for a moment instead (:meth:`_put_off`).
        """
        try:
            for start in range(0, len(tasks), FRESH_CHUNK):
                if self._stopping.is_set():
                    return
                chunk: Sequence[Task] = tasks[start:start + FRESH_CHUNK]
                if not (waited or check) and len(tasks) >= FRESH_CHUNK and self.spares.contested():
                    self._put_off(chunk)
                    continue
                # Fresh offers before the first claim are not read: one node per offer
                # leaves this node its own share, and a read would delay its first claim.
                losing = self.spares.noted > 0 and self.spares.loss >= FRESH_LOSS
                if (waited or check or losing) and self._room():
                    chunk = self._still_open(list(chunk), "waiting", check=check)
                self._offer(chunk)
        finally:
            self.approved = 0
            if self._claims.writer is not None:  # outcomes left to a claim that is not coming
                self._claims.writer.nudge()

    def _room(self) -> bool:
        """Whether an offer could be claimed now (a free slot, not frozen). Without one a chunk
        is only deferred: narrowing it first would be a read for nothing (a start-up backlog
        of 20,000 cost a node 40 reads while its slots were full)."""
        with self._lock:
            return self._open(self.free_slots())

    def _open(self, slots: int | None) -> bool:
        """Whether this node claims with ``slots`` free (not frozen, a slot or no bound)."""
        return not self.frozen and (slots is None or slots > 0)

    def _put_off(self, tasks: Sequence[Task]) -> None:
        """Ignore a chunk of a long fresh list for a moment (``DEFER_FOR``): most claims lose.

        A node walking a backlog right behind another, in the same order, loses nearly every
        race, its view of what the other took a moment late: it tried stale offers one claim
        after another while its share waited. Put off, the chunk comes back as offers that
        waited, narrowed to what is still open when it is reached (see :meth:`offer`), and
        the node moves on to the rest of the list.
        """
        now = self._clock.monotonic()
        due = now + self._rng.uniform(*DEFER_FOR)
        with self._lock:
            for task in tasks:
                if task.id not in self._running and task.id not in self.ignores:
                    self.ignores.put(task, due)
        self._wake.set()

    def _offer(self, tasks: Sequence[Task]) -> None:
        approved: list[Task] = []
        approved_ids: set[str] = set()
        # Running tasks per spread group, counted once per claim burst (not once per offer).
        spreads: dict[str | None, int] | None = None
        for task in tasks:
            if self._stopping.is_set():
                return
            if task.selector and not matches(task.selector, self._options.labels):
                continue  # placement: another node's task (the claim would refuse it too)
            with self._lock:
                if task.id in self._running or task.id in approved_ids:
                    continue
                if task.id in self.ignores:
                    self.ignores.keep_offer(task)
                    continue
                slots = self.free_slots()
                if not self._open(slots):
                    self.deferred.put(task, own=self._first.own(task))
                    continue
            if task.spread is not None and spreads is None:
                with self._lock:
                    spreads = collections.Counter(e.task.spread for e in self._running.values())
            wait = self._placement.hold_back(task, approved, spreads)
            if wait is not None:
                self.ignore(task, wait)
                continue
            ok = self._can_claim(task, ignore=not approved)
            if not ok and approved:
                # Refused while a burst is approved but not claimed: claim it, then ask again
                # against what was won, so a race lost in the burst does not leave this node
                # short while the rest of the pass waits out a refusal.
                self._claim_approved(approved)
                approved = []
                approved_ids.clear()
                spreads = None
                ok = self._can_claim(task)
            if not ok:
                continue
            approved.append(task)
            approved_ids.add(task.id)
            self.approved = len(approved)
            burst = self._claim_burst if slots is None else min(self._claim_burst,
                                                                 self.spares.offers_for(slots))
            if len(approved) >= burst:
                self.claim(approved, len(approved) if slots is None else slots)
                approved = []
                approved_ids.clear()
                self.approved = 0  # those won run now; those lost are not ours
                spreads = None  # the burst started handlers: count again when next needed
        if approved:
            self._claim_approved(approved)

    def _claim_approved(self, approved: list[Task]) -> None:
        with self._lock:
            slots = self.free_slots()
        self.claim(approved, len(approved) if slots is None else max(1, slots))
        self.approved = 0  # those won run now; those lost are not ours

    def _can_claim(self, task: Task, ignore: bool = True) -> bool:
        """Ask the balancer; a refusal (or a balancer error) ignores the offer for a while
        (unless not ``ignore``: the caller asks again)."""
        try:
            ok, until = self._balancer.can_claim(task)
        except Exception as exc:
            self._log.exception("balancer failed on can_claim(%s): %s", task.id, exc,
                                extra={"task": task.id, "action": "can_claim"})
            ok, until = False, None
        if not ok and ignore:
            self.ignore(task, until)
        return ok

    def free_slots(self) -> int | None:
        """Handlers this node may still start (None: no bound). Called holding the lock."""
        return self.capacity.free_slots(len(self._running))

    def claim(self, tasks: list[Task], limit: int) -> None:
        """Claim up to ``limit`` of ``tasks`` in one request and start what was won."""
        began = SYSTEM_CLOCK.monotonic()
        try:
            with tracing.claim_span(self._coord.node_id, len(tasks)) as span:
                claimed = self._claims.claim(tasks, limit)
                span.set_attribute("metafora.claimed", len(claimed))
        except CoordinatorClosed:
            raise
        except MetaforaError as exc:  # one failed claim must not take the node down
            self._log.warning("claiming %d task(s) failed, will retry: %s", len(tasks), exc,
                              extra={"action": "claim"})
            for task in tasks:
                self.ignore(task, self._options.refuse_retry)
            return
        self._first.delay.note(took := SYSTEM_CLOCK.monotonic() - began)
        self._stats.claim_latency.observe(took)
        self.spares.note(tasks, claimed, limit)
        if len(claimed) < limit:  # every offer was tried (else the rest are deferred below)
            self._group_waits(tasks, claimed)
        if len(claimed) < limit:  # every offer was tried: those not won went to others
            self._stats.incr("races_lost", len(tasks) - len(claimed))
        elif len(claimed) < len(tasks):
            # The limit was reached: offers past it may not have been tried. Defer them again
            # (a slot freeing up re-offers them); stale ones drop out once a claim tries all.
            won = {t.id for t in claimed}
            with self._lock:
                for task in tasks:
                    if task.id not in won:
                        self.deferred.put(task, replace=False, own=self._first.own(task))
        for task in claimed:
            self._start(task)
        with self._lock:
            slots = self.free_slots()
            room = bool(self.deferred) and (slots is None or slots > 0)
        if room:
            # Offers met while this batch filled the free slots were deferred. The tasks we
            # did not win (or did not start) leave slots free, and no handler may ever finish
            # to retry the deferred offers: retry them now (through the loop, not recursively).
            self._post(Signal.ROOM)

    def fuse_outcomes(self, writer: OutcomeWriter) -> None:
        """Claims take the outcomes queued on ``writer`` along (:class:`FusedClaims`)."""
        self._claims.attach(writer, self.claim_soon)

    def claim_soon(self) -> bool:
        """Whether a claim is in flight, or due: offers wait and a slot is free for them. The
        outcome writer then leaves queued outcomes to it for a moment (called from the
        writer's thread and where handlers end: reads only, no lock). Offers waiting while
        every slot is taken are no claim due: an outcome left to one would wait for nothing."""
        if self._claims.claiming:
            return True
        if not self.deferred or self._stopping.is_set():
            return False
        return self._open(self.capacity.free_slots(len(self._running)))

    # -- limit groups -----------------------------------------------------------------

    def _group_waits(self, tasks: list[Task], claimed: list[Task]) -> None:
        """Offers of a limit group this claim did not win wait a little (:class:`GroupWaits`)."""
        with self._lock:
            waiting = self._grouped.note(tasks, claimed)
        for task in waiting:
            self.ignore(task, self._options.refuse_retry)

    def group_freed(self, group: str) -> None:
        """A task of ``group`` ended here: its waiting offers are due now."""
        with self._lock:
            self._grouped.freed(group, self.ignores, self._clock.monotonic())
        self._wake.set()

    # -- ignoring ---------------------------------------------------------------------

    def ignore(self, task: Task, until: datetime | float | None) -> None:
        """Ignore offers of ``task`` until ``until`` (a time, seconds, or ``refuse_retry``)."""
        if until is None:
            delay = self._options.refuse_retry
        elif isinstance(until, datetime):
            delay = (until - self._clock.now()).total_seconds()
        else:
            delay = until
        with self._lock:
            self.ignores.put(task, self._clock.monotonic() + max(0.0, delay))
        self._wake.set()

    def back_off(self, task: Task) -> None:
        """This node let ``task`` go: ignore it for a back-off doubling per release (lock held)."""
        count = self._releases.get(task.id, 0) + 1
        self._releases[task.id] = count
        options = self._options
        backoff = min(options.release_backoff * 2 ** (count - 1), options.release_backoff_max)
        if backoff > 0:
            self.ignore(task.with_token(0), backoff * self._rng.uniform(0.8, 1.2))

    def forget_releases(self, task_id: str) -> None:
        """``task`` ended for good here: its next release backs off from the start (lock held)."""
        self._releases.pop(task_id, None)


class FusedClaims:
    """A node's claims: ``claim_many``, and where the coordinator can (``finish_and_claim``)
    the outcomes waiting for the group commit go along in the same request (one round trip)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coord = coordinator
        self.writer: OutcomeWriter | None = None  # the group commit (set by attach)
        self.claiming = False  # a claim is in flight

    def attach(self, writer: OutcomeWriter, claim_soon: Callable[[], bool]) -> None:
        """Where the coordinator can (``finish_and_claim``), claims take the outcomes queued
        on ``writer`` along, and the writer leaves them to a due claim (``claim_soon``) for
        ``FUSE_LINGER``."""
        if hasattr(self._coord, "finish_and_claim"):
            self.writer = writer
            writer.linger = FUSE_LINGER
            writer.claim_soon = claim_soon

    def claim(self, tasks: list[Task], limit: int) -> list[Task]:
        """Claim up to ``limit`` of ``tasks``: the tasks won."""
        fused: Any = getattr(self._coord, "finish_and_claim", None)
        writer = self.writer
        if fused is None or writer is None:
            return self._coord.claim_many(tasks, limit)
        self.claiming = True
        try:
            taken = writer.take(FUSED_OUTCOMES)
            if not taken:
                return self._coord.claim_many(tasks, limit)
            try:
                results, claimed = fused([p.finish for p in taken], tasks, limit)
            except BaseException:
                writer.give_back(taken)  # the group commit writes them on its own
                raise
            writer.written(taken, list(results))
            return list(claimed)
        finally:
            self.claiming = False
