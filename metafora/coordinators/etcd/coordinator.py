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
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from metafora.clock import SYSTEM_CLOCK, Clock
from metafora.commands import Command
from metafora.coordinator import (
    Coordinator,
    CoordinatorContext,
    Finish,
    Outcome,
    TaskCommandListener,
    TaskSink,
    as_sink,
    crash_limit_error,
    error_text,
    rotated,
)
from metafora.coordinators.etcd import schedules as _schedules
from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.driver import (
    Compare,
    Delete,
    EtcdDriver,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    Range,
    TxnRequest,
    WatchBatch,
    WatchCompacted,
    WatchFailure,
    WatchHandle,
    absent,
    created_at,
    modified_at,
    value_is,
)
from metafora.coordinators.etcd.layout import (
    Keys,
    StoredProps,
    TaskRecord,
    crashes_of,
    encode_json,
    gather,
    iso,
    props_of,
)
from metafora.coordinators.etcd.outcomes import ITEMS_PER_TXN, GroupCommit, OutcomeWriter
from metafora.coordinators.etcd.queries import (
    active_task_count,
    expire_task,
    fail_unclaimed,
    launch_and_expiry,
    node_labels,
    node_task_count,
    read_all_tasks,
)
from metafora.errors import (
    CoordinatorClosed,
    CoordinatorUnavailable,
    InvalidCommand,
    InvalidProps,
    InvalidTaskId,
    MetaforaError,
    NodeExists,
    NodeNotFound,
)
from metafora.schedule import Schedule
from metafora.task import Task, matches, validate_task_id

__all__ = ["EtcdCoordinator", "fence_margin", "new_command_name"]

log = logging.getLogger(__name__)

_BACKOFF_START = 0.05
_BACKOFF_MAX = 2.0
_TIMER_CAP = 60.0  # re-check wall-clock timers at least this often (clock jumps)
_STOP = object()


_BATCH = 32
"""Tasks per claim txn: 4 compares, 3 puts and 4 failure reads each, within etcd's default
limit of 128 operations per txn branch."""

_COMMIT_BATCH = 4 * ITEMS_PER_TXN
"""Outcomes of concurrent done/release/fail calls written together at most (4 txns in flight)."""

_CLOSE_BATCH = 64
"""Claims per txn clearing running keys on close: 2 compares and 1 delete each (128 compares)."""


def fence_margin(lease_ttl: float) -> float:
    """Seconds before the lease could expire at which a node stops its handlers."""
    return max(0.5, lease_ttl / 4)


@dataclass
class _Held:
    task: Task
    finishing: bool = False  # a release/done/fail of this claim is in flight


@dataclass(frozen=True)
class _Known:
    """A task as a claim sees it: its props and the revisions the claim is fenced on."""

    props: dict[str, Any]
    damage: str | None
    props_mod: int
    running_mod: int
    crashes_before: int | None  # None: the previous claim had an outcome (or there was none)
    stored: StoredProps | None = None  # placement (selector, priority, prefer, spread)
    valid: bool = False  # the props made a Task already (no need to check them again)

    @property
    def selector(self) -> Mapping[str, str]:
        """The task's selector ({} when unknown)."""
        return self.stored.selector if self.stored is not None else {}

    def task(self, task_id: str, token: int = 0) -> Task:
        """The task these props describe, carrying ``token``."""
        if self.stored is None:
            return Task(task_id, self.props, token)
        return self.stored.task(task_id, token)

    def crashes(self) -> int:
        """This claim's count of crashes in a row (the previous claim died if it left its key)."""
        return 0 if self.crashes_before is None else self.crashes_before + 1


@dataclass
class _Entry:
    """The watch cache's view of one task."""

    props: dict[str, Any] | None = None
    props_error: str | None = None  # the damage of a props value written around metafora
    props_valid: bool = False  # these props made a Task when offered
    props_mod: int = 0
    launch_at: datetime | None = None
    expires_at: datetime | None = None
    finished: bool = False
    owner: str | None = None
    owner_rev: int = 0
    stored: StoredProps | None = None

    running_mod: int = 0  # of the running key (0: absent, the last claim had an outcome)
    running_crashes: int | None = None

    def known(self) -> _Known:
        """What a claim is judged and fenced on."""
        assert self.props is not None
        return _Known(self.props, self.props_error, self.props_mod, self.running_mod,
                      self.running_crashes, self.stored, self.props_valid)

    def set_running(self, kv: KeyValue | None) -> None:
        self.running_mod = 0 if kv is None else kv.mod_revision
        self.running_crashes = crashes_of(kv)

    def set_props(self, kv: KeyValue, task_id: str) -> None:
        stored = props_of(kv, task_id)
        self.props, self.props_error = stored.props, stored.error
        self.stored = stored
        self.props_valid = False
        self.props_mod = kv.mod_revision
        self.launch_at, self.expires_at = launch_and_expiry(self.props)

    @classmethod
    def from_record(cls, task_id: str, rec: TaskRecord) -> _Entry:
        entry = cls()
        if rec.props is not None:
            entry.set_props(rec.props, task_id)
        entry.finished = rec.state is not None
        entry.set_running(rec.running)
        if rec.owner is not None:
            entry.owner = rec.owner.value.decode(errors="replace")
            entry.owner_rev = rec.owner.create_revision
        return entry


@dataclass
class _Subscriber:
    """One running ``watch(out)``: which task ids to re-evaluate."""

    event: threading.Event = field(default_factory=threading.Event)
    ids: set[str] = field(default_factory=set)
    everything: bool = True

    def mark(self, ids: set[str] | None) -> None:
        if ids is None:
            self.everything = True
        elif ids:
            self.ids |= ids
        else:
            return
        self.event.set()


class EtcdCoordinator(Coordinator):
    """A node's coordinator on an etcd v3 cluster (``etcd://host:2379/NAMESPACE``).

    Construction touches nothing; :meth:`init` registers the node (``NodeExists`` if its
    id is live) and starts the lease and watch threads.
    """

    def __init__(self, config: EtcdConfig, node_id: str, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._cfg = config
        self._node_id = validate_task_id(node_id)
        self._node_bytes = self._node_id.encode()
        self._keys = Keys(config.namespace)
        self._clock = clock
        self._driver = EtcdDriver(config.connection)
        self._extra = {"node": self._node_id}
        self._lock = threading.Lock()
        self._ctx: CoordinatorContext | None = None
        self._closed = False
        self._stop = threading.Event()
        # lease
        self._lease_id: int | None = None
        self._old_lease: int | None = None  # dropped after a fence, revoked on re-register
        self._old_lease_until = 0.0  # monotonic: when the dropped lease expires by itself
        self._renewed_at = 0.0
        self._beat_wake = threading.Event()
        self._keepalive_paused = False
        self._fence_after = config.lease_ttl - fence_margin(config.lease_ttl)
        self._alive_rev = 0  # create revision of our registration key
        self._started_at = clock.now()
        self._frozen = False
        self._leaving = False
        self._member_listeners: list[Callable[[], None]] = []
        self._labels: dict[str, str] = {}  # placement labels, from init(ctx)
        # claims this node holds
        self._held: dict[str, _Held] = {}
        self._schedule_listeners: list[Callable[[], None]] = []
        # watch cache
        self._cache: dict[str, _Entry] = {}
        self._cache_ready = False
        self._cache_rev = 0
        self._subs: list[_Subscriber] = []
        self._unusable: dict[str, int] = {}  # stored ids no Task may have -> props revision logged
        self._watch_queue: queue.Queue[object] | None = None
        self._watch_gen = 0  # which watch stream may fold events into the cache
        # commands
        self._cmd_cond = threading.Condition(self._lock)
        self._cmd_seq = 0
        self._cmd_seen_seq = -1  # the _cmd_seq of the last look at the node's commands
        self._cmd_check_at = 0.0  # monotonic: next safety-net look at the node's commands
        self._cmd_failing = False
        self._task_cmd_listeners: list[TaskCommandListener] = []
        # outcomes: done/release/fail of concurrent callers share txns
        self._outcomes = OutcomeWriter(self._driver, self._keys, self._node_id, clock)
        self._commit: GroupCommit[Finish, MetaforaError | None] = GroupCommit(
            self._outcomes.write, _COMMIT_BATCH
        )
        # threads
        self._threads: list[threading.Thread] = []
        self._watcher_started = False

    # -- identity ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._cfg.name

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def config(self) -> EtcdConfig:
        """The validated configuration."""
        return self._cfg

    @property
    def driver(self) -> EtcdDriver:
        """This node's etcd connection (for stores that keep their data beside the tasks,
        such as :mod:`metafora.statemachine.stores.etcd`)."""
        return self._driver

    @property
    def keys(self) -> Keys:
        """The key layout of this namespace."""
        return self._keys

    def __repr__(self) -> str:
        return f"EtcdCoordinator({self.name!r}, node_id={self._node_id!r})"

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

    def _start_thread(self, role: str, target: Any) -> None:
        thread = threading.Thread(
            target=target, name=f"metafora-etcd-{role}[{self._node_id}]", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _ensure_watcher(self) -> None:
        with self._lock:
            if self._watcher_started or self._closed:
                return
            self._watcher_started = True
        self._start_thread("watch", self._watch_loop)

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosed(f"coordinator {self._node_id!r} on {self.name} is closed")

    def _require_init(self) -> None:
        self._check_open()
        if self._ctx is None:
            raise CoordinatorClosed("init(ctx) must be called before using the coordinator")

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

    # -- lease ------------------------------------------------------------------------

    def _register(self) -> None:
        """Grant a lease and create the node's registration key if absent."""
        alive = self._keys.node_alive(self._node_id)
        started = self._clock.monotonic()
        lease, _granted = self._driver.grant(self._cfg.lease_ttl)
        value = self._alive_record()
        try:
            result = self._driver.txn([absent(alive)], [Put(alive, value, lease)], [Range(alive)])
        except BaseException:
            self._revoke_quietly(lease)
            raise
        if not result.succeeded:
            self._revoke_quietly(lease)
            raise NodeExists(f"node {self._node_id!r} is already live on {self.name}")
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._lease_id = lease
                self._renewed_at = started
                self._alive_rev = result.revision
        if closed:
            self._revoke_quietly(lease)
            raise CoordinatorClosed(f"coordinator {self._node_id!r} closed while registering")

    def _alive_record(self) -> bytes:
        return encode_json(
            {
                "started_at": iso(self._started_at),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "frozen": self._frozen,
                "leaving": self._leaving,
                **({"labels": self._labels} if self._labels else {}),
            }
        )

    def report_frozen(self, frozen: bool) -> None:
        """Publish the frozen flag in the node's registration (best effort)."""
        with self._lock:
            self._frozen = frozen
        self._republish(f"frozen={frozen}", logging.DEBUG)

    def announce_leaving(self) -> None:
        """Publish ``leaving`` in the node's registration (best effort): the other nodes'
        watches see it at once and their balancers stop counting this node."""
        with self._lock:
            self._leaving = True
        self._republish("leaving", logging.WARNING)

    def _republish(self, what: str, level: int) -> None:
        with self._lock:
            lease, alive_rev = self._lease_id, self._alive_rev
        if lease is None or self._closed:
            return
        alive = self._keys.node_alive(self._node_id)
        try:
            self._driver.txn([created_at(alive, alive_rev)], [Put(alive, self._alive_record(), lease)])
        except MetaforaError as exc:
            log.log(level, "node %s: could not publish %s: %s", self._node_id, what, exc,
                    extra=self._extra)

    def listen_membership(self, listener: Callable[[], None]) -> bool:
        """Call ``listener`` when the namespace watch sees a registration key change (a
        join, a leave or lease expiry, a ``leaving`` flag) and whenever it re-lists."""
        with self._lock:
            self._member_listeners.append(listener)
        self._ensure_watcher()
        return True

    def _members_changed(self) -> None:
        with self._lock:
            listeners = list(self._member_listeners)
        for listener in listeners:
            listener()

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self._driver.revoke(lease, timeout=1.0)
        except MetaforaError:
            log.debug("could not revoke lease %x", lease, exc_info=True, extra=self._extra)

    def _lease_loop(self) -> None:
        interval = self._cfg.lease_ttl / 3
        next_beat = self._clock.monotonic() + interval
        backoff = _BACKOFF_START
        failing = False
        while not self._stop.is_set():
            try:
                with self._lock:
                    lease, renewed, paused = self._lease_id, self._renewed_at, self._keepalive_paused
                now = self._clock.monotonic()
                if lease is None:
                    if paused:
                        self._beat_wake.wait(0.05)
                        self._beat_wake.clear()
                        continue
                    with self._lock:
                        grace = self._old_lease_until - now if self._old_lease is not None else 0.0
                    if grace > 0:
                        # The fenced handlers get the margin to stop: revoking the old lease
                        # now would let another node claim their tasks while they still run.
                        self._beat_wake.wait(grace)
                        self._beat_wake.clear()
                        continue
                    if self._reregister():
                        next_beat = self._clock.monotonic() + interval
                        backoff = _BACKOFF_START
                    else:
                        self._stop.wait(backoff)
                        backoff = min(backoff * 2, _BACKOFF_MAX)
                    continue
                fence_at = renewed + self._fence_after
                if now >= fence_at:
                    self._fence(f"no successful lease renewal for {now - renewed:.2f}s")
                    continue
                wake_at = min(next_beat, fence_at)
                if wake_at > now:
                    self._beat_wake.wait(wake_at - now)
                    self._beat_wake.clear()
                    continue
                if paused:  # fault injection: pretend the renewal never got through
                    next_beat = now + interval
                    continue
                started = self._clock.monotonic()
                try:
                    ttl = self._driver.keepalive(lease, timeout=fence_at - started)
                except MetaforaError as exc:
                    level = logging.DEBUG if failing else logging.WARNING
                    log.log(level, "node %s: lease renewal failed: %s", self._node_id, exc,
                            extra=self._extra)
                    failing = True
                    next_beat = self._clock.monotonic() + min(interval, 0.25)
                    continue
                if ttl <= 0:
                    self._fence("etcd no longer knows the lease")
                    continue
                took = self._clock.monotonic() - started
                with self._lock:
                    if self._lease_id == lease:
                        self._renewed_at = started
                    ctx = self._ctx
                if ctx is not None:
                    ctx.renewed(took)
                if failing:
                    log.info("node %s: lease renewal recovered", self._node_id, extra=self._extra)
                    failing = False
                if took > interval:
                    log.warning("node %s: lease renewal took %.2fs (interval %.2fs)",
                                self._node_id, took, interval, extra=self._extra)
                next_beat = started + interval
            except Exception:  # never let the heartbeat die: a dead heartbeat is a zombie
                log.exception("node %s: unexpected error in the lease loop", self._node_id,
                              extra=self._extra)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)

    def _reregister(self) -> bool:
        """After a fence: revoke the old lease, register again. True on success."""
        old = self._old_lease
        try:
            if old is not None:
                self._driver.revoke(old)
                with self._lock:
                    if self._old_lease == old:
                        self._old_lease = None
            self._register()
        except NodeExists:
            log.error("node %s: cannot re-register, another live node uses this id",
                      self._node_id, extra=self._extra)
            return False
        except CoordinatorClosed:
            return False
        except MetaforaError as exc:
            log.warning("node %s: re-registration failed: %s", self._node_id, exc,
                        extra=self._extra)
            return False
        log.warning("node %s: re-registered with a new lease", self._node_id, extra=self._extra)
        # Offers made while the node had no lease were refused (claim() returned None) and the
        # consumer dropped them; nothing changes in etcd to offer them again, so re-offer
        # every claimable task now rather than at the next safety-net re-list.
        with self._lock:
            for sub in self._subs:
                sub.mark(None)
        return True

    def _fence(self, reason: str) -> None:
        """Drop the lease and tell the node every claim is lost (self-fencing)."""
        with self._lock:
            lease = self._lease_id
            if lease is None:
                return
            self._lease_id = None
            self._old_lease = lease
            self._old_lease_until = self._renewed_at + self._cfg.lease_ttl
            lost = [held.task for held in self._held.values()]
            self._held.clear()
        log.warning("node %s: lease lost (%s); stopping %d task(s)", self._node_id, reason,
                    len(lost), extra=self._extra)
        self._notify_lost(lost)
        self._beat_wake.set()

    def _notify_lost(self, tasks: list[Task]) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        for task in tasks:
            if self._closed:
                return
            log.info("node %s lost task %s (token %d)", self._node_id, task.id, task.token,
                     extra={"node": self._node_id, "task": task.id})
            try:
                ctx.lost(task)
            except Exception:
                log.exception("ctx.lost(%s) raised", task.id,
                              extra={"node": self._node_id, "task": task.id})

    def suspend_keepalive(self) -> None:
        """Fault injection for tests: stop renewing the lease (as if etcd were cut off).

        The node then self-fences (``ctx.lost`` for every claim) before the lease expires,
        and does not re-register until :meth:`resume_keepalive`.
        """
        with self._lock:
            self._keepalive_paused = True
        self._beat_wake.set()

    def resume_keepalive(self) -> None:
        """Undo :meth:`suspend_keepalive`."""
        with self._lock:
            self._keepalive_paused = False
        self._beat_wake.set()

    @property
    def lease_id(self) -> int | None:
        """The node's current etcd lease (None while it has none)."""
        with self._lock:
            return self._lease_id

    # -- claims -----------------------------------------------------------------------

    def seen_taken(self, task: Task) -> bool:
        # The watch cache saw an owner or a finish. If that view is stale, the release or
        # resubmission that follows reaches the cache and re-offers the task.
        with self._lock:
            entry = self._cache.get(task.id)
            return entry is not None and (entry.owner is not None or entry.finished)

    def claim(self, task: Task) -> Task | None:
        self._require_init()
        with self._lock:
            lease = self._lease_id
            entry = self._cache.get(task.id)
            known = entry.known() if entry is not None and entry.props is not None else None
        if lease is None:
            return None  # the lease is lost; the lease thread is re-registering
        if known is None:
            known = self._read_known(task.id)
            if known is None:
                return None
        claimed = self._claim_known([(task, known)], lease)
        return claimed[0] if claimed else None

    def _read_known(self, task_id: str) -> _Known | None:
        """A task the watch cache does not know (yet): read it."""
        tk = self._keys.task(task_id)
        kvs, _ = self._driver.range(Range(tk.prefix, prefix=True))
        rec = gather(self._keys, kvs).get(task_id)
        if rec is None or rec.props is None:
            return None
        return _Entry.from_record(task_id, rec).known()

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        """Claim offers in multi-op txns (up to :data:`_BATCH` tasks each, all in flight at
        once); a txn refused because one of its tasks was taken meanwhile tells, in the same
        round trip, which ones to try again."""
        self._require_init()
        with self._lock:
            lease = self._lease_id
            batch: list[tuple[Task, _Known]] = []
            single: list[Task] = []
            seen: set[str] = set()
            for task in tasks:
                if task.id in seen:
                    continue  # one claim txn may not write a key twice
                seen.add(task.id)
                entry = self._cache.get(task.id)
                if entry is not None and (entry.owner is not None or entry.finished):
                    continue  # seen taken: no round trip for a stale offer
                if entry is None or entry.props is None:
                    single.append(task)
                else:
                    batch.append((task, entry.known()))
        if lease is None:
            return []
        for task in single:  # not in the watch cache yet: rare (an offer the cache has not seen)
            known = self._read_known(task.id)
            if known is not None:
                batch.append((task, known))
        claimed: list[Task] = []
        while batch and len(claimed) < limit:
            take, batch = batch[: limit - len(claimed)], batch[limit - len(claimed):]
            claimed += self._claim_known(take, lease)
        return claimed

    def _claim_known(self, items: list[tuple[Task, _Known]], lease: int) -> list[Task]:
        """Claim ``items`` as judged by their ``_Known``: one txn per :data:`_BATCH` of them,
        in flight together; what a refused txn's failure branch read re-judges its tasks for
        the next round (at most three rounds, as a lone claim always had)."""
        claimed: list[Task] = []
        error: MetaforaError | None = None
        for _round in range(3):
            items = [(t, k) for t, k in items if self._claimable(t.id, k)]
            if not items:
                break
            chunks = [items[i:i + _BATCH] for i in range(0, len(items), _BATCH)]
            requests = [self._claim_request(chunk, lease) for chunk in chunks]
            answers = self._driver.txns(requests, repeatable=True)
            items = []
            for chunk, answer in zip(chunks, answers, strict=True):
                if isinstance(answer, LeaseNotFound):
                    self._fence("etcd refused a claim: lease not found")
                    return claimed
                if isinstance(answer, MetaforaError):
                    error = answer
                    continue
                if answer.succeeded:
                    for task, known in chunk:
                        got = self._took(known.task(task.id, answer.revision), lease)
                        if got is not None:
                            claimed.append(got)
                    continue
                for n, (task, _known) in enumerate(chunk):
                    props_kvs, state_kvs, owner_kvs, running_kvs = answer.ranges[4 * n:4 * n + 4]
                    if owner_kvs:
                        owner = owner_kvs[0]
                        if (
                            answer.retried
                            and owner.value == self._node_bytes
                            and owner.lease == lease
                            and props_kvs
                            and not self.holds_claim(task.id)
                        ):
                            # Ours but not known: the lost first attempt of this txn was
                            # applied. The owner key is on this node's lease, so no one else
                            # could have taken it meanwhile.
                            stored = props_of(props_kvs[0], task.id)
                            got = self._took(stored.task(task.id, owner.create_revision), lease)
                            if got is not None:
                                claimed.append(got)
                        continue
                    if state_kvs or not props_kvs:
                        continue
                    # Resubmitted, or its previous claim ended, since we read it: judge again.
                    rec = TaskRecord(props=props_kvs[0],
                                     running=running_kvs[0] if running_kvs else None)
                    items.append((task, _Entry.from_record(task.id, rec).known()))
        if error is not None:
            if not claimed:
                raise error
            log.warning("node %s: some claims failed (%s); their tasks are offered again at the "
                        "next re-list", self._node_id, error, extra=self._extra)
        return claimed

    def _claim_request(self, chunk: list[tuple[Task, _Known]], lease: int) -> TxnRequest:
        """The txn claiming every task of ``chunk``; its failure branch reads them back."""
        compares: list[Compare] = []
        puts: list[Op] = []
        reads: list[Op] = []
        record = self._claim_record()  # one clock read and encoding per txn, not per task
        for task, known in chunk:
            c, p = self._claim_ops(task.id, known, lease, record)
            compares += c
            puts += p
            tk = self._keys.task(task.id)
            reads += [Range(tk.props), Range(tk.state), Range(tk.owner), Range(tk.running)]
        return compares, puts, reads

    def _claim_record(self) -> bytes:
        """The claim key's value for claims made now."""
        return encode_json({"node": self._node_id, "claimed_at": iso(self._clock.now())})

    def _claim_ops(self, task_id: str, known: _Known, lease: int,
                   record: bytes) -> tuple[list[Compare], list[Put]]:
        """The compares and puts of one claim: free, unfinished, as judged, and this node's."""
        tk = self._keys.task(task_id)
        compares = [
            absent(tk.owner),
            absent(tk.state),
            modified_at(tk.props, known.props_mod),
            modified_at(tk.running, known.running_mod),
        ]
        puts = [
            Put(tk.owner, self._node_bytes, lease),
            Put(tk.claim, record),
            Put(tk.running, _running_record(known.crashes())),
        ]
        return compares, puts

    def holds_claim(self, task_id: str) -> bool:
        """Whether this node knows it holds a claim of ``task_id`` (its local view, no I/O)."""
        with self._lock:
            return task_id in self._held

    def _claimable(self, task_id: str, known: _Known) -> bool:
        """Whether to try the claim; fails or expires a task that can never run."""
        try:
            if known.damage is not None:
                raise InvalidProps(known.damage)
            if not known.valid:  # checked when offered, unless read since
                Task(task_id, known.props)
        except InvalidProps as exc:
            # Written by hand or by something else than metafora: it can never run.
            self._fail_unclaimed(task_id, known.props_mod, f"invalid props: {exc}")
            return False
        if not matches(known.selector, self._labels):
            return False  # placement: this node's labels do not match the task's selector
        limit = self._ctx.max_crashes if self._ctx is not None else None
        verdict = crash_limit_error(known.crashes(), limit)
        if verdict is not None:
            self._fail_unclaimed(task_id, known.props_mod, verdict)
            return False
        now = self._clock.now()
        launch, expires = launch_and_expiry(known.props)
        if expires is not None and expires <= now:
            self._expire(task_id, known.props_mod)
            return False
        return launch is None or launch <= now

    def _took(self, claimed: Task, lease: int) -> Task | None:
        """Record a successful claim, unless it is already gone."""
        with self._lock:
            entry = self._cache.get(claimed.id)
            gone = self._cache_rev >= claimed.token and (
                entry is None or entry.owner_rev != claimed.token
            )
            if self._lease_id != lease or self._closed or gone:
                # Fenced or closed meanwhile, or the watch has already seen the owner key go
                # (deleted right after the claim): the claim is not ours to run.
                return None
            self._held[claimed.id] = _Held(claimed)
        log.debug("node %s claimed %s (token %d)", self._node_id, claimed.id, claimed.token,
                  extra={"node": self._node_id, "task": claimed.id})
        return claimed

    def _fail_unclaimed(self, task_id: str, props_mod: int, error: str) -> None:
        extra = {"node": self._node_id, "task": task_id}
        try:
            if fail_unclaimed(self._driver, self._keys, task_id, props_mod, self._clock.now(), error):
                log.error("task %s cannot run; marked it failed: %s", task_id, error, extra=extra)
        except MetaforaError as err:
            log.warning("could not mark task %s failed (%s): %s", task_id, error, err, extra=extra)

    def _expire(self, task_id: str, props_mod: int) -> None:
        try:
            if expire_task(self._driver, self._keys, task_id, props_mod, self._clock.now()):
                log.info("task %s expired", task_id, extra={"node": self._node_id, "task": task_id})
        except MetaforaError as exc:
            log.debug("could not expire task %s: %s", task_id, exc,
                      extra={"node": self._node_id, "task": task_id})

    def release(self, task: Task) -> None:
        self._finish_one(Finish(task, Outcome.RELEASE))

    def done(self, task: Task) -> None:
        self._finish_one(Finish(task, Outcome.DONE))

    def fail(self, task: Task, error: BaseException | str) -> None:
        self._finish_one(Finish(task, Outcome.FAIL, error_text(error)))

    def _finish_one(self, finish: Finish) -> None:
        """One fenced outcome, group-committed with those other threads write meanwhile."""
        self._check_open()
        self._finishing([finish])
        error = self._commit.submit(finish)
        self._finished([finish], [error])
        if error is not None:
            raise error

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Record many outcomes in multi-op txns (up to 42 outcomes each, several in flight),
        each fenced by its own claim's owner key and token exactly as a single write is."""
        self._check_open()
        finishes = list(finishes)
        if not finishes:
            return []
        self._finishing(finishes)
        results = self._outcomes.write(finishes)
        self._finished(finishes, results)
        if all(isinstance(r, CoordinatorUnavailable | CoordinatorClosed) for r in results):
            # Nothing written: the caller retries the batch (an outcome whose lost first
            # answer was applied is then refused as ClaimLost, as a single write is).
            error = results[0]
            assert error is not None
            raise error
        return results

    def _finishing(self, finishes: list[Finish]) -> None:
        """Mark the claims whose outcome is being written (their owner key's delete is not a
        lost claim)."""
        with self._lock:
            for finish in finishes:
                held = self._held.get(finish.task.id)
                if held is not None and held.task.token == finish.task.token:
                    held.finishing = True

    def _finished(self, finishes: list[Finish], results: list[MetaforaError | None]) -> None:
        """Forget the claims whose outcome was written, or refused (kept while etcd could not
        be reached: the caller retries)."""
        with self._lock:
            for finish, error in zip(finishes, results, strict=True):
                if isinstance(error, CoordinatorUnavailable | CoordinatorClosed):
                    continue
                held = self._held.get(finish.task.id)
                if held is not None and held.task.token == finish.task.token:
                    del self._held[finish.task.id]
        for finish, error in zip(finishes, results, strict=True):
            if error is None:
                task = finish.task
                log.debug("node %s: %s %s (token %d)", self._node_id, finish.outcome.value,
                          task.id, task.token, extra={"node": self._node_id, "task": task.id})

    def holds(self, task: Task) -> bool:
        with self._lock:
            mine = self._held.get(task.id)
            live = self._lease_id is not None and (
                self._clock.monotonic() < self._renewed_at + self._fence_after
            )
        return live and mine is not None and mine.task.token == task.token

    def claim_time_left(self, task: Task) -> float | None:
        with self._lock:
            mine = self._held.get(task.id)
            if self._lease_id is None or mine is None or mine.task.token != task.token:
                return 0.0
            return max(0.0, self._renewed_at + self._fence_after - self._clock.monotonic())

    def held(self) -> list[Task]:
        """The claims this node holds now (as it believes)."""
        with self._lock:
            return [h.task for h in self._held.values()]

    # -- cluster state ----------------------------------------------------------------

    def node_task_count(self) -> dict[str, int]:
        self._check_open()
        return node_task_count(self._driver, self._keys)

    def active_task_count(self) -> dict[str, int]:
        self._check_open()
        return active_task_count(self._driver, self._keys)
    def node_labels(self) -> dict[str, dict[str, str]]:
        self._check_open()
        return node_labels(self._driver, self._keys)

    # -- commands ---------------------------------------------------------------------

    def command(self, timeout: float | None = None) -> Command | None:
        """The next node command: etcd is read only after the watch saw one queued (or
        re-listed), or once per ``poll_interval`` as a safety net -- not on every call."""
        deadline = None if timeout is None else self._clock.monotonic() + timeout
        while True:
            with self._lock:
                if self._closed:
                    return None
                seq = self._cmd_seq
                due = self._ctx is not None and (
                    seq != self._cmd_seen_seq or self._clock.monotonic() >= self._cmd_check_at
                )
                if due:  # marked before the look: a wake-up during it is kept
                    self._cmd_seen_seq = seq
                    self._cmd_check_at = self._clock.monotonic() + self._cfg.poll_interval
            if due:
                command, more = self._look_for_command()
                if command is not None or more:
                    with self._lock:
                        self._cmd_seen_seq = -1  # more may be queued behind it
                if command is not None:
                    return command
                if more:
                    continue
            left = None if deadline is None else deadline - self._clock.monotonic()
            if left is not None and left <= 0:
                return None
            with self._lock:
                wait = max(0.0, self._cmd_check_at - self._clock.monotonic())
                if left is not None:
                    wait = min(wait, left)
                if self._cmd_seq == seq and not self._closed:
                    self._cmd_cond.wait(wait)

    def _look_for_command(self) -> tuple[Command | None, bool]:
        """:meth:`_take_command`, with store errors logged: (command, look again soon)."""
        try:
            found = self._take_command()
            self._cmd_failing = False
            return found
        except MetaforaError as exc:
            if isinstance(exc, CoordinatorClosed) or self._closed:
                return None, False
            level = logging.DEBUG if self._cmd_failing else logging.WARNING
            self._cmd_failing = True
            log.log(level, "node %s: reading commands failed: %s", self._node_id, exc,
                    extra=self._extra)
            with self._lock:  # retry within a second, not a whole poll_interval
                self._cmd_check_at = min(self._cmd_check_at, self._clock.monotonic() + 1.0)
            return None, False

    def _take_command(self) -> tuple[Command | None, bool]:
        """(the oldest command, whether to look again at once)."""
        prefix = self._keys.node_commands(self._node_id)
        kvs, _ = self._driver.range(Range(prefix, prefix=True, limit=1, by_create=True))
        if not kvs:
            return None, False
        kv = kvs[0]
        taken = self._driver.txn([created_at(kv.key, kv.create_revision)], [Delete(kv.key)])
        if not taken.succeeded:
            return None, True  # taken by another thread of ours
        try:
            return Command.from_json(kv.value), False
        except InvalidCommand as exc:
            log.warning("node %s: dropping malformed command %r: %s", self._node_id,
                        kv.value[:200], exc, extra=self._extra)
            return None, True

    def inject_raw_command(self, raw: str | bytes) -> None:
        """Queue raw (possibly malformed) command text for this node, for fault tests."""
        self._require_init()
        alive = self._keys.node_alive(self._node_id)
        kvs, _ = self._driver.range(Range(alive))
        if not kvs:
            raise NodeNotFound(f"node {self._node_id!r} is not live")
        key = self._keys.node_commands(self._node_id) + new_command_name().encode()
        data = raw.encode() if isinstance(raw, str) else raw
        result = self._driver.txn(
            [created_at(alive, kvs[0].create_revision)], [Put(key, data, kvs[0].lease)]
        )
        if not result.succeeded:
            raise NodeNotFound(f"node {self._node_id!r} is not live")

    # -- watch ------------------------------------------------------------------------

    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        sink = as_sink(out)
        sub = _Subscriber()
        sub.event.set()  # the first round offers every claimable task
        with self._lock:
            if self._closed:
                return
            self._subs.append(sub)
        self._ensure_watcher()
        timers: dict[str, datetime] = {}
        try:
            while True:
                now = self._clock.now()
                wait = _TIMER_CAP
                if timers:
                    wait = min(wait, max(0.0, (min(timers.values()) - now).total_seconds()))
                sub.event.wait(wait)
                offers, expiring = self._evaluate(sub, timers)
                for task_id, props_mod in expiring:
                    if self._closed:
                        return
                    self._expire(task_id, props_mod)
                for task in offers:
                    if self._closed:
                        return
                    sink(task)
                if self._closed:
                    return
        finally:
            with self._lock:
                if sub in self._subs:
                    self._subs.remove(sub)

    def _evaluate(
        self, sub: _Subscriber, timers: dict[str, datetime]
    ) -> tuple[list[Task], list[tuple[str, int]]]:
        """Which of the marked or due tasks to offer, and which to expire."""
        now = self._clock.now()
        offers: list[Task] = []
        expiring: list[tuple[str, int]] = []
        unusable: list[tuple[str, InvalidTaskId]] = []
        with self._lock:
            sub.event.clear()
            if self._closed or not self._cache_ready:
                return offers, expiring  # the first listing marks everything again
            candidates = set(self._cache) if sub.everything else sub.ids
            sub.ids = set()
            sub.everything = False
            for task_id, due in list(timers.items()):
                if due <= now:
                    candidates.add(task_id)
                    del timers[task_id]
            for task_id in sorted(candidates):
                entry = self._cache.get(task_id)
                if entry is None or entry.props is None or entry.finished or entry.owner:
                    timers.pop(task_id, None)
                    if entry is None:
                        self._unusable.pop(task_id, None)
                    continue
                try:
                    validate_task_id(task_id)
                except InvalidTaskId as bad_id:
                    # A key written by hand: no Task can carry this id. Skip it (log once).
                    timers.pop(task_id, None)
                    if self._unusable.get(task_id) != entry.props_mod:
                        self._unusable[task_id] = entry.props_mod
                        unusable.append((task_id, bad_id))
                    continue
                if entry.expires_at is not None and entry.expires_at <= now:
                    expiring.append((task_id, entry.props_mod))
                    timers.pop(task_id, None)
                elif entry.launch_at is not None and entry.launch_at > now:
                    timers[task_id] = entry.launch_at
                else:
                    offer, entry.props_valid = _offer(task_id, entry)
                    offers.append(offer)
                    if entry.expires_at is not None:
                        timers[task_id] = entry.expires_at
                    else:
                        timers.pop(task_id, None)
        for task_id, reason in unusable:
            log.warning("node %s: not offering the task stored as %r (an invalid id): %s",
                        self._node_id, task_id[:80], reason, extra=self._extra)
        # From a random place (racing nodes start in different regions), highest priority
        # first (the sort is stable: each priority keeps its rotation).
        offers = rotated(offers)
        offers.sort(key=lambda t: -t.priority)
        return offers, expiring

    def _watch_loop(self) -> None:
        backoff = _BACKOFF_START
        failing = False
        while not self._stop.is_set():
            handle: WatchHandle | None = None
            try:
                with self._lock:  # from now on, a late event of the old stream is dropped
                    self._watch_gen += 1
                    gen = self._watch_gen
                revision = self._relist()
                wq: queue.Queue[object] = queue.Queue()
                with self._lock:
                    if self._closed:
                        return
                    self._watch_queue = wq

                def deliver(item: WatchBatch | WatchFailure, gen: int = gen,
                            wq: queue.Queue[object] = wq) -> None:
                    # Events are folded in on the stream's reader thread: one thread hop
                    # less between a submit and its offer. Failures go to this loop.
                    if isinstance(item, WatchBatch):
                        self._apply(item, gen)
                    else:
                        wq.put(item)

                handle = self._driver.watch_prefix(self._keys.root, revision + 1, deliver)
                # Schedule changes while no watch ran were not pushed: the schedulers look once.
                with self._lock:
                    wakes = list(self._schedule_listeners)
                for wake in wakes:
                    wake()
                if failing:
                    log.info("node %s: watch recovered", self._node_id, extra=self._extra)
                failing = False
                backoff = _BACKOFF_START
                relist_at = self._clock.monotonic() + self._cfg.poll_interval
                while True:
                    left = relist_at - self._clock.monotonic()
                    if left <= 0:
                        break  # safety net: re-list now and then, in case a change was missed
                    try:
                        item = wq.get(timeout=left)
                    except queue.Empty:
                        break
                    if item is _STOP:
                        return
                    if isinstance(item, WatchFailure):
                        if item.compacted:
                            raise WatchCompacted(revision + 1)
                        raise CoordinatorUnavailable(f"etcd watch ended: {item.error!r}")
            except WatchCompacted:
                log.info("node %s: watch history compacted; re-listing", self._node_id,
                         extra=self._extra)
            except Exception as exc:
                if self._stop.is_set():
                    return
                level = logging.DEBUG if failing else logging.WARNING
                if not isinstance(exc, MetaforaError):
                    level = logging.ERROR
                log.log(level, "node %s: watch failed (%s: %s); retrying in %.2fs", self._node_id,
                        type(exc).__name__, exc, backoff, extra=self._extra,
                        exc_info=not isinstance(exc, MetaforaError))
                failing = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
            finally:
                if handle is not None:
                    handle.cancel()

    def _relist(self) -> int:
        """Rebuild the cache from one consistent read; returns its revision."""
        records, revision = read_all_tasks(self._driver, self._keys)
        cache = {task_id: _Entry.from_record(task_id, rec) for task_id, rec in records.items()}
        lost: list[Task] = []
        with self._lock:
            self._cache = cache
            self._cache_rev = revision
            self._cache_ready = True
            for task_id, held in list(self._held.items()):
                if held.task.token > revision:
                    continue  # claimed after this read
                entry = cache.get(task_id)
                if entry is None or entry.owner_rev != held.task.token:
                    del self._held[task_id]
                    if not held.finishing:
                        lost.append(held.task)
            for sub in self._subs:
                sub.mark(None)
            self._cmd_seq += 1
            self._cmd_cond.notify_all()
            listeners = list(self._task_cmd_listeners)
        self._notify_lost(lost)
        for listener in listeners:
            listener.recheck()  # the watch restarts: a put meanwhile may be unseen
        self._members_changed()  # likewise for a node that came or went meanwhile
        return revision

    def listen_task_commands(self, listener: TaskCommandListener) -> bool:
        """Ring ``listener`` for every task command the namespace watch sees queued, and
        ask it to recheck whenever the watch re-lists."""
        with self._lock:
            self._task_cmd_listeners.append(listener)
        return True

    def schedules(self) -> list[Schedule]:
        self._check_open()
        return _schedules.list_schedules(self._driver, self._keys)

    def materialise(self, schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
        self._check_open()
        return _schedules.materialise(self._driver, self._keys, schedule, tasks, cursor,
                                      self._clock.now())

    def listen_schedules(self, wake: Callable[[], None]) -> bool:
        """Woken by the node's watch (it covers the namespace); False before :meth:`init`."""
        with self._lock:
            if self._ctx is None:
                return False
            self._schedule_listeners.append(wake)
        return True

    def _apply(self, batch: WatchBatch, gen: int) -> None:
        """Fold watch events into the cache; collect offers, lost claims, command wake-ups.

        ``gen`` is the stream's: events of a stream replaced since (a late delivery racing
        its cancel) are dropped, the re-list that replaced it has read past them.
        """
        dirty: set[str] = set()
        lost: list[Task] = []
        commands = False
        schedules_changed = False
        members = False
        task_commands: list[str] = []
        with self._lock:
            if gen != self._watch_gen:
                return
            for event in batch.events:
                parsed = self._keys.parse(event.kv.key)
                if parsed is None:
                    continue
                kind, name, part = parsed
                put = event.kind == "put"
                if kind == "command":
                    commands = commands or (put and name == self._node_id)
                    continue
                if kind == "alive":
                    members = members or name != self._node_id
                    continue
                if kind == "taskcmd":
                    if put:
                        task_commands.append(name)
                    continue
                if kind == "schedule":
                    schedules_changed = True
                    continue
                if kind not in ("task", "owner") or part == "claim":
                    continue  # the claim key (who claimed last, when) is not cached
                entry = self._cache.setdefault(name, _Entry())
                if kind == "owner":
                    held = self._held.get(name)
                    if put:
                        entry.owner = event.kv.value.decode(errors="replace")
                        entry.owner_rev = event.kv.create_revision
                        if held is not None and event.kv.create_revision > held.task.token:
                            del self._held[name]  # someone else holds it now
                            if not held.finishing:
                                lost.append(held.task)
                    else:
                        entry.owner = None
                        entry.owner_rev = 0
                        dirty.add(name)
                        if held is not None and event.kv.mod_revision > held.task.token:
                            del self._held[name]
                            if not held.finishing:
                                lost.append(held.task)
                elif part == "props":
                    if put:
                        entry.set_props(event.kv, name)
                        dirty.add(name)
                    else:
                        entry.props = None
                elif part == "running":
                    entry.set_running(event.kv if put else None)
                elif part == "state":
                    entry.finished = put
                    if not put:
                        dirty.add(name)
                if entry.props is None and entry.owner is None:
                    del self._cache[name]
            self._cache_rev = max(self._cache_rev, batch.revision)
            if dirty:
                for sub in self._subs:
                    sub.mark(dirty)
            if commands:
                self._cmd_seq += 1
                self._cmd_cond.notify_all()
            listeners = list(self._task_cmd_listeners) if task_commands else []
            wakes = list(self._schedule_listeners) if schedules_changed else []
        for wake in wakes:
            wake()
        self._notify_lost(lost)
        if members:
            self._members_changed()
        for listener in listeners:
            for task_id in task_commands:
                listener.ring(task_id)


def _offer(task_id: str, entry: _Entry) -> tuple[Task, bool]:
    """The task to offer, and whether its props are valid; without them if they are not
    (the claim then fails it)."""
    try:
        task = entry.stored.task(task_id) if entry.stored is not None else Task(task_id)
        return task, entry.stored is not None
    except InvalidProps:
        return Task(task_id), False


@functools.lru_cache(maxsize=64)
def _running_record(crashes: int) -> bytes:
    """The running key's value (a handful of distinct values: encoded once each)."""
    return encode_json({"crashes": crashes})


def new_command_name() -> str:
    """A unique command key segment (time-ordered; the queue order is the create revision)."""
    return f"{SYSTEM_CLOCK.now().timestamp() * 1e9:020.0f}-{uuid.uuid4().hex[:12]}"

