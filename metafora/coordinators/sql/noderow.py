"""A node's row in ``metafora_nodes``: its registration, and what its heartbeat writes and reads.

:class:`~metafora.coordinators.sql.lease.Lease` keeps the node's lease in memory (the claims,
the fencing deadline, the heartbeat and watchdog threads); this is the one place that speaks
to the store about the node's row: taking the registration (freeing an earlier one's claims),
renewing it, publishing the count of claims, and reading the pokes and the claims' summary.
It also keeps what every registration and renewal publishes: the frozen flag, the labels, the
weight and the capacity.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from metafora.coordinators.sql.store import Database

__all__ = ["NodeRow", "labels_json"]

log = logging.getLogger("metafora.coordinators.sql.lease")


class NodeRow:
    """This node's row: its statements, and the values its registration publishes."""

    def __init__(self, db: Database, node_id: str) -> None:
        self._db = db
        self.node_id = node_id
        self.frozen: bool | None = None  # published with every registration
        self.labels: Mapping[str, str] = {}  # likewise (placement labels, from register)
        self.weight = 1.0  # likewise (the node's weight, from register)
        self.capacity: Callable[[], int | None] = lambda: None  # published at every renewal

    def labels_json(self) -> str | None:
        """The node's labels as stored (JSON object text; None when it has none)."""
        return labels_json(self.labels)

    def register(self, session: str, first: bool) -> bool:
        """Take (or take back) the registration under ``session``; False if the id is live
        elsewhere. Frees the claims of any earlier registration of this id; ``first`` (init)
        also drops commands queued for a dead earlier process."""
        node = self.node_id
        params: dict[str, Any] = {
            "node": node, "session": session, "ttl": self._db.config.lease_ttl,
            "host": socket.gethostname(), "pid": os.getpid(), "frozen": self.frozen,
            "labels": self.labels_json(), "weight": self.weight, "capacity": self.capacity(),
        }
        with self._db.transaction() as conn:
            if self._db.execute(conn, "register", params).first() is None:
                return False
            freed = self._db.execute(conn, "free_own", {"node": node}).fetchall()
            if freed:
                self._db.next_token_used(conn, max(int(row[0]) for row in freed))
                log.info("node %s re-registered; %d claims of its earlier registration are "
                         "pending again", node, len(freed), extra={"node": node})
            if first:
                self._db.execute(conn, "drop_commands", {"node": node})
        return True

    def renew(self, session: str | None, count: int) -> Any:
        """One renewal publishing ``count`` claims: the row (pokes, then the membership
        fingerprint), or None when the store no longer has this registration live."""
        params = {"node": self.node_id, "session": session, "ttl": self._db.config.lease_ttl,
                  "count": count, "capacity": self.capacity()}
        with self._db.hot() as cur:
            return cur.one("heartbeat", params)

    def publish(self, session: str, count: int) -> None:
        """Publish the node's count of claims between renewals."""
        with self._db.write() as conn:
            self._db.execute(conn, "publish_count", {"node": self.node_id, "session": session,
                                                     "count": count})

    def pokes(self) -> Any:
        """The row's pokes, then the membership fingerprint (None: no registration)."""
        with self._db.read() as conn:
            return self._db.execute(conn, "node_pokes", {"node": self.node_id}).first()

    def summary(self) -> Any:
        """The count and token sum of the claims the store has for this node, then the
        membership fingerprint."""
        with self._db.read() as conn:
            return self._db.execute(conn, "held_summary", {"node": self.node_id}).one()

    def claims(self) -> dict[str, int]:
        """Task id -> token of every claim the store has for this node."""
        with self._db.read() as conn:
            rows = self._db.execute(conn, "held_list", {"node": self.node_id}).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}


def labels_json(labels: Mapping[str, str]) -> str | None:
    """Labels as stored (JSON object text; None for none)."""
    return json.dumps(dict(labels), separators=(",", ":"), sort_keys=True) if labels else None
