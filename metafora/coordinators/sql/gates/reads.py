"""The SQL item store's reads: items and partitions as :mod:`metafora.gates.model` values.

Mixed into :class:`~metafora.coordinators.sql.gates.store.SQLItemStore` (the reads of the
:class:`~metafora.gates.ItemStore` interface); the writes, fenced or not, stay there and in
:mod:`~metafora.coordinators.sql.gates.lease`, which reads its rows with :meth:`ItemReads.item_from_row`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from metafora.coordinators.sql.gates.statements import ITEM_COLUMNS
from metafora.coordinators.sql.options import SQLConfig
from metafora.coordinators.sql.store import Database
from metafora.core.errors import ConfigError
from metafora.core.task import validate_task_id
from metafora.gates.model import (
    Item,
    ItemNotFound,
    ItemStatus,
    PartitionInfo,
    PartitionStatus,
    check_gate,
)

__all__ = ["ItemReads"]


class ItemReads:
    """Reads of items and partitions, over the store's database and namespace (the
    store's ``_db`` and ``_config``, its statements through ``_run``)."""

    _db: Database
    _config: SQLConfig

    def ensure_schema(self, conn: Connection | None = None) -> None:
        raise NotImplementedError

    def _run(self, conn: Connection, name: str, params: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _item(self, partition: str, row: Any) -> Item:
        conv = self._db.dialect.from_db_time
        return Item(
            partition=partition,
            id=int(row[0]),
            gate=int(row[1]),
            status=ItemStatus(row[2]),
            data=bytes(row[3]) if row[3] is not None else b"",
            attempts=int(row[4]),
            error=row[5],
            permanent=bool(row[6]),
            token=int(row[7]),
            created_at=conv(row[8]),
            updated_at=conv(row[9]),
        )

    def item_from_row(self, partition: str, row: Any) -> Item:
        """An :class:`Item` from a row of the item columns."""
        return self._item(partition, row)

    # -- reading ----------------------------------------------------------------------------

    def list(self, partition: str, *, gate: int | None = None,
             status: ItemStatus | str | None = None, limit: int | None = None,
             after: int | None = None) -> list[Item]:
        """The partition's items (at ``gate``, in ``status``), ordered by id; ``after`` an id
        to page from, ``limit`` the most to return."""
        validate_task_id(partition)
        conditions = ["namespace = :ns", "partition_id = :p"]
        params: dict[str, Any] = {"p": partition, "ns": self._config.namespace}
        if gate is not None:
            conditions.append("gate = :gate")
            params["gate"] = check_gate(gate)
        if status is not None:
            conditions.append("status = :status")
            params["status"] = ItemStatus(status).value
        if after is not None:
            conditions.append("id > :after")
            params["after"] = int(after)
        sql = f"SELECT {ITEM_COLUMNS} FROM metafora_items WHERE {' AND '.join(conditions)} ORDER BY id"
        if limit is not None:
            if limit < 0:
                raise ConfigError(f"limit must be >= 0, got {limit}")
            sql += " LIMIT :limit"
            params["limit"] = int(limit)
        self.ensure_schema()
        with self._db.read() as conn:
            rows = conn.execute(text(sql), params).fetchall()
        return [self._item(partition, row) for row in rows]

    def get(self, partition: str, item_id: int) -> Item:
        """One item. Raises ItemNotFound."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.read() as conn:
            row = self._run(conn, "item", {"p": partition, "id": int(item_id)}).first()
        if row is None:
            raise ItemNotFound(f"no item {item_id} in partition {partition!r} of {self._db.name}")
        return self._item(partition, row)

    def info(self, partition: str) -> PartitionInfo:
        """The partition's gate, status, owner token and item counts (by gate and status)."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.read() as conn:
            row = self._run(conn, "partition", {"p": partition}).first()
            counts_rows = self._run(conn, "counts", {"p": partition}).fetchall()
        counts: dict[int, dict[ItemStatus, int]] = {}
        for gate, status, count in counts_rows:
            counts.setdefault(int(gate), {})[ItemStatus(status)] = int(count)
        if row is None:
            return PartitionInfo(partition, counts=counts, exists=bool(counts))
        return PartitionInfo(
            partition, gate=int(row[0]), status=PartitionStatus(row[1]), token=int(row[2]),
            counts=counts, exists=True, updated_at=self._db.dialect.from_db_time(row[3]),
        )

    def failures(self, partition: str) -> tuple[int, int]:
        """How many items of the partition are failed, and how many of those permanently."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.read() as conn:
            failed, permanent = self._run(conn, "failures", {"p": partition}).one()
        return int(failed), int(permanent)
