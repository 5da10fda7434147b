"""The cluster's view on a node's ``/metrics``: the signal a platform scales workers by.

A consumer serving ``/metrics`` runs a :class:`ClusterGauges` side loop that reads, every
``every`` seconds (default 5) and never per scrape, through the same store reads the
balancer uses (:class:`~metafora.contracts.balancer.ClusterState`, O(nodes)):

- ``metafora_cluster_pending_tasks``: tasks claimable now (pending and due, or held by a
  dead node) -- :meth:`~metafora.contracts.balancer.ClusterState.claimable_count`, read with the
  active counts; a store that does not say falls back to an indexed count of pending rows;
- ``metafora_cluster_held_tasks``: tasks held by live nodes that are not leaving (the counts
  they published, ``active_task_count``; on a client, which has no published view, the count
  of the claims);
- ``metafora_cluster_capacity``: the sum of the capacities the live nodes published (their
  ``max_tasks`` or thread cap; a node of an earlier release that publishes none adds 0);
- ``metafora_cluster_nodes``: live nodes.

Each carries the label ``namespace``. A scrape renders the last snapshot (or nothing before
the first read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from metafora.core.clock import Clock
from metafora.core.errors import CoordinatorClosed, MetaforaError

if TYPE_CHECKING:
    from metafora.contracts.client import Client
    from metafora.contracts.coordinator import Coordinator
    from metafora.core.retention import Retention

__all__ = ["CLUSTER_READ_EVERY", "ClusterGauges", "ClusterSnapshot", "backlog_line", "read_backlog",
           "read_cluster"]

log = logging.getLogger("metafora.cluster_metrics")  # its name before the move (users' log config names it)

CLUSTER_READ_EVERY = 5.0
"""Seconds between two reads of the cluster's view (whatever the scrape rate)."""


@dataclass(frozen=True)
class ClusterSnapshot:
    """One read of the cluster's backlog and room."""

    namespace: str
    pending: int
    held: int
    capacity: int
    nodes: int

    def describe(self) -> str:
        """``backlog 12 pending, 40 held / capacity 64 on 4 nodes`` (``top``, dashboard)."""
        return (f"backlog {self.pending} pending, {self.held} held / capacity {self.capacity}"
                f" on {self.nodes} node{'' if self.nodes == 1 else 's'}")


def read_cluster(store: Coordinator | Client) -> ClusterSnapshot:
    """The cluster's view, through the balancer's reads (see the module docstring)."""
    # The counts the nodes published (a node's count is up to a second late), read with the
    # claimable count; never a count of the claims themselves, which grows with the tasks.
    published = getattr(store, "published_task_count", None)  # SQL: one row per node
    held = published() if published is not None else store.active_task_count()
    pending = store.claimable_count()
    if pending is None:
        pending = store.pending_count()
    capacities = store.node_capacities()
    capacity = sum(cap for node, cap in capacities.items() if node in held)
    return ClusterSnapshot(store.namespace_label(), pending, sum(held.values()), capacity,
                           len(held))


def read_backlog(client: Client | Coordinator) -> tuple[ClusterSnapshot | None, Retention | None]:
    """The cluster's backlog and capacity, and the retention policy (None where the store
    does not keep them)."""
    try:
        cluster: ClusterSnapshot | None = read_cluster(client)
    except NotImplementedError:
        cluster = None
    try:
        retention: Retention | None = client.retention()
    except NotImplementedError:
        retention = None
    return cluster, retention


def backlog_line(cluster: ClusterSnapshot | None, retention: Retention | None) -> str:
    """``backlog 6 pending, 4 held / capacity 64 on 2 nodes — retention done 7d, ...``."""
    parts = []
    if cluster is not None:
        parts.append(cluster.describe())
    if retention is not None:
        parts.append(f"retention {retention.describe()}")
    return " — ".join(parts)


class ClusterGauges:
    """A consumer's side loop keeping the last :class:`ClusterSnapshot`."""

    def __init__(self, store: Coordinator, clock: Clock, *, every: float = CLUSTER_READ_EVERY,
                 logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self._store = store
        self._on_error = on_error  # counts an error of the loop (``cluster-metrics``)
        self._clock = clock
        self.every = every
        self._log = logger or log
        self._stop = threading.Event()
        self.reads = 0
        """Reads done (for tests: the cost does not follow the scrapes)."""
        self.last: ClusterSnapshot | None = None

    def stop(self) -> None:
        """End :meth:`run` soon."""
        self._stop.set()

    def run(self) -> None:
        """Read every ``every`` seconds until :meth:`stop`; errors keep the last snapshot."""
        warned = False
        while not self._stop.is_set():
            try:
                self.last = read_cluster(self._store)
                self.reads += 1
                warned = False
            except CoordinatorClosed:
                return
            except NotImplementedError:
                return
            except MetaforaError as exc:
                if self._on_error is not None:
                    self._on_error("cluster-metrics")
                if not warned:
                    self._log.warning("cluster metrics: %s (keeping the last read)", exc,
                                      extra={"action": "metrics"})
                warned = True
            self._clock.wait(self._stop, self.every)
