"""What a SQL coordinator tells balancers of the live nodes: counts, weights, frozen flags,
capacities, labels and the claimable count.

The balancers' counts are what each node published with its heartbeat (and within a second
of a change, see :class:`~metafora.coordinators.sql.lease.Lease`): one row per
node, so their cost follows the number of nodes, never the tasks held. Exact counts from the
claims (``node_counts``) are read on demand only (operators' views).

A balancer asks ``active_task_count()`` and then the weights, frozen nodes, capacities and
claimable count: the count statements return those columns too, and :class:`NodeReads`
keeps what they said (:class:`~metafora.coordinators.members.SeenWithCounts`) so the asks
that follow cost no second read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from metafora.coordinators.members import SeenWithCounts, stored_capacity, stored_weight
from metafora.coordinators.sql.store import Database
from metafora.core.errors import MetaforaError
from metafora.core.task import decode_labels

__all__ = ["CLAIMABLE_CAP_MIN", "NodeReads", "NodeViews", "claimable_cap"]

log = logging.getLogger(__name__)

CLAIMABLE_CAP_MIN = 10_000
"""The claimable count is read up to at least this many rows (see :func:`claimable_cap`)."""


def claimable_cap(held: int) -> int:
    """How many claimable rows the balancers' read counts at most, ``held`` tasks being held.

    Shares depend on the claimable count only while it is comparable with what the cluster
    holds: beyond twice that (or ``CLAIMABLE_CAP_MIN``) every node's share is far above what
    it holds whatever the exact number, and claiming raises ``held`` (so the cap) before the
    next read. An idle cluster has no pending rows to count at all.
    """
    return max(CLAIMABLE_CAP_MIN, 2 * held)


class NodeReads:
    """The live nodes as one SQL store says them, read together and kept a moment."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._seen = SeenWithCounts()
        self._last: tuple[dict[str, float], frozenset[str], dict[str, int]] = ({}, frozenset(), {})

    def counts(self, statement: str) -> dict[str, int]:
        """Node id -> tasks it holds, by ``statement`` (``node_counts``, ``active_counts``)."""
        return {str(r[0]): int(r[1]) for r in self._read(statement)}

    def _read(self, statement: str) -> list[Any]:
        """The node rows of ``statement`` (id, [count,] weight, frozen, capacity); what they
        say is kept for the asks that follow. ``active_counts`` also counts the claimable
        tasks, in the same read transaction (see :func:`claimable_cap`)."""
        self._db.ensure_schema()
        claimable = None
        with self._db.read() as conn:
            rows = list(self._db.execute(conn, statement, {}).fetchall())
            nodes = [r for r in rows if r[0] is not None]
            # active_counts: its NULL-id row counts the claimable tasks
            claimable = next((int(r[1]) for r in rows if r[0] is None), None)
            if statement == "published_counts":
                cap = claimable_cap(sum(max(0, int(r[1] or 0)) for r in nodes))
                claimable = int(self._db.execute(conn, "claimable_capped", {"cap": cap}).scalar()
                                or 0)
        weights = {str(r[0]): stored_weight(r[-3], str(r[0])) for r in nodes}
        frozen = frozenset(str(r[0]) for r in nodes if r[-2])
        capacities = {str(r[0]): c for r in nodes if (c := stored_capacity(r[-1])) is not None}
        self._seen.seen(weights, frozen, claimable, capacities)
        self._last = (weights, frozen, capacities)
        return nodes

    def claimable(self) -> int | None:
        """Tasks claimable at the last ``active_counts`` read (within a second; else None)."""
        return self._seen.claimable()

    def weights(self) -> dict[str, float]:
        """Live node -> its weight: what the last count read saw (within a second), else read
        (with the frozen flags and capacities, for the asks that follow)."""
        found = self._seen.weights()
        return found if found is not None else self._read_members()[0]

    def frozen(self) -> frozenset[str]:
        """Live nodes that reported themselves frozen (read as :meth:`weights` is)."""
        found = self._seen.frozen()
        return found if found is not None else self._read_members()[1]

    def capacities(self) -> dict[str, int]:
        """Live nodes that published a capacity -> it (read as :meth:`weights` is)."""
        found = self._seen.capacities()
        return found if found is not None else self._read_members()[2]

    def _read_members(self) -> tuple[dict[str, float], frozenset[str], dict[str, int]]:
        """Read the live nodes (no counts): their weights, frozen flags and capacities."""
        self._read("node_members")
        return self._last

    def labels(self) -> dict[str, dict[str, str]]:
        """Live node -> its placement labels (labels written around metafora: none)."""
        self._db.ensure_schema()
        with self._db.read() as conn:
            rows: Sequence[Any] = self._db.execute(conn, "node_labels", {}).fetchall()
        labels: dict[str, dict[str, str]] = {}
        for node_id, raw in rows:
            try:
                labels[str(node_id)] = decode_labels(raw, f"stored labels of node {node_id!r}")
            except MetaforaError as exc:
                log.warning("%s", exc, extra={"node": str(node_id)})
                labels[str(node_id)] = {}
        return labels


class NodeViews:
    """A coordinator's answers about the live nodes, from its :class:`NodeReads` (mixed
    into :class:`~metafora.coordinators.sql.coordinator.SQLCoordinator`, before the
    contract's defaults)."""

    _nodes: NodeReads

    def _check_open(self) -> None:
        raise NotImplementedError

    # -- cluster state (one read of the nodes answers the asks that follow: NodeReads) -------

    def node_task_count(self) -> dict[str, int]:
        self._check_open()
        return self._nodes.counts("node_counts")

    def active_task_count(self) -> dict[str, int]:
        self._check_open()
        return self._nodes.counts("active_counts")

    publishes_counts = True  # metafora_nodes.task_count, written with each renewal

    def published_task_count(self) -> dict[str, int]:
        """The counts the active nodes published with their renewals (one row per node, a
        moment late; the cluster's view on ``/metrics``), with the claimable count."""
        self._check_open()
        return self._nodes.counts("published_counts")

    def claimable_count(self) -> int | None:
        """Tasks claimable at the last :meth:`active_task_count` (read with the counts, within
        a second; None otherwise)."""
        return self._nodes.claimable()

    def node_weights(self) -> dict[str, float]:
        """Live node -> its weight (from the last count read within a second, else read)."""
        self._check_open()
        return self._nodes.weights()

    def frozen_nodes(self) -> frozenset[str]:
        """Live nodes that reported themselves frozen (read as :meth:`node_weights` is)."""
        self._check_open()
        return self._nodes.frozen()

    def node_capacities(self) -> dict[str, int]:
        """Live nodes that published a capacity -> it (read as :meth:`node_weights` is)."""
        self._check_open()
        return self._nodes.capacities()

    def node_labels(self) -> dict[str, dict[str, str]]:
        self._check_open()
        return self._nodes.labels()
