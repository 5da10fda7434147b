"""The SQL coordinator: a consumer's view of a SQLite or PostgreSQL store.

A claim is one statement (see :mod:`~metafora.coordinators.sql.statements`): it takes a new
token from the store-wide counter and is valid while this node's lease is (see
:mod:`~metafora.coordinators.sql.lease`). Every write about a claim is fenced by owner and
token. Wake-ups (:mod:`~metafora.coordinators.sql.listen`) are pushed by PostgreSQL
LISTEN/NOTIFY; on SQLite a thread watches ``PRAGMA data_version`` (any commit by another
connection) every 10 ms. ``poll_interval`` is the safety-net poll behind both.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from metafora.commands import Command
from metafora.coordinator import Coordinator, CoordinatorContext, TaskSink, as_sink, error_text
from metafora.coordinators.sql.lease import Lease
from metafora.coordinators.sql.listen import ChangeFeed
from metafora.coordinators.sql.store import Database
from metafora.coordinators.sql.watch import Watch
from metafora.errors import (
    ClaimLost,
    CoordinatorClosed,
    InvalidCommand,
    MetaforaError,
    NodeExists,
)
from metafora.task import Task, validate_task_id

__all__ = ["SQLCoordinator"]

log = logging.getLogger(__name__)

_CLAIM_MANY_MAX = 100  # ids per claim_many statement


class SQLCoordinator(Coordinator):
    """A node's coordinator on a SQL store. Build it with :func:`metafora.open_coordinator`.

    Nothing touches the store until :meth:`init`. Thread-safe.
    """

    def __init__(self, db: Database, node_id: str) -> None:
        self._db = db
        self._node_id = validate_task_id(node_id)
        self._extra = {"node": self._node_id}
        self._lock = threading.Lock()
        self._ctx: CoordinatorContext | None = None
        self._lease = Lease(db, self._node_id, self._lost)
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._command_wake = threading.Event()
        self._watches: list[Watch] = []
        self._listener: ChangeFeed | None = None  # wake-ups, started on first need

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
            self._db.ensure_schema()
            if not self._lease.register(first=True):
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
        self._command_wake.set()
        with self._lock:
            watches = list(self._watches)
            registered = self._ctx is not None
        for watch in watches:
            watch.wake.set()
        session = self._lease.stop()
        if registered and session is not None:
            self._deregister(session)
        if self._listener is not None:
            self._listener.stop()
        self._db.close()
        log.info("node %s closed on %s", self._node_id, self.name, extra=self._extra)

    def _deregister(self, session: str) -> None:
        params = {"node": self._node_id, "session": session}
        db = self._db
        try:
            with db.transaction() as conn:
                freed = db.execute(conn, "close_free", dict(params)).fetchall()
                if freed:
                    db.next_token_used(conn, max(int(row[0]) for row in freed))
                db.execute(conn, "close_commands", dict(params))
                db.execute(conn, "close_node", dict(params))
        except MetaforaError as exc:
            log.warning("could not deregister node %s from %s (its lease will expire): %s",
                        self._node_id, self.name, exc, extra=self._extra)
            return
        if freed:
            log.info("node %s released %d claim(s) on close", self._node_id, len(freed),
                     extra=self._extra)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise CoordinatorClosed(f"coordinator {self._node_id!r} on {self.name} is closed")

    def _require_init(self) -> None:
        self._check_open()
        if self._ctx is None:
            raise CoordinatorClosed("init(ctx) must be called before using the coordinator")

    def _lost(self, task: Task) -> None:
        ctx = self._ctx
        if ctx is not None and not self._closed.is_set():
            ctx.lost(task)

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
        if kind == "t":
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                watch.task_notified(name)
        elif kind == "c" and name == self._node_id:
            self._command_wake.set()
        elif kind == "n" and name == self._node_id:
            self._lease.request_check()
        elif kind == "":  # SQLite: something was committed; look
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                watch.wake.set()
            self._command_wake.set()

    def _reconnected(self) -> None:
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.rescan()
        self._command_wake.set()
        if self._ctx is not None:
            self._lease.request_check()

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
        self._require_init()
        started = self._lease.begin_claim(task.id)
        if started is None:
            log.debug("node %s is not live; not claiming %s", self._node_id, task.id,
                      extra={"node": self._node_id, "task": task.id})
            return None
        epoch, session = started
        claimed: Task | None = None
        props_text: str | None = None
        token = 0
        try:
            with self._db.hot() as cur:
                row = cur.one("claim", {"id": task.id, "node": self._node_id, "session": session})
                if row is not None:
                    token, props_text = int(row[0]), str(row[1])
                    cur.token_used(token)
            if props_text is not None:
                claimed = self._parse_claimed(task.id, props_text, token)
        finally:
            kept = self._lease.end_claim(task.id, epoch, claimed)
        if claimed is not None and not kept:
            # The lease was lost (or the node closed) while the claim was in flight.
            self._lease.release_untracked(claimed.id, claimed.token)
            return None
        return claimed

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        """Claim up to ``limit`` of ``tasks`` in one statement (one round trip)."""
        self._require_init()
        ids = list(dict.fromkeys(t.id for t in tasks))[: max(0, _CLAIM_MANY_MAX)]
        if not ids or limit <= 0:
            return []
        if len(ids) == 1:
            one = self.claim(tasks[0])
            return [] if one is None else [one]
        begun: list[tuple[str, int]] = []
        session = ""
        for task_id in ids:
            started = self._lease.begin_claim(task_id)
            if started is None:  # the lease is not live: claim nothing
                for done_id, epoch in begun:
                    self._lease.end_claim(done_id, epoch, None)
                return []
            begun.append((task_id, started[0]))
            session = started[1]
        epoch = begun[0][1]
        claimed: dict[str, Task | None] = {}
        try:
            with self._db.hot() as cur:
                rows = cur.all("claim_many", {
                    "ids": self._db.dialect.ids_param(ids), "limit": min(limit, len(ids)),
                    "node": self._node_id, "session": session,
                })
                if rows:
                    cur.token_used(max(int(r[1]) for r in rows))
            for task_id, token, props_text in rows:
                claimed[str(task_id)] = self._parse_claimed(str(task_id), str(props_text), int(token))
        finally:
            kept: list[Task] = []
            for task_id in ids:
                got = claimed.get(task_id)
                if self._lease.end_claim(task_id, epoch, got) and got is not None:
                    kept.append(got)
                elif got is not None:
                    self._lease.release_untracked(got.id, got.token)
        return kept

    def _parse_claimed(self, task_id: str, props_text: str, token: int) -> Task | None:
        try:
            return Task(task_id, json.loads(props_text), token)
        except (ValueError, MetaforaError) as exc:
            log.error("task %s has invalid stored props; marking it failed: %s", task_id, exc,
                      extra={"node": self._node_id, "task": task_id})
            with self._db.hot() as cur:
                cur.one("fail", {"id": task_id, "node": self._node_id, "token": token,
                                 "error": f"invalid props: {exc}"})
            return None

    def release(self, task: Task) -> None:
        self._fenced("release", task, {})

    def done(self, task: Task) -> None:
        self._fenced("done", task, {})

    def fail(self, task: Task, error: BaseException | str) -> None:
        self._fenced("fail", task, {"error": error_text(error)})

    def _fenced(self, name: str, task: Task, params: dict[str, Any]) -> None:
        self._check_open()
        params.update(id=task.id, node=self._node_id, token=task.token)
        self._lease.begin_finish(task.id)
        settled = False
        try:
            with self._db.hot() as cur:
                row = cur.one(name, params)
                if row is not None and name == "release":
                    cur.token_used(int(row[0]))
            settled = True
        finally:
            self._lease.end_finish(task, settled)
        if row is None:
            raise ClaimLost(
                f"node {self._node_id!r} no longer holds task {task.id!r} with token {task.token}"
            )

    # -- commands ---------------------------------------------------------------------------

    def command(self, timeout: float | None = None) -> Command | None:
        if self._closed.is_set():
            return None
        self._db.ensure_schema()
        self._start_listener()
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = self._db.config.poll_interval
        while not self._closed.is_set():
            self._command_wake.clear()
            command = self._take_command()
            if command is not None:
                return command
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._command_wake.wait(poll if left is None else min(poll, left))
        return None

    def _take_command(self) -> Command | None:
        db, params = self._db, {"node": self._node_id}
        for _ in range(100):  # bounded: malformed commands are dropped one by one
            with db.read() as conn:
                if db.execute(conn, "command_peek", dict(params)).scalar() is None:
                    return None
            with db.write() as conn:
                row = db.execute(conn, "command_take", dict(params)).first()
            if row is None:
                continue  # taken by a concurrent reader; look again
            try:
                return Command.from_json(str(row[1]))
            except InvalidCommand as exc:
                log.warning("dropping malformed command %s for node %s: %s", row[0],
                            self._node_id, exc, extra=self._extra)
        return None

    # -- cluster state ----------------------------------------------------------------------

    def node_task_count(self) -> dict[str, int]:
        self._check_open()
        self._db.ensure_schema()
        with self._db.read() as conn:
            rows = self._db.execute(conn, "node_counts", {}).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

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
