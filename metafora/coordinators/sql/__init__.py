"""SQL coordinator and client: SQLite (the embedded default) and PostgreSQL.

>>> coord = open_coordinator("sqlite:///metafora.db", node_id="a")          # doctest: +SKIP
>>> client = open_client("postgresql://user:pass@db:5432/jobs?namespace=x")  # doctest: +SKIP

SQLAlchemy 2 Core on psycopg 3 (PostgreSQL) or the stdlib ``sqlite3``; the hot statements
(claim, release, done, fail, heartbeat) are compiled once and run on bare pooled driver
connections. Modules:

- :mod:`~metafora.coordinators.sql.options`: URLs and options (a typed config);
- :mod:`~metafora.coordinators.sql.schema`: the tables, versioned migrations;
- :mod:`~metafora.coordinators.sql.dialect`: every PostgreSQL/SQLite difference;
- :mod:`~metafora.coordinators.sql.statements`: every statement, written once;
- :mod:`~metafora.coordinators.sql.store`: the engine, error translation at the boundary;
- :mod:`~metafora.coordinators.sql.lease`: node leases, renewal, self-fencing
  (:mod:`metafora.core.leases` says when);
- :mod:`~metafora.coordinators.sql.claims`: claims and their fenced outcomes;
- :mod:`~metafora.coordinators.sql.watch`: offering claimable tasks;
- :mod:`~metafora.coordinators.sql.listen`: wake-ups (LISTEN/NOTIFY, SQLite data_version);
- :mod:`~metafora.coordinators.sql.coordinator`, :mod:`~metafora.coordinators.sql.client`;
- the features' storage: :mod:`~metafora.coordinators.sql.states` (the state machine's states
  and task commands), :mod:`~metafora.coordinators.sql.gates` (the gated partitions' items),
  through the seam :mod:`~metafora.coordinators.sql.shared`.
"""

from __future__ import annotations

from typing import Any

from metafora.coordinators.sql.client import SQLClient
from metafora.coordinators.sql.coordinator import SQLCoordinator
from metafora.coordinators.sql.options import SQLConfig, parse_config
from metafora.coordinators.sql.schema import SCHEMA_VERSION
from metafora.coordinators.sql.store import Database
from metafora.core.config import StoreURL

__all__ = ["SCHEMA_VERSION", "SQLClient", "SQLConfig", "SQLCoordinator", "open_client", "open_coordinator"]


def open_coordinator(url: StoreURL, node_id: str, options: dict[str, Any]) -> SQLCoordinator:
    """Backend hook for :func:`metafora.open_coordinator` (touches nothing until ``init``)."""
    return SQLCoordinator(Database(parse_config(url, dict(options))), node_id)


def open_client(url: StoreURL, options: dict[str, Any]) -> SQLClient:
    """Backend hook for :func:`metafora.open_client` (connects on first use)."""
    return SQLClient(Database(parse_config(url, dict(options))))
