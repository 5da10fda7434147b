"""The etcd v3 coordinator: one lease per node, claims as leased owner keys, push via watch.

Semantics are those of docs/coordinators.md (the memory coordinator is the reference);
the key layout is in :mod:`metafora.coordinators.etcd.layout`.

Threads (named, daemon, stopped by :meth:`EtcdCoordinator.close`):

``metafora-etcd-lease[<node>]``
    Renews the node's lease every ``lease_ttl / 3`` (one keep-alive per node renews every
    claim). It self-fences: when ``lease_ttl - margin`` seconds have passed on this host's
    monotonic clock since the *start* of the last successful renewal, it calls
    ``ctx.lost(task)`` for every claim and drops the lease, then, once the old lease has
    expired by that clock (the margin later), re-registers with a new lease (revoking the
    old one first, in case etcd still has it) and carries on.
    etcd expires a lease ``lease_ttl`` after it *received* the last renewal, which is later
    than when we sent it, so everyone else can claim only after we have fenced; the margin
    (:data:`~metafora.coordinators.etcd.config.ETCD_FENCING`: ``max(0.5 s, lease_ttl / 4)``) is
    the time handlers get to notice ``stop()``.

``metafora-etcd-watch[<node>]``
    Lists the tasks and owner keys at one revision into a cache, then watches the whole
    namespace from that revision + 1. Feeds :meth:`EtcdCoordinator.watch`, tells the node
    when a claim it holds disappears (task deleted by a client, lease expired) and wakes
    :meth:`EtcdCoordinator.command` and the task command listeners (a put under
    ``taskcmds/<id>/`` rings the task's mailbox; a re-list asks them to recheck). Any
    watch error (etcd restarted, compaction, a member gone) restarts it with back-off and a
    full re-list; so does ``poll_interval`` (the safety net). It never dies on an error.

The class is composed of one object per concern, each built here with what it needs (the
driver, the key layout, the config, the clock, the node's shared
:class:`~metafora.coordinators.etcd.node.NodeState` and lock, the parts it calls):
:class:`~.lease.NodeLease` (registration, renewal, fencing), :class:`~.watch.NamespaceWatch`
(re-list, events, offers) over a :class:`~.cache.TaskCache` (what the watch knows of the
tasks), :class:`~.claims.Claims` (claim txns), :class:`~.outcomes.ClaimOutcomes` (done,
release, fail) and :class:`~.commands.NodeCommands` (node commands). This module keeps the
life cycle (``init``/``close``), the cluster-state reads and the delegation.
"""

from __future__ import annotations

import logging
import math
import queue
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from metafora.contracts.coordinator import (
    Coordinator,
    CoordinatorContext,
    Finish,
    TaskCommandListener,
    TaskSink,
)
from metafora.coordinators.etcd import schedules as _schedules
from metafora.coordinators.etcd.cache import TaskCache
from metafora.coordinators.etcd.claims import CLAIM_TXN_TASKS, Claims
from metafora.coordinators.etcd.commands import NodeCommands, new_command_name
from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import Keys, hold_record
from metafora.coordinators.etcd.lease import NodeLease
from metafora.coordinators.etcd.limits import GroupLimits
from metafora.coordinators.etcd.node import NodeState
from metafora.coordinators.etcd.ops import Compare, LeaseNotFound, Put, created_at, value_is
from metafora.coordinators.etcd.outcomes import ClaimOutcomes
from metafora.coordinators.etcd.queries import (
    Registration,
    active_task_count,
    node_labels,
    node_task_count,
    read_members,
)
from metafora.coordinators.etcd.retention import EtcdRetention, prune_batch
from metafora.coordinators.etcd.watch import NamespaceWatch
from metafora.coordinators.members import SeenWithCounts, context_capacity, context_weight
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.commands import Command
from metafora.core.errors import CoordinatorClosed, MetaforaError
from metafora.core.holds import check_sticky_for
from metafora.core.leases import LeaseTiming, renew_every
from metafora.core.retention import Cutoffs
from metafora.core.schedule_model import Schedule
from metafora.core.task import Task, validate_task_id

__all__ = ["EtcdCoordinator", "new_command_name"]


log = logging.getLogger(__name__)

_CLOSE_BATCH = 64
"""Claims per txn clearing running keys on close: 2 compares and 1 delete each (128 compares)."""


class EtcdCoordinator(EtcdRetention, Coordinator):
    """A node's coordinator on an etcd v3 cluster (``etcd://host:2379/NAMESPACE``).

    Construction touches nothing; :meth:`init` registers the node (``NodeExists`` if its
    id is live) and starts the lease and watch threads.
    """

    backend = "etcd"

    claim_burst = CLAIM_TXN_TASKS
    """Offers the consumer hands to one :meth:`claim_many` (one txn).

    256 (8 txns in flight) kept the txns fuller when most offers of a storm were stale, but
    did not pay: the 10,000-task / 4-node storm took 32.5 s against 5.1 s with 32, and the
    100,000 / 10 one on 3 members 120.5 s against 113.4 s.
    """

    def __init__(self, config: EtcdConfig, node_id: str, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._cfg = config
        self._clock = clock
        self._state = NodeState(validate_task_id(node_id), config.name)
        self._keys = Keys(config.namespace)
        self._driver = EtcdDriver(config.connection)
        self._cache = TaskCache()
        self._commands = NodeCommands(self._driver, self._keys, config, clock, self._state)
        self._lease = NodeLease(self._driver, self._keys, config, clock, self._state,
                                on_registered_again=self._reoffer_all)
        self._limits = GroupLimits(self._driver, self._keys, clock)
        self._state.on_lost = self._limits.free_lost_later
        self._claims = Claims(self._driver, self._keys, clock, self._state, self._cache,
                              self._lease, self._limits)
        self._outcomes = ClaimOutcomes(self._driver, self._keys, clock, self._state, self._limits)
        self._watch = NamespaceWatch(self._driver, self._keys, config, clock, self._state,
                                     self._cache, expire=self._claims.expire,
                                     commands_queued=self._commands.ring)
        self._seen = SeenWithCounts()  # weights and frozen nodes the last count saw

    def _reoffer_all(self) -> None:
        # The watch is built after the lease (it needs the claims, which need the lease).
        self._watch.reoffer_all()

    # -- identity ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The store URL without its password."""
        return self._cfg.name

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._state.node_id

    @property
    def config(self) -> EtcdConfig:
        """The validated configuration."""
        return self._cfg

    @property
    def driver(self) -> EtcdDriver:
        """This node's etcd connection (for stores that keep their data beside the tasks,
        such as :mod:`metafora.coordinators.etcd.states`)."""
        return self._driver

    @property
    def keys(self) -> Keys:
        """The key layout of this namespace."""
        return self._keys

    def __repr__(self) -> str:
        return f"EtcdCoordinator({self.name!r}, node_id={self.node_id!r})"

    # -- lifecycle --------------------------------------------------------------------

    def init(self, ctx: CoordinatorContext) -> None:
        state = self._state
        with state.lock:
            state.check_open()
            if state.ctx is not None:
                raise MetaforaError(f"coordinator {state.node_id!r} is already initialised")
            state.labels = dict(ctx.labels)
            state.weight = context_weight(ctx)
        self._lease.capacity = context_capacity(ctx)  # registered with it, then followed
        self._driver.connect()
        self._lease.register()
        with state.lock:
            state.ctx = ctx
        state.start_thread("lease", self._lease.run)
        self._watch.ensure_started()
        log.info("node %s registered on %s", state.node_id, self.name, extra=state.extra)

    def close(self) -> None:
        state = self._state
        with state.lock:
            if state.closed:
                return
            state.closed = True
            given_back = state.drop_held()
        leases = self._lease.close()
        self._watch.close()
        self._commands.close()
        state.stop.set()
        if leases:
            self._clear_running(given_back)
        # Revoking the lease deletes the registration, every owner key (the claims become
        # claimable at once) and the queued commands, in one round trip.
        for lease in leases:
            try:
                self._driver.revoke(lease)
            except MetaforaError as exc:
                log.warning(
                    "node %s: could not revoke its lease on close (%s); it expires in %ss",
                    state.node_id, exc, self._cfg.lease_ttl, extra=state.extra,
                )
        state.join_threads(self._cfg.timeout + 2)
        self._driver.close()
        log.info("node %s closed", state.node_id, extra=state.extra)

    def _clear_running(self, tasks: list[Task]) -> None:
        """Delete the running keys of the claims close() gives back: a release, not a crash.

        Fenced like a release (still ours, same token), in txns of ``_CLOSE_BATCH`` tasks; a
        batch with a claim lost meanwhile is redone task by task.
        """
        for start in range(0, len(tasks), _CLOSE_BATCH):
            batch = tasks[start:start + _CLOSE_BATCH]
            try:
                try:
                    self._clear_batch(batch)
                except LeaseNotFound:
                    # The hold lease expired or was drained while handlers stopped: the
                    # hold is over, the keys are deleted (a plain release), not lost.
                    if not self._outcomes.drop_hold():
                        raise
                    self._clear_batch(batch)
            except MetaforaError as exc:
                log.warning("node %s: could not clear the running keys of its claims on close "
                            "(%s); their next claims count a crash", self.node_id, exc,
                            extra=self._state.extra)
                return

    def _clear_batch(self, batch: list[Task]) -> None:
        """One txn for ``batch``; if a claim was lost meanwhile, task by task."""
        if not self._driver.txn(self._owned(batch), self._outcomes.running_keys(batch)).succeeded:
            for task in batch:
                self._driver.txn(self._owned([task]), self._outcomes.running_keys([task]))

    def _owned(self, tasks: list[Task]) -> list[Compare]:
        compares: list[Compare] = []
        for task in tasks:
            owner = self._keys.task(task.id).owner
            compares += [value_is(owner, self._state.node_bytes), created_at(owner, task.token)]
        return compares

    def hold_releases(self, seconds: float) -> bool:
        """Grant a hold lease of ``seconds`` (etcd's clock ends the hold: its expiry deletes
        the held running keys, and the watches offer the tasks then), name it under the
        node's ``hold`` key for ``drain``, and hold every later release on it."""
        seconds = check_sticky_for(seconds, "seconds")
        if not seconds:
            self._outcomes.hold_releases(None)
            return True
        lease, _ttl = self._driver.grant(max(1, math.ceil(seconds)))
        self._driver.txn([], [Put(self._keys.node_hold(self.node_id), str(lease).encode(), lease)])
        until = self._clock.now() + timedelta(seconds=seconds)
        self._outcomes.hold_releases((hold_record(self.node_id, until), lease))
        return True

    # -- lease and membership -----------------------------------------------------------

    @property
    def lease_id(self) -> int | None:
        """The node's current etcd lease (None while it has none)."""
        with self._state.lock:
            return self._state.lease_id

    def report_frozen(self, frozen: bool) -> None:
        """Publish the frozen flag in the node's registration (best effort)."""
        self._lease.report_frozen(frozen)

    def announce_leaving(self) -> None:
        """Publish ``leaving`` in the node's registration (best effort): the other nodes'
        watches see it at once and their balancers stop counting this node."""
        self._lease.announce_leaving()

    def suspend_keepalive(self) -> None:
        """Fault injection for tests: stop renewing the lease (as if etcd were cut off).

        The node then self-fences (``ctx.lost`` for every claim) before the lease expires,
        and does not re-register until :meth:`resume_keepalive`.
        """
        self._lease.suspend_keepalive()

    def resume_keepalive(self) -> None:
        """Undo :meth:`suspend_keepalive`."""
        self._lease.resume_keepalive()

    def listen_membership(self, listener: Callable[[], None]) -> bool:
        """Call ``listener`` when the namespace watch sees a registration key change (a
        join, a leave or lease expiry, a ``leaving`` flag) and whenever it re-lists."""
        return self._watch.listen_membership(listener)

    # -- watch ------------------------------------------------------------------------

    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        self._watch.watch(out)

    def listen_task_commands(self, listener: TaskCommandListener) -> bool:
        """Ring ``listener`` for every task command the namespace watch sees queued, and
        ask it to recheck whenever the watch re-lists."""
        return self._watch.listen_task_commands(listener)

    def listen_schedules(self, wake: Callable[[], None]) -> bool:
        """Woken by the node's watch (it covers the namespace); False before :meth:`init`."""
        return self._watch.listen_schedules(wake)

    def cached_task_count(self, active: bool) -> dict[str, int] | None:
        """Live node -> tasks it holds, from the watch cache (without ``leaving`` nodes when
        ``active``); None while no watch stream follows the store (then read it instead)."""
        return self._watch.cached_task_count(active)

    # -- claims and outcomes ------------------------------------------------------------

    def seen_taken(self, task: Task) -> bool:
        return self._claims.seen_taken(task)

    def claim(self, task: Task) -> Task | None:
        return self._claims.claim(task)

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        """Claim offers in multi-op txns (up to :data:`~.claims.CLAIM_TXN_TASKS` tasks each,
        all in flight at once); a txn refused because one of its tasks was taken meanwhile
        tells, in the same round trip, which ones to try again."""
        return self._claims.claim_many(tasks, limit)

    def holds(self, task: Task) -> bool:
        return self._claims.holds(task)

    def holds_claim(self, task_id: str) -> bool:
        """Whether this node knows it holds a claim of ``task_id`` (its local view, no I/O)."""
        return self._state.holds_claim(task_id)

    def claim_time_left(self, task: Task) -> float | None:
        return self._claims.claim_time_left(task)

    def lease_time_left(self) -> float | None:
        return self._claims.lease_time_left()

    def lease_timing(self) -> LeaseTiming:
        """When this node renews and fences (the optional seam of
        :mod:`metafora.core.leases`)."""
        return LeaseTiming(renew_every=renew_every(self._cfg.lease_ttl), fence_after=self._lease.fence_after)

    def held(self) -> list[Task]:
        """The claims this node holds now (as it believes)."""
        return self._claims.held()

    def release(self, task: Task) -> None:
        self._outcomes.release(task)

    def done(self, task: Task) -> None:
        self._outcomes.done(task)

    def fail(self, task: Task, error: BaseException | str) -> None:
        self._outcomes.fail(task, error)

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Record many outcomes in multi-op txns (up to 42 outcomes each, several in flight),
        each fenced by its own claim's owner key and token exactly as a single write is."""
        return self._outcomes.finish_many(finishes)

    # -- commands ---------------------------------------------------------------------

    def command(self, timeout: float | None = None) -> Command | None:
        """The next node command: etcd is read only after the watch saw one queued (or
        re-listed), or once per ``poll_interval`` as a safety net -- not on every call."""
        return self._commands.command(timeout)

    def inject_raw_command(self, raw: str | bytes) -> None:
        """Queue raw (possibly malformed) command text for this node, for fault tests."""
        self._commands.inject_raw_command(raw)

    # -- cluster state ----------------------------------------------------------------

    def node_task_count(self) -> dict[str, int]:
        self._state.check_open()
        return node_task_count(self._driver, self._keys)

    def active_task_count(self) -> dict[str, int]:
        """Live, not leaving, node -> tasks it holds: from the watch cache while a watch
        follows the store (the balancers ask every second; reading every owner key each time
        grew with the tasks held), else read from etcd."""
        self._state.check_open()
        view = self._watch.cached_members(active=True)
        if view is None:
            counts, found, newest = active_task_count(self._driver, self._keys)
            self._watch.read_directly(newest)
        else:
            counts, found = view
        self._remember(found, self._watch.cached_claimable(self._clock.now()))
        return counts

    def _retention_parts(self) -> tuple[EtcdDriver, Keys, Clock]:
        if self._state.closed:
            raise CoordinatorClosed(f"coordinator {self._state.node_id!r} on {self.name} is closed")
        return self._driver, self._keys, self._clock

    def _pruner_batch(self, cutoffs: Cutoffs, limit: int) -> int:
        """The periodic pruner's batch: the candidates come from the watch cache, and only
        they are read (none before the cache's first re-list: the next turn tries again)."""
        driver, keys, _ = self._retention_parts()
        candidates = self._watch.prunable(cutoffs, limit)
        if candidates is None:
            return 0
        return prune_batch(driver, keys, cutoffs, limit, self._prune_extras(), candidates)

    def claimable_count(self) -> int | None:
        """Tasks claimable at the last :meth:`active_task_count` (within a second), from the
        watch cache (None before its first re-list)."""
        return self._seen.claimable()

    def _remember(self, found: dict[str, Registration],
                  claimable: int | None = None) -> dict[str, Registration]:
        """Keep the weights and frozen nodes of ``found`` (and the claimable count read with
        them) for the next asks (see members.py)."""
        self._seen.seen({node: m.weight for node, m in found.items()},
                        frozenset(node for node, m in found.items() if m.frozen), claimable,
                        {node: m.capacity for node, m in found.items() if m.capacity is not None})
        return found

    def _members_now(self) -> dict[str, Registration]:
        """Live node -> what its registration says: from the watch cache, else read."""
        view = self._watch.cached_members(active=False)
        if view is not None:
            return self._remember(view[1])
        found, newest = read_members(self._driver, self._keys)
        self._watch.read_directly(newest)
        return self._remember(found)

    def node_weights(self) -> dict[str, float]:
        """Live node -> its weight: what the last :meth:`active_task_count` saw (within a
        second), else the watch cache's view, else read from etcd."""
        self._state.check_open()
        weights = self._seen.weights()
        if weights is None:
            weights = {node: m.weight for node, m in self._members_now().items()}
        return weights

    def node_capacities(self) -> dict[str, int]:
        """Live nodes whose registration gives a capacity -> it (found as :meth:`node_weights`
        is)."""
        self._state.check_open()
        capacities = self._seen.capacities()
        if capacities is None:
            capacities = {node: m.capacity for node, m in self._members_now().items()
                          if m.capacity is not None}
        return capacities

    def frozen_nodes(self) -> frozenset[str]:
        """Live nodes whose registration says frozen (found as :meth:`node_weights` is)."""
        self._state.check_open()
        frozen = self._seen.frozen()
        if frozen is None:
            frozen = frozenset(node for node, m in self._members_now().items() if m.frozen)
        return frozen

    def node_labels(self) -> dict[str, dict[str, str]]:
        self._state.check_open()
        return node_labels(self._driver, self._keys)

    def schedules(self) -> list[Schedule]:
        self._state.check_open()
        return _schedules.list_schedules(self._driver, self._keys)

    def materialise(self, schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
        self._state.check_open()
        return _schedules.materialise(self._driver, self._keys, schedule, tasks, cursor,
                                      self._clock.now())
