"""The memory store's entry in the stores' registry (``memory://NAME``)."""

from __future__ import annotations

from typing import Any

from metafora.contracts.backends import StoreBackend
from metafora.coordinators.memory.client import MemoryClient, open_client
from metafora.coordinators.memory.coordinator import MemoryCoordinator, open_coordinator
from metafora.coordinators.memory.store import LEASE_TTL
from metafora.core.config import StoreURL

__all__ = ["BACKEND", "MemoryBackend"]


class MemoryBackend(StoreBackend):
    """The in-process store: no lease expires by the clock, so no fencing rule."""

    name = "memory"
    lease_ttl = LEASE_TTL
    features = {
        "state_store": "metafora.coordinators.memory.states:MemoryStateStore",
        "task_commands": "metafora.coordinators.memory.states:MemoryTaskCommands",
    }

    def open_coordinator(self, url: StoreURL, node_id: str, options: dict[str, Any]) -> MemoryCoordinator:
        return open_coordinator(url, node_id, options)

    def open_client(self, url: StoreURL, options: dict[str, Any]) -> MemoryClient:
        return open_client(url, options)


BACKEND = MemoryBackend()
"""Registered under ``memory`` in the entry-point group ``metafora.stores``."""
