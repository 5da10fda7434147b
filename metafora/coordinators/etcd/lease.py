"""A node's lease: registration, renewal, self-fencing and re-registration.

See :mod:`metafora.coordinators.etcd.coordinator` for the lease thread's contract, and
:mod:`metafora.core.leases` for when the node fences.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

from metafora.coordinators.etcd.config import ETCD_FENCING, EtcdConfig
from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import Keys, encode_json, iso
from metafora.coordinators.etcd.node import BACKOFF_MAX, BACKOFF_START, NodeState
from metafora.coordinators.etcd.ops import Put, Range, absent, created_at
from metafora.coordinators.members import context_capacity
from metafora.core.clock import Clock
from metafora.core.errors import CoordinatorClosed, MetaforaError, NodeExists
from metafora.core.leases import renew_every, report_renewal_failure

__all__ = ["NodeLease"]

log = logging.getLogger(__name__)


class NodeLease:
    """The lease thread and the node's registration key.

    The current lease and its last renewal are in the shared :class:`~.node.NodeState`
    (claims are fenced on them); the rest is this object's, guarded by the node's
    ``lease_lock``: the lease thread never waits for the node's lock (held for work over every
    task) before a renewal. ``on_registered_again`` runs after a re-registration (the watch
    re-offers every task).
    """

    def __init__(self, driver: EtcdDriver, keys: Keys, config: EtcdConfig, clock: Clock,
                 state: NodeState, on_registered_again: Callable[[], None]) -> None:
        self._driver = driver
        self._keys = keys
        self._cfg = config
        self._clock = clock
        self._state = state
        self._on_registered_again = on_registered_again
        self.fence_after = ETCD_FENCING.fence_after(config.lease_ttl)
        """Seconds after the start of the last good renewal at which the node self-fences."""
        self._old_lease: int | None = None  # dropped after a fence, revoked on re-register
        self._old_lease_until = 0.0  # monotonic: when the dropped lease expires by itself
        self._beat_wake = threading.Event()
        self._paused = False
        self._alive_rev = 0  # create revision of our registration key
        self._started_at = clock.now()
        self._frozen = False
        self._leaving = False
        self._failing = False  # the last renewal failed (the lease thread's own)
        self.capacity: int | None = None  # as published (see _publish_capacity)

    def register(self) -> None:
        """Grant a lease and create the node's registration key if absent."""
        self._state.check_open()  # a closing node does not register again (CoordinatorClosed)
        alive = self._keys.node_alive(self._state.node_id)
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
            raise NodeExists(f"node {self._state.node_id!r} is already live on {self._state.name}")
        with self._state.lock, self._state.lease_lock:
            if self._state.closed:
                closed = True
            else:
                closed = False
                self._state.lease_id = lease
                self._state.renewed_at = started
                self._alive_rev = result.revision
        if closed:
            self._revoke_quietly(lease)
            raise CoordinatorClosed(f"coordinator {self._state.node_id!r} closed while registering")

    def _alive_record(self) -> bytes:
        return encode_json(
            {
                "started_at": iso(self._started_at),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "frozen": self._frozen,
                "leaving": self._leaving,
                **({"labels": self._state.labels} if self._state.labels else {}),
                **({"weight": self._state.weight} if self._state.weight != 1.0 else {}),
                **({"capacity": self.capacity} if self.capacity is not None else {}),
            }
        )

    def report_frozen(self, frozen: bool) -> None:
        """Publish the frozen flag in the node's registration (best effort)."""
        with self._state.lease_lock:
            self._frozen = frozen
        self._republish(f"frozen={frozen}", logging.DEBUG)

    def announce_leaving(self) -> None:
        """Publish ``leaving`` in the node's registration (best effort): the other nodes'
        watches see it at once and their balancers stop counting this node."""
        with self._state.lease_lock:
            self._leaving = True
        self._republish("leaving", logging.WARNING)

    def _publish_capacity(self, ctx: object) -> None:
        """Republish the registration when the node's capacity changed (rare: a failed
        handler start, or the capacity rising again)."""
        capacity = context_capacity(ctx)
        with self._state.lease_lock:
            if capacity == self.capacity:
                return
            self.capacity = capacity
        self._republish(f"capacity={capacity}", logging.DEBUG)

    def _republish(self, what: str, level: int) -> None:
        with self._state.lease_lock:
            lease, alive_rev = self._state.lease_id, self._alive_rev
        if lease is None or self._state.closed:
            return
        alive = self._keys.node_alive(self._state.node_id)
        try:
            self._driver.txn([created_at(alive, alive_rev)], [Put(alive, self._alive_record(), lease)])
        except MetaforaError as exc:
            log.log(level, "node %s: could not publish %s: %s", self._state.node_id, what, exc,
                    extra=self._state.extra)

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self._driver.revoke(lease, timeout=1.0)
        except MetaforaError:
            log.debug("could not revoke lease %x", lease, exc_info=True, extra=self._state.extra)

    def run(self) -> None:
        interval = renew_every(self._cfg.lease_ttl)
        next_beat = self._clock.monotonic() + interval
        backoff = BACKOFF_START
        while not self._state.stop.is_set():
            try:
                with self._state.lease_lock:  # not the node's lock: see the class docstring
                    lease, renewed, paused = self._state.lease_id, self._state.renewed_at, self._paused
                    # close() marks the node closed before it drops the lease: a lease gone
                    # with the node closed is not a fence, and must not be re-registered.
                    closed = self._state.closed
                if closed:
                    return
                now = self._clock.monotonic()
                if lease is None:
                    if paused:
                        self._beat_wake.wait(0.05)
                        self._beat_wake.clear()
                        continue
                    with self._state.lease_lock:
                        grace = self._old_lease_until - now if self._old_lease is not None else 0.0
                    if grace > 0:
                        # The fenced handlers get the margin to stop: revoking the old lease
                        # now would let another node claim their tasks while they still run.
                        self._beat_wake.wait(grace)
                        self._beat_wake.clear()
                        continue
                    if self._reregister():
                        next_beat = self._clock.monotonic() + interval
                        backoff = BACKOFF_START
                    else:
                        self._state.stop.wait(backoff)
                        backoff = min(backoff * 2, BACKOFF_MAX)
                    continue
                fence_at = renewed + self.fence_after
                if now >= fence_at:
                    self.fence(f"no successful lease renewal for {now - renewed:.2f}s")
                    continue
                wake_at = min(next_beat, fence_at)
                if wake_at > now:
                    self._beat_wake.wait(wake_at - now)
                    self._beat_wake.clear()
                    continue
                if paused:  # fault injection: pretend the renewal never got through
                    next_beat = now + interval
                    continue
                beat = self._renew(lease, fence_at, interval)
                if beat is not None:
                    next_beat = beat
            except Exception:  # never let the heartbeat die: a dead heartbeat is a zombie
                log.exception("node %s: unexpected error in the lease loop", self._state.node_id,
                              extra=self._state.extra)
                self._state.stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)


    def _renew(self, lease: int, fence_at: float, interval: float) -> float | None:
        """One renewal of ``lease`` (due now): the time of the next one, or None when the
        node fenced (the loop re-registers, which sets it anew)."""
        started = self._clock.monotonic()
        try:
            ttl = self._driver.keepalive(lease, timeout=fence_at - started)
        except MetaforaError as exc:
            level = logging.DEBUG if self._failing else logging.WARNING
            log.log(level, "node %s: lease renewal failed: %s", self._state.node_id, exc,
                    extra=self._state.extra)
            self._failing = True
            next_beat = self._clock.monotonic() + min(interval, 0.25)
            ctx = self._state.ctx  # set once by init, before this thread starts
            if ctx is not None:
                report_renewal_failure(ctx, exc)
            return next_beat
        if ttl <= 0:
            self.fence("etcd no longer knows the lease")
            return None
        took = self._clock.monotonic() - started
        with self._state.lease_lock:
            if self._state.lease_id == lease:
                self._state.renewed_at = started
        ctx = self._state.ctx
        if ctx is not None:
            ctx.renewed(took)
            self._publish_capacity(ctx)
        if self._failing:
            log.info("node %s: lease renewal recovered", self._state.node_id, extra=self._state.extra)
            self._failing = False
        if took > interval:
            log.warning("node %s: lease renewal took %.2fs (interval %.2fs)",
                        self._state.node_id, took, interval, extra=self._state.extra)
        return started + interval

    def _reregister(self) -> bool:
        """After a fence: revoke the old lease, register again. True on success."""
        with self._state.lease_lock:
            old = self._old_lease
        try:
            if old is not None:
                self._driver.revoke(old)
                with self._state.lease_lock:
                    if self._old_lease == old:
                        self._old_lease = None
            self.register()
        except NodeExists:
            if self._state.closed:
                # close() took the old lease (to revoke it itself) while this thread was
                # about to re-register: the key found is this node's own, going away.
                return False
            log.error("node %s: cannot re-register, another live node uses this id",
                      self._state.node_id, extra=self._state.extra)
            return False
        except CoordinatorClosed:
            return False
        except MetaforaError as exc:
            log.warning("node %s: re-registration failed: %s", self._state.node_id, exc,
                        extra=self._state.extra)
            return False
        log.warning("node %s: re-registered with a new lease", self._state.node_id, extra=self._state.extra)
        # Offers made while the node had no lease were refused (claim() returned None) and the
        # consumer dropped them; nothing changes in etcd to offer them again, so re-offer
        # every claimable task now rather than at the next safety-net re-list.
        self._on_registered_again()
        return True

    def fence(self, reason: str) -> None:
        """Drop the lease and tell the node every claim is lost (self-fencing)."""
        with self._state.lock:
            with self._state.lease_lock:
                lease = self._state.lease_id
                if lease is None:
                    return
                self._state.lease_id = None
                self._old_lease = lease
                self._old_lease_until = self._state.renewed_at + self._cfg.lease_ttl
            lost = self._state.drop_held()
        log.warning("node %s: lease lost (%s); stopping %d task(s)", self._state.node_id, reason,
                    len(lost), extra=self._state.extra)
        self._state.notify_lost(lost)
        self._beat_wake.set()

    def suspend_keepalive(self) -> None:
        """Fault injection for tests: stop renewing the lease (as if etcd were cut off).

        The node then self-fences (``ctx.lost`` for every claim) before the lease expires,
        and does not re-register until :meth:`resume_keepalive`.
        """
        with self._state.lease_lock:
            self._paused = True
        self._beat_wake.set()

    def resume_keepalive(self) -> None:
        """Undo :meth:`suspend_keepalive`."""
        with self._state.lease_lock:
            self._paused = False
        self._beat_wake.set()

    def close(self) -> list[int]:
        """Stop the lease thread; the leases to revoke (taken from the node: no claim or
        renewal uses them any more)."""
        with self._state.lock, self._state.lease_lock:
            leases = [lease for lease in (self._state.lease_id, self._old_lease)
                      if lease is not None]
            self._state.lease_id = self._old_lease = None
        self._beat_wake.set()
        return leases
