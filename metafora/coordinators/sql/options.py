"""The SQL store's URL and options, validated once into a typed :class:`SQLConfig`.

``sqlite:///relative.db`` or ``sqlite:////abs/path.db``; ``postgresql://user:pass@host:port/db``
(``postgres://`` and ``postgresql+psycopg://`` are accepted too). Query options (or keyword
arguments, which win): ``namespace``, ``lease_ttl``, ``poll_interval``, ``pool_size``,
``migrate`` (default true: create and upgrade the tables on first use; false: never touch the
schema, a missing or older one is :class:`~metafora.core.errors.SchemaNotReady` naming
``metafora migrate``), and ``connect_timeout`` / ``sslmode`` (PostgreSQL) or ``busy_timeout``
(SQLite).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any, Literal

from metafora.core.config import OptionReader, StoreURL
from metafora.core.errors import ConfigError
from metafora.core.leases import Fencing, LeaseTTL, read_lease_ttl, renew_every

__all__ = ["LEASE_TTL", "PG_SCHEMES", "SQL_FENCING", "SQLConfig", "parse_config"]

PG_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")

LEASE_TTL = LeaseTTL(minimum=1.0, maximum=86400.0)
"""The SQL stores' bounds on ``lease_ttl``: any seconds from 1 to a day."""

SQL_FENCING = Fencing(share=1 / 3)
"""The SQL stores' self-fencing margin: a third of the TTL."""
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_MIN_SQLITE = (3, 35, 0)  # RETURNING


_COMMAND_RECHECK_MIN = 30.0  # seconds


@dataclass(frozen=True)
class SQLConfig:
    """Everything a SQL coordinator or client needs, checked and typed."""

    kind: Literal["postgresql", "sqlite"]
    url: StoreURL = field(repr=False)
    namespace: str
    lease_ttl: float
    poll_interval: float
    pool_size: int
    connect_timeout: float
    busy_timeout: float
    sslmode: str | None
    path: str | None  # SQLite file
    migrate: bool = True  # False: never create or alter the schema (``metafora migrate`` does)

    @property
    def name(self) -> str:
        """The URL without its password (safe for logs and errors)."""
        return self.url.redacted()

    @property
    def renew_interval(self) -> float:
        """Seconds between lease renewals (:func:`~metafora.core.leases.renew_every`)."""
        return renew_every(self.lease_ttl)

    @property
    def command_recheck(self) -> float:
        """Seconds between safety-net looks for node and task commands.

        Commands are pushed (NOTIFY, SQLite's change check) and a reconnect rechecks at
        once, so this only bounds the delay of a notification lost without a reconnect:
        ``max(poll_interval, 30 s)`` keeps an idle node's traffic to its heartbeat.
        """
        return max(self.poll_interval, _COMMAND_RECHECK_MIN)

    @property
    def fence_after(self) -> float:
        """Seconds after the start of the last good renewal at which a node self-fences.

        :data:`SQL_FENCING`: ``lease_ttl`` minus a margin of
        ``lease_ttl / 3`` (the store keeps the lease for ``lease_ttl`` from the renewal's
        database time, so handlers get a third of the TTL to stop).
        """
        return SQL_FENCING.fence_after(self.lease_ttl)


def parse_config(url: StoreURL, options: dict[str, Any]) -> SQLConfig:
    """Validate ``url`` and ``options`` (ConfigError naming the bad value)."""
    if url.scheme in PG_SCHEMES:
        kind: Literal["postgresql", "sqlite"] = "postgresql"
    elif url.scheme == "sqlite":
        kind = "sqlite"
    else:
        raise ConfigError(f"the SQL store does not handle the scheme {url.scheme!r} ({url})")
    reader = OptionReader(url, options)
    namespace = reader.namespace()
    lease_ttl = read_lease_ttl(reader, LEASE_TTL, "sql")
    # PostgreSQL pushes every change (NOTIFY); its poll is only the safety net for rows
    # written without one (another program), so it can be rare: 15 s keeps an idle node
    # well under one request per second.
    poll_default = 15.0 if kind == "postgresql" else 0.25
    poll_interval = reader.number("poll_interval", poll_default, minimum=0.01, maximum=3600.0)
    pool_size = reader.integer("pool_size", 10, minimum=1, maximum=100)
    migrate = reader.boolean("migrate", True)
    connect_timeout = 5.0
    busy_timeout = 5.0
    sslmode = None
    path = None
    if kind == "postgresql":
        connect_timeout = reader.number("connect_timeout", 5.0, minimum=1.0, maximum=600.0)
        sslmode = reader.string("sslmode")
        if sslmode is not None and sslmode not in _SSLMODES:
            raise ConfigError(f"option 'sslmode' must be one of {', '.join(_SSLMODES)}, got {sslmode!r}")
        if len(url.hosts) != 1:
            raise ConfigError(f"a PostgreSQL URL needs exactly one host: {url}")
        if url.path.strip("/") == "" or "/" in url.path.strip("/"):
            raise ConfigError(f"a PostgreSQL URL needs a database name as its path: {url}")
    else:
        busy_timeout = reader.number("busy_timeout", 5.0, minimum=0.1, maximum=600.0)
        if url.hosts or url.username is not None:
            raise ConfigError(
                f"a SQLite URL has no host: use sqlite:///relative.db or sqlite:////abs/path.db, got {url}"
            )
        path = url.path[1:] if url.path.startswith("/") else url.path
        if not path or path == ":memory:":
            raise ConfigError(
                f"a SQLite store must be a file shared by the processes (use memory:// for an "
                f"in-process store), got {url}"
            )
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise ConfigError(
                f"SQLite {sqlite3.sqlite_version} is too old for the SQL store (needs 3.35+)"
            )
    reader.finish()
    return SQLConfig(
        kind=kind,
        url=url,
        namespace=namespace,
        lease_ttl=lease_ttl,
        poll_interval=poll_interval,
        pool_size=pool_size,
        connect_timeout=connect_timeout,
        busy_timeout=busy_timeout,
        sslmode=sslmode,
        path=path,
        migrate=migrate,
    )
