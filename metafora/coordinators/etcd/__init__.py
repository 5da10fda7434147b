"""etcd v3 coordinator and client (``etcd://host:2379[,host:2379...]/NAMESPACE``).

``etcds://`` uses TLS (options ``ca_cert``, ``cert_key``, ``cert_cert``); ``user:password@``
in the URL enables etcd authentication. Other options: ``lease_ttl`` (whole seconds, >= 2,
default 30), ``poll_interval`` (safety-net re-list, default 30 s), ``timeout`` (one request,
default 5 s), ``namespace`` (the URL path wins). Needs ``pip install 'metafora-cluster[etcd]'``
(``etcd-sdk-python`` and ``protobuf>=5.27.2``).

Key layout: :mod:`metafora.coordinators.etcd.layout`. Lease, watch and self-fencing:
:mod:`metafora.coordinators.etcd.coordinator`. The state machine's states and task commands:
:mod:`metafora.coordinators.etcd.states`.
"""

from __future__ import annotations

from typing import Any

from metafora.coordinators.etcd.client import EtcdClient
from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.coordinator import EtcdCoordinator
from metafora.core.config import StoreURL

__all__ = ["EtcdClient", "EtcdConfig", "EtcdCoordinator", "open_client", "open_coordinator"]


def open_coordinator(url: StoreURL, node_id: str, options: dict[str, Any]) -> EtcdCoordinator:
    """Backend hook for :func:`metafora.open_coordinator` (touches nothing until ``init``)."""
    return EtcdCoordinator(EtcdConfig.from_url(url, dict(options)), node_id)


def open_client(url: StoreURL, options: dict[str, Any]) -> EtcdClient:
    """Backend hook for :func:`metafora.open_client` (connects on first use)."""
    return EtcdClient(EtcdConfig.from_url(url, dict(options)))
