"""A deterministic one-process model of a metafora cluster: a simulated store, simulated nodes.

Used by :mod:`benchmarks.simulate` to run the REAL balancer code (any
:class:`~metafora.contracts.balancer.Balancer`, by default :class:`~metafora.balancers.FairBalancer`)
at sizes no machine runs as processes (1,000 nodes, 1,000,000 tasks), on a fake clock
(:class:`metafora.testing.FakeClock`) advanced in ticks.

**The store** (:class:`SimStore`) keeps what the real stores keep, with the same semantics: a
claim is a compare-and-set on an unowned task; a released task becomes claimable and is offered
to every live node; a node that announced it is leaving is left out of ``active_task_count``.
Counts are kept incrementally (the memory coordinator recounts, which is quadratic with a
big backlog). Each node reads it through its own :class:`ClusterState` view, which counts
that node's store requests.

**A node** (:class:`benchmarks.sim_node.SimNode`) follows the consumer's loop
(``metafora/consumer``) where it matters for balance: offers are tried in a shuffled order and
asked ``balancer.can_claim``; a refusal ignores the offer until the deadline the balancer gave
(``refuse_retry`` if none); approved offers are claimed ``claim_burst`` per request, and the
node's count (the balancer's ``ctx.task_count()``) counts the offers approved for the burst being filled, as
``OfferRouter.offer`` does (``count_approved=False``: only once the burst is claimed); the
balancer runs every ``balance_every`` (jittered), after a membership change within
``rebalance_window`` and once more a few seconds later (``consumer.balancing.Rebalancer``); a
released task is written back after ``handoff`` seconds and ignored by its old owner for the
doubling ``release_backoff``; a node that hears another left tries its refused offers again.

Where the model is cheaper than the consumer (so a million tasks fit in minutes):

- **offers**: every live node is offered every claimable task, but a node draws its offers at
  random from the store's claimable set (the shuffle of ``OfferRouter.arrange``) instead of
  keeping a copy of the backlog; an offer another node claimed earlier in the same tick is
  still drawn (the watch lags by that much: a claim of it is a lost race), older ones are not
  (a real node also tries those, and loses the race inside the same claim request);
- **passes**: a node tries at most ``offers_per_tick`` offers and ``claims_per_tick`` claim
  requests per tick; after its first refusal a pass puts at most ``refusals_per_pass`` more
  offers to the balancer, and the node tries no new offer until that refusal's deadline (the
  consumer refuses every offer of the pass: same snapshot, same count); offers whose ignore ran
  out are all tried again, and a membership change ends the quiet;
- **the store** serves every request at once (no capacity limit, no latency but the tick);
- **handlers** return at once when stopped (``handoff`` seconds later), tasks never finish;
  nodes do not crash, leases do not expire, rendezvous preference is not modelled.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from metafora.contracts.balancer import ClusterState
from metafora.core.task import Task
from metafora.testing.clock import FakeClock

__all__ = ["FREE", "NodeView", "SimClock", "SimConfig", "SimStore", "task_id", "task_index"]

FREE = -1  # the owner of a claimable task
RELEASE_BATCH = 500  # releases per group-committed write (the outcome writer's batch)


@dataclass(frozen=True)
class SimConfig:
    """How the simulated consumers behave (consumer defaults unless said otherwise)."""

    tick: float = 0.025
    """Simulated seconds per step; store events reach the other nodes one tick later."""
    claim_burst: int = 256
    """Offers per claim request (the SQL coordinator's ``claim_burst``; etcd's is 32)."""
    claims_per_tick: int = 1
    """Claim requests a node makes per tick (one in flight, ~25 ms each)."""
    offers_per_tick: int = 1000
    """New offers a node tries per tick at most (the consumer's drain of 1,000 events)."""
    refusals_per_pass: int = 64
    """Offers a pass puts to the balancer after its first refusal (the consumer refuses every
    offer of the pass; at the deadline it tries them again, and claims those nobody took)."""
    balance_every: float = 60.0
    balance_jitter: float = 0.1
    rebalance_window: float = 3.0
    release_backoff: float = 1.0
    release_backoff_max: float = 60.0
    refuse_retry: float = 1.0
    handoff: float = 0.05
    """Seconds from a release asked of a handler to the release written (hold handlers)."""
    shutdown: float = 0.2
    """Seconds from a graceful leave's announcement to its claims released and deregistered."""
    count_approved: bool = True
    """Count the offers approved for the claim burst being filled in ``ctx.task_count()``, as
    the consumer does (False: only once the burst is claimed, as it did before)."""


class SimClock(FakeClock):
    """The fake clock, read without its lock: the simulation runs in one thread, and the
    balancers read the time on every offer."""

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._mono


def task_id(index: int) -> str:
    """The id of task ``index``."""
    return f"t{index:07d}"


def task_index(tid: str) -> int:
    """The index of the task named ``tid``."""
    return int(tid[1:])


def _make_tasks(count: int) -> list[Task]:
    """``count`` plain tasks; the first is validated, the rest share its empty mappings."""
    first = Task(task_id(0))
    tasks = [first]
    template = dict(first.__dict__)
    for i in range(1, count):
        task = object.__new__(Task)
        task.__dict__.update(template)
        task.__dict__["id"] = task_id(i)
        tasks.append(task)
    return tasks


class SimStore:
    """The tasks, their owners and the live nodes; counts kept incrementally.

    Node state is indexed by node number (``names[n]`` is its id). ``requests`` counters are
    per node number: ``claim_requests``/``claim_rows`` (claim_many calls and offers in them),
    ``count_reads`` (node_task_count / active_task_count), ``aux_reads`` (weights, frozen,
    labels: answered by today's stores without a request), ``release_requests``/``releases``.
    """

    def __init__(self, tasks: int, clock: FakeClock) -> None:
        self.clock = clock
        self.tasks = _make_tasks(tasks)
        self.owner = array("i", [FREE]) * tasks
        self.starts = array("H", [0]) * tasks
        self.pool: list[int] = list(range(tasks))  # claimable tasks (swap-remove)
        self.pos = array("i", range(tasks))  # index of a claimable task in pool
        self.taken: list[int] = []  # claimed during this tick: still seen as offers
        self.pool_at_tick = tasks
        self.names: list[str] = []
        self.held: list[int] = []
        self.live: dict[int, None] = {}  # registered nodes, in registration order
        self.leaving: set[int] = set()
        self.active_version = 0  # bumped when the set of active nodes changes
        self.claimable_version = 0  # bumped when a task becomes claimable
        self._counts: dict[bool, tuple[int, dict[str, int]]] = {}
        self._version = 0  # bumped on any change of the counts
        self.claim_requests: list[int] = []
        self.claim_rows: list[int] = []
        self.etcd_txns: list[int] = []
        self.races_lost: list[int] = []
        self.count_reads: list[int] = []
        self.aux_reads: list[int] = []
        self.release_requests: list[int] = []
        self.releases: list[int] = []
        self.offers_sent = 0  # offers the watch delivered (claimable tasks x live nodes)
        self.total_starts = 0  # handler starts
        self.started = 0  # tasks started at least once

    # -- nodes ---------------------------------------------------------------------------

    def add_node(self, name: str) -> int:
        """A node number for ``name`` (the same number when a node restarts)."""
        if name in self.names:
            return self.names.index(name)
        self.names.append(name)
        for counters in (self.held, self.claim_requests, self.claim_rows, self.etcd_txns,
                         self.races_lost, self.count_reads, self.aux_reads,
                         self.release_requests, self.releases):
            counters.append(0)
        return len(self.names) - 1

    def register(self, node: int) -> None:
        """The node joined: live and active, holding nothing; it is offered the backlog."""
        self.live[node] = None
        self.leaving.discard(node)
        self.offers_sent += len(self.pool)
        self._changed(active=True)

    def announce_leaving(self, node: int) -> None:
        """The node is shutting down: no longer active (it still holds its tasks)."""
        self.leaving.add(node)
        self._changed(active=True)

    def deregister(self, node: int) -> None:
        """The node is gone (it must hold nothing)."""
        assert self.held[node] == 0, f"{self.names[node]} deregistered holding {self.held[node]}"
        self.live.pop(node, None)
        self.leaving.discard(node)
        self._changed(active=False)

    def active(self) -> list[int]:
        """Live nodes that did not announce they are leaving."""
        return [n for n in self.live if n not in self.leaving]

    # -- tasks ---------------------------------------------------------------------------

    def begin_tick(self) -> None:
        """A new tick: claims of the last one are now seen by every node."""
        self.taken.clear()
        self.pool_at_tick = len(self.pool)

    def draw(self, rnd: Callable[[], float]) -> int:
        """A claimable task at random (possibly one claimed earlier this tick)."""
        pool, taken = self.pool, self.taken
        i = int(rnd() * (len(pool) + len(taken)))
        return pool[i] if i < len(pool) else taken[i - len(pool)]

    def seen(self) -> list[int]:
        """Every task a node sees as claimable now (a copy)."""
        return self.pool + self.taken

    def claim(self, node: int, tasks: list[int]) -> list[int]:
        """One claim request: compare-and-set each unowned task to ``node``; the won ones."""
        owner, pool, pos = self.owner, self.pool, self.pos
        won = []
        for t in tasks:
            if owner[t] != FREE:
                continue
            owner[t] = node
            last = pool.pop()
            if last != t:
                i = pos[t]
                pool[i] = last
                pos[last] = i
            self.taken.append(t)
            if not self.starts[t]:
                self.started += 1
            self.starts[t] += 1
            won.append(t)
        self.total_starts += len(won)
        self.held[node] += len(won)
        self.claim_requests[node] += 1
        self.claim_rows[node] += len(tasks)
        self.etcd_txns[node] += math.ceil(len(tasks) / 32)
        self.races_lost[node] += len(tasks) - len(won)
        if won:
            self._changed(active=False)
        return won

    def release(self, node: int, tasks: list[int]) -> None:
        """Group-committed releases: the tasks become claimable and are offered to all."""
        if not tasks:
            return
        owner, pool, pos = self.owner, self.pool, self.pos
        for t in tasks:
            assert owner[t] == node, f"{self.names[node]} released {task_id(t)} it does not hold"
            owner[t] = FREE
            pos[t] = len(pool)
            pool.append(t)
        self.held[node] -= len(tasks)
        self.release_requests[node] += math.ceil(len(tasks) / RELEASE_BATCH)
        self.releases[node] += len(tasks)
        self.offers_sent += len(tasks) * len(self.live)
        self.claimable_version += 1
        self._changed(active=False)

    @property
    def version(self) -> int:
        """Bumped on every change of the counts or of the live nodes."""
        return self._version

    # -- the cluster state -------------------------------------------------------------

    def counts(self, active: bool) -> dict[str, int]:
        """Live (``active``: and not leaving) node id -> tasks held (cached per change)."""
        cached = self._counts.get(active)
        if cached is None or cached[0] != self._version:
            names, held, leaving = self.names, self.held, self.leaving
            counts = {names[n]: held[n] for n in self.live if not (active and n in leaving)}
            cached = self._counts[active] = (self._version, counts)
        return dict(cached[1])

    def _changed(self, *, active: bool) -> None:
        self._version += 1
        if active:
            self.active_version += 1


class NodeView(ClusterState):
    """One node's view of the store: what a coordinator answers, each read counted."""

    def __init__(self, store: SimStore, node: int) -> None:
        self._store = store
        self._node = node

    def node_task_count(self) -> dict[str, int]:
        self._store.count_reads[self._node] += 1
        return self._store.counts(active=False)

    def active_task_count(self) -> dict[str, int]:
        self._store.count_reads[self._node] += 1
        return self._store.counts(active=True)

    def node_labels(self) -> dict[str, dict[str, str]]:
        self._store.aux_reads[self._node] += 1
        return {}

    def node_weights(self) -> dict[str, float]:
        self._store.aux_reads[self._node] += 1
        return {}

    def frozen_nodes(self) -> frozenset[str]:
        self._store.aux_reads[self._node] += 1
        return frozenset()
