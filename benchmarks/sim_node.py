"""The simulated nodes and the cluster that steps them (see :mod:`benchmarks.sim_model`)."""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from benchmarks.sim_model import FREE, NodeView, SimClock, SimConfig, SimStore, task_index
from metafora.contracts.balancer import Balancer, BalancerContext, RunningTask

__all__ = ["BalancerFactory", "Cluster", "SimNode"]

log = logging.getLogger(__name__)


class SimNode:
    """One consumer: its running tasks, ignored offers, balancer and balance schedule.

    ``step`` is one pass of the consumer's loop (``Consumer._loop``): membership, offers
    (ignored ones that are due first), handoffs, the balance tick. ``wants`` says whether a
    pass would do anything, so idle nodes cost nothing.
    """

    def __init__(self, store: SimStore, node: int, balancer: Balancer, cfg: SimConfig,
                 rng: random.Random) -> None:
        self.store = store
        self.node = node
        self.name = store.names[node]
        self.balancer = balancer
        self.cfg = cfg
        self.rng = rng
        self.running: dict[int, RunningTask] = {}  # in claim order: oldest first
        self.stopping: dict[int, float] = {}  # released task -> when its release is written
        self.ignored: dict[int, float] = {}  # task -> ignored until (monotonic)
        self._heap: list[tuple[float, int]] = []  # may hold stale entries: checked on pop
        self.released: dict[int, int] = {}  # task -> times this node released it
        self.next_balance = math.inf
        self.follow_up = False
        self.members: frozenset[int] | None = None
        self.members_seen = -1
        self.drained = -1  # claimable_version at which this node had no offer left to try
        self.quiet_until = 0.0  # a pass ended in a refusal: no new offers tried before this
        self._refused_until = 0.0  # the deadline of the last refusal
        self.leaving_at: float | None = None
        self.in_burst = 0  # approved offers not yet claimed, when cfg.count_approved
        self.balances = 0
        self.refusals = 0

    # -- what the balancer sees ------------------------------------------------------------

    def _tasks(self) -> list[RunningTask]:
        return list(self.running.values())

    def _count(self) -> int:
        return len(self.running) + self.in_burst

    def _claimable(self) -> int:
        """Claimable tasks this node sees (its watch cache is up to date)."""
        return len(self.store.pool)

    # -- life ------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        """Register, init the balancer, read the members, schedule the first balance."""
        store = self.store
        store.register(self.node)
        self.balancer.init(BalancerContext(
            self.name, NodeView(store, self.node), self._tasks, store.clock,
            count_source=self._count, claimable_source=self._claimable))
        store.count_reads[self.node] += 1
        self.members = frozenset(store.active())
        self.members_seen = store.active_version
        # Rebalancer.schedule_first with pushed membership events.
        self.next_balance = now + min(self._interval(), self._settle())

    def leave(self, now: float) -> None:
        """A graceful shutdown begins: announced as leaving, it claims and balances no more."""
        self.store.announce_leaving(self.node)
        self.leaving_at = now + self.cfg.shutdown

    def finish_leave(self) -> None:
        """The handlers stopped: every claim released (one request), then deregistered."""
        store = self.store
        store.release(self.node, list(self.running))
        self.running.clear()
        self.stopping.clear()
        store.deregister(self.node)

    # -- the loop --------------------------------------------------------------------------

    def wants(self, now: float) -> bool:
        """Whether a pass now would do anything."""
        store = self.store
        if self.members_seen != store.active_version or now >= self.next_balance or self.stopping:
            return True
        if self._heap and self._heap[0][0] <= now:
            return True
        return (bool(store.pool or store.taken) and self.drained != store.claimable_version
                and now >= self.quiet_until)

    def step(self, now: float, now_dt: datetime) -> None:
        """One pass of the loop (see the class docstring)."""
        store = self.store
        if self.members_seen != store.active_version:
            self._members_changed(now)
        due = self._pop_due(now) if self._heap and self._heap[0][0] <= now else []
        new = (bool(store.pool or store.taken) and self.drained != store.claimable_version
               and now >= self.quiet_until)
        if due or new:
            self._offers(now, now_dt, due, new)
            self.in_burst = 0  # approved offers left unclaimed (the tick's requests ran out)
        if self.stopping:
            self._handoffs(now)
        if now >= self.next_balance:
            self._balance(now, now_dt)

    # -- offers ----------------------------------------------------------------------------

    def _offers(self, now: float, now_dt: datetime, due: list[int], new: bool) -> None:
        """Offers whose ignore ran out, then new ones, through can_claim into claim bursts."""
        cfg, owner = self.cfg, self.store.owner
        approved: list[int] = []
        requests = 0
        for t in due:
            if owner[t] != FREE:
                continue  # taken meanwhile: the offer is dropped
            if self._can_claim(t, now, now_dt):
                approved.append(t)
                self.in_burst += cfg.count_approved
                if len(approved) >= cfg.claim_burst:
                    self._claim(approved, now_dt)
                    approved = []
                    requests += 1
                    if requests >= cfg.claims_per_tick:
                        return
        if due:
            self.drained = -1  # an offer tried again but not claimed is an offer like any
        if new:
            requests = self._new_offers(now, now_dt, approved, requests)
        elif approved:
            self._claim(approved, now_dt)

    def _new_offers(self, now: float, now_dt: datetime, approved: list[int], requests: int) -> int:
        """Draw new offers until a refusal, the tick's budget, or none left; claim bursts.

        A refusal makes the node quiet until its deadline (the consumer ignores every offer of
        the pass it refuses: same snapshot, same count), after up to ``refusals_per_pass``
        offers were put to the balancer (each refused one is re-offered at the deadline).
        An offer another node claimed earlier this tick is not put to the balancer: it joins
        the burst when this pass approves offers (the claim loses the race, as the real one
        would), and is dropped when the pass refuses; a pass that met only such offers asks
        the balancer about the first and does for all of them what it says.
        """
        cfg, store, me = self.cfg, self.store, self.node
        owner, ignored = store.owner, self.ignored
        seen = len(store.pool) + len(store.taken)
        exact = seen <= 2 * cfg.offers_per_tick  # few: walk all of them, shuffled
        cands = store.seen() if exact else []
        if exact:
            self.rng.shuffle(cands)
        rnd = self.rng.random
        limit = len(cands) if exact else 4 * cfg.offers_per_tick
        chosen = set(approved)
        stale: list[int] = []  # taken offers met while this pass approved nothing
        approving = bool(approved)
        tried = attempts = refusals = 0
        while tried < cfg.offers_per_tick and requests < cfg.claims_per_tick and attempts < limit:
            t = cands[attempts] if exact else store.draw(rnd)
            attempts += 1
            if owner[t] == me or t in ignored or t in chosen:
                continue
            tried += 1
            if owner[t] != FREE:
                if not approving:
                    stale.append(t)
                    continue
            elif self._can_claim(t, now, now_dt):
                approving = True
                if stale:
                    approved += stale
                    chosen.update(stale)
                    self.in_burst += len(stale) * cfg.count_approved
                    stale.clear()
            else:
                if not refusals:
                    self.quiet_until = self._refused_until
                refusals += 1
                approving = False
                stale.clear()
                if refusals >= cfg.refusals_per_pass:
                    break
                continue
            approved.append(t)
            chosen.add(t)
            self.in_burst += cfg.count_approved
            if len(approved) >= cfg.claim_burst:
                self._claim(approved, now_dt)
                approved = []
                chosen.clear()
                requests += 1
        if stale and not refusals and requests < cfg.claims_per_tick:
            # Only taken offers: the balancer decides for the first what it would for all.
            if self._can_claim(stale[0], now, now_dt):
                approved += stale
            else:
                refusals = 1
                self.quiet_until = self._refused_until
        if approved and requests < cfg.claims_per_tick:
            self._claim(approved, now_dt)
            requests += 1
        if not refusals and attempts >= limit and (exact or tried == len(stale)):
            self.drained = store.claimable_version
        return requests

    def _can_claim(self, t: int, now: float, now_dt: datetime) -> bool:
        """Ask the balancer; a refusal (or an error) ignores the offer until its deadline."""
        try:
            ok, until = self.balancer.can_claim(self.store.tasks[t])
        except Exception:
            log.exception("%s: balancer failed on can_claim", self.name)
            ok, until = False, None
        if not ok:
            self.refusals += 1
            delay = self.cfg.refuse_retry if until is None else (until - now_dt).total_seconds()
            self._refused_until = now + max(0.0, delay)
            self._ignore(t, self._refused_until)
        return ok

    def _claim(self, approved: list[int], now_dt: datetime) -> None:
        store = self.store
        won = store.claim(self.node, approved)
        tasks, running = store.tasks, self.running
        for t in won:
            running[t] = RunningTask(tasks[t], now_dt)
        self.in_burst = 0

    # -- ignores ---------------------------------------------------------------------------

    def _ignore(self, t: int, until: float) -> None:
        old = self.ignored.get(t)
        self.ignored[t] = until
        if old != until:
            heapq.heappush(self._heap, (until, t))

    def _pop_due(self, now: float) -> list[int]:
        heap, ignored = self._heap, self.ignored
        out = []
        while heap and heap[0][0] <= now:
            until, t = heapq.heappop(heap)
            if ignored.get(t) == until:
                del ignored[t]
                out.append(t)
        return out

    def _forgive(self, now: float) -> None:
        """A node left: refused offers may be its orphans; try them now (not own releases)."""
        for t, until in list(self.ignored.items()):
            if t not in self.released and until > now:
                self._ignore(t, now)

    # -- balancing -------------------------------------------------------------------------

    def _members_changed(self, now: float) -> None:
        """Rebalancer.members_changed: read the members; on a change, tell the balancer and
        balance within the window (and once more after the settle)."""
        store = self.store
        store.count_reads[self.node] += 1
        self.members_seen = store.active_version
        members = frozenset(store.active())
        before, self.members = self.members, members
        if before is None or before == members:
            return
        self.quiet_until = 0.0
        left = bool(before - members)
        try:
            self.balancer.nodes_changed(left)
        except Exception:
            log.exception("%s: balancer failed on nodes_changed", self.name)
        if left:
            self._forgive(now)
        delay = self.cfg.rebalance_window * self.rng.uniform(0.5, 1.0)
        self.next_balance = min(self.next_balance, now + delay)
        self.follow_up = True

    def _balance(self, now: float, now_dt: datetime) -> None:
        """Rebalancer.tick: balance, ask the chosen handlers to stop, schedule the next."""
        self.balances += 1
        try:
            ids = self.balancer.balance()
        except Exception:
            log.exception("%s: balancer failed", self.name)
            ids = []
        for tid in ids:
            t = task_index(tid)
            rt = self.running.get(t)
            if rt is None or rt.stopped is not None:
                continue
            self.running[t] = replace(rt, stopped=now_dt)
            self.stopping[t] = now + self.cfg.handoff
        self.next_balance = now + self._interval()
        if self.follow_up:
            self.follow_up = False
            self.next_balance = min(self.next_balance, now + self._settle())

    def _handoffs(self, now: float) -> None:
        """Handlers that returned: their releases written (one request), backed off."""
        done = [t for t, due in self.stopping.items() if due <= now]
        if not done:
            return
        for t in done:
            del self.stopping[t]
            del self.running[t]
        self.store.release(self.node, done)
        cfg = self.cfg
        for t in done:
            count = self.released.get(t, 0) + 1
            self.released[t] = count
            backoff = min(cfg.release_backoff * 2 ** (count - 1), cfg.release_backoff_max)
            if backoff > 0:
                self._ignore(t, now + backoff * self.rng.uniform(0.8, 1.2))

    def _interval(self) -> float:
        spread = self.cfg.balance_jitter * self.cfg.balance_every
        return self.cfg.balance_every + self.rng.uniform(-spread, spread)

    def _settle(self) -> float:
        return max(2 * self.cfg.rebalance_window, 2.0) * self.rng.uniform(1.0, 1.5)


BalancerFactory = Callable[[random.Random], Balancer]


class Cluster:
    """Nodes over one :class:`SimStore` on a fake clock, stepped a tick at a time.

    Deterministic for a ``seed``: every random choice (offer order, jitter, which tasks a
    balancer releases) comes from generators seeded by it and the node's name; each tick
    visits the nodes in an order drawn from the cluster's generator.
    """

    def __init__(self, tasks: int, cfg: SimConfig, seed: int, factory: BalancerFactory) -> None:
        self.clock = SimClock()
        self.store = SimStore(tasks, self.clock)
        self.cfg = cfg
        self.seed = seed
        self.factory = factory
        self.rng = random.Random(f"{seed}/cluster")
        self.nodes: dict[int, SimNode] = {}
        self._incarnation: dict[str, int] = {}
        self.ticks = 0
        self.steps = 0

    @property
    def now(self) -> float:
        """Simulated seconds (monotonic)."""
        return self.clock.monotonic()

    def start(self, name: str) -> SimNode:
        """Start a node (a restarted node keeps its name and number, with a fresh balancer)."""
        inc = self._incarnation[name] = self._incarnation.get(name, 0) + 1
        number = self.store.add_node(name)
        assert number not in self.nodes, f"{name} is already running"
        balancer = self.factory(random.Random(f"{self.seed}/{name}/{inc}/balancer"))
        node = SimNode(self.store, number, balancer, self.cfg,
                       random.Random(f"{self.seed}/{name}/{inc}"))
        node.start(self.now)
        self.nodes[number] = node
        return node

    def stop(self, name: str) -> None:
        """Begin a graceful shutdown of ``name``."""
        self.nodes[self.store.names.index(name)].leave(self.now)

    def running(self, name: str) -> bool:
        """Whether ``name`` is running (not gone)."""
        return name in self.store.names and self.store.names.index(name) in self.nodes

    def tick(self) -> None:
        """Every node that has something to do takes one pass; then time moves one tick."""
        store = self.store
        store.begin_tick()
        now, now_dt = self.clock.monotonic(), self.clock.now()
        order = []
        for node in list(self.nodes.values()):
            if node.leaving_at is not None:
                if now >= node.leaving_at:
                    node.finish_leave()
                    del self.nodes[node.node]
            elif node.wants(now):
                order.append(node)
        self.rng.shuffle(order)
        for node in order:  # a step changes nothing another node's wants() read but the pool
            node.step(now, now_dt)
        self.steps += len(order)
        self.clock.advance(self.cfg.tick)
        self.ticks += 1

    def run_for(self, seconds: float) -> None:
        """Tick for ``seconds`` of simulated time."""
        end = self.now + seconds - 1e-9
        while self.now < end:
            self.tick()

    def run_until(self, done: Callable[[], bool], limit: float) -> float:
        """Simulated seconds until ``done()`` holds after a tick (NaN if not within ``limit``)."""
        began = self.now
        while self.now - began < limit:
            if done():
                return self.now - began
            self.tick()
        return math.nan

    # -- what the scenarios measure ----------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Live node id -> tasks held (leaving nodes included), as node_task_count says."""
        return {self.store.names[n]: self.store.held[n] for n in self.store.live}

    def all_held(self) -> bool:
        """Every task held by a live node."""
        return sum(self.store.held[n] for n in self.store.live) == len(self.store.tasks)
