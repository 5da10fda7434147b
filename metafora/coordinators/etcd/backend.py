"""The etcd store's entry in the stores' registry (``etcd://``, ``etcds://``)."""

from __future__ import annotations

from typing import Any

from metafora.contracts.backends import StoreBackend
from metafora.coordinators.etcd import open_client, open_coordinator
from metafora.coordinators.etcd.client import EtcdClient
from metafora.coordinators.etcd.config import ETCD_FENCING, LEASE_TTL
from metafora.coordinators.etcd.coordinator import EtcdCoordinator
from metafora.core.config import StoreURL

__all__ = ["BACKEND", "EtcdBackend"]


class EtcdBackend(StoreBackend):
    """etcd v3 (its driver, ``etcd-sdk-python`` and grpc, is imported with this module: a
    missing one fails the entry point's load, which names the ``etcd`` extra)."""

    name = "etcd"
    lease_ttl = LEASE_TTL
    fencing = ETCD_FENCING
    features = {
        "state_store": "metafora.coordinators.etcd.states:EtcdStateStore",
        "task_commands": "metafora.coordinators.etcd.states:EtcdTaskCommands",
    }

    def open_coordinator(self, url: StoreURL, node_id: str, options: dict[str, Any]) -> EtcdCoordinator:
        return open_coordinator(url, node_id, options)

    def open_client(self, url: StoreURL, options: dict[str, Any]) -> EtcdClient:
        return open_client(url, options)


BACKEND = EtcdBackend()
"""Registered under ``etcd`` and ``etcds`` in the entry-point group ``metafora.stores``."""
