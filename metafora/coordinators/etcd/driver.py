"""The one module that talks to etcd: the gRPC connection, failover and retry, translated errors.

Everything above this module sees the plain values of :mod:`metafora.coordinators.etcd.ops`
(:class:`KeyValue`, :class:`TxnResult`, :class:`WatchBatch`; re-exported here) and metafora
exceptions; no other module imports grpc or the etcd client library
(:mod:`~metafora.coordinators.etcd.messages` builds the protobuf messages from the
library's generated module, which this one hands it).

The client library is ``etcd-sdk-python`` (import name ``pyetcd``), a maintained fork of
python-etcd3 whose generated protobuf code works with protobuf >= 5.27.2; ``etcd3`` is
accepted when that is what is installed. From the library we use the generated protobuf
messages and stubs (``etcdrpc``), its endpoint/channel and authentication handling
(``MultiEndpointEtcd3Client`` built from ``Endpoint(host, port, secure, time_retry=1)``)
and its watch-stream multiplexer (``watch.Watcher``). Calls go straight to the stubs so
that each has its own deadline and its response header (the txn revision is the fencing
token) is not lost.

Failover: on a connection error the call moves to the next endpoint and, if the request
may be repeated (reads, or when the caller says so), is retried there once per endpoint.
A single endpoint is never marked failed: its gRPC channel reconnects by itself with a
short back-off (the library's default of refusing a failed node for 300 s is avoided).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc

from metafora.coordinators.etcd.lease_calls import Invoke, LeaseCalls
from metafora.coordinators.etcd.messages import (
    kv_from,
    range_request,
    txn_request,
    txn_result,
)
from metafora.coordinators.etcd.ops import (
    Compare,
    Delete,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    Range,
    TxnRequest,
    TxnResult,
    WatchBatch,
    WatchCallback,
    WatchCompacted,
    WatchEvent,
    WatchFailure,
    absent,
    created_at,
    exists,
    modified_at,
    prefix_end,
    value_is,
)
from metafora.coordinators.etcd.stream import WatchHandle
from metafora.core.errors import (
    ConfigError,
    CoordinatorUnavailable,
    MetaforaError,
    RequestTooLarge,
    StoreError,
)

# The value types are re-exported: ``from metafora.coordinators.etcd.driver import Put``
# keeps working for the modules, tests and benchmarks that import them from here.
__all__ = [
    "Compare",
    "ConnectionSettings",
    "Delete",
    "EtcdDriver",
    "KeyValue",
    "LeaseNotFound",
    "Op",
    "Put",
    "Range",
    "TxnRequest",
    "TxnResult",
    "WatchBatch",
    "WatchCallback",
    "WatchCompacted",
    "WatchEvent",
    "WatchFailure",
    "WatchHandle",
    "absent",
    "created_at",
    "exists",
    "load_library",
    "modified_at",
    "prefix_end",
    "value_is",
]

log = logging.getLogger(__name__)

# gRPC channel options: reconnect quickly after a server restart (the default back-off grows
# to 120 s) and notice a dead peer under a quiet watch stream. etcd answers pings more
# often than every 5 s, or pings on a connection without streams, with GOAWAY
# ("too_many_pings"), which fails the next call: ping every 10 s, and only while a call
# (the coordinator's watch) is open.
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
_RETRY_PAUSE = 0.05  # before repeating a call on the same (only) endpoint

_UNAVAILABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # "too many requests": retryable
    }
)
_TOKEN_ERRORS = ("invalid auth token", "auth token")


def _too_large(code: object, details: str) -> bool:
    """Whether etcd (or gRPC in front of it) refused a request for its size: never retryable."""
    text = details.lower()
    return (code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in text) or (
        code == grpc.StatusCode.INVALID_ARGUMENT and "too large" in text
    )


def load_library() -> ModuleType:
    """The installed etcd client library: ``pyetcd`` (preferred) or ``etcd3``."""
    errors = []
    for name in ("pyetcd", "etcd3"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:  # pragma: no cover - depends on the environment
            errors.append(f"{name}: {exc}")
        except Exception as exc:  # pragma: no cover - e.g. etcd3 with protobuf >= 4
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    raise ImportError(
        "no usable etcd client library (pip install 'metafora-cluster[etcd]'): " + "; ".join(errors)
    )


@dataclass(frozen=True)
class ConnectionSettings:
    """How to reach etcd (parsed from the store URL)."""

    hosts: tuple[tuple[str, int], ...]
    secure: bool = False
    ca_cert: str | None = None
    cert_key: str | None = None
    cert_cert: str | None = None
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    timeout: float = 5.0
    display: str = ""  # the endpoints as shown in errors (never a password)


class EtcdDriver:
    """A connection to one etcd cluster. Thread-safe; :meth:`connect` before use."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._lib: ModuleType | None = None
        self._client: Any = None
        self._channels: list[Any] = []
        self._current = 0
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._closed = False
        self._leases = LeaseCalls(self._call, settings.timeout)

    @property
    def endpoints(self) -> str:
        """The endpoints, for messages (no password)."""
        return self._settings.display

    # -- connection -------------------------------------------------------------------

    def connect(self) -> None:
        """Build the client (channels, and a token when user/password are set).

        Raises CoordinatorUnavailable if authentication cannot reach the server.
        """
        with self._lock:
            if self._client is not None:
                return
            if self._closed:
                raise CoordinatorUnavailable(f"etcd connection to {self.endpoints} is closed")
            self._build()

    def _build(self) -> None:
        lib = load_library()
        if not hasattr(lib, "MultiEndpointEtcd3Client"):
            raise ConfigError(
                f"the installed {lib.__name__} is too old (no MultiEndpointEtcd3Client); "
                "pip install 'metafora-cluster[etcd]'"
            )
        s = self._settings
        creds = None
        if s.secure:
            creds = grpc.ssl_channel_credentials(
                _read(s.ca_cert), _read(s.cert_key), _read(s.cert_cert)
            )
        # With user/password the library authenticates at once, against a member it picks
        # at random: try again (a few times per member) while that member is unreachable.
        attempts = 1 if s.user is None else 2 * len(s.hosts)
        for attempt in range(attempts):
            endpoints = [
                lib.Endpoint(host, port, secure=s.secure, creds=creds, time_retry=1,
                             opts=_CHANNEL_OPTIONS)
                for host, port in s.hosts
            ]
            try:
                client = lib.MultiEndpointEtcd3Client(
                    endpoints=endpoints, timeout=s.timeout, user=s.user, password=s.password,
                    failover=True,
                )
                break
            except grpc.RpcError as exc:
                for ep in endpoints:
                    ep.close()
                err = self._translate(exc, "authenticate")
                if not isinstance(err, CoordinatorUnavailable) or attempt == attempts - 1:
                    raise err from exc
        self._lib = lib
        self._client = client
        self._channels = [ep.channel for ep in endpoints]
        self._metadata = client.metadata
        self._current = random.randrange(len(self._channels))  # spread clients over members

    def _reauthenticate(self) -> None:
        with self._lock:
            old = self._client
            self._client = None
            self._build()
        if old is not None:
            try:
                old.close()
            except Exception:  # pragma: no cover - best effort
                log.debug("ignoring error closing an old etcd client", exc_info=True)

    def close(self) -> None:
        """Close every channel (watches end). Idempotent."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            self._channels = []
        if client is not None:
            try:
                client.close()
            except Exception:  # pragma: no cover - best effort
                log.debug("ignoring error closing the etcd client", exc_info=True)

    def _channel(self) -> tuple[Any, int, ModuleType]:
        with self._lock:
            if self._client is None:
                if self._closed:
                    raise CoordinatorUnavailable(f"etcd connection to {self.endpoints} is closed")
                self._build()
            assert self._lib is not None
            return self._channels[self._current], self._current, self._lib

    def _failover(self, index: int) -> None:
        with self._lock:
            if len(self._channels) > 1 and self._current == index:
                self._current = (index + 1) % len(self._channels)
                log.info("etcd: switching to endpoint %d of %s", self._current, self.endpoints)

    def _translate(self, exc: grpc.RpcError, what: str) -> Exception:
        code = exc.code() if hasattr(exc, "code") else None
        details = (exc.details() if hasattr(exc, "details") else None) or str(code)
        if _too_large(code, details):
            return RequestTooLarge(f"etcd at {self.endpoints} refused the request as too large ({what}): "
                                   f"{details}")
        if code in _UNAVAILABLE_CODES:
            return CoordinatorUnavailable(
                f"etcd at {self.endpoints} is unavailable ({what}): {details}"
            )
        if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
            return LeaseNotFound(f"etcd: {details}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            code == grpc.StatusCode.INVALID_ARGUMENT and "authentication" in details
        ):
            return ConfigError(f"etcd at {self.endpoints} refused the credentials ({what}): {details}")
        return StoreError(f"etcd at {self.endpoints} failed ({what}): {details}")

    def _call(
        self,
        what: str,
        invoke: Invoke,
        *,
        repeatable: bool,
    ) -> tuple[Any, bool]:
        """Run ``invoke(channel, lib, metadata)``; returns (result, retried).

        A repeatable call that meets a connection error is tried once on every endpoint,
        and at least twice (a connection the server just closed is re-opened at once).
        """
        attempts = max(2, len(self._settings.hosts)) if repeatable else 1
        retried = False
        reauthed = False
        last: Exception | None = None
        i = 0
        while i < attempts:
            channel, index, lib = self._channel()
            try:
                return invoke(channel, lib, self._metadata), retried
            except grpc.RpcError as exc:
                details = (exc.details() if hasattr(exc, "details") else "") or ""
                if (
                    not reauthed
                    and self._settings.user is not None
                    and exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    and any(t in details for t in _TOKEN_ERRORS)
                ):
                    reauthed = True
                    self._reauthenticate()
                    continue  # the request was refused, so repeating it is safe
                err = self._translate(exc, what)
                err.__cause__ = exc
                if not isinstance(err, CoordinatorUnavailable):
                    raise err from exc
                self._failover(index)
                last = err
                retried = True
                i += 1
                if i < attempts and len(self._settings.hosts) == 1:
                    threading.Event().wait(_RETRY_PAUSE)
        assert last is not None
        raise last

    # -- KV ---------------------------------------------------------------------------

    def _limit(self, timeout: float | None) -> Callable[[], float]:
        """Each attempt's gRPC deadline: the request timeout, cut to what is left of
        ``timeout`` (seconds for the whole call, retries included); past it, unavailable."""
        if timeout is None:
            return lambda: self._settings.timeout
        ends = time.monotonic() + timeout

        def left() -> float:
            remaining = ends - time.monotonic()
            if remaining <= 0:
                raise CoordinatorUnavailable(
                    f"etcd at {self.endpoints}: no answer within the {timeout:.2f}s allowed"
                )
            return min(self._settings.timeout, remaining)

        return left

    def range(self, request: Range, *, revision: int = 0,
              timeout: float | None = None) -> tuple[list[KeyValue], int]:
        """Read keys; returns them and the store revision of the read. ``timeout`` bounds
        the whole call (retries included) below the request timeout."""
        limit = self._limit(timeout)

        def invoke(channel: Any, lib: ModuleType, md: Any) -> Any:
            rpc = lib.etcdrpc
            return rpc.KVStub(channel).Range(
                range_request(rpc, request, revision), limit(), metadata=md
            )

        response, _ = self._call("range", invoke, repeatable=True)
        return [kv_from(kv) for kv in response.kvs], int(response.header.revision)

    def count(self, request: Range, *, timeout: float | None = None) -> int:
        """How many keys ``request`` would read (etcd counts them; no key is sent back)."""
        limit = self._limit(timeout)

        def invoke(channel: Any, lib: ModuleType, md: Any) -> Any:
            rpc = lib.etcdrpc
            message = range_request(rpc, request, 0)
            message.count_only = True
            return rpc.KVStub(channel).Range(message, limit(), metadata=md)

        response, _ = self._call("range", invoke, repeatable=True)
        return int(response.count)

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        repeatable: bool = False,
        timeout: float | None = None,
    ) -> TxnResult:
        """Run a transaction. With ``repeatable`` it is retried on another endpoint after a
        connection error (``TxnResult.retried`` then says an earlier attempt may have applied).
        ``timeout`` bounds the whole call (retries included) below the request timeout.
        """
        limit = self._limit(timeout)

        def invoke(channel: Any, lib: ModuleType, md: Any) -> Any:
            rpc = lib.etcdrpc
            request = txn_request(rpc, compares, success, failure)
            return rpc.KVStub(channel).Txn(request, limit(), metadata=md)

        response, retried = self._call("txn", invoke, repeatable=repeatable)
        return txn_result(response, retried)

    def txns(
        self,
        requests: Sequence[TxnRequest],
        *,
        repeatable: bool = False,
        timeout: float | None = None,
    ) -> list[TxnResult | MetaforaError]:
        """Run independent transactions with all of them in flight at once (one round trip
        of latency for the lot instead of one each); result ``i`` is request ``i``'s.

        A request refused or lost is reported as its error (never raised), so that a caller
        can keep what the others did. With ``repeatable``, one that met a connection error
        is run again through :meth:`txn` (its result then says ``retried``).
        """
        if len(requests) == 1:
            try:
                return [self.txn(*requests[0], repeatable=repeatable, timeout=timeout)]
            except MetaforaError as exc:
                return [exc]
        limit = self._limit(timeout)
        results: list[TxnResult | MetaforaError] = []
        try:
            channel, index, lib = self._channel()
            rpc = lib.etcdrpc
            stub = rpc.KVStub(channel)
            futures = [
                stub.Txn.future(txn_request(rpc, *request), limit(), metadata=self._metadata)
                for request in requests
            ]
        except MetaforaError as exc:
            return [exc for _ in requests]
        for request, future in zip(requests, futures, strict=True):
            try:
                results.append(txn_result(future.result(), retried=False))
                continue
            except grpc.RpcError as exc:
                err = self._translate(exc, "txn")
                err.__cause__ = exc
            assert isinstance(err, MetaforaError)
            if isinstance(err, ConfigError) and self._settings.user is not None:
                # Perhaps an expired auth token: refused, so safe to run again; txn()
                # re-authenticates.
                try:
                    results.append(self.txn(*request, repeatable=repeatable, timeout=timeout))
                except MetaforaError as exc:
                    results.append(exc)
                continue
            if not isinstance(err, CoordinatorUnavailable):
                results.append(err)
                continue
            self._failover(index)
            if not repeatable:
                results.append(err)
                continue
            try:  # on its own now; the first attempt may have been applied
                again = self.txn(*request, repeatable=True, timeout=timeout)
                results.append(dataclasses.replace(again, retried=True))
            except MetaforaError as exc:
                results.append(exc)
        return results

    # -- leases (the RPCs are :class:`~.lease_calls.LeaseCalls`') ---------------------

    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease; returns (lease id, granted TTL in seconds)."""
        return self._leases.grant(ttl)

    def keepalive(self, lease_id: int, timeout: float) -> int:
        """Renew a lease once; returns its TTL, or 0 when etcd no longer knows it."""
        return self._leases.keepalive(lease_id, timeout)

    def lease_keys(self, lease_id: int) -> int:
        """How many keys are attached to a lease (0 when etcd does not know it)."""
        return self._leases.lease_keys(lease_id)

    def revoke(self, lease_id: int, timeout: float | None = None) -> None:
        """Revoke a lease (its keys are deleted). An unknown lease is not an error."""
        self._leases.revoke(lease_id, timeout)

    # -- watch ------------------------------------------------------------------------

    def watch_prefix(self, prefix: bytes, start_revision: int, callback: WatchCallback,
                     skip: Callable[[bytes], bool] | None = None) -> WatchHandle:
        """Watch every key under ``prefix`` from ``start_revision`` (but those ``skip`` names:
        their events are dropped undecoded).

        ``callback`` runs on the watch's reader thread with a :class:`WatchBatch` per
        response, and finally (at most once) with a :class:`WatchFailure` when the stream
        ends for any reason other than :meth:`WatchHandle.cancel` (compaction included).
        It must not block. Raises CoordinatorUnavailable if the watch is not confirmed
        within the request timeout.
        """
        channel, index, lib = self._channel()
        rpc = lib.etcdrpc
        requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        create = rpc.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision
        )
        requests.put(rpc.WatchRequest(create_request=create))
        call = rpc.WatchStub(channel).Watch(iter(requests.get, None), metadata=self._metadata)
        handle = WatchHandle(call, requests, callback, "metafora-etcd-watch-stream", skip)
        handle.start()
        if handle.wait_created(self._settings.timeout):
            return handle
        handle.cancel()
        failure = handle.failure
        if failure is not None and failure.compacted:
            raise WatchCompacted(start_revision)
        error = failure.error if failure is not None else None
        if isinstance(error, grpc.RpcError):
            err = self._translate(error, "watch")
            if isinstance(err, CoordinatorUnavailable):
                self._failover(index)
            raise err from error
        if error is not None:
            raise StoreError(f"etcd watch failed: {error}") from error
        self._failover(index)
        raise CoordinatorUnavailable(
            f"etcd at {self.endpoints} is unavailable (watch): not confirmed within "
            f"{self._settings.timeout:g}s"
        )


# --------------------------------------------------------------------------- helpers


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path!r}: {exc.strerror}") from exc
