"""The SQL :class:`~metafora.gates.PartitionLease`: a claim's fenced handle on its partition's
items (see :mod:`metafora.coordinators.sql.gates.store`).

Every write is one transaction that ends with the **guard** (a fenced ``UPDATE`` of the
partition row); :meth:`SQLPartitionLease.take_over` raises the partition's token to the
claim's, which shuts every older claim out. The statements are
:mod:`metafora.coordinators.sql.gates.statements`'.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, Protocol

from sqlalchemy import Connection, TextClause

from metafora.core.errors import ClaimLost
from metafora.core.task import Task
from metafora.gates.lease import PartitionLease
from metafora.gates.model import Advance, Item, ItemResult, ItemStatus, PartitionStatus
from metafora.statemachine.store import LeaseBound

__all__ = ["LeaseStore", "SQLPartitionLease"]

log = logging.getLogger(__name__)


class LeaseStore(Protocol):
    """What a lease needs of its item store (:class:`~metafora.coordinators.sql.gates.store.SQLItemStore`)."""

    @property
    def namespace(self) -> str:
        """The namespace the items live in."""

    def ensure_schema(self, conn: Connection | None = None) -> None:
        """Create or upgrade the item tables (once)."""

    def owner_statements(self, claim_fence: bool) -> dict[str, TextClause]:
        """The owner's fenced statements."""

    def read(self) -> AbstractContextManager[Connection]:
        """A connection for autocommit reads."""

    def transaction(self, timeout: float | None = None) -> AbstractContextManager[Connection]:
        """A connection in a transaction, waiting at most ``timeout`` seconds for locks."""

    def item_from_row(self, partition: str, row: Any) -> Item:
        """An item from a row of the item columns."""


class SQLPartitionLease(PartitionLease):
    """A claim's fenced access to its partition's items in SQL (built by
    :meth:`~metafora.coordinators.sql.gates.store.SQLItemStore.lease`).

    Every write is refused with :class:`~metafora.core.errors.ClaimLost` once the claim is gone:
    a newer claim opened the partition, or (same-database mode) the coordinator no longer
    shows this node holding the task under this token with a live lease.
    """

    def __init__(self, store: LeaseStore, task: Task, node_id: str | None, claim_fence: bool,
                 bound: LeaseBound | None = None) -> None:
        self.store = store
        self.task = task
        self.partition = task.id
        self.token = task.token
        self._node = node_id
        self._sql = store.owner_statements(claim_fence)
        self.claim_fence = claim_fence
        self._bound = bound or LeaseBound()

    @contextmanager
    def _transaction(self, what: str) -> Iterator[Connection]:
        """A fenced write's transaction, bounded by the node's lease on the claim."""
        with self._bound.bounding(self.task, what) as timeout, self.store.transaction(timeout) as tx:
            yield tx

    def _params(self, **extra: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"ns": self.store.namespace, "p": self.partition, "token": self.token}
        if self._node is not None:
            params["node"] = self._node
        params.update(extra)
        return params

    def _lost(self, why: str = "") -> ClaimLost:
        return ClaimLost(
            f"partition {self.partition!r} is no longer held with token {self.token}{why}"
        )

    def take_over(self) -> tuple[int, PartitionStatus]:
        """Take the partition over for this claim (raise its token to ours); its gate and status.

        The items an older claim had taken in its last batch and left without a result
        become orphans (see :meth:`take`), their attempt counted. ClaimLost if a newer claim
        already took it (or the claim is not held).
        """
        self.store.ensure_schema()
        with self._transaction("open the partition") as tx:
            tx.execute(self._sql["ensure"], self._params())
            orphans = int(tx.execute(self._sql["orphans"], self._params()).rowcount)
            row = tx.execute(self._sql["take_over"], self._params()).first()
            if row is None:
                raise self._lost(" (a newer claim took it)")
        if orphans:
            log.warning("partition %s: %d item(s) were in work when their last owner stopped "
                        "without writing them; they run again one at a time", self.partition,
                        orphans, extra={"task": self.partition, "action": "orphans"})
        return int(row[0]), PartitionStatus(row[1])

    def state(self) -> tuple[int, PartitionStatus]:
        """The partition's current gate and status, checking that this claim still holds it."""
        with self.store.read() as conn:
            row = conn.execute(self._sql["state"], self._params()).first()
        if row is None or int(row[2]) != self.token or not int(row[3]):
            raise self._lost()
        return int(row[0]), PartitionStatus(row[1])

    def take(self, gate: int, limit: int, results: Sequence[ItemResult] = (), *,
             max_deaths: int = 3) -> list[Item]:
        """Write ``results`` (items processed at ``gate``, as :meth:`finish`), then take up to
        ``limit`` available items of ``gate`` for processing, in one fenced transaction.

        Items are taken in a batch, in id order, and the batch is recorded on the partition
        row in the same transaction: if this claim ends without writing an item's result
        (its process died), the next claim counts that attempt and treats the item as an
        **orphan** (:meth:`take_over`). When no other item is left, orphans are taken one at a
        time (their attempt recorded on the item), so that only an item that kills its
        process keeps counting deaths; an orphan whose claim died with it taken on its own,
        ``max_deaths`` claims in a row (counting the batch it was first in), is returned
        **failed** instead ("process died while processing", permanent).

        The items are returned as stored, except ``attempts``: the attempts made before
        this one. ClaimLost (nothing written) if the claim is gone.
        """
        with self._transaction("item results and take") as tx:
            # The guard (last, as in every owner write) is also the batch's record.
            self._write(tx, gate, results)
            rows = tx.execute(self._sql["take"], self._params(gate=gate, limit=limit)).fetchall()
            if rows:
                self._guard(tx, "guard_record", gate=gate, first=int(rows[0][0]), last=int(rows[-1][0]))
                return [self.store.item_from_row(self.partition, row) for row in rows]
            self._guard(tx)
            rows = self._take_orphan(tx, gate, max_deaths)
        return [self._alone(self.store.item_from_row(self.partition, row)) for row in rows]

    @staticmethod
    def _alone(item: Item) -> Item:
        """An item taken on its own, as the processor sees it (its attempt counted already)."""
        return item if item.status is ItemStatus.FAILED else replace(item, attempts=item.attempts - 1)

    def _take_orphan(self, tx: Connection, gate: int, max_deaths: int) -> list[Any]:
        died = self._params(gate=gate, max_deaths=max_deaths, died=(
            f"process died while processing this item ({max_deaths} claim(s) in a row ended "
            "without its result; the last one had taken it on its own)"))
        rows = tx.execute(self._sql["died"], died).fetchall()
        if rows:
            log.warning("partition %s: item(s) %s failed: their process died while processing "
                        "them %d time(s) in a row", self.partition, [int(r[0]) for r in rows],
                        max_deaths, extra={"task": self.partition, "action": "item_died"})
            return list(rows)
        return list(tx.execute(self._sql["orphan"], self._params(gate=gate)).fetchall())

    def _guard(self, tx: Connection, statement: str = "guard", **params: Any) -> int:
        """Lock the partition row, proving the fence (last in a write, see the module
        docstring); its gate. ClaimLost if the claim is gone."""
        row = tx.execute(self._sql[statement], self._params(**params)).first()
        if row is None:
            raise self._lost()
        return int(row[0])

    def finish(self, gate: int, outcomes: Sequence[ItemResult], *, release: bool = False) -> int:
        """Write the results of items processed at ``gate`` (and their spawned items) in one
        fenced transaction; returns how many items were written.

        An item changed meanwhile (already written, deleted, retried) is skipped with a
        warning, and so are the items it spawned: calling ``finish`` again after a commit
        whose answer was lost writes nothing twice. ``release``: the claim is letting go of
        the partition cleanly, so its batch record is dropped: the items it took and never
        started are not orphans (no attempt counted). ClaimLost (nothing written) if the
        claim is gone.
        """
        if not outcomes and not release:
            return 0
        with self._transaction("item results") as tx:
            written = self._write(tx, gate, outcomes)
            if release:
                tx.execute(self._sql["give_back"], self._params())
            self._guard(tx, "guard_unrecord" if release else "guard")
        return written

    def _write(self, tx: Connection, gate: int, outcomes: Sequence[ItemResult]) -> int:
        """Write item results inside ``tx`` (guarded by the caller); how many were written."""
        plain: list[dict[str, Any]] = []
        spawning: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        for out in outcomes:
            row = self._params(
                id=out.item_id, gate=gate, status=out.status.value, new_gate=out.gate,
                keep=1 if out.data is None else 0, data=out.data, error=out.error,
                permanent=1 if out.permanent else 0, tries=out.tries,
            )
            if out.spawn:
                spawning.append((row, [self._params(new_gate=n.gate, data=n.data) for n in out.spawn]))
            else:
                plain.append(row)
        written = 0
        if plain:
            written += int(tx.execute(self._sql["result"], plain).rowcount)
        for row, spawns in spawning:  # one by one: spawn only for a result written now
            if int(tx.execute(self._sql["result"], row).rowcount) != 1:
                continue
            written += 1
            if int(tx.execute(self._sql["spawn"], spawns).rowcount) != len(spawns):
                raise self._lost()
        if written != len(outcomes):
            log.warning("partition %s: %d of %d item result(s) not written (the items changed "
                        "meanwhile)", self.partition, len(outcomes) - written, len(outcomes),
                        extra={"task": self.partition, "action": "finish"})
        return written

    def reopen_failed(self, gate: int) -> int:
        """Make the retryable failed items of ``gate`` available again (a partition retry)."""
        with self._transaction("reopen failed items") as tx:
            reopened = int(tx.execute(self._sql["reopen"], self._params(gate=gate)).rowcount)
            self._guard(tx)
            return reopened

    def failed_items(self, gate: int, limit: int = 5) -> list[Item]:
        """A few failed items of ``gate`` (for error messages)."""
        with self.store.read() as conn:
            rows = conn.execute(self._sql["failed_at"], self._params(gate=gate, limit=limit)).fetchall()
        return [self.store.item_from_row(self.partition, row) for row in rows]

    def peek(self, gate: int) -> tuple[int | None, int]:
        """The lowest gate >= ``gate`` with available items (or None), and the failed count."""
        with self.store.read() as conn:
            low, failed = conn.execute(self._sql["work"], self._params(gate=gate)).one()
        return (None if low is None else int(low)), int(failed)

    def advance(self, gate: int, *, move: bool, close: bool) -> Advance:
        """Decide, atomically with any concurrent add, what follows an empty gate ``gate``.

        In one fenced transaction holding the partition row: if ``gate`` has work again or
        failed items, say so; else jump to the lowest gate with available items (``move``)
        -- not one step per poll; else, with no work left, complete the partition
        (``close``) or report it idle.
        """
        with self._transaction("gate advance") as tx:
            current = self._guard(tx)
            if current != gate:
                return Advance("moved", current)  # moved by an operator meanwhile
            low, failed = tx.execute(self._sql["work"], self._params(gate=gate)).one()
            if int(failed):
                return Advance("failed", gate)
            if low is not None and int(low) == gate:
                return Advance("work", gate)
            if low is not None:
                if not move:
                    return Advance("waiting", gate)
                tx.execute(self._sql["move"], self._params(new_gate=int(low)))
                return Advance("moved", int(low))
            if close:
                tx.execute(self._sql["complete"], self._params())
                return Advance("completed", gate)
            return Advance("idle", gate)
