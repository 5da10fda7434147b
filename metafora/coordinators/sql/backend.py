"""The SQL store's entry in the stores' registry (``sqlite``, ``postgresql``, ``postgres``,
``postgresql+psycopg``): how to open it, its lease rules, the storage of its features and its
async pieces (the async client on PostgreSQL, writes in an application's async transaction)."""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from typing import Any

from metafora.contracts.aio import AsyncClient
from metafora.contracts.backends import Migrated, StoreBackend
from metafora.contracts.client import Client
from metafora.coordinators.sql import open_client, open_coordinator
from metafora.coordinators.sql.client import SQLClient
from metafora.coordinators.sql.coordinator import SQLCoordinator
from metafora.coordinators.sql.options import LEASE_TTL, PG_SCHEMES, SQL_FENCING
from metafora.core.config import StoreURL
from metafora.core.errors import ConfigError
from metafora.core.submitting import IfExists, no_completion, no_transactions
from metafora.core.task import Task

__all__ = ["BACKEND", "SQLBackend"]


class SQLBackend(StoreBackend):
    """SQLite (the stdlib driver) and PostgreSQL (psycopg 3, the ``postgres`` extra)."""

    name = "sql"
    lease_ttl = LEASE_TTL
    fencing = SQL_FENCING
    features = {
        "state_store": "metafora.coordinators.sql.states:SQLStateStore",
        "task_commands": "metafora.coordinators.sql.states:SQLTaskCommands",
        "item_store": "metafora.coordinators.sql.gates.store:SQLItemStore",
        "job_log": "metafora.coordinators.sql.joblog:SQLJobLog",
        "job_logs": "metafora.coordinators.sql.joblog:job_logs",
    }

    def check_driver(self, url: StoreURL) -> None:
        # The SQL modules import psycopg only when they connect: say so before, not then.
        if url.scheme in PG_SCHEMES and importlib.util.find_spec("psycopg") is None:
            raise ModuleNotFoundError("No module named 'psycopg'")

    def open_coordinator(self, url: StoreURL, node_id: str, options: dict[str, Any]) -> SQLCoordinator:
        return open_coordinator(url, node_id, options)

    def open_client(self, url: StoreURL, options: dict[str, Any]) -> SQLClient:
        return open_client(url, options)

    def migrate(self, url: StoreURL) -> list[Migrated]:
        from metafora.coordinators.sql.migrations import migrate_store

        return migrate_store(url.raw)

    def open_async_client(self, client: Client, threads: int) -> AsyncClient | None:
        """PostgreSQL's async client (async driver end to end); None for SQLite."""
        if not isinstance(client, SQLClient) or client._db.config.kind != "postgresql":
            return None
        if importlib.util.find_spec("greenlet") is None:
            client.close()
            raise ConfigError("the async client on PostgreSQL needs SQLAlchemy's asyncio support"
                              " (greenlet): pip install 'metafora-cluster[async]'")
        from metafora.coordinators.sql.aio import PostgresAsyncClient

        return PostgresAsyncClient(client._db)

    async def submit_in_transaction(
        self, client: Client, conn: Any, tasks: list[Task], mode: IfExists,
        run: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> int:
        if not isinstance(client, SQLClient):
            raise no_transactions(client.name)
        from metafora.coordinators.sql.aio import submit_in_transaction

        return await submit_in_transaction(client, conn, tasks, mode, run)

    async def complete_in_transaction(
        self, client: Client, conn: Any, task: Task,
        run: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> None:
        if not isinstance(client, SQLClient):
            raise no_completion(client.name)
        from metafora.coordinators.sql.aio import complete_in_transaction

        await complete_in_transaction(client, conn, task, run)


BACKEND = SQLBackend()
"""Registered under every SQL scheme in the entry-point group ``metafora.stores``."""
