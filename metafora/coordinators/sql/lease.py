"""A node's lease: registration, renewal, self-fencing, and the claims it holds.

The lease is the node's row in ``metafora_nodes``; ``lease_until`` is set from the database
clock (``now() + lease_ttl``) and a claim is valid while its owner's lease is. Two threads:

- **heartbeat** renews every ``lease_ttl / 3`` with ONE ``UPDATE`` of the node's row that
  reads no task: it publishes the node's count of claims (and, between renewals, a changed
  count within ``PUBLISH_DELAY``) and returns the row's *pokes*, which a client bumps when it
  changes one of this node's claims (deleting a claimed task). The node checks its claims --
  the count and token sum the store has for it, against the local set -- only when something
  says they may differ: the pokes changed, a PostgreSQL ``n<node>`` notification came, a
  claim or outcome failed without a clear answer (it may have committed), or the store came
  back. A mismatch triggers a reconcile that reports vanished claims as lost and releases
  claims nobody here tracks. Between renewals, while it holds claims, a node looks at its
  pokes every ``poll_interval`` on SQLite (which has no notifications) and every
  ``command_recheck`` on PostgreSQL: one row, whatever the number of claims. So an idle
  node's store traffic never grows with what it holds (guarantee 7). Claims taken over by
  another node need no check: that takes an expired lease, and then the renewal finds the
  registration gone and the node fences.
- **watchdog** self-fences: when ``2/3 * lease_ttl`` (lease_ttl minus a margin of a third)
  has passed on this host's monotonic clock since the START of the last successful renewal,
  it calls ``ctx.lost`` for every held claim. The store keeps the lease for ``lease_ttl``
  after that renewal's database time, so handlers have at least a third of the TTL to stop
  before anyone else can claim their tasks. It does not wait for a hung renewal to return.

After a fence (or when the store says the registration is gone) the node re-registers as
soon as its old registration has expired by the database clock; re-registering frees the
old claims (pending again, ready to be claimed, by this node too).
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from metafora.coordinators.sql.store import Database
from metafora.errors import MetaforaError
from metafora.task import Task

__all__ = ["PUBLISH_DELAY", "Lease", "reconcile", "release_untracked"]

log = logging.getLogger(__name__)

PUBLISH_DELAY = 0.25
"""Seconds a changed count of claims waits before it is published: a burst of claims and
outcomes costs one UPDATE of the node's row, and balancers see it a quarter second late."""
_RECHECK_AFTER = 0.5  # seconds before a check spoiled by claims in flight is done again


class Lease:
    """This node's registration and the claims it holds (all state guarded by one lock)."""

    def __init__(
        self,
        db: Database,
        node_id: str,
        on_lost: Callable[[Task], None],
        on_renewed: Callable[[float], None] | None = None,
        on_members: Callable[[tuple[Any, ...]], None] | None = None,
        on_failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_lost`` is told each claim lost, ``on_renewed`` each renewal's seconds,
        ``on_members`` the membership fingerprint of every lease read (see :mod:`.statements`),
        ``on_failed`` each failed renewal of a live lease."""
        self._db = db
        self._node_id = node_id
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self._on_failed = on_failed
        self._on_members = on_members
        self._frozen: bool | None = None  # published with every registration
        self._labels: Mapping[str, str] = {}  # likewise (placement labels, from register)
        self._weight = 1.0  # likewise (the node's weight, from register)
        self.capacity: Callable[[], int | None] = lambda: None  # published at every renewal
        cfg = db.config
        self._renew_every = cfg.renew_interval
        self._fence_after = cfg.fence_after
        # PostgreSQL pushes a deleted claim (NOTIFY n<node>) and every renewal compares the
        # summary anyway: checking between renewals is only SQLite's way to notice promptly.
        self._check_every = (
            max(cfg.poll_interval, 0.05) if cfg.kind == "sqlite" else cfg.command_recheck
        )
        self._extra = {"node": node_id}
        self._lock = threading.Lock()
        self._session: str | None = None
        self._live = False
        self._epoch = 0
        self._deadline = 0.0
        self._held: dict[str, Task] = {}
        self._busy: dict[str, int] = {}  # ids with a claim/done/release in flight
        self._changes = 0  # bumped by every local change to _held or _busy
        self._inconclusive = 0  # summary checks in a row spoiled by concurrent changes
        self._stop = threading.Event()
        self._wake = threading.Event()  # heartbeat: check now / re-evaluate
        self._watchdog_wake = threading.Event()
        self._paused = threading.Event()
        self._check_at: float | None = None  # when to check the claims (None: no need)
        self._pokes_seen: int | None = None  # None: check at the next look (a new registration)
        self._published: int | None = None  # the count of claims the node's row says
        self._publish_due: float | None = None  # monotonic time of the next publish
        self._threads: list[threading.Thread] = []

    # -- registration -------------------------------------------------------------------

    def labels_json(self) -> str | None:
        """The node's labels as stored (JSON object text; None when it has none)."""
        return labels_json(self._labels)

    def set_frozen(self, frozen: bool) -> None:
        """Whether the node is frozen, as every later registration publishes it."""
        self._frozen = frozen

    def register(self, first: bool, labels: Mapping[str, str] | None = None,
                 weight: float | None = None) -> bool:
        """Take (or take back) this node's registration; False if the id is live elsewhere.

        Frees the claims of any earlier registration of this id; ``first`` (init) also drops
        commands queued for a dead earlier process. ``labels`` and ``weight`` are kept for later.
        """
        self._labels = self._labels if labels is None else labels
        self._weight = self._weight if weight is None else weight
        session = uuid.uuid4().hex
        started = time.monotonic()
        params: dict[str, Any] = {
            "node": self._node_id, "session": session, "ttl": self._db.config.lease_ttl,
            "host": socket.gethostname(), "pid": os.getpid(), "frozen": self._frozen,
            "labels": self.labels_json(), "weight": self._weight, "capacity": self.capacity(),
        }
        with self._db.transaction() as conn:
            if self._db.execute(conn, "register", params).first() is None:
                return False
            freed = self._db.execute(conn, "free_own", {"node": self._node_id}).fetchall()
            if freed:
                self._db.next_token_used(conn, max(int(row[0]) for row in freed))
                log.info("node %s re-registered; %d claims of its earlier registration are "
                         "pending again", self._node_id, len(freed), extra=self._extra)
            if first:
                self._db.execute(conn, "drop_commands", {"node": self._node_id})
        with self._lock:
            self._session = session
            self._live = True
            self._epoch += 1
            self._deadline = started + self._fence_after
            self._held.clear()
            self._pokes_seen = None
            self._published = 0  # the registration wrote task_count = 0
        self._watchdog_wake.set()
        return True

    def start(self) -> None:
        """Start the heartbeat and watchdog threads (after the first :meth:`register`)."""
        for name, target in (("heartbeat", self._heartbeat_loop), ("watchdog", self._watchdog_loop)):
            thread = threading.Thread(
                target=target, name=f"metafora-sql-{name}-{self._node_id}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self) -> str | None:
        """Stop both threads; mark the lease not live. Returns the session to deregister."""
        self._stop.set()
        self._wake.set()
        self._watchdog_wake.set()
        self._paused.clear()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(5.0, self._db.config.connect_timeout + 1.0))
        with self._lock:
            self._live = False
            self._epoch += 1
            self._held.clear()
            return self._session

    # -- the claims ---------------------------------------------------------------------

    def begin_claim(self, task_ids: list[str]) -> tuple[int, str] | None:
        """Before a claim statement: (epoch, session), or None if the lease is not live."""
        with self._lock:
            if not self._live or self._session is None or time.monotonic() >= self._deadline:
                return None
            busy = self._busy
            for task_id in task_ids:
                busy[task_id] = busy.get(task_id, 0) + 1
            self._changes += 1
            return self._epoch, self._session

    def end_claim(self, task_ids: list[str], epoch: int, claimed: list[Task],
                  failed: bool = False) -> bool:
        """After a claim statement: keep ``claimed`` if the lease held throughout.
        ``failed``: the statement raised, so it may have claimed without saying: check."""
        with self._lock:
            for task_id in task_ids:
                self._unbusy(task_id)
            self._changes += 1
            if failed:
                self._check_at = time.monotonic()
                self._wake.set()
            if not claimed:
                return False
            if self._live and self._epoch == epoch and time.monotonic() < self._deadline:
                for task in claimed:
                    self._held[task.id] = task
                self._count_changed()
                return True
            return False

    def holds(self, task_id: str) -> bool:
        """Whether this node holds a claim on ``task_id`` (no I/O)."""
        with self._lock:
            return task_id in self._held

    def still_holds(self, task: Task) -> bool:
        """This node's lease is live by its own clock and it tracks ``task`` with its token."""
        with self._lock:  # on the hot path of every outcome: no call beyond the lock
            mine = self._held.get(task.id)
            return (self._live and time.monotonic() < self._deadline and mine is not None
                    and mine.token == task.token)

    def time_left(self, task: Task | None = None) -> float:
        """Seconds until the fencing deadline while the lease is live and, given ``task``,
        this node holds it under its token (else 0)."""
        with self._lock:
            mine = None if task is None else self._held.get(task.id)
            if not self._live or (task is not None and (mine is None or mine.token != task.token)):
                return 0.0
            return max(0.0, self._deadline - time.monotonic())

    def begin_finish(self, task_id: str) -> None:
        """Before a fenced write (release/done/fail) of ``task_id``."""
        with self._lock:
            self._busy[task_id] = self._busy.get(task_id, 0) + 1
            self._changes += 1

    def end_finish(self, task: Task, settled: bool) -> None:
        """After the fenced write; ``settled``: the claim is over (written or refused). Not
        settled: the write failed without a clear answer (it may have committed): check."""
        with self._lock:
            self._unbusy(task.id)
            self._changes += 1
            held = self._held.get(task.id)
            if settled and held is not None and held.token == task.token:
                del self._held[task.id]
                self._count_changed()
            if not settled:
                self._check_at = time.monotonic()
                self._wake.set()

    def _unbusy(self, task_id: str) -> None:
        """One write of ``task_id`` is no longer in flight (caller holds the lock)."""
        left = self._busy.get(task_id, 0) - 1
        if left > 0:
            self._busy[task_id] = left
        else:
            self._busy.pop(task_id, None)

    def _count_changed(self) -> None:
        """The count of claims changed (caller holds the lock): publish it soon."""
        if self._publish_due is None:
            self._publish_due = time.monotonic() + PUBLISH_DELAY
            self._wake.set()

    def session(self) -> str | None:
        """The current registration's session id (None before the first)."""
        with self._lock:
            return self._session if self._live else None

    def held(self) -> list[Task]:
        """The claims this node holds now."""
        with self._lock:
            return list(self._held.values())

    def request_check(self) -> None:
        """Check the held claims against the store soon (a claim may be gone)."""
        with self._lock:
            self._check_at = time.monotonic()
        self._wake.set()

    # -- test hooks -----------------------------------------------------------------------

    def pause(self) -> None:
        """Stop renewing (a stalled node); the watchdog still fences. For fault tests."""
        self._paused.set()

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._paused.clear()
        self._wake.set()

    # -- fencing ----------------------------------------------------------------------------

    def _fence(self, reason: str) -> None:
        with self._lock:
            if not self._live:
                return
            self._live = False
            self._epoch += 1
            lost = list(self._held.values())
            self._held.clear()
        log.warning("node %s lost its lease (%s): stopping %d task(s)", self._node_id, reason,
                    len(lost), extra=self._extra)
        self._report_lost(lost)
        self._wake.set()

    def _report_lost(self, tasks: list[Task]) -> None:
        for task in tasks:
            self._hook(self._on_lost, task, f"ctx.lost({task.id})")

    def _watchdog_loop(self) -> None:
        while not self._stop.is_set():
            self._watchdog_wake.clear()
            with self._lock:
                timeout = self._deadline - time.monotonic() if self._live else None
            if timeout is not None and timeout <= 0:
                self._fence(f"no renewal for {self._fence_after:.2f}s")
                continue
            self._watchdog_wake.wait(timeout)

    # -- the heartbeat ----------------------------------------------------------------------

    def _snapshot(self) -> tuple[int, tuple[int, int], bool]:
        """(change counter, (count, token sum) of the held claims, anything in flight)."""
        with self._lock:
            held = (len(self._held), sum(t.token for t in self._held.values()))
            return self._changes, held, bool(self._busy)

    def _heartbeat_loop(self) -> None:
        next_renew = time.monotonic() + self._renew_every
        next_check = time.monotonic() + self._check_every
        retry = 0.0
        while not self._stop.is_set():
            if self._paused.is_set():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self._wake.clear()
            now = time.monotonic()
            renewing = True
            live = False
            try:
                with self._lock:
                    live = self._live
                    check = self._check_at is not None and now >= self._check_at
                    publish = self._publish_due is not None and now >= self._publish_due
                if not live:
                    if not self.register(first=False):
                        raise _NotYet("its earlier registration is still live")
                    next_renew = time.monotonic() + self._renew_every
                elif now >= next_renew:
                    next_renew = self._renew() + self._renew_every
                elif check:
                    renewing = False
                    self._check_held()
                elif publish:
                    renewing = False
                    self._publish()
                elif now >= next_check:
                    renewing = False
                    next_check = now + self._check_every
                    if self._snapshot()[1][0]:  # pokes concern held claims only
                        self._look()
                if retry:
                    log.info("lease of node %s on %s works again", self._node_id, self._db.name,
                             extra=self._extra)
                retry = 0.0
            except (MetaforaError, _NotYet) as exc:
                # Warn once per outage (then debug), so a long outage does not flood the log.
                level = logging.DEBUG if retry or isinstance(exc, _NotYet) else logging.WARNING
                retry = self._backoff(retry)
                log.log(level, "lease of node %s on %s: %s (retrying in %.2fs)", self._node_id,
                        self._db.name, exc, retry, extra=self._extra)
                if renewing and live:
                    self._hook(self._on_failed, exc, "renewal-failed")
            except Exception:
                retry = self._backoff(retry)
                log.exception("lease loop of node %s failed", self._node_id, extra=self._extra)
            if retry:
                again = time.monotonic() + retry * random.uniform(0.8, 1.2)
                if renewing:
                    next_renew = again
                else:
                    next_check = again
            with self._lock:
                due = min(next_renew, next_check, self._publish_due or next_renew)
                if self._check_at is not None and not retry:
                    due = min(due, self._check_at)
            self._wake.wait(max(due - time.monotonic(), 0.0))

    def _backoff(self, retry: float) -> float:
        return min(max(retry * 2, 0.05), max(self._renew_every / 2, 0.1))

    def _check_held(self) -> None:
        """Compare the claims the store has for this node with the local set (O(claims):
        only when something says they may differ, see the module docstring)."""
        with self._lock:
            self._check_at = None  # a request made from now on asks again
        before = self._snapshot()
        try:
            with self._db.read() as conn:
                row = self._db.execute(conn, "held_summary", {"node": self._node_id}).one()
        except BaseException:
            with self._lock:
                self._check_at = time.monotonic()  # still to do once the store answers
            raise
        self._hook(self._on_members, tuple(row[2:]), "membership")
        if not self._compare(before, (int(row[0]), int(row[1]))):
            with self._lock:  # changes in flight spoiled it: look again a little later
                self._check_at = time.monotonic() + _RECHECK_AFTER

    def _look(self) -> None:
        """Between renewals: the node's pokes and the membership (one row, no task read)."""
        with self._db.read() as conn:
            row = self._db.execute(conn, "node_pokes", {"node": self._node_id}).first()
        if row is None:
            return  # the registration is gone: the next renewal finds out and fences
        self._hook(self._on_members, tuple(row[1:]), "membership")
        self._poked(int(row[0]))

    def _poked(self, pokes: int) -> None:
        """The store says the node's pokes are ``pokes``: check the claims if they changed."""
        with self._lock:
            if pokes != self._pokes_seen:
                self._pokes_seen = pokes
                self._check_at = time.monotonic()
                self._wake.set()

    def _publish(self) -> None:
        """Publish the node's count of claims if it changed since it was last published."""
        with self._lock:
            self._publish_due = None
            count, session = len(self._held), self._session
            if count == self._published or session is None:
                return
        with self._db.write() as conn:
            self._db.execute(conn, "publish_count", {"node": self._node_id, "session": session,
                                                     "count": count})
        with self._lock:
            self._published = count

    def _renew(self) -> float:
        """One renewal; returns its (monotonic) start time."""
        started = time.monotonic()
        with self._lock:
            session, epoch = self._session, self._epoch
        before = self._snapshot()
        params = {"node": self._node_id, "session": session, "ttl": self._db.config.lease_ttl,
                  "count": before[1][0], "capacity": self.capacity()}
        with self._lock:
            self._publish_due = None  # the renewal publishes the count
        with self._db.hot() as cur:
            row = cur.one("heartbeat", params)
        if row is None:
            self._fence("the store no longer has this registration live")
            return started
        with self._lock:
            fresh = self._live and self._epoch == epoch and time.monotonic() < self._deadline
            if fresh:
                self._deadline = started + self._fence_after
        if not fresh:
            # Renewed too late: the watchdog fenced (or is about to); start over cleanly.
            self._fence("renewal came back after the fencing deadline")
            return started
        elapsed = time.monotonic() - started
        if elapsed > self._renew_every:
            log.warning("lease renewal of node %s took %.2fs", self._node_id, elapsed,
                        extra=self._extra)
        if self._on_renewed is not None:
            try:
                self._on_renewed(elapsed)
            except Exception:
                log.exception("the renewal hook raised", extra=self._extra)
        with self._lock:
            self._published = before[1][0]
        self._hook(self._on_members, tuple(row[1:]), "membership")
        self._poked(int(row[0]))
        return started

    def _hook(self, hook: Callable[[Any], None] | None, value: Any, what: str) -> None:
        """Call an ``on_*`` hook; one that raises is logged, never stops the heartbeat."""
        if hook is not None:
            try:
                hook(value)
            except Exception:
                log.exception("the %s hook raised", what, extra=self._extra)

    def _compare(self, before: tuple[int, tuple[int, int], bool], store: tuple[int, int]) -> bool:
        """Reconcile if the store's (count, token sum) of our claims differs from ours; False
        when the check was inconclusive (to be done again).

        A claim or done in flight during the check can explain a difference: then the check
        is inconclusive, and only the fourth inconclusive one in a row reconciles anyway
        (listing the claims costs more than comparing two numbers).
        """
        after = self._snapshot()
        if store in (before[1], after[1]):
            self._inconclusive = 0
            return True
        quiet = before[0] == after[0] and not before[2] and not after[2]
        if not quiet:
            self._inconclusive += 1
            if self._inconclusive < 4:
                return False
        self._inconclusive = 0
        self._reconcile()
        return True

    def _reconcile(self) -> None:
        """Find claims that vanished under us (lost) and claims nobody here tracks (release)."""
        with self._lock:
            epoch = self._epoch
            before = {tid: t.token for tid, t in self._held.items()}
            busy_before = set(self._busy)
        with self._db.read() as conn:
            rows = self._db.execute(conn, "held_list", {"node": self._node_id}).fetchall()
        store = {str(r[0]): int(r[1]) for r in rows}
        with self._lock:
            if epoch != self._epoch:
                return
            lost, orphans = reconcile(before, self._held, busy_before | set(self._busy), store)
            for task in lost:
                del self._held[task.id]
        for task in lost:
            log.warning("claim of node %s on task %s (token %d) is gone from the store",
                        self._node_id, task.id, task.token,
                        extra={"node": self._node_id, "task": task.id})
        self._report_lost(lost)
        for tid, token in orphans:
            release_untracked(self._db, self._node_id, tid, token)


def reconcile(before: Mapping[str, int], held: Mapping[str, Task], busy: set[str],
              store: Mapping[str, int]) -> tuple[list[Task], list[tuple[str, int]]]:
    """Which claims vanished from the store and which it has that nobody here tracks.

    ``before``: task id -> token held when the store was read; ``held``: the claims held
    now; ``busy``: ids with a claim or outcome in flight during the read (judged next time);
    ``store``: task id -> token the store says this node holds. Returns (the held claims
    to report lost: held since before the read, not busy, not in the store with their
    token; the (id, token) claims to release: in the store, not busy, not held as such).
    """
    lost = [
        task for tid, task in held.items()
        if before.get(tid) == task.token and tid not in busy and store.get(tid) != task.token
    ]
    gone = {task.id for task in lost}
    orphans = [
        (tid, token) for tid, token in store.items()
        if tid not in busy and (tid not in held or tid in gone or held[tid].token != token)
    ]
    return lost, orphans


def release_untracked(db: Database, node_id: str, task_id: str, token: int) -> None:
    """Release a claim ``node_id`` holds in the store but does not track (best effort)."""
    extra = {"node": node_id, "task": task_id}
    try:
        with db.hot() as cur:
            row = cur.one("release", {"id": task_id, "node": node_id, "token": token,
                                      "held": None, "secs": 0.0})
            if row is not None:
                cur.token_used(int(row[0]))
    except MetaforaError as exc:
        log.warning("could not release untracked claim on task %s: %s", task_id, exc,
                    extra=extra)
        return
    if row is not None:
        log.warning("released claim on task %s (token %d) that node %s no longer tracked",
                    task_id, token, node_id, extra=extra)


class _NotYet(Exception):
    """Re-registration must wait (the old registration is still live)."""


def labels_json(labels: Mapping[str, str]) -> str | None:
    """Labels as stored (JSON object text; None for none)."""
    return json.dumps(dict(labels), separators=(",", ":"), sort_keys=True) if labels else None
