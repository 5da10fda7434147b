"""Wake-ups of the item store: who in this process waits for news of which partition.

On PostgreSQL news also arrives by NOTIFY on the namespace's :func:`items_channel`
(``i<partition>`` payloads); on SQLite, which has no push, writers in this process ring the
:class:`Hub` at once and handlers also poll.
"""

from __future__ import annotations

import hashlib
import os
import threading

from metafora.coordinators.sql.shared import SQLConfig

__all__ = ["Hub", "hub_for", "items_channel"]


def items_channel(namespace: str) -> str:
    """The PostgreSQL NOTIFY channel of a namespace's items (``i<partition>`` payloads)."""
    return "metafora_items_" + hashlib.sha1(namespace.encode()).hexdigest()[:16]


class Hub:
    """Who waits for news of which partition, for one store in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}

    def subscribe(self, partition: str, event: threading.Event) -> None:
        """Set ``event`` on news of ``partition``."""
        with self._lock:
            self._waiters.setdefault(partition, set()).add(event)

    def unsubscribe(self, partition: str, event: threading.Event) -> None:
        """Stop setting ``event``."""
        with self._lock:
            waiting = self._waiters.get(partition)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[partition]

    def notify(self, partition: str) -> None:
        """News of ``partition``: wake its waiters."""
        with self._lock:
            events = list(self._waiters.get(partition, ()))
        for event in events:
            event.set()

    def notify_all(self) -> None:
        """Wake every waiter (news may have been missed, e.g. while reconnecting)."""
        with self._lock:
            events = [e for waiting in self._waiters.values() for e in waiting]
        for event in events:
            event.set()


_HUBS: dict[tuple[str, ...], Hub] = {}
_HUBS_LOCK = threading.Lock()


def hub_for(config: SQLConfig) -> Hub:
    """The hub of the items in ``config``'s database and namespace, in this process."""
    if config.kind == "sqlite":
        where = os.path.realpath(config.path or "")
    else:
        where = ",".join(f"{h}:{p or 5432}" for h, p in config.url.hosts) + config.url.path
    key = (config.kind, where, config.namespace)
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None:
            hub = _HUBS[key] = Hub()
        return hub
