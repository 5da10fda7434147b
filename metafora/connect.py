"""Open a coordinator or a client from a store URL (dispatch on the scheme)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import uuid
from types import ModuleType
from typing import Any, Protocol, cast

from metafora.config import StoreURL, parse_store_url
from metafora.coordinator import Client, Coordinator
from metafora.errors import ConfigError, InvalidTaskId
from metafora.task import validate_task_id

__all__ = [
    "DEFAULT_URL",
    "ENV_URL",
    "default_url",
    "new_node_id",
    "open_client",
    "open_coordinator",
    "storage_for_url",
    "storage_of",
    "validate_node_id",
]

DEFAULT_URL = "sqlite:///metafora.db"
ENV_URL = "METAFORA_URL"

# The backend table: store -> the module of its hooks (its package). Each store package owns
# all of its storage and offers it through these hooks: open_coordinator, open_client, and for
# the features state_store, task_commands (the state machine) and item_store_type (the gated
# partitions' items, SQL only).
_STORES: dict[str, str] = {
    "memory": "metafora.coordinators.memory",
    "sql": "metafora.coordinators.sql",
    "etcd": "metafora.coordinators.etcd",
}

# scheme -> (store, pip extra that provides its driver)
_SCHEMES: dict[str, tuple[str, str | None]] = {
    "memory": ("memory", None),
    "sqlite": ("sql", None),
    "postgresql": ("sql", "postgres"),
    "postgres": ("sql", "postgres"),
    "postgresql+psycopg": ("sql", "postgres"),
    "etcd": ("etcd", "etcd"),
    "etcds": ("etcd", "etcd"),
}

# pip extra -> the driver module a store module imports only when it connects
_DRIVERS: dict[str, str] = {"postgres": "psycopg"}


class _Backend(Protocol):
    def open_coordinator(self, url: StoreURL, node_id: str, options: dict[str, Any]) -> Coordinator:
        ...

    def open_client(self, url: StoreURL, options: dict[str, Any]) -> Client:
        ...


def default_url() -> str:
    """``$METAFORA_URL`` if set, else the embedded SQLite default ``sqlite:///metafora.db``."""
    return os.environ.get(ENV_URL) or DEFAULT_URL


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


def _backend(url: StoreURL) -> _Backend:
    entry = _SCHEMES.get(url.scheme)
    if entry is None:
        known = ", ".join(sorted(_SCHEMES))
        raise ConfigError(f"unknown store scheme {url.scheme!r} in {url} (known: {known})")
    store, extra = entry
    try:
        module = _load(store)
        driver = _DRIVERS.get(extra or "")
        if driver is not None and importlib.util.find_spec(driver) is None:
            raise ModuleNotFoundError(f"No module named {driver!r}")
    except ImportError as exc:
        hint = f" (pip install 'metafora-cluster[{extra}]')" if extra else ""
        raise ConfigError(
            f"the {url.scheme} store is not available: {exc}{hint}"
        ) from exc
    return cast(_Backend, module)


def _load(store: str) -> ModuleType:
    return importlib.import_module(_STORES[store])


def storage_of(owner: object) -> ModuleType:
    """The hooks of the store a coordinator or client belongs to (its
    :attr:`~metafora.coordinator.Coordinator.backend` in the backend table): the features call
    them for their storage beside it. ConfigError for one of no built-in store."""
    store = type(owner).backend if isinstance(owner, Coordinator | Client) else ""
    if store not in _STORES:
        raise ConfigError(f"{type(owner).__name__} belongs to no built-in store (metafora.connect "
                          f"knows {', '.join(_STORES)})")
    return _load(store)


def storage_for_url(url: str | None) -> tuple[StoreURL, ModuleType]:
    """The parsed ``url`` (default: :func:`default_url`) and the hooks of its store (as
    :func:`storage_of`); ConfigError for an unknown scheme or a store not installed."""
    parsed = parse_store_url(url or default_url())
    return parsed, cast(ModuleType, _backend(parsed))


def open_coordinator(
    url: str | None = None, node_id: str | None = None, **options: Any
) -> Coordinator:
    """Open the coordinator for ``url`` (default: :func:`default_url`) as node ``node_id``.

    ``options`` override the URL's query options (``namespace``, ``lease_ttl``, ...).
    Nothing touches the store until ``Coordinator.init`` (called by the Consumer).
    """
    parsed = parse_store_url(url or default_url())
    node = validate_node_id(node_id) if node_id is not None else new_node_id()
    return _backend(parsed).open_coordinator(parsed, node, options)


def open_client(url: str | None = None, **options: Any) -> Client:
    """Open an operator client for ``url`` (default: :func:`default_url`)."""
    parsed = parse_store_url(url or default_url())
    return _backend(parsed).open_client(parsed, options)
