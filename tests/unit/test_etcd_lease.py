"""The etcd lease thread (:mod:`metafora.coordinators.etcd.lease`) against a fake driver:
renewals do not wait for the node's lock, and a closing node does not re-register."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.layout import Keys
from metafora.coordinators.etcd.lease import NodeLease
from metafora.coordinators.etcd.node import NodeState
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.config import parse_store_url
from tests.helpers import wait_until


class FakeDriver:
    """Leases and the one registration key, as etcd keeps them (enough for NodeLease)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next_lease = 1
        self.live: set[int] = set()
        self.alive_on: int | None = None  # the lease of the registration key, if any
        self.grants = 0
        self.keepalives = 0
        self.renewed = threading.Condition(self.lock)  # notified at every keepalive

    def grant(self, ttl: int) -> tuple[int, int]:
        with self.lock:
            lease, self.next_lease = self.next_lease, self.next_lease + 1
            self.live.add(lease)
            self.grants += 1
        return lease, ttl

    def txn(self, compares: Any, success: Any, failure: Any = ()) -> Any:
        # register()'s txn: create the registration key if absent
        with self.lock:
            if self.alive_on is not None:
                return SimpleNamespace(succeeded=False, revision=1)
            self.alive_on = success[0].lease
            return SimpleNamespace(succeeded=True, revision=1)

    def keepalive(self, lease: int, timeout: float) -> int:
        with self.lock:
            self.keepalives += 1
            self.renewed.notify_all()
            return 2 if lease in self.live else 0

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        with self.lock:
            self.live.discard(lease)
            if self.alive_on == lease:
                self.alive_on = None


def make(ttl: int = 2) -> tuple[NodeLease, NodeState, FakeDriver, threading.Thread]:
    config = EtcdConfig.from_url(parse_store_url(f"etcd://h1/ns?lease_ttl={ttl}"), {})
    state = NodeState("n1", config.name)
    driver = FakeDriver()
    lease = NodeLease(driver, Keys(config.namespace), config, SYSTEM_CLOCK, state,  # type: ignore[arg-type]
                      on_registered_again=lambda: None)
    lease.register()
    thread = threading.Thread(target=lease.run, daemon=True)
    thread.start()
    return lease, state, driver, thread


@pytest.mark.timing
def test_renewals_go_on_while_the_node_lock_is_held() -> None:
    _lease, state, driver, thread = make(ttl=2)  # renews every 0.67 s, fences after 1.5 s
    first = state.lease_id
    # The node's lock held as a re-list or a watch batch over every task would, for longer
    # than the fence: four renewals take 2 s at least.
    with state.lock, driver.lock:
        renewed = driver.renewed.wait_for(lambda: driver.keepalives >= 4, timeout=30)
    assert renewed, "the lease thread waited for the node's lock"
    state.stop.set()
    thread.join(5)
    assert state.lease_id == first  # never fenced


def test_a_closing_node_does_not_re_register(caplog: pytest.LogCaptureFixture) -> None:
    lease, state, driver, thread = make(ttl=30)
    # What EtcdCoordinator.close() does before it sets `stop` and revokes the lease.
    with state.lock:
        state.closed = True
        state.drop_held()
    leases = lease.close()
    with caplog.at_level(logging.WARNING):
        thread.join(2)
    assert not thread.is_alive()  # the lease thread ended without waiting for `stop`
    assert driver.grants == 1  # the first registration only
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for old in leases:
        driver.revoke(old)


def test_a_fenced_node_re_registers_after_the_grace() -> None:
    lease, state, driver, thread = make(ttl=2)  # margin 0.5 s
    first = state.lease_id
    lease.fence("test")
    assert state.lease_id is None
    wait_until(lambda: state.lease_id is not None, 10, "the node to register again")
    assert state.lease_id != first
    assert first not in driver.live  # revoked before registering again
    state.stop.set()
    thread.join(5)
