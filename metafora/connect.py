"""Open a coordinator or a client from a store URL (dispatch on the scheme), and the backend
table: which store package implements what (:func:`implementation`), for the stores and for
the features that keep their storage in them (the state machine, the gated partitions)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any, Protocol, cast

from metafora.client import Client
from metafora.config import StoreURL, parse_store_url
from metafora.coordinator import Coordinator
from metafora.errors import ConfigError, InvalidTaskId
from metafora.task import validate_task_id

if TYPE_CHECKING:
    from metafora.aio import AsyncClient

__all__ = [
    "DEFAULT_URL",
    "ENV_URL",
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

DEFAULT_URL = "sqlite:///metafora.db"
ENV_URL = "METAFORA_URL"

# The backend table: each store, and where its implementations live ("module:name"): the
# module of its coordinator and client hooks (open_coordinator, open_client), and the storage
# of the features, which the store package owns too (each class is built with .of(owner) or,
# for an item store, from a URL). A store without an entry for a feature does not keep it.
_STORES: dict[str, dict[str, str]] = {
    "memory": {
        "hooks": "metafora.coordinators.memory",
        "state_store": "metafora.coordinators.memory.states:MemoryStateStore",
        "task_commands": "metafora.coordinators.memory.states:MemoryTaskCommands",
    },
    "sql": {
        "hooks": "metafora.coordinators.sql",
        "state_store": "metafora.coordinators.sql.states:SQLStateStore",
        "task_commands": "metafora.coordinators.sql.states:SQLTaskCommands",
        "item_store": "metafora.coordinators.sql.gates.store:SQLItemStore",
    },
    "etcd": {
        "hooks": "metafora.coordinators.etcd",
        "state_store": "metafora.coordinators.etcd.states:EtcdStateStore",
        "task_commands": "metafora.coordinators.etcd.states:EtcdTaskCommands",
    },
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


def _scheme(url: StoreURL) -> tuple[str, str | None]:
    entry = _SCHEMES.get(url.scheme)
    if entry is None:
        known = ", ".join(sorted(_SCHEMES))
        raise ConfigError(f"unknown store scheme {url.scheme!r} in {url} (known: {known})")
    return entry


def _backend(url: StoreURL) -> _Backend:
    store, extra = _scheme(url)
    try:
        module = importlib.import_module(_STORES[store]["hooks"])
        driver = _DRIVERS.get(extra or "")
        if driver is not None and importlib.util.find_spec(driver) is None:
            raise ModuleNotFoundError(f"No module named {driver!r}")
    except ImportError as exc:
        hint = f" (pip install 'metafora-cluster[{extra}]')" if extra else ""
        raise ConfigError(
            f"the {url.scheme} store is not available: {exc}{hint}"
        ) from exc
    return cast(_Backend, module)


def store_of(owner: object) -> str:
    """The store a coordinator or client belongs to (its
    :attr:`~metafora.coordinator.Coordinator.backend`, a key of the backend table); ConfigError
    for one of no built-in store."""
    store = type(owner).backend if isinstance(owner, Coordinator | Client) else ""
    if store not in _STORES:
        raise ConfigError(f"{type(owner).__name__} belongs to no built-in store (metafora.connect "
                          f"knows {', '.join(_STORES)})")
    return store


def store_of_url(url: str | None) -> tuple[StoreURL, str]:
    """The parsed ``url`` (default: :func:`default_url`) and the store it names; ConfigError
    for an unknown scheme."""
    parsed = parse_store_url(url or default_url())
    return parsed, _scheme(parsed)[0]


def implementation(store: str, feature: str) -> Any:
    """The class that implements ``feature`` (``"state_store"``, ``"task_commands"``,
    ``"item_store"``) in ``store``, from the backend table; None when the store keeps none."""
    target = _STORES[store].get(feature)
    if target is None:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


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


def open_async_client(url: str | None = None, **options: Any) -> AsyncClient:
    """Open an async client for ``url`` (default: :func:`default_url`): the client's verbs as
    coroutines, ``async with open_async_client(url) as client:``.

    PostgreSQL runs on an async driver end to end; SQLite, etcd and memory run the sync
    client's calls on a bounded pool of ``threads`` worker threads (option, default 8). See
    :mod:`metafora.aio` and docs/submit.md.
    """
    from metafora.aio import DEFAULT_THREADS, open_async

    threads = options.pop("threads", DEFAULT_THREADS)
    return open_async(open_client(url, **options), threads)
