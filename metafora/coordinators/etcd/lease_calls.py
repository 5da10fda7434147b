"""The lease RPCs of :class:`~metafora.coordinators.etcd.driver.EtcdDriver`: grant, keep-alive,
time-to-live and revoke.

Run through the driver's call (failover, retry, translated errors): the driver delegates its
lease verbs here, and callers keep using them on the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

from metafora.coordinators.etcd.ops import LeaseNotFound
from metafora.core.errors import StoreError

__all__ = ["LeaseCalls"]

Invoke = Callable[[Any, ModuleType, tuple[tuple[str, str], ...] | None], Any]
"""A request to run: ``invoke(channel, lib, metadata)``."""


class Call(Protocol):
    """The driver's way to run a request: returns (result, retried)."""

    def __call__(self, what: str, invoke: Invoke, *, repeatable: bool) -> tuple[Any, bool]: ...


class LeaseCalls:
    """The lease RPCs, each with its own deadline (``timeout``: the connection's)."""

    def __init__(self, call: Call, timeout: float) -> None:
        self._call = call
        self._timeout = timeout

    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease; returns (lease id, granted TTL in seconds)."""

        def invoke(channel: Any, lib: ModuleType, md: Any) -> Any:
            rpc = lib.etcdrpc
            return rpc.LeaseStub(channel).LeaseGrant(
                rpc.LeaseGrantRequest(TTL=ttl), self._timeout, metadata=md
            )

        response, _ = self._call("lease grant", invoke, repeatable=True)
        if getattr(response, "error", ""):
            raise StoreError(f"etcd refused a lease: {response.error}")
        return int(response.ID), int(response.TTL)

    def keepalive(self, lease_id: int, timeout: float) -> int:
        """Renew a lease once; returns its TTL, or 0 when etcd no longer knows it."""
        deadline = max(0.05, min(timeout, self._timeout))

        def invoke(channel: Any, lib: ModuleType, md: Any) -> Any:
            rpc = lib.etcdrpc
            stream = rpc.LeaseStub(channel).LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), deadline, metadata=md
            )
            for response in stream:
                return int(response.TTL)
            return 0

        ttl, _ = self._call("lease keep-alive", invoke, repeatable=False)
        return int(ttl)

    def lease_keys(self, lease_id: int) -> int:
        """How many keys are attached to a lease (0 when etcd does not know it)."""

        def invoke(channel: Any, lib: ModuleType, md: Any) -> Any:
            rpc = lib.etcdrpc
            return rpc.LeaseStub(channel).LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True), self._timeout,
                metadata=md)

        response, _ = self._call("lease time-to-live", invoke, repeatable=True)
        return len(response.keys) if int(response.TTL) > 0 else 0

    def revoke(self, lease_id: int, timeout: float | None = None) -> None:
        """Revoke a lease (its keys are deleted). An unknown lease is not an error."""
        deadline = self._timeout if timeout is None else max(0.05, timeout)

        def invoke(channel: Any, lib: ModuleType, md: Any) -> Any:
            rpc = lib.etcdrpc
            return rpc.LeaseStub(channel).LeaseRevoke(
                rpc.LeaseRevokeRequest(ID=lease_id), deadline, metadata=md
            )

        try:
            self._call("lease revoke", invoke, repeatable=True)
        except LeaseNotFound:
            pass
