"""The watch loop: offer every claimable task, then what becomes claimable, until close.

Each round starts with one cheap read of the database clock and of when the next thing
falls due (the earliest future ``launch_at``, the earliest live lease expiry) and then:

- a **full scan** (the first round, after a lost LISTEN connection or an error, and every
  ``max(poll_interval, 5 s)``): sweeps pending tasks past ``expires_at`` to ``expired``,
  offers every claimable pending task (ordered by id, ``BATCH`` at a time) and every task
  claimed by a node whose registration has expired, and deletes long-dead registrations
  that hold nothing; claims whose owner vanished altogether (written around metafora) are
  looked for at the first scan and after an error only (they walk every claimed row);
- otherwise a **quick check**: tasks named by notifications (PostgreSQL; a bulk submit
  notifies once per batch with its lowest ``ready`` value, and the ``ready`` scan steps back
  to it), tasks that became
  pending since the last look (the ``ready`` counter; exact on SQLite, where writers are
  serialized), tasks whose ``launch_at`` or hold (``held_until``, :mod:`metafora.core.holds`)
  passed since the last round, and the claims of
  registrations that expired since. On PostgreSQL, whose sequence hands out ready values in
  one order while transactions commit in another, each stretch of ready values is read once
  more a second after the scan passed it (ids only; see ``Settling``).

It then sleeps until a notification, ``close()``, the poll interval, or the next due time,
whichever comes first: a crashed owner's tasks are offered right after its lease expires.
Store errors never end the watch: it logs, backs off and rescans when the store is back.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from metafora.coordinators.sql.shapes import OfferShapes
from metafora.coordinators.sql.statements import BATCH
from metafora.coordinators.sql.store import Database
from metafora.core.errors import MetaforaError
from metafora.core.heap import gc_paused
from metafora.core.task import Task

__all__ = ["Settling", "Watch"]

log = logging.getLogger(__name__)

_RESCAN = 5.0  # seconds between full scans at least (the safety net)
_AFTER_ALL = "\U0010ffff"  # sorts after any id: "nothing left at this ready value"
_MIN_WAIT = 0.005
_RESCAN_ROWS_PER_S = 5000  # a full scan comes no more often than backlog / this many seconds
# A round that offered notified tasks leaves the rest of the quick check (the clock read and
# the ready / launched / dead-owner scans: three round trips or more) for this long at most,
# so it does not compete with the claim the offer is about to cause (on a 2-core machine it
# added ~1 ms to submit->start), and a wave of notifications pays for it once, not per wake-up.
_COALESCE = 0.02
# How long after the ready scan passed a ready value a transaction that took a lower one is
# given to commit before the stretch is read again (longer ones wait for the full scan).
_SETTLE = 1.0


class Watch:
    """One ``Coordinator.watch`` call: its wake-up event, notified ids and scan positions."""

    def __init__(
        self, db: Database, node_id: str, sink: Callable[[Task], None], closed: threading.Event
    ) -> None:
        self._db = db
        self._sink = sink
        self._closed = closed
        self._extra = {"node": node_id}
        self._node_id = node_id  # tasks held for another node are not offered (holds.py)
        self._poll = db.config.poll_interval
        self._rescan = max(_RESCAN, self._poll)
        self._grace = db.config.lease_ttl
        self.wake = threading.Event()
        self._lock = threading.Lock()
        # Notified ids -> a plain task's props (offered without reading the row), or None.
        self._ids: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._full = True
        # Claims with no live owner at all (rows written around metafora: a registration
        # deleted by hand, a NULL owner) are looked for by walking every claimed row: at the
        # first full scan and after a store error or lost notifications, never periodically
        # (an idle cluster's safety net must not grow with the tasks it holds). Claims of
        # expired registrations -- the way a crashed node leaves them -- are found through the
        # dead registrations at every scan.
        self._orphans = True
        self._next_full = 0.0
        self._ready = (0, _AFTER_ALL)
        self._rewind: int | None = None  # the lowest ready value a bulk submit notified
        self._last_now: Any = None
        self._offered_dead: dict[str, int] = {}
        self._this_round: set[str] = set()  # offered in this round (no duplicates per round)
        # When the rest of a notified round is due (None: no notified round is waiting for it).
        self._quick_due: float | None = None
        self._shapes = OfferShapes()
        self._settling = Settling() if db.config.kind == "postgresql" else None

    # -- called by the notification listener ---------------------------------------------------

    def task_notified(self, task_id: str, props: str | None = None) -> None:
        """A notification says ``task_id`` became claimable; ``props`` (its props' JSON text)
        when it is a plain task (no priority, selector, placement, group or launch time),
        offered from the notification alone, without reading its row."""
        with self._lock:
            self._ids[task_id] = props  # the newest word on the row counts
        self.wake.set()

    def pending_from(self, ready: int) -> None:
        """A notification says tasks with ready values from ``ready`` on became pending."""
        with self._lock:
            self._rewind = ready if self._rewind is None else min(self._rewind, ready)
        self.wake.set()

    def rescan(self) -> None:
        """Do a full scan next (notifications may have been missed)."""
        with self._lock:
            self._full = True
            self._orphans = True
        self.wake.set()

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Offer tasks until the coordinator closes."""
        backoff = 0.1
        while not self._closed.is_set():
            self.wake.clear()
            try:
                timeout = self._round()
                backoff = 0.1
            except MetaforaError as exc:
                if self._closed.is_set():
                    return
                log.warning("watch on %s failed, rescanning in %.1fs: %s", self._db.name,
                            backoff, exc, extra=self._extra)
                with self._lock:
                    self._full = True
                    self._orphans = True
                timeout = backoff * random.uniform(0.8, 1.2)
                backoff = min(backoff * 2, 5.0)
            self.wake.wait(timeout)

    def _round(self) -> float:
        db = self._db
        self._this_round.clear()
        with self._lock:
            notified = [] if self._full else list(self._ids.items())
            self._ids.clear()
            # A bulk submit's rewind is taken before the clock read: the rows it names had
            # committed by then, so their ready values are at most the round's top (see
            # _scan_ready); a rewind notified later is the next round's.
            rewind, self._rewind = self._rewind, None
        # Notified tasks first, before the clock read: a plain task is offered at once (its
        # claim reads the row), any other after one round trip (the scan of its row).
        scan = [task_id for task_id, props in notified
                if props is None or not self._offer_plain(task_id, props)]
        for i in range(0, len(scan), BATCH):
            self._scan_ids(scan[i : i + BATCH])
        if notified:
            now = time.monotonic()
            with self._lock:
                # Only when nothing else asked for a look (a rescan, a bulk submit's rewind).
                defer = not self._full and rewind is None and now < self._next_full
            if defer:
                if self._quick_due is None:
                    self._quick_due = now + _COALESCE
                if now < self._quick_due:
                    return max(self._quick_due - now, _MIN_WAIT)
        self._quick_due = None
        with db.read() as conn:
            state = db.execute(conn, "watch_state", {"since": self._last_now}).one()
        (db_now, secs_launch, secs_lease, n_expired, n_dead, top_ready, secs_unhold,
         launched, unheld) = state
        max_ready = 0 if top_ready is None else int(top_ready)  # None: nothing pending
        if n_expired:
            with db.write() as conn:
                db.execute(conn, "sweep_expired", {})
        started = time.monotonic()
        with self._lock:
            full = self._full or started >= self._next_full
            self._full = False
            if full:
                self._ids.clear()
                self._rewind = None
            ids = list(self._ids)
            self._ids.clear()
        if full:
            backlog = self._scan_all(n_dead, pending=top_ready is not None)
            # The safety net re-offers the whole backlog; spacing it by the backlog's size keeps
            # its cost per second bounded (100,000 pending rows re-parsed every 5 s by every node
            # starved a start-up storm). Progress never waits for it: notifications, the
            # consumer's own re-offers of refused tasks and dead-owner scans go on meanwhile.
            self._next_full = time.monotonic() + max(self._rescan, backlog / _RESCAN_ROWS_PER_S)
            self._ready = (int(max_ready), _AFTER_ALL)
            if self._settling is not None:
                self._settling.reset(int(max_ready))
        else:
            for i in range(0, len(ids), BATCH):
                self._scan_ids(ids[i : i + BATCH])
            if rewind is not None:  # rows of a batch may commit behind ready values seen
                self._ready = min(self._ready, (rewind - 1, _AFTER_ALL))
            self._scan_ready(max_ready)
            self._scan_settled()
            if self._last_now is not None and launched:
                self._scan_launched(self._last_now, db_now)
            if self._last_now is not None and unheld:
                self._scan_launched(self._last_now, db_now, "scan_unheld")
            if n_dead:
                self._scan_dead()
        self._last_now = db_now
        timeout = min(self._poll, self._next_full - time.monotonic())
        for due in (secs_launch, secs_lease, secs_unhold):
            if due is not None:
                timeout = min(timeout, float(due) + _MIN_WAIT)
        if self._settling is not None and self._settling.next_due is not None:
            timeout = min(timeout, self._settling.next_due - time.monotonic())
        return max(timeout, _MIN_WAIT)

    # -- scans ----------------------------------------------------------------------------------

    def _query(self, name: str, params: dict[str, Any]) -> Sequence[Any]:
        params.setdefault("limit", BATCH)
        params.setdefault("node", self._node_id)
        with self._db.read() as conn:
            rows: Sequence[Any] = self._db.execute(conn, name, params).fetchall()
        return rows

    def _offer_rows(self, rows: Sequence[Any], by_priority: bool = True) -> None:
        """Offer a page of rows (id, props, ..., selector, priority, placement), highest
        priority first unless the page holds one priority (a scan's).

        The page's tasks are built with the cyclic collector paused (bulk work: the consumer
        keeps most of them a while; see :mod:`metafora.core.heap`), then failed or offered: the
        failure's write and the sink (which may block) run with the collector on.
        """
        if by_priority:
            rows = sorted(rows, key=lambda r: -int(r[-2] or 0))
        invalid: list[tuple[str, str]] = []
        with gc_paused(len(rows)):
            tasks = [task for row in rows if (task := self._build(row, invalid)) is not None]
        for task_id, error in invalid:
            self._fail_invalid(task_id, error)
        for task in tasks:
            self._sink(task)

    def _build(self, row: Any, invalid: list[tuple[str, str]]) -> Task | None:
        """The task of ``row`` to offer (None: offered this round already, or invalid: then
        (id, error) is added to ``invalid``)."""
        task_id, props = str(row[0]), row[1]
        if task_id in self._this_round:
            return None
        self._this_round.add(task_id)
        try:
            return self._shapes.task(task_id, props, row[-3], row[-2], row[-1])
        except MetaforaError as exc:
            invalid.append((task_id, f"invalid props: {exc}"))
            return None

    def _offer_plain(self, task_id: str, props: str) -> bool:
        """Offer a plain task from its notification. False: an id or props that are not
        valid (a row written around metafora), left to the scan (which fails the task)."""
        if task_id in self._this_round:
            return True
        try:
            task = self._shapes.task(task_id, props, None, 0, None)
        except MetaforaError:
            return False
        self._this_round.add(task_id)
        self._sink(task)
        return True

    def _fail_invalid(self, task_id: str, error: str) -> None:
        """A row written around metafora that can never run: failed, not pending forever."""
        log.warning("task %r can never run (%s); marking it failed", task_id, error,
                    extra={**self._extra, "task": task_id})
        with self._db.write() as conn:
            self._db.execute(conn, "fail_invalid", {"id": task_id, "error": error})

    def _scan_all(self, n_dead: int, pending: bool = True) -> int:
        """Offer every claimable task (and stale claims); returns how many were pending.
        ``pending`` False: the round's clock read found no pending row (none to walk)."""
        levels: Sequence[Any] = []
        if pending:
            with self._db.read() as conn:
                levels = self._db.execute(conn, "pending_levels", {}).fetchall()
        backlog = 0
        # One priority at a time, highest first; within one, page by page (bounded memory)
        # from just after a random pending id to the end, then from the start up to it.
        for priority, count in levels:
            if self._closed.is_set():
                break
            pivot = self._pivot(int(priority), int(count))
            backlog += self._scan_range(int(priority), pivot, _AFTER_ALL)
            if pivot:
                backlog += self._scan_range(int(priority), "", pivot)
        with self._lock:
            orphans, self._orphans = self._orphans, False
        if orphans:
            offered: dict[str, int] = {}
            self._scan_claims("scan_orphans", offered)
            self._scan_claims("scan_unowned", offered)
            self._offered_dead = offered
        elif n_dead:
            self._offered_dead = {}  # the safety net offers every dead claim again
            self._scan_dead()
        if n_dead:
            with self._db.write() as conn:
                self._db.execute(conn, "clean_nodes", {"secs": -self._grace})
                self._db.execute(conn, "clean_commands", {})
        return backlog

    def _pivot(self, priority: int, count: int) -> str:
        """A random pending id of ``priority`` ("" when fewer than two rows have it)."""
        if count < 2:
            return ""
        with self._db.read() as conn:
            row = self._db.execute(conn, "pending_at", {"skip": random.randrange(count),
                                                        "priority": priority}).first()
        return "" if row is None else str(row[0])

    def _scan_range(self, priority: int, after: str, until: str) -> int:
        """Offer the claimable pending tasks of ``priority`` with ``after < id <= until``;
        returns how many."""
        seen = 0
        while not self._closed.is_set():
            rows = self._query("scan_pending", {"priority": priority, "after": after, "until": until})
            self._offer_rows(rows, by_priority=False)  # one priority per scan
            seen += len(rows)
            if len(rows) < BATCH:
                break
            after = rows[-1][0]
        return seen

    def _scan_claims(self, name: str, offered: dict[str, int]) -> None:
        """Offer the stale claims ``name`` pages through by (owner, id) (unowned: by id)."""
        owner, after = "", ""
        while not self._closed.is_set():
            rows = self._query(name, {"owner": owner, "after": after})
            for row in rows:
                offered[row[0]] = int(row[2])
            self._offer_rows(rows, by_priority=False)
            if len(rows) < BATCH:
                break
            owner, after = rows[-1][3], rows[-1][0]

    def _scan_ids(self, ids: list[str]) -> None:
        if self._db.config.kind == "postgresql":
            # The latency path (a notification names the task): compiled once, prepared.
            with self._db.hot() as cur:
                rows: Sequence[Any] = cur.all("scan_ids_hot",
                                              {"ids": self._db.dialect.ids_param(ids),
                                               "node": self._node_id})
        else:
            rows = self._query("scan_ids", {"ids": ids})
        self._offer_rows(rows)

    def _scan_ready(self, top: int) -> None:
        """Offer the pending rows past the ready scan's position, a page at a time, up to
        ``top`` (the highest ready value pending at this round's clock read) at least.

        A full page that reached ``top`` ends the scan: the read after it would find only rows
        committed since the clock read, which their own notification (PostgreSQL) or the next
        round (SQLite's poll) brings anyway. A bulk submit notifies once per 500 rows, a full
        page: every node read an empty page after each (a fifth of a node's reads in a storm).
        """
        ready, after = self._ready
        while not self._closed.is_set():
            rows = self._query("scan_ready", {"ready": ready, "after": after})
            self._offer_rows(rows)
            if rows:
                ready, after = int(rows[-1][2]), rows[-1][0]
                self._ready = (ready, after)
                if self._settling is not None:
                    self._settling.saw(rows)
            if len(rows) < BATCH or ready >= top:
                break
        if self._settling is not None:
            self._settling.mark(time.monotonic(), self._ready[0])

    def _scan_settled(self) -> None:
        """Offer the pending rows that committed behind the ready scan (see ``Settling``)."""
        settling = self._settling
        until = None if settling is None else settling.due(time.monotonic())
        if settling is None or until is None:
            return
        ready, after = settling.settled, _AFTER_ALL
        while not self._closed.is_set():
            rows = self._query("scan_settled", {"ready": ready, "after": after, "until": until})
            late = settling.unseen(rows)
            if late:
                log.debug("%d pending rows committed behind the ready scan", len(late),
                          extra=self._extra)
            for i in range(0, len(late), BATCH):
                self._scan_ids(late[i : i + BATCH])
            if len(rows) < BATCH:
                break
            ready, after = int(rows[-1][1]), rows[-1][0]
        settling.done(until)

    def _scan_launched(self, since: Any, until: Any, name: str = "scan_launched") -> None:
        """Offer the tasks whose launch time (``scan_unheld``: whose hold) passed in
        (``since``, ``until``]."""
        rows = self._query(name, {"since": since, "until": until})
        self._offer_rows(rows)
        if len(rows) >= BATCH:
            self.rescan()

    def _scan_dead(self) -> None:
        owner, after = "", ""
        while not self._closed.is_set():
            rows = self._query("scan_dead_owners", {"owner": owner, "after": after})
            fresh = []
            for row in rows:
                token = int(row[2])
                if self._offered_dead.get(row[0]) != token:
                    self._offered_dead[row[0]] = token
                    fresh.append(row)
            self._offer_rows(fresh, by_priority=False)
            if len(rows) < BATCH:
                break
            owner, after = rows[-1][3], rows[-1][0]


class Settling:
    """The ready values the watch's ready scan passed, to be read once more when settled.

    PostgreSQL's sequence hands out ready values in one order, and transactions commit in
    another: a row whose transaction took its value before a later row's, but committed after
    the ready scan had read that later row, lies behind the scan's position, and nothing but
    the full scan (``poll_interval``: a minute, say) would find it. So each scan marks how far
    it got and when; once a mark is ``_SETTLE`` old, the stretch up to it is read again (ids
    and ready values only) and the rows the scan never saw are offered. Each stretch is read
    twice at most, and the ids kept are those of the last second or two of scans.
    """

    def __init__(self) -> None:
        self.settled = 0  # ready values up to this one have been read again
        self._last = float("-inf")  # when (monotonic) a stretch was last read again
        self._marks: collections.deque[tuple[float, int]] = collections.deque()
        self._seen: dict[str, int] = {}  # ids the ready scan offered past ``settled``

    @property
    def next_due(self) -> float | None:
        """When (monotonic) the oldest mark settles; None without marks."""
        if not self._marks:
            return None
        return max(self._marks[0][0] + _SETTLE, self._last + _SETTLE / 2)

    def reset(self, ready: int) -> None:
        """A full scan read everything up to ``ready``."""
        self.settled = ready
        self._marks.clear()
        self._seen.clear()

    def saw(self, rows: Sequence[Any]) -> None:
        """The ready scan read ``rows`` (id, props, ready, ...)."""
        for row in rows:
            self._seen[row[0]] = int(row[2])

    def mark(self, now: float, ready: int) -> None:
        """The ready scan got to ``ready`` at ``now``."""
        last = self._marks[-1][1] if self._marks else self.settled
        if ready > last:
            self._marks.append((now, ready))

    def due(self, now: float) -> int | None:
        """The ready value up to which to read again now (None: nothing has settled yet, or
        the last read again was less than half ``_SETTLE`` ago: under a stream of submits a
        round comes every few ms, and one read per stretch of half a second is enough)."""
        if now - self._last < _SETTLE / 2:
            return None
        until = None
        while self._marks and self._marks[0][0] + _SETTLE <= now:
            until = self._marks.popleft()[1]
        if until is not None:
            self._last = now
        return until

    def unseen(self, rows: Sequence[Any]) -> list[str]:
        """The ids of ``rows`` (id, ready) the ready scan never read."""
        return [row[0] for row in rows if self._seen.get(row[0]) != int(row[1])]

    def done(self, until: int) -> None:
        """Everything up to ``until`` was read again."""
        self.settled = max(self.settled, until)
        self._seen = {k: v for k, v in self._seen.items() if v > self.settled}
