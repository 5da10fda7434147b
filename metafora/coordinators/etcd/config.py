"""``etcd://`` / ``etcds://`` URLs and their options, validated once into :class:`EtcdConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metafora.coordinators.etcd.driver import ConnectionSettings
from metafora.core.config import DEFAULT_NAMESPACE, OptionReader, StoreURL, validate_namespace
from metafora.core.errors import ConfigError
from metafora.core.leases import Fencing, LeaseTTL, read_lease_ttl

__all__ = ["DEFAULT_PORT", "ETCD_FENCING", "LEASE_TTL", "EtcdConfig"]

LEASE_TTL = LeaseTTL(minimum=2.0, whole=True)
"""etcd's bounds on ``lease_ttl``: whole seconds, at least 2 (etcd's least TTL is ~1.5 s)."""

ETCD_FENCING = Fencing(share=1 / 4, floor=0.5)
"""etcd's self-fencing margin: a quarter of the TTL, at least half a second."""

DEFAULT_PORT = 2379


@dataclass(frozen=True)
class EtcdConfig:
    """Everything an etcd coordinator or client needs, checked at construction.

    - ``namespace``: the URL path (``etcd://host/NAMESPACE``) or the ``namespace`` option
      (the path wins), default ``metafora``. Keys live under ``/metafora/<namespace>/``.
    - ``lease_ttl``: whole seconds, >= 2 (default 30; :data:`LEASE_TTL`). One lease per node.
    - ``poll_interval``: seconds between safety-net re-lists of the watch (default 30; at
      least one second per 100 tasks in the namespace).
    - ``timeout``: seconds for one etcd request (default 5).
    - ``ca_cert``, ``cert_key``, ``cert_cert``: PEM files for ``etcds://``.
    - ``user:password@`` in the URL: etcd authentication.
    """

    url: StoreURL
    namespace: str
    lease_ttl: int
    poll_interval: float
    timeout: float
    connection: ConnectionSettings

    @property
    def name(self) -> str:
        """The URL without its password."""
        return self.url.redacted()

    @classmethod
    def from_url(cls, url: StoreURL, options: dict[str, Any]) -> EtcdConfig:
        """Parse and validate; raises ConfigError naming the bad value."""
        if url.scheme not in ("etcd", "etcds"):
            raise ConfigError(f"not an etcd URL: {url}")
        if not url.hosts:
            raise ConfigError(f"etcd URL needs at least one host: {url}")
        reader = OptionReader(url, options)
        namespace = reader.namespace()
        path = url.path.strip("/")
        if path:
            if "/" in path:
                raise ConfigError(f"etcd URL path must be one namespace, got {url.path!r} in {url}")
            namespace = validate_namespace(path)
        elif not namespace:
            namespace = DEFAULT_NAMESPACE
        ttl = read_lease_ttl(reader, LEASE_TTL, "etcd")
        poll = reader.number("poll_interval", 30.0, minimum=0.05, maximum=3600.0)
        timeout = reader.number("timeout", 5.0, minimum=0.05, maximum=600)
        ca_cert = reader.string("ca_cert")
        cert_key = reader.string("cert_key")
        cert_cert = reader.string("cert_cert")
        reader.finish()
        secure = url.scheme == "etcds"
        if not secure and (ca_cert or cert_key or cert_cert):
            raise ConfigError(f"TLS options need an etcds:// URL, got {url}")
        if (cert_key is None) != (cert_cert is None):
            raise ConfigError("options 'cert_key' and 'cert_cert' must be given together")
        if (url.username is None) != (url.password is None):
            raise ConfigError(f"etcd authentication needs both user and password in {url}")
        hosts = tuple((host, DEFAULT_PORT if port is None else port) for host, port in url.hosts)
        display = ",".join(f"{'https' if secure else 'http'}://{_host(h)}:{p}" for h, p in hosts)
        connection = ConnectionSettings(
            hosts=hosts,
            secure=secure,
            ca_cert=ca_cert,
            cert_key=cert_key,
            cert_cert=cert_cert,
            user=url.username,
            password=url.password,
            timeout=timeout,
            display=display,
        )
        return cls(url, namespace, int(ttl), poll, timeout, connection)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
