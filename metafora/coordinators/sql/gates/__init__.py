"""The gated partitions' items in SQL (SQLite or PostgreSQL): the SQL store's implementation
of :mod:`metafora.gates`' :class:`~metafora.gates.ItemStore` and
:class:`~metafora.gates.PartitionLease`.

Items live in the SQL coordinator's database (same URL and namespace: item writes are also
fenced by the coordinator's claims), or in a SQL database of their own (when the coordinator
is etcd). Modules: :mod:`~metafora.coordinators.sql.gates.store` (:class:`SQLItemStore`, and
how items are fenced and what a crash leaves), :mod:`~metafora.coordinators.sql.gates.lease`
(:class:`SQLPartitionLease`), :mod:`~metafora.coordinators.sql.gates.statements` (their
SQL), :mod:`~metafora.coordinators.sql.gates.schema` (the tables, versioned apart from the
coordinator's), :mod:`~metafora.coordinators.sql.gates.wakeups` (news of partitions).
"""

from __future__ import annotations

from metafora.coordinators.sql.gates.lease import SQLPartitionLease
from metafora.coordinators.sql.gates.schema import GATES_SCHEMA_VERSION
from metafora.coordinators.sql.gates.store import SQLItemStore
from metafora.coordinators.sql.gates.wakeups import items_channel

__all__ = ["GATES_SCHEMA_VERSION", "SQLItemStore", "SQLPartitionLease", "items_channel"]
