"""What the SQL coordinator shares with the storage of the features kept beside its tables.

The state machine's states and commands (:mod:`metafora.coordinators.sql.states`) and the
gated partitions' items (:mod:`metafora.coordinators.sql.gates`) live in a SQL coordinator's
database, or (items) in a SQL database of their own. This module is their one seam into the
coordinator's modules: a database handle and its typed configuration, error translation at
the boundary, push wake-ups on PostgreSQL, and the one SQL condition that says a claim is
held -- so neither reads ``metafora_tasks`` or ``metafora_nodes`` by name. Everything here is
a stable name; what stands behind it may be rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable

from metafora.coordinators.sql.dialect import Dialect, PostgresDialect
from metafora.coordinators.sql.listen import ChangeFeed, Listener
from metafora.coordinators.sql.options import PG_SCHEMES, SQLConfig, parse_config
from metafora.coordinators.sql.schema import schema_not_ready
from metafora.coordinators.sql.store import Database, translate_error
from metafora.core.errors import ConfigError

__all__ = [
    "SQL_SCHEMES",
    "ChangeFeed",
    "Database",
    "Dialect",
    "SQLConfig",
    "claim_held",
    "database_of",
    "is_postgres",
    "listen",
    "parse_config",
    "schema_not_ready",
    "translate_error",
]

SQL_SCHEMES = ("sqlite", *PG_SCHEMES)
"""The URL schemes of the SQL coordinator."""


def database_of(coordinator_or_client: object) -> Database:
    """The database handle of a SQL coordinator or client (shared: same engine and pool).

    ConfigError for anything else.
    """
    db = getattr(coordinator_or_client, "_db", None)
    if not isinstance(db, Database):
        raise ConfigError(f"{type(coordinator_or_client).__name__} is not a SQL coordinator or client")
    return db


def is_postgres(dialect: Dialect) -> bool:
    """Whether ``dialect`` speaks PostgreSQL (else SQLite)."""
    return isinstance(dialect, PostgresDialect)


def listen(config: SQLConfig, channel: str, name: str, on_notify: Callable[[str], None],
           on_connect: Callable[[], None]) -> ChangeFeed:
    """A PostgreSQL LISTEN on ``channel`` in a thread of its own (call ``start()``):
    ``on_notify(payload)`` for each notification, ``on_connect()`` after every (re)connect
    (a notification may have been missed meanwhile). ``name`` names the thread."""
    dialect = PostgresDialect(config)
    dialect.channel = channel
    return Listener(dialect, name, on_notify, on_connect)


def claim_held(task: str = ":id", *, owner: str | None = None,
               aliases: tuple[str, str] = ("t", "n")) -> str:
    """A SQL condition: the task ``task`` (a bind parameter or column) is claimed under
    ``:token`` (and by ``owner`` when given) by a node whose lease is live by the database
    clock. It binds ``:ns`` and ``:token``, and leaves ``{now}`` for the dialect's clock
    fragment (``str.format``), as the statements that use it do. ``aliases`` name the tasks
    and the nodes rows, so that it can nest in a query on the same tables.
    """
    alias, nodes = aliases
    by_owner = f" AND {alias}.owner = {owner}" if owner is not None else ""
    return (
        f"EXISTS (SELECT 1 FROM metafora_tasks {alias} WHERE {alias}.namespace = :ns"
        f" AND {alias}.id = {task} AND {alias}.state = 'claimed' AND {alias}.token = :token{by_owner}"
        f" AND EXISTS (SELECT 1 FROM metafora_nodes {nodes} WHERE {nodes}.namespace = :ns"
        f" AND {nodes}.node_id = {alias}.owner AND {nodes}.lease_until > {{now}}))"
    )
