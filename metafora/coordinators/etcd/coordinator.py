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
    (``max(0.5 s, lease_ttl / 4)``) is the time handlers get to notice ``stop()``.

``metafora-etcd-watch[<node>]``
    Lists the tasks and owner keys at one revision into a cache, then watches the whole
    namespace from that revision + 1. Feeds :meth:`EtcdCoordinator.watch`, tells the node
    when a claim it holds disappears (task deleted by a client, lease expired) and wakes
    :meth:`EtcdCoordinator.command` and the task command listeners (a put under
    ``taskcmds/<id>/`` rings the task's mailbox; a re-list asks them to recheck). Any
    watch error (etcd restarted, compaction, a member gone) restarts it with back-off and a
    full re-list; so does ``poll_interval`` (the safety net). It never dies on an error.

The class is assembled from one module per concern, all sharing the state and lock of
:class:`~metafora.coordinators.etcd.node.NodeBase`: :mod:`.lease` (registration, renewal,
fencing), :mod:`.watch` (re-list, events, offers), :mod:`.cache` (what the watch knows of a
task), :mod:`.claims` (claim txns and outcomes) and :mod:`.commands` (node commands).
This module keeps the life cycle (``init``/``close``) and the cluster-state reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import datetime

from metafora.coordinator import Coordinator, CoordinatorContext
from metafora.coordinators.etcd import schedules as _schedules
from metafora.coordinators.etcd.claims import ClaimsMixin
from metafora.coordinators.etcd.commands import CommandsMixin, new_command_name
from metafora.coordinators.etcd.driver import Compare, Delete, Op, created_at, value_is
from metafora.coordinators.etcd.lease import LeaseMixin, fence_margin
from metafora.coordinators.etcd.node import _STOP
from metafora.coordinators.etcd.queries import active_task_count, node_labels, node_task_count
from metafora.coordinators.etcd.watch import WatchMixin
from metafora.errors import MetaforaError
from metafora.schedule import Schedule
from metafora.task import Task

__all__ = ["EtcdCoordinator", "fence_margin", "new_command_name"]


log = logging.getLogger(__name__)

_CLOSE_BATCH = 64
"""Claims per txn clearing running keys on close: 2 compares and 1 delete each (128 compares)."""


class EtcdCoordinator(LeaseMixin, WatchMixin, ClaimsMixin, CommandsMixin, Coordinator):
    """A node's coordinator on an etcd v3 cluster (``etcd://host:2379/NAMESPACE``).

    Construction touches nothing; :meth:`init` registers the node (``NodeExists`` if its
    id is live) and starts the lease and watch threads.
    """

    # -- lifecycle --------------------------------------------------------------------

    def init(self, ctx: CoordinatorContext) -> None:
        with self._lock:
            self._check_open()
            if self._ctx is not None:
                raise MetaforaError(f"coordinator {self._node_id!r} is already initialised")
            self._labels = dict(ctx.labels)
        self._driver.connect()
        self._register()
        with self._lock:
            self._ctx = ctx
        self._start_thread("lease", self._lease_loop)
        self._ensure_watcher()
        log.info("node %s registered on %s", self._node_id, self.name, extra=self._extra)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leases = [lease for lease in (self._lease_id, self._old_lease) if lease is not None]
            self._lease_id = self._old_lease = None
            given_back = [held.task for held in self._held.values()]
            self._held.clear()
            for sub in self._subs:
                sub.event.set()
            self._cmd_cond.notify_all()
            wq = self._watch_queue
        self._stop.set()
        self._beat_wake.set()
        if wq is not None:
            wq.put(_STOP)
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
                    self._node_id, exc, self._cfg.lease_ttl, extra=self._extra,
                )
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(self._cfg.timeout + 2)
        self._driver.close()
        log.info("node %s closed", self._node_id, extra=self._extra)

    def _clear_running(self, tasks: list[Task]) -> None:
        """Delete the running keys of the claims close() gives back: a release, not a crash.

        Fenced like a release (still ours, same token), in txns of ``_CLOSE_BATCH`` tasks; a
        batch with a claim lost meanwhile is redone task by task.
        """
        for start in range(0, len(tasks), _CLOSE_BATCH):
            batch = tasks[start:start + _CLOSE_BATCH]
            try:
                if not self._driver.txn(self._owned(batch), self._running_keys(batch)).succeeded:
                    for task in batch:
                        self._driver.txn(self._owned([task]), self._running_keys([task]))
            except MetaforaError as exc:
                log.warning("node %s: could not clear the running keys of its claims on close "
                            "(%s); their next claims count a crash", self._node_id, exc,
                            extra=self._extra)
                return

    def _owned(self, tasks: list[Task]) -> list[Compare]:
        compares: list[Compare] = []
        for task in tasks:
            owner = self._keys.task(task.id).owner
            compares += [value_is(owner, self._node_bytes), created_at(owner, task.token)]
        return compares

    def _running_keys(self, tasks: list[Task]) -> list[Op]:
        return [Delete(self._keys.task(task.id).running) for task in tasks]

    # -- cluster state ----------------------------------------------------------------

    def node_task_count(self) -> dict[str, int]:
        self._check_open()
        return node_task_count(self._driver, self._keys)

    def active_task_count(self) -> dict[str, int]:
        """Live, not leaving, node -> tasks it holds: from the watch cache while a watch
        follows the store (the balancers ask every second; reading every owner key each time
        grew with the tasks held), else read from etcd."""
        self._check_open()
        counts = self.cached_task_count(active=True)
        return counts if counts is not None else active_task_count(self._driver, self._keys)

    def node_labels(self) -> dict[str, dict[str, str]]:
        self._check_open()
        return node_labels(self._driver, self._keys)

    def schedules(self) -> list[Schedule]:
        self._check_open()
        return _schedules.list_schedules(self._driver, self._keys)

    def materialise(self, schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
        self._check_open()
        return _schedules.materialise(self._driver, self._keys, schedule, tasks, cursor,
                                      self._clock.now())

