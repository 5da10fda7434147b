"""The renewal of a SQL node's lease: the heartbeat thread and what it schedules.

:class:`~metafora.coordinators.sql.lease.Lease` keeps the claims and the fencing deadline;
its :class:`Heartbeat` decides when to renew (every ``renew_interval``), when to publish a
changed count of claims (within ``PUBLISH_DELAY``), when to look at the node's pokes between
renewals and when to check the claims against the store, and backs off while the store fails
(see the lease module's docstring for why each exists). The heartbeat never calls the lease
while it holds its own lock, and the lease calls it under the lease's lock: one order only.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from metafora.coordinators.sql.noderow import NodeRow
from metafora.core.errors import MetaforaError

__all__ = ["PUBLISH_DELAY", "Heartbeat", "call_hook"]

log = logging.getLogger("metafora.coordinators.sql.lease")

# A changed count waits this long before it is published (renewals publish it too): short
# tasks change a node's count all the time, and each publish is a write per node, so the
# cluster's cost per second grew with its nodes (at 0.25 s, 10 busy nodes wrote ~20/s). The
# counts serve balances and the cluster's view, where a second late costs nothing (a balance
# reads the exact counts before it moves anything: docs/rebalancing.md).
PUBLISH_DELAY = 1.0
"""Seconds a changed count of claims waits before it is published: a burst of claims and
outcomes costs one UPDATE of the node's row, and balancers see it up to a second late."""


class LeaseSide(Protocol):
    """What the heartbeat asks of the lease it renews."""

    def live(self) -> bool: ...
    def register(self, first: bool) -> bool: ...
    def renew(self) -> float: ...
    def check_held(self) -> None: ...
    def holds_any(self) -> bool: ...
    def to_publish(self) -> tuple[int, str | None]: ...


class NotYet(Exception):
    """Re-registration must wait (the old registration is still live)."""


def call_hook(hook: Callable[[Any], None] | None, value: Any, what: str, extra: dict[str, str]) -> None:
    """Call an ``on_*`` hook; one that raises is logged, never stops the heartbeat."""
    if hook is not None:
        try:
            hook(value)
        except Exception:
            log.exception("the %s hook raised", what, extra=extra)


class Heartbeat:
    """The lease's heartbeat thread and its schedule (renew, check, publish, look)."""

    def __init__(self, lease: LeaseSide, row: NodeRow, *, store: str, stop: threading.Event,
                 renew_every: float, check_every: float,
                 on_members: Callable[[tuple[Any, ...]], None] | None,
                 on_failed: Callable[[BaseException], None] | None) -> None:
        self._lease, self._row, self._store, self._stop = lease, row, store, stop
        self.renew_every, self._check_every = renew_every, check_every
        self._on_members, self._on_failed = on_members, on_failed
        self._extra = {"node": row.node_id}
        self._lock = threading.Lock()
        self._wake = threading.Event()  # check now / re-evaluate
        self._paused = threading.Event()
        self._check_at: float | None = None  # when to check the claims (None: no need)
        self._pokes_seen: int | None = None  # None: check at the next look (a new registration)
        self._published: int | None = None  # the count of claims the node's row says
        self._publish_due: float | None = None  # monotonic time of the next publish

    # -- told by the lease ------------------------------------------------------------------

    def wake(self) -> None:
        """Re-evaluate now (a fence, a stop)."""
        self._wake.set()

    def pause(self, paused: bool) -> None:
        """Stop renewing (a stalled node, for fault tests) or renew again."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()
            self._wake.set()

    def request_check(self, after: float = 0.0, *, wake: bool = True) -> None:
        """Check the claims against the store ``after`` seconds from now (``wake``: re-plan
        at once; not after a failed check, which the back-off paces)."""
        with self._lock:
            self._check_at = time.monotonic() + after
        if wake:
            self._wake.set()

    def check_started(self) -> None:
        """A check starts: a request made from now on asks again."""
        with self._lock:
            self._check_at = None

    def count_changed(self) -> None:
        """The count of claims changed: publish it soon."""
        with self._lock:
            if self._publish_due is not None:
                return
            self._publish_due = time.monotonic() + PUBLISH_DELAY
        self._wake.set()

    def registered(self) -> None:
        """A new registration: it wrote a count of 0; check at the next look."""
        with self._lock:
            self._pokes_seen = None
            self._published = 0

    def renewing(self) -> None:
        """A renewal starts: it publishes the count."""
        with self._lock:
            self._publish_due = None

    def renewed(self, count: int, row: Any) -> None:
        """A renewal published ``count`` and returned ``row`` (pokes, then membership)."""
        with self._lock:
            self._published = count
        call_hook(self._on_members, tuple(row[1:]), "membership", self._extra)
        self._poked(int(row[0]))

    # -- the thread ---------------------------------------------------------------------------

    def run(self) -> None:
        """The heartbeat loop, until the lease's stop event is set."""
        lease, node = self._lease, self._row.node_id
        next_renew = time.monotonic() + self.renew_every
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
                live = lease.live()
                with self._lock:
                    check = self._check_at is not None and now >= self._check_at
                    publish = self._publish_due is not None and now >= self._publish_due
                if not live:
                    if not lease.register(first=False):
                        raise NotYet("its earlier registration is still live")
                    next_renew = time.monotonic() + self.renew_every
                elif now >= next_renew:
                    next_renew = lease.renew() + self.renew_every
                elif check:
                    renewing = False
                    lease.check_held()
                elif publish:
                    renewing = False
                    self._publish()
                elif now >= next_check:
                    renewing = False
                    next_check = now + self._check_every
                    if lease.holds_any():  # pokes concern held claims only
                        self._look()
                if retry:
                    log.info("lease of node %s on %s works again", node, self._store, extra=self._extra)
                retry = 0.0
            except (MetaforaError, NotYet) as exc:
                # Warn once per outage (then debug), so a long outage does not flood the log.
                level = logging.DEBUG if retry or isinstance(exc, NotYet) else logging.WARNING
                retry = self._backoff(retry)
                log.log(level, "lease of node %s on %s: %s (retrying in %.2fs)", node,
                        self._store, exc, retry, extra=self._extra)
                if renewing and live:
                    call_hook(self._on_failed, exc, "renewal-failed", self._extra)
            except Exception:
                retry = self._backoff(retry)
                log.exception("lease loop of node %s failed", node, extra=self._extra)
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
        return min(max(retry * 2, 0.05), max(self.renew_every / 2, 0.1))

    def _look(self) -> None:
        """Between renewals: the node's pokes and the membership (one row, no task read)."""
        row = self._row.pokes()
        if row is None:
            return  # the registration is gone: the next renewal finds out and fences
        call_hook(self._on_members, tuple(row[1:]), "membership", self._extra)
        self._poked(int(row[0]))

    def _poked(self, pokes: int) -> None:
        """The store says the node's pokes are ``pokes``: check the claims if they changed."""
        with self._lock:
            if pokes == self._pokes_seen:
                return
            self._pokes_seen = pokes
            self._check_at = time.monotonic()
        self._wake.set()

    def _publish(self) -> None:
        """Publish the node's count of claims if it changed since it was last published."""
        with self._lock:
            self._publish_due = None
        count, session = self._lease.to_publish()
        with self._lock:
            if count == self._published or session is None:
                return
        self._row.publish(session, count)
        with self._lock:
            self._published = count
