"""Open a coordinator or a client from a store URL: the scheme names the store through the
entry-point group ``metafora.stores`` (:mod:`metafora.contracts.backends`, whose names are re-exported
here)."""

from __future__ import annotations

import os
import socket
import uuid
from typing import TYPE_CHECKING, Any

from metafora.contracts.backends import (
    DEFAULT_URL,
    ENV_URL,
    backend_of,
    default_url,
    implementation,
    store_of,
    store_of_url,
)
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError, InvalidTaskId
from metafora.core.task import validate_task_id

if TYPE_CHECKING:
    from metafora.contracts.aio import AsyncClient

__all__ = [
    "DEFAULT_URL",
    "ENV_URL",
    "NODE_ID_ENV",
    "default_url",
    "implementation",
    "new_node_id",
    "open_async_client",
    "open_client",
    "open_coordinator",
    "store_of",
    "store_of_url",
    "validate_node_id",
]

NODE_ID_ENV = "METAFORA_NODE_ID"
"""The environment variable naming this node when no node id is given."""


def new_node_id() -> str:
    """A fresh node id: ``hostname-<8 hex>``."""
    host = socket.gethostname().split(".")[0] or "node"
    return f"{host}-{uuid.uuid4().hex[:8]}"


def validate_node_id(node_id: object) -> str:
    """Node ids follow the task id rules (non-empty, <= 256 chars, no control characters)."""
    try:
        return validate_task_id(node_id)
    except InvalidTaskId as exc:
        raise ConfigError(str(exc).replace("task id", "node id")) from None


def open_coordinator(
    url: str | None = None, node_id: str | None = None, **options: Any
) -> Coordinator:
    """Open the coordinator for ``url`` (default: :func:`default_url`) as node ``node_id``.

    Without ``node_id``, ``METAFORA_NODE_ID`` names the node when it is set (a stable id: a
    StatefulSet pod's name, a systemd instance), else a fresh id is made up
    (:func:`new_node_id`; ``Coordinator.node_id_generated`` then says so).
    ``options`` override the URL's query options (``namespace``, ``lease_ttl``, ...).
    Nothing touches the store until ``Coordinator.init`` (called by the Consumer).
    """
    parsed = parse_store_url(url or default_url())
    if node_id is None and os.environ.get(NODE_ID_ENV):
        node_id = os.environ[NODE_ID_ENV]
    node = validate_node_id(node_id) if node_id is not None else new_node_id()
    coordinator = backend_of(parsed).open_coordinator(parsed, node, options)
    coordinator.node_id_generated = node_id is None
    return coordinator


def open_client(url: str | None = None, **options: Any) -> Client:
    """Open an operator client for ``url`` (default: :func:`default_url`)."""
    parsed = parse_store_url(url or default_url())
    return backend_of(parsed).open_client(parsed, options)


def open_async_client(url: str | None = None, **options: Any) -> AsyncClient:
    """Open an async client for ``url`` (default: :func:`default_url`): the client's verbs as
    coroutines, ``async with open_async_client(url) as client:``.

    PostgreSQL runs on an async driver end to end; SQLite, etcd and memory run the sync
    client's calls on a bounded pool of ``threads`` worker threads (option, default 8). See
    :mod:`metafora.contracts.aio` and docs/submit.md.
    """
    from metafora.contracts.aio import DEFAULT_THREADS, ThreadedAsyncClient

    threads = options.pop("threads", DEFAULT_THREADS)
    parsed = parse_store_url(url or default_url())
    backend = backend_of(parsed)
    client = backend.open_client(parsed, options)
    # the store's own async client (PostgreSQL's), else the sync client's calls on threads
    native = backend.open_async_client(client, threads)
    return native or ThreadedAsyncClient(client, threads, backend)
