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

The :class:`Lease` keeps the claims and the fencing; the heartbeat's schedule (renew, check,
publish, look, back off) is :class:`~metafora.coordinators.sql.heartbeat.Heartbeat`, and the
statements of the node's row (registration included) are
:class:`~metafora.coordinators.sql.noderow.NodeRow`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from metafora.coordinators.sql.heartbeat import PUBLISH_DELAY, Heartbeat, call_hook
from metafora.coordinators.sql.noderow import NodeRow
from metafora.coordinators.sql.store import Database
from metafora.core.errors import MetaforaError
from metafora.core.task import Task

__all__ = ["PUBLISH_DELAY", "Lease", "reconcile", "release_untracked"]

log = logging.getLogger(__name__)

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
        self.row = NodeRow(db, node_id)  # the statements; what registrations publish
        cfg = db.config
        self._fence_after = cfg.fence_after
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
        self._watchdog_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        # PostgreSQL pushes a deleted claim (NOTIFY n<node>) and every renewal compares the
        # summary anyway: checking between renewals is only SQLite's way to notice promptly.
        check_every = max(cfg.poll_interval, 0.05) if cfg.kind == "sqlite" else cfg.command_recheck
        self.heartbeat = Heartbeat(self, self.row, store=db.name, stop=self._stop,
                                   renew_every=cfg.renew_interval, check_every=check_every,
                                   on_members=on_members, on_failed=on_failed)

    # -- registration -------------------------------------------------------------------

    def register(self, first: bool, labels: Mapping[str, str] | None = None,
                 weight: float | None = None) -> bool:
        """Take (or take back) this node's registration; False if the id is live elsewhere
        (see :meth:`NodeRow.register`). ``labels`` and ``weight`` are kept for later."""
        row = self.row
        row.labels = row.labels if labels is None else labels
        row.weight = row.weight if weight is None else weight
        session = uuid.uuid4().hex
        started = time.monotonic()
        if not row.register(session, first):
            return False
        with self._lock:
            self._session = session
            self._live = True
            self._epoch += 1
            self._deadline = started + self._fence_after
            self._held.clear()
        self.heartbeat.registered()
        self._watchdog_wake.set()
        return True

    def start(self) -> None:
        """Start the heartbeat and watchdog threads (after the first :meth:`register`)."""
        for name, target in (("heartbeat", self.heartbeat.run), ("watchdog", self._watchdog_loop)):
            thread = threading.Thread(
                target=target, name=f"metafora-sql-{name}-{self._node_id}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self) -> str | None:
        """Stop both threads; mark the lease not live. Returns the session to deregister."""
        self._stop.set()
        self.heartbeat.pause(False)  # and wake it
        self._watchdog_wake.set()
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
                self.heartbeat.request_check()
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
                self.heartbeat.request_check()

    def _unbusy(self, task_id: str) -> None:
        """One write of ``task_id`` is no longer in flight (caller holds the lock)."""
        left = self._busy.get(task_id, 0) - 1
        if left > 0:
            self._busy[task_id] = left
        else:
            self._busy.pop(task_id, None)

    def _count_changed(self) -> None:
        """The count of claims changed (caller holds the lock): publish it soon."""
        self.heartbeat.count_changed()

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
        self.heartbeat.request_check()

    def live(self) -> bool:
        """Whether the registration is live (the heartbeat re-registers when not)."""
        with self._lock:
            return self._live

    def holds_any(self) -> bool:
        """Whether this node holds a claim."""
        with self._lock:
            return bool(self._held)

    def to_publish(self) -> tuple[int, str | None]:
        """The count of claims to publish and the session to publish it under."""
        with self._lock:
            return len(self._held), self._session

    # -- test hooks -----------------------------------------------------------------------

    def pause(self) -> None:
        """Stop renewing (a stalled node); the watchdog still fences. For fault tests."""
        self.heartbeat.pause(True)

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self.heartbeat.pause(False)

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
        self.heartbeat.wake()

    def _report_lost(self, tasks: list[Task]) -> None:
        for task in tasks:
            call_hook(self._on_lost, task, f"ctx.lost({task.id})", self._extra)

    def _watchdog_loop(self) -> None:
        while not self._stop.is_set():
            self._watchdog_wake.clear()
            with self._lock:
                timeout = self._deadline - time.monotonic() if self._live else None
            if timeout is not None and timeout <= 0:
                self._fence(f"no renewal for {self._fence_after:.2f}s")
                continue
            self._watchdog_wake.wait(timeout)

    # -- the renewal and the check (run by the heartbeat) ----------------------------------

    def _snapshot(self) -> tuple[int, tuple[int, int], bool]:
        """(change counter, (count, token sum) of the held claims, anything in flight)."""
        with self._lock:
            held = (len(self._held), sum(t.token for t in self._held.values()))
            return self._changes, held, bool(self._busy)

    def check_held(self) -> None:
        """Compare the claims the store has for this node with the local set (O(claims):
        only when something says they may differ, see the module docstring)."""
        self.heartbeat.check_started()
        before = self._snapshot()
        try:
            row = self.row.summary()
        except BaseException:
            self.heartbeat.request_check(wake=False)  # still to do once the store answers
            raise
        call_hook(self._on_members, tuple(row[2:]), "membership", self._extra)
        if not self._compare(before, (int(row[0]), int(row[1]))):
            # changes in flight spoiled it: look again a little later
            self.heartbeat.request_check(_RECHECK_AFTER, wake=False)

    def renew(self) -> float:
        """One renewal; returns its (monotonic) start time."""
        started = time.monotonic()
        with self._lock:
            session, epoch = self._session, self._epoch
        before = self._snapshot()
        self.heartbeat.renewing()  # the renewal publishes the count
        row = self.row.renew(session, before[1][0])
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
        if elapsed > self.heartbeat.renew_every:
            log.warning("lease renewal of node %s took %.2fs", self._node_id, elapsed,
                        extra=self._extra)
        if self._on_renewed is not None:
            try:
                self._on_renewed(elapsed)
            except Exception:
                log.exception("the renewal hook raised", extra=self._extra)
        self.heartbeat.renewed(before[1][0], row)
        return started

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
        store = self.row.claims()
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
