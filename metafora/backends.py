"""The backend table: which store package implements what.

Each store (``memory``, ``sql``, ``etcd``) names the module of its coordinator and client hooks
and the classes of the features whose storage it owns (the state machine, the gated
partitions); each URL scheme names its store and the pip extra of its driver. ``connect``
opens coordinators and clients through it; features find their store's implementation here
(:func:`implementation`), never by importing a store package themselves. This module imports
no coordinator, client or feature, so anything may import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

from metafora.config import StoreURL, parse_store_url
from metafora.errors import ConfigError

__all__ = [
    "DEFAULT_URL",
    "DRIVERS",
    "ENV_URL",
    "SCHEMES",
    "STORES",
    "default_url",
    "hooks_of",
    "implementation",
    "scheme_of",
    "store_of",
    "store_of_url",
]

DEFAULT_URL = "sqlite:///metafora.db"
ENV_URL = "METAFORA_URL"

# The backend table: each store, and where its implementations live ("module:name"): the
# module of its coordinator and client hooks (open_coordinator, open_client), and the storage
# of the features, which the store package owns too (each class is built with .of(owner) or,
# for an item store, from a URL). A store without an entry for a feature does not keep it.
STORES: dict[str, dict[str, str]] = {
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
SCHEMES: dict[str, tuple[str, str | None]] = {
    "memory": ("memory", None),
    "sqlite": ("sql", None),
    "postgresql": ("sql", "postgres"),
    "postgres": ("sql", "postgres"),
    "postgresql+psycopg": ("sql", "postgres"),
    "etcd": ("etcd", "etcd"),
    "etcds": ("etcd", "etcd"),
}

# pip extra -> the driver module a store module imports only when it connects
DRIVERS: dict[str, str] = {"postgres": "psycopg"}


def default_url() -> str:
    """``$METAFORA_URL`` if set, else the embedded SQLite default ``sqlite:///metafora.db``."""
    return os.environ.get(ENV_URL) or DEFAULT_URL


def scheme_of(url: StoreURL) -> tuple[str, str | None]:
    entry = SCHEMES.get(url.scheme)
    if entry is None:
        known = ", ".join(sorted(SCHEMES))
        raise ConfigError(f"unknown store scheme {url.scheme!r} in {url} (known: {known})")
    return entry


def store_of(owner: object) -> str:
    """The store a coordinator or client belongs to (its
    :attr:`~metafora.coordinator.Coordinator.backend`, a key of the backend table); ConfigError
    for one of no built-in store."""
    store = getattr(type(owner), "backend", "")  # Coordinator.backend, Client.backend
    if store not in STORES:
        raise ConfigError(f"{type(owner).__name__} belongs to no built-in store (metafora.backends "
                          f"knows {', '.join(STORES)})")
    return store


def store_of_url(url: str | None) -> tuple[StoreURL, str]:
    """The parsed ``url`` (default: :func:`default_url`) and the store it names; ConfigError
    for an unknown scheme."""
    parsed = parse_store_url(url or default_url())
    return parsed, scheme_of(parsed)[0]


def implementation(store: str, feature: str) -> Any:
    """The class that implements ``feature`` (``"state_store"``, ``"task_commands"``,
    ``"item_store"``) in ``store``, from the backend table; None when the store keeps none."""
    target = STORES[store].get(feature)
    if target is None:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def hooks_of(url: StoreURL) -> ModuleType:
    """The hooks module of the store ``url`` names (its ``open_coordinator`` and
    ``open_client``); ConfigError naming the pip extra when its driver is not installed."""
    store, extra = scheme_of(url)
    try:
        module = importlib.import_module(STORES[store]["hooks"])
        driver = DRIVERS.get(extra or "")
        if driver is not None and importlib.util.find_spec(driver) is None:
            raise ModuleNotFoundError(f"No module named {driver!r}")
    except ImportError as exc:
        hint = f" (pip install 'metafora-cluster[{extra}]')" if extra else ""
        raise ConfigError(f"the {url.scheme} store is not available: {exc}{hint}") from exc
    return module
