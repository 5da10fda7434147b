"""The Balancer interface: what a node may claim and what it should give back."""

from __future__ import annotations

import abc
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from metafora.contracts.handler import AsyncHandler, Handler
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.task import Task

__all__ = ["Balancer", "BalancerContext", "ClusterState", "RecentRuns", "RunningTask", "SelectorKey",
           "selector_key"]

SelectorKey = tuple[tuple[str, str], ...]
"""A task's selector as its ``(key, value)`` pairs sorted by key (``()``: no selector)."""


def selector_key(selector: Mapping[str, str]) -> SelectorKey:
    """``selector`` as a :data:`SelectorKey`: hashable, one value per distinct selector."""
    return tuple(sorted(selector.items())) if selector else ()


@dataclass(frozen=True)
class RunningTask:
    """A task running on this node: when it started, if asked to stop, when, and the
    :class:`~metafora.contracts.handler.Handler` running it (Metafora's ``RunningTask.Handler()``;
    None where no handler is known, as in a balancer's unit test)."""

    task: Task
    started: datetime
    stopped: datetime | None = None
    handler: Handler | AsyncHandler | None = field(default=None, compare=False, repr=False)

    @property
    def id(self) -> str:
        """The task id."""
        return self.task.id


class ClusterState(abc.ABC):
    """What a balancer may learn about the whole cluster; every coordinator implements it."""

    @abc.abstractmethod
    def node_task_count(self) -> dict[str, int]:
        """Live node id -> number of tasks it holds (nodes holding none are included)."""

    def active_task_count(self) -> dict[str, int]:
        """Like :meth:`node_task_count`, without the nodes that announced they are leaving.

        A node shutting down (see ``Coordinator.announce_leaving``) still holds its last
        tasks while their handlers stop, but it will take none: balancers must not average
        over it (Metafora's issue #92). Stores that keep the flag override this; the default
        counts every live node.
        """
        return self.node_task_count()

    def node_labels(self) -> dict[str, dict[str, str]]:
        """Live node id -> its placement labels (one store read).

        Balancers ask only when a task carries a selector. A node missing from the answer
        (this default knows none) is taken as able to run any task.
        """
        return {}

    def node_weights(self) -> dict[str, float]:
        """Live node id -> the weight it published (``Consumer(weight=...)``).

        A node's fair share of the work is proportional to its weight, for clusters of
        unequal machines. A node missing from the answer has weight 1.0: this default
        (``{}``) makes every node equal. Balancers read it together with the counts (and
        cache it with them), never per offer; a store may answer it from the same read.
        """
        return {}

    def node_capacities(self) -> dict[str, int]:
        """Live node id -> the most tasks it said it can run now (its ``max_tasks``, thread
        cap, or a capacity reduced after a failed start).

        A node's share never exceeds its capacity: what it cannot take is shared by the
        others, and nobody gives tasks back for a node that is full. A node missing from the
        answer has no bound: this default (``{}``) knows none. Read with the counts, like
        :meth:`node_weights`.
        """
        return {}

    publishes_counts: bool = False
    """Whether :meth:`published_task_count` answers from what the nodes published (a read
    that follows the nodes), not from :meth:`active_task_count` as this default does."""

    def published_task_count(self) -> dict[str, int]:
        """Like :meth:`active_task_count`, from what each node published of itself (one
        record per node, a moment late) where the store keeps that: a read whose cost follows
        the nodes, not the tasks held. This default answers :meth:`active_task_count`.

        The claimable count that follows (:meth:`claimable_count`) may be capped. Balancers
        use it to decide *whether* to look closer (an idle cluster is even, and reading the
        claims every balance grew with the tasks held), never to decide what to move.
        """
        return self.active_task_count()

    def claimable_count(self) -> int | None:
        """How many tasks were claimable in the whole store at the last count read, or None
        when the store does not say (this default).

        Read in the same store request as :meth:`active_task_count` (so the counts and this
        number are one consistent picture): their sum is the work of the cluster, which no
        claim changes, only submits and ends. A balancer computes a node's share at claim time
        from it without a request per offer.
        """
        return None

    def frozen_nodes(self) -> frozenset[str]:
        """Ids of live nodes that are frozen (they claim nothing while frozen).

        A frozen node takes no work, so balancers leave it out of the fair shares, as they
        leave out leaving nodes. This default knows none; read with the counts, like
        :meth:`node_weights`.
        """
        return frozenset()


class RecentRuns:
    """How long this node's last tasks ran: the consumer adds each finished run, balancers
    read (a bounded ring; appends and copies are safe across threads).

    What it tells a balancer: when tasks end quickly, completion evens the cluster on its
    own and refusing offers only slows it; when tasks run long, a move is the costly event.
    """

    def __init__(self, size: int = 16, clock: Clock = SYSTEM_CLOCK) -> None:
        self._runs: deque[tuple[float, float]] = deque(maxlen=size)  # (monotonic end, seconds)
        self._clock = clock

    def add(self, seconds: float) -> None:
        """A task ran ``seconds`` (from its start to its handler's return) and ended now."""
        self._runs.append((self._clock.monotonic(), max(0.0, seconds)))

    def latest(self) -> float | None:
        """When the last kept run ended (monotonic), None before any: a change says a run
        ended since it was last asked."""
        runs = self._runs
        try:
            return runs[-1][0]
        except IndexError:
            return None

    def recent(self, within: float) -> tuple[int, float | None]:
        """(how many of the kept runs ended in the last ``within`` seconds, their median
        run time or None when none did)."""
        since = self._clock.monotonic() - within
        times = [ran for end, ran in list(self._runs) if end >= since]
        return len(times), (statistics.median(times) if times else None)


@dataclass
class BalancerContext:
    """Handed to ``Balancer.init``: the node, its running tasks, the cluster, a clock."""

    node_id: str
    cluster_state: ClusterState
    task_source: Callable[[], list[RunningTask]] = field(repr=False)
    clock: Clock = field(default=SYSTEM_CLOCK, repr=False)
    count_source: Callable[[], int] | None = field(default=None, repr=False)
    claimable_source: Callable[[], int] | None = field(default=None, repr=False)
    runs: RecentRuns | None = field(default=None, repr=False)  # None: the consumer does not say
    selector_source: Callable[[], Collection[SelectorKey]] | None = field(default=None, repr=False)

    def tasks(self) -> list[RunningTask]:
        """The tasks running on this node now, oldest first."""
        return self.task_source()

    def task_count(self) -> int:
        """How many tasks run on this node now: ``len(tasks())`` without building the list
        (balancers ask on every offer; a node holding thousands must not pay for a copy)."""
        return self.count_source() if self.count_source is not None else len(self.task_source())

    def claimable_count(self) -> int | None:
        """How many tasks this node sees as claimable now (pending, from its watch cache
        or offers; no store request), or None when the consumer does not say.

        With it a balancer can compute this node's share of the work at claim time,
        ``ceil((held + claimable) / nodes)``; without it, only of the work already held.
        """
        return self.claimable_source() if self.claimable_source is not None else None

    def held_selectors(self) -> frozenset[SelectorKey] | None:
        """The distinct selectors of the tasks in :meth:`tasks` (each a :data:`SelectorKey`,
        ``()`` for tasks without one; stopping tasks count), or None when the consumer does
        not say.

        What a balancer needs to know which peer groups this node's tasks fall in without
        building :meth:`tasks` (O(tasks held)): a source answers in O(distinct selectors),
        from a tally kept as tasks start and end. It answers for the same tasks as
        :meth:`tasks`; no tasks: an empty set.
        """
        return None if self.selector_source is None else frozenset(self.selector_source())


class Balancer(abc.ABC):
    """Decides which offered tasks this node claims and which running tasks it releases."""

    @abc.abstractmethod
    def init(self, ctx: BalancerContext) -> None:
        """Called once by the consumer before any other method."""

    @abc.abstractmethod
    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Whether to claim ``task`` now; when not, optionally until when to ignore it."""

    @abc.abstractmethod
    def balance(self) -> list[str]:
        """Ids of running tasks this node should release now (may be empty)."""

    def refusals_lifted(self) -> bool:
        """Whether the offers this balancer refused may be claimed now, before the deadlines
        it gave: the reason it refused them went away (``FairBalancer``: the node's tasks turned
        out short, so completion evens the cluster). Asked by the consumer when tasks end; True
        has it try those offers again at once instead of at their deadlines. Optional."""
        return False

    def nodes_changed(self, left: bool) -> None:
        """The cluster's membership changed; ``left``: a node left or announced it is leaving.

        Called by the consumer (on its loop, before the dampened balance it schedules). Tasks
        of a node that left are orphans, not a rebalance: a balancer that refuses claims
        after its own releases should stop refusing when ``left``. Optional.
        """
        return
