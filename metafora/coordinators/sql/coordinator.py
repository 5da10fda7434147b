"""The SQL coordinator: a consumer's view of a SQLite or PostgreSQL store.

A claim is one statement (see :mod:`~metafora.coordinators.sql.statements`): it takes a new
token from the store-wide counter and is valid while this node's lease is (see
:mod:`~metafora.coordinators.sql.lease`). Every write about a claim is fenced by owner and
token (:mod:`~metafora.coordinators.sql.claims`). The coordinator is composed of those
parts, each given what it needs at construction: the lease (with its hooks), the claims and
outcomes (with the lease), a watch per ``watch(out)`` and the change feed. Wake-ups
(:mod:`~metafora.coordinators.sql.listen`) are pushed by PostgreSQL LISTEN/NOTIFY; on
SQLite a thread watches ``PRAGMA data_version`` (any commit by another connection) every
10 ms. ``poll_interval`` is the safety-net poll behind both.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from metafora.contracts.coordinator import (
    Coordinator,
    CoordinatorContext,
    Finish,
    TaskCommandListener,
    TaskSink,
    as_sink,
)
from metafora.coordinators.members import context_capacity, context_weight
from metafora.coordinators.sql import schedules as _schedules
from metafora.coordinators.sql.claims import ClaimOutcomes, Claims
from metafora.coordinators.sql.commands import NodeCommands
from metafora.coordinators.sql.complete import complete_in
from metafora.coordinators.sql.lease import Lease
from metafora.coordinators.sql.listen import ChangeFeed
from metafora.coordinators.sql.nodes import NodeReads, NodeViews
from metafora.coordinators.sql.retention import SQLRetention
from metafora.coordinators.sql.store import Database
from metafora.coordinators.sql.watch import Watch
from metafora.core.commands import Command
from metafora.core.errors import (
    CoordinatorClosed,
    MetaforaError,
    NodeExists,
)
from metafora.core.holds import check_sticky_for
from metafora.core.leases import LeaseTiming, report_renewal_failure
from metafora.core.schedule_model import Schedule
from metafora.core.task import Task, validate_task_id

__all__ = ["SQLCoordinator"]

log = logging.getLogger(__name__)

class SQLCoordinator(NodeViews, SQLRetention, Coordinator):
    """A node's coordinator on a SQL store. Build it with :func:`metafora.open_coordinator`.

    Nothing touches the store until :meth:`init`. Thread-safe.
    """

    backend = "sql"

    claim_burst = 256  # claim_many takes them in one statement (SQLite: 100 per statement), in order

    def __init__(self, db: Database, node_id: str) -> None:
        self._db = db
        self._node_id = validate_task_id(node_id)
        self._extra = {"node": self._node_id}
        self._lock = threading.Lock()
        self._ctx: CoordinatorContext | None = None
        self._lease = Lease(db, self._node_id, self._lost, self._renewed,
                            on_members=self._members_seen, on_failed=self._renewal_failed)
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._task_command_listeners: list[TaskCommandListener] = []
        self._schedule_listeners: list[Callable[[], None]] = []
        self._watches: list[Watch] = []
        self._listener: ChangeFeed | None = None  # wake-ups, started on first need
        self._member_listeners: list[Callable[[], None]] = []
        self._member_print: tuple[Any, ...] | None = None  # last membership fingerprint seen
        self._nodes = NodeReads(db)
        self._claims = Claims(db, self._node_id, self._lease, self._initialised)
        self._outcomes = ClaimOutcomes(db, self._node_id, self._lease, self._check_open)
        self._commands = NodeCommands(db, self._node_id, closed=self._closed,
                                      before_read=self._before_command_read)

    @property
    def name(self) -> str:
        return self._db.name

    @property
    def node_id(self) -> str:
        return self._node_id

    # -- life cycle -------------------------------------------------------------------------

    def init(self, ctx: CoordinatorContext) -> None:
        with self._lock:
            self._check_open()
            if self._ctx is not None:
                raise MetaforaError(f"coordinator {self._node_id!r} is already initialised")
            weight = context_weight(ctx)
            self._lease.row.capacity = lambda: context_capacity(ctx)
            self._db.ensure_schema()
            if not self._lease.register(first=True, labels=ctx.labels, weight=weight):
                raise NodeExists(f"node {self._node_id!r} is already live on {self.name}")
            self._ctx = ctx
        self._start_listener()
        self._lease.start()
        log.info("node %s registered on %s", self._node_id, self.name, extra=self._extra)

    def close(self) -> None:
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._commands.wake()
        with self._lock:
            watches = list(self._watches)
            registered = self._ctx is not None
        for watch in watches:
            watch.wake.set()
        session = self._lease.stop()
        if registered and session is not None:
            _deregister(self._db, self._node_id, session, self._outcomes.hold)
        if self._listener is not None:
            self._listener.stop()
        self._db.close()
        log.info("node %s closed on %s", self._node_id, self.name, extra=self._extra)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise CoordinatorClosed(f"coordinator {self._node_id!r} on {self.name} is closed")

    def _retention_db(self) -> Database:
        self._check_open()
        return self._db

    def _initialised(self) -> CoordinatorContext:
        """The context; CoordinatorClosed when closed or not initialised yet."""
        self._check_open()
        ctx = self._ctx
        if ctx is None:
            raise CoordinatorClosed("init(ctx) must be called before using the coordinator")
        return ctx

    def _lost(self, task: Task) -> None:
        ctx = self._ctx
        if ctx is not None and not self._closed.is_set():
            ctx.lost(task)

    def _renewed(self, seconds: float) -> None:
        ctx = self._ctx
        if ctx is not None:
            ctx.renewed(seconds)

    def _renewal_failed(self, error: BaseException) -> None:
        ctx = self._ctx
        if ctx is not None:
            report_renewal_failure(ctx, error)

    # -- notifications ----------------------------------------------------------------------

    def _start_listener(self) -> None:
        with self._lock:
            if self._listener is not None or self._closed.is_set():
                return
            from metafora.coordinators.sql.listen import make_feed

            self._listener = make_feed(self._db.dialect, self._node_id, self._notified,
                                       self._reconnected)
        self._listener.start()

    def _notified(self, payload: str) -> None:
        kind, name = payload[:1], payload[1:]
        if kind in ("t", "p"):
            props: str | None = None
            if kind == "p":  # a plain task: id US props (see the dialect's notify_task)
                name, _, props = name.partition("\x1f")
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                watch.task_notified(name, props)
        elif kind == "b" and name.isdigit():  # a bulk submit: one notification per batch
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                watch.pending_from(int(name))
        elif kind == "c" and name == self._node_id:
            self._commands.wake()
        elif kind == "n" and name == self._node_id:
            self._lease.request_check()
        elif kind == "m":
            for listener in self._listeners():
                listener.ring(name)
        elif kind == "s":
            self._wake_schedulers()
        elif kind == "j" and name != self._node_id:
            self._members_changed()
        elif kind == "":  # SQLite: something was committed; look
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                watch.wake.set()
            self._commands.wake()
            for listener in self._listeners():
                listener.recheck()

    def _reconnected(self) -> None:
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.rescan()
        self._commands.wake()
        for listener in self._listeners():
            listener.recheck()
        self._wake_schedulers()
        if self._ctx is not None:
            self._lease.request_check()

    def _members_seen(self, fingerprint: tuple[Any, ...]) -> None:
        """The lease read the membership fingerprint: tell the listeners if it changed."""
        with self._lock:
            before, self._member_print = self._member_print, fingerprint
        if before != fingerprint:  # the first reading too: a change before it went unseen
            self._members_changed()

    def _members_changed(self) -> None:
        with self._lock:
            listeners = list(self._member_listeners)
        for listener in listeners:
            listener()

    def listen_membership(self, listener: Callable[[], None]) -> bool:
        """PostgreSQL: NOTIFY on every register, leaving and deregister; both dialects: the
        lease's renewal (and SQLite's held-claims check) compare a membership fingerprint,
        which also catches a node whose lease expired."""
        with self._lock:
            self._member_listeners.append(listener)
        return True

    def announce_leaving(self) -> None:
        """Set this node's ``leaving`` flag (best effort; NOTIFY on PostgreSQL)."""
        session = self._lease.session()
        if session is None or self._closed.is_set():
            return
        try:
            with self._db.write() as conn:
                self._db.execute(conn, "node_leaving",
                                 {"node": self._node_id, "session": session}).fetchall()
        except MetaforaError as exc:
            log.warning("could not publish that node %s is leaving: %s", self._node_id, exc,
                        extra=self._extra)

    def _listeners(self) -> list[TaskCommandListener]:
        with self._lock:
            return list(self._task_command_listeners)

    def listen_task_commands(self, listener: TaskCommandListener) -> bool:
        """Ring ``listener`` on ``m<task id>`` notifications (PostgreSQL); SQLite: recheck
        on every commit seen by the change feed, and after a reconnect."""
        with self._lock:
            self._task_command_listeners.append(listener)
        return True

    # -- schedules --------------------------------------------------------------------------

    def _wake_schedulers(self) -> None:
        with self._lock:
            wakes = list(self._schedule_listeners)
        for wake in wakes:
            wake()

    def schedules(self) -> list[Schedule]:
        self._check_open()
        self._db.ensure_schema()
        return _schedules.list_schedules(self._db)

    def materialise(self, schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
        self._check_open()
        self._db.ensure_schema()
        return _schedules.materialise(self._db, schedule, tasks, cursor)

    def listen_schedules(self, wake: Callable[[], None]) -> bool:
        """PostgreSQL: ``s`` notifications. SQLite has no push worth listening to for this
        (its change feed fires on every commit): the scheduler's safety net re-reads."""
        if self._db.config.kind != "postgresql":
            return False
        with self._lock:
            self._schedule_listeners.append(wake)
        self._start_listener()
        if self._listener is not None:
            # LISTEN before the scheduler's first read, so no change in between is missed.
            self._listener.wait_listening(self._db.config.connect_timeout)
        return True

    # -- tasks ------------------------------------------------------------------------------

    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        sink = as_sink(out)
        if self._closed.is_set():
            return
        self._db.ensure_schema()
        watch = Watch(self._db, self._node_id, sink, self._closed)
        with self._lock:
            if self._closed.is_set():
                return
            self._watches.append(watch)
        try:
            self._start_listener()
            if self._listener is not None:
                # LISTEN before the first scan, so nothing submitted in between is missed.
                self._listener.wait_listening(self._db.config.connect_timeout)
            watch.run()
        finally:
            with self._lock:
                self._watches.remove(watch)

    def claim(self, task: Task) -> Task | None:
        return self._claims.claim(task)

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        """Claim up to ``limit`` of ``tasks`` in one transaction (one statement per 100), in
        the order offered (see :meth:`.claims.Claims.claim_many`)."""
        return self._claims.claim_many(tasks, limit)

    def claimable(self, tasks: Sequence[Task]) -> list[Task]:
        """Those of ``tasks`` that are still claimable by this node, in order (one read per
        500, no write lock)."""
        return self._claims.claimable(tasks)

    def seen_taken(self, task: Task) -> bool:
        return self._claims.seen_taken(task)

    def holds(self, task: Task) -> bool:
        return self._lease.still_holds(task)

    def claim_time_left(self, task: Task) -> float | None:
        return self._lease.time_left(task)

    def lease_time_left(self) -> float | None:
        return self._lease.time_left()

    def lease_timing(self) -> LeaseTiming:
        """When this node renews and fences (the optional seam of
        :mod:`metafora.core.leases`)."""
        cfg = self._db.config
        return LeaseTiming(renew_every=cfg.renew_interval, fence_after=cfg.fence_after)

    def release(self, task: Task) -> None:
        self._outcomes.release(task)

    def hold_releases(self, seconds: float) -> bool:
        self._outcomes.hold_releases(check_sticky_for(seconds, "seconds"))
        return True

    def done(self, task: Task) -> None:
        self._outcomes.done(task)

    def fail(self, task: Task, error: BaseException | str) -> None:
        self._outcomes.fail(task, error)

    def complete_task(self, task: Task, *, conn: Any) -> None:
        """As :meth:`metafora.Client.complete_task` (see :mod:`~metafora.coordinators.sql.complete`)."""
        self._check_open()
        complete_in(conn, self._db, task)

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Group commit: one fenced statement per outcome kind (and per 500 outcomes)."""
        return self._outcomes.finish_many(finishes)

    def finish_and_claim(self, finishes: Sequence[Finish], tasks: Sequence[Task], limit: int,
                         ) -> tuple[list[MetaforaError | None], list[Task]]:
        """``finish_many(finishes)`` and ``claim_many(tasks, limit)`` in one request: the
        outcomes of finished tasks and the claim of the next batch in one round trip
        (PostgreSQL: one statement; SQLite: one transaction), each fenced as on its own. The
        consumer sends the outcomes waiting for the group commit along with its claims."""
        if not finishes:
            return [], self.claim_many(tasks, limit)
        return self._claims.with_outcomes(self._outcomes, finishes, tasks, limit)

    # -- commands ---------------------------------------------------------------------------

    def command(self, timeout: float | None = None) -> Command | None:
        """The next node command (see :class:`~metafora.coordinators.sql.commands.NodeCommands`)."""
        return self._commands.next(timeout)

    def _before_command_read(self) -> None:
        self._db.ensure_schema()
        self._start_listener()

    def report_frozen(self, frozen: bool) -> None:
        """Publish whether this node is frozen (``metafora nodes`` shows it). Best effort."""
        self._lease.row.frozen = frozen
        session = self._lease.session()
        if session is None or self._closed.is_set():
            return
        try:
            with self._db.write() as conn:
                self._db.execute(conn, "node_frozen",
                                 {"node": self._node_id, "session": session, "frozen": frozen})
        except MetaforaError as exc:
            log.debug("could not publish the frozen state of node %s: %s", self._node_id, exc,
                      extra=self._extra)

    # -- test hooks -------------------------------------------------------------------------

    def _pause_heartbeat(self) -> None:
        """Stop renewing the lease, as a stalled node would (the node still self-fences)."""
        self._lease.pause()

    def _resume_heartbeat(self) -> None:
        """Renew again after :meth:`_pause_heartbeat` (the node re-registers if it must)."""
        self._lease.resume()

    def _held(self) -> list[Task]:
        """The claims this node tracks (for tests)."""
        return self._lease.held()


def _deregister(db: Database, node_id: str, session: str, hold: dict[str, Any]) -> None:
    """Free a closing node's claims (held for it as ``hold`` says), drop its commands and
    its row, in one transaction."""
    params = {"node": node_id, "session": session, **hold}
    extra = {"node": node_id}
    try:
        with db.transaction() as conn:
            freed = db.execute(conn, "close_free", dict(params)).fetchall()
            if freed:
                db.next_token_used(conn, max(int(row[0]) for row in freed))
            db.execute(conn, "close_commands", dict(params))
            db.execute(conn, "close_node", dict(params)).fetchall()
    except MetaforaError as exc:
        log.warning("could not deregister node %s from %s (its lease will expire): %s",
                    node_id, db.name, exc, extra=extra)
        return
    if freed:
        log.info("node %s released %d claim(s) on close", node_id, len(freed), extra=extra)
