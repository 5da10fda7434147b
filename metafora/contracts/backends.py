"""The stores' registry: a URL scheme names a store through the entry-point group
``metafora.stores``.

Each store (``memory``, ``sql``, ``etcd``, or an outside package's) is one
:class:`StoreBackend` object, registered under every URL scheme it serves; metafora's own
stores use the same door (setup.cfg)::

    [options.entry_points]
    metafora.stores =
        sqlite = metafora.coordinators.sql.backend:BACKEND
        postgresql = metafora.coordinators.sql.backend:BACKEND [postgres]

The ``[extra]`` of an entry point names the pip extra that provides the scheme's driver: a
missing driver is a :class:`~metafora.core.errors.ConfigError` that names it. ``connect`` opens
coordinators and clients through :func:`backend_of`; features find their store's
implementation through :func:`implementation`, never by importing a store package. The group
itself is read by :mod:`metafora.contracts.registry` (which the client, below this module, uses too).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import import_module, metadata
from typing import Any

from metafora.contracts.aio import AsyncClient
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.contracts.registry import GROUP, entry_points, find, loaded, schemes
from metafora.core.config import StoreURL, parse_store_url
from metafora.core.errors import ConfigError
from metafora.core.leases import Fencing, LeaseTTL
from metafora.core.submitting import IfExists, no_completion, no_transactions
from metafora.core.task import Task

__all__ = [
    "DEFAULT_URL",
    "ENV_URL",
    "GROUP",
    "Migrated",
    "StoreBackend",
    "backend_of",
    "backend_of_store",
    "default_url",
    "implementation",
    "schemes",
    "store_of",
    "store_of_url",
    "stores",
]

DEFAULT_URL = "sqlite:///metafora.db"
ENV_URL = "METAFORA_URL"


@dataclass(frozen=True)
class Migrated:
    """One schema of a store: its version before and after ``metafora migrate``."""

    schema: str
    before: int
    after: int

    @property
    def changed(self) -> bool:
        """Whether migrations were applied."""
        return self.after != self.before


class StoreBackend(abc.ABC):
    """A store as metafora finds it: how to open its coordinator and client, its rules for
    leases, and where the storage of the features it keeps lives.

    A package registers one instance under each URL scheme it serves, in the entry-point
    group ``metafora.stores``. The instance's module should import nothing heavy: the
    driver is imported when a coordinator or client is opened.
    """

    name: str = ""
    """The store's name (``"sql"``), the ``backend`` of its coordinators and clients."""

    lease_ttl: LeaseTTL = LeaseTTL(minimum=0.1)
    """The store's bounds on the ``lease_ttl`` URL option."""

    fencing: Fencing | None = None
    """The store's self-fencing margin; None for a store without leases that expire."""

    features: Mapping[str, str] = {}
    """Feature (``"state_store"``, ``"task_commands"``, ``"item_store"``) -> ``"module:name"``
    of the class that keeps it in this store; a store without an entry does not keep it."""

    def check_driver(self, url: StoreURL) -> None:
        """Raise ImportError when the driver ``url``'s scheme needs is not installed (checked
        before anything is opened; the registry adds the pip extra to install). By default
        every driver comes with the module of the backend object."""
        return None

    @abc.abstractmethod
    def open_coordinator(self, url: StoreURL, node_id: str, options: dict[str, Any]) -> Coordinator:
        """The coordinator of node ``node_id`` on ``url`` (touches nothing until ``init``)."""

    @abc.abstractmethod
    def open_client(self, url: StoreURL, options: dict[str, Any]) -> Client:
        """An operator client on ``url`` (connects on first use)."""

    def implementation(self, feature: str) -> Any:
        """The class that keeps ``feature`` in this store (see :attr:`features`); None when
        the store keeps none."""
        target = self.features.get(feature)
        if target is None:
            return None
        module, _, name = target.partition(":")
        return getattr(import_module(module), name)

    def migrate(self, url: StoreURL) -> list[Migrated]:
        """Bring every schema of the store ``url`` names up to date (``metafora migrate``,
        the release step of a store run with ``migrate=false``); what each was before and is
        now. The default refuses: the store has no schema."""
        raise ConfigError(f"{url} has no schema to migrate: only SQL stores (sqlite:///PATH.db, "
                          "postgresql://...) have one")

    def open_async_client(self, client: Client, threads: int) -> AsyncClient | None:
        """A native async client over ``client``'s store; None (the default) runs the sync
        client's calls on a pool of ``threads`` threads."""
        return None

    async def submit_in_transaction(
        self, client: Client, conn: Any, tasks: list[Task], mode: IfExists,
        run: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> int:
        """Write ``tasks`` in the application's async transaction ``conn`` (the async
        client's ``conn=``), ``run`` running a sync call off the event loop: the number
        added or replaced. The default refuses: the store shares no transaction."""
        raise no_transactions(client.name)

    async def complete_in_transaction(
        self, client: Client, conn: Any, task: Task,
        run: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> None:
        """Mark the claimed ``task`` done in the application's async transaction ``conn``
        (the async client's ``complete_task``), fenced by its token. The default refuses."""
        raise no_completion(client.name)


def default_url() -> str:
    """``$METAFORA_URL`` if set, else the embedded SQLite default ``sqlite:///metafora.db``."""
    return os.environ.get(ENV_URL) or DEFAULT_URL


def _load(ep: metadata.EntryPoint) -> StoreBackend:
    backend = ep.load()
    if not isinstance(backend, StoreBackend):
        raise ConfigError(f"the entry point {ep.name} = {ep.value} of {GROUP} is not a "
                          f"metafora.contracts.backends.StoreBackend (got {type(backend).__name__})")
    return backend


def _unavailable(ep: metadata.EntryPoint, exc: ImportError) -> ConfigError:
    dist = ep.dist.name if ep.dist is not None else "metafora-cluster"
    hint = f" (pip install '{dist}[{','.join(ep.extras)}]')" if ep.extras else ""
    return ConfigError(f"the {ep.name} store is not available: {exc}{hint}")


def backend_of(url: StoreURL) -> StoreBackend:
    """The store ``url``'s scheme names; ConfigError for an unknown scheme, or naming the pip
    extra to install when the scheme's driver is missing."""
    ep = entry_points().get(url.scheme)
    if ep is None:
        known = ", ".join(schemes()) or (
            f"none: the entry points {GROUP} come with an installed metafora-cluster; in a "
            "checkout, run pip install -e .")
        raise ConfigError(f"unknown store scheme {url.scheme!r} in {url} (known: {known})")
    try:
        backend = _load(ep)
        backend.check_driver(url)
    except ImportError as exc:
        raise _unavailable(ep, exc) from exc
    return backend


def stores() -> dict[str, StoreBackend]:
    """Every registered store that loads here, by name (a store whose driver is missing, or
    an entry point that names no backend object, is left out: opening its URL says why)."""
    return {name: backend for name, backend in loaded().items() if isinstance(backend, StoreBackend)}


def backend_of_store(store: str) -> StoreBackend:
    """The registered store named ``store`` (``"sql"``); ConfigError if none is. Loads no
    other store when that one's module is imported already (see :func:`metafora.contracts.registry.find`)."""
    backend = find(store)
    if not isinstance(backend, StoreBackend):
        raise ConfigError(f"no store named {store!r} is registered ({GROUP} has "
                          f"{', '.join(sorted(stores())) or 'none'})")
    return backend


def store_of(owner: object) -> str:
    """The store a coordinator or client belongs to (its
    :attr:`~metafora.contracts.coordinator.Coordinator.backend`, a registered store's name);
    ConfigError for one of no registered store."""
    store = getattr(type(owner), "backend", "")  # Coordinator.backend, Client.backend
    if not store or not isinstance(find(store), StoreBackend):
        raise ConfigError(f"{type(owner).__name__} belongs to no registered store ({GROUP} has "
                          f"{', '.join(sorted(stores()))})")
    return str(store)


def store_of_url(url: str | None) -> tuple[StoreURL, str]:
    """The parsed ``url`` (default: :func:`default_url`) and the name of the store it
    names; ConfigError for an unknown scheme."""
    parsed = parse_store_url(url or default_url())
    return parsed, backend_of(parsed).name


def implementation(store: str, feature: str) -> Any:
    """The class that implements ``feature`` (``"state_store"``, ``"task_commands"``,
    ``"item_store"``) in the store named ``store``; None when the store keeps none."""
    return backend_of_store(store).implementation(feature)
