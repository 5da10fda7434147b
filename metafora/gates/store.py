"""The item store: the interface of partitions' items, kept beside the tasks they belong to.

:class:`ItemStore` is the user's and the operator's handle (add, list, retry, move a gate);
:class:`~metafora.gates.lease.PartitionLease` is the owner's, every item write of which is
**fenced** by the partition's claim token, so a zombie owner (paused past its lease, its
partition claimed elsewhere) cannot commit anything.

``ItemStore(url)`` opens the item store of the store ``url`` names: each store's backend
object (:mod:`metafora.contracts.backends`) names its implementation, and each store package owns it (items
live in SQL, SQLite or PostgreSQL: :mod:`metafora.coordinators.sql.gates`, which documents the
tables, the fencing and what a crash leaves behind).
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from metafora.contracts.backends import implementation, store_of_url
from metafora.contracts.recipes import verb
from metafora.core.errors import ConfigError, TaskNotFound
from metafora.core.task import Task
from metafora.gates.lease import PartitionLease
from metafora.gates.model import Item, ItemStatus, NewItem, PartitionInfo
from metafora.statemachine.store import LeaseBound

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from metafora.contracts.client import Client

__all__ = ["ItemStore"]

log = logging.getLogger(__name__)


class ItemStore:
    """Items of gated partitions, in the store ``url`` names (SQLite or PostgreSQL).

    ``url`` is the SQL coordinator's own URL (then the items live beside its tasks and item
    writes are also fenced by the coordinator's claims), or a SQL URL of their own (when the
    coordinator is etcd); None means ``$METAFORA_URL`` or the embedded SQLite default.
    ``options`` are the store's URL options (``namespace``, ``poll_interval``,
    ``pool_size``, ...). Nothing is touched until the first call, which creates the item
    tables if needed. Thread-safe; :meth:`close` releases the connections.

    ``ItemStore(url)`` gives the store's own implementation, a subclass; ConfigError for a
    store that keeps no items. This class is the interface: a subclass must implement every
    method that raises NotImplementedError here (checked when the subclass is defined). It
    is no ``abc.ABC`` so that ``ItemStore(url)`` type-checks as the constructor it is.
    """

    def __new__(cls, url: str | None = None, **options: Any) -> ItemStore:
        if cls is not ItemStore:
            return super().__new__(cls)
        parsed, store = store_of_url(url)
        kind = implementation(store, "item_store")
        if kind is None:
            raise ConfigError(
                f"items live in SQL (sqlite:///PATH.db or postgresql://...), not {parsed}; with an "
                "etcd coordinator give the item store a SQL URL of its own"
            )
        assert issubclass(kind, ItemStore)
        return cast(ItemStore, super().__new__(kind))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in _INTERFACE if getattr(cls, name) is getattr(ItemStore, name)]
        if missing:
            raise TypeError(f"{cls.__name__} does not implement ItemStore.{', '.join(missing)}")

    @property
    def name(self) -> str:
        """The store URL without its password."""
        raise NotImplementedError

    @property
    def namespace(self) -> str:
        """The namespace the items live in (the URL's ``namespace`` option)."""
        raise NotImplementedError

    @property
    def poll_interval(self) -> float:
        """Seconds between looks for new items when push notifications are not available."""
        raise NotImplementedError

    def beside(self, coordinator: object) -> bool:
        """Whether ``coordinator`` keeps its tasks in this store and namespace (then the
        owners' item writes are also fenced by its claims)."""
        raise NotImplementedError

    def subscribe(self, partition: str, event: threading.Event) -> Callable[[], None]:
        """Set ``event`` whenever items are added to ``partition``, retried or its gate is
        moved (by anyone where the store pushes; in this process at once elsewhere, whose
        handlers also poll every :attr:`poll_interval`). Returns the function that
        unsubscribes."""
        raise NotImplementedError

    def wait_listening(self, timeout: float = 10.0) -> bool:
        """Block until push notifications are in place (True at once where there are none)."""
        raise NotImplementedError

    def add(self, partition: str, items: Sequence[NewItem], *, conn: Connection | None = None) -> list[int]:
        """Add ``items`` to ``partition`` in one transaction; returns their ids in order.

        With ``conn`` (a SQLAlchemy Connection in the caller's transaction, on this store's
        database) the items are written in that transaction and appear with the caller's
        other writes, or not at all. Raises :class:`~metafora.gates.ItemBelowGate` (nothing
        is written) if an item's gate is below the partition's current gate -- it would
        never run -- and :class:`~metafora.gates.PartitionClosed` if the partition is
        completed.
        """
        raise NotImplementedError

    def list(self, partition: str, *, gate: int | None = None,
             status: ItemStatus | str | None = None, limit: int | None = None,
             after: int | None = None) -> builtins.list[Item]:
        """The partition's items (at ``gate``, in ``status``), ordered by id; ``after`` an id
        to page from, ``limit`` the most to return."""
        raise NotImplementedError

    def get(self, partition: str, item_id: int) -> Item:
        """One item. Raises :class:`~metafora.gates.ItemNotFound`."""
        raise NotImplementedError

    def info(self, partition: str) -> PartitionInfo:
        """The partition's gate, status, owner token and item counts (by gate and status)."""
        raise NotImplementedError

    def failures(self, partition: str) -> tuple[int, int]:
        """How many items of the partition are failed, and how many of those permanently."""
        raise NotImplementedError

    def set_gate(self, partition: str, gate: int, *, force: bool = False) -> int:
        """Move the partition's gate to ``gate`` (``manual_checkpoint`` partitions wait for
        this); returns the previous gate.

        Refused (:class:`~metafora.gates.GateMoveRefused`) if items below ``gate`` are still
        available or failed -- they would be stranded -- unless ``force``; and for a
        completed partition (:class:`~metafora.gates.PartitionClosed`). The owner picks the
        new gate up at once.
        """
        raise NotImplementedError

    def reopen(self, partition: str, items: Sequence[NewItem] = ()) -> int:
        """Open a completed partition again (Go Feed's reopen), with ``items`` added in the
        same transaction; returns its gate. The store's half of :meth:`reopen_partition`,
        which also makes the task pending.

        Items already done stay done (they are not processed again); the gate becomes the
        lowest gate that has unfinished items -- new ones included -- or 0 when none has, so
        items added later may go at any gate. A partition that is open already is left as
        it is (``items`` are added at or above its gate, else ItemBelowGate); one that never
        existed is a GateError.
        """
        raise NotImplementedError

    def reopen_partition(self, partition: str, client: Client | None = None, *,
                         items: Sequence[NewItem] = ()) -> int:
        """Reopen a completed partition and make its task pending again so a node runs the
        new items; returns the gate. See :func:`metafora.gates.reopen_partition`.

        ``client`` is the coordinator's store; without it, the tasks kept beside the items
        (:meth:`tasks_client`: a SQL coordinator on this database and namespace). When the
        task is not there (an etcd coordinator keeps it), only the partition is reopened and
        a warning says to pass the coordinator's client.
        """
        recipe = verb("reopen_partition")  # the gates' own (metafora.contracts.recipes)

        def reopen_partition(target: Client | None, *, new_items: Sequence[NewItem]) -> int:
            gate: int = recipe(self, partition, target, new_items=new_items)
            return gate

        if client is not None:
            return reopen_partition(client, new_items=items)
        own = self.tasks_client()
        if own is None:
            return reopen_partition(None, new_items=items)
        try:
            try:
                own.get_task(partition)
            except TaskNotFound:
                log.warning("partition %s: no task of that id beside the items in %s; reopening "
                            "the partition only (pass the coordinator's client to revive its task)",
                            partition, self.name, extra={"task": partition, "action": "reopen"})
                return reopen_partition(None, new_items=items)
            return reopen_partition(own, new_items=items)
        finally:
            own.close()

    def tasks_client(self) -> Client | None:
        """A client of the tasks kept in this store's database and namespace, if the store
        can keep tasks (the caller closes it); None here."""
        return None

    def retry(self, partition: str) -> int:
        """Make the partition's failed items available again (error cleared); returns how
        many. See :func:`metafora.gates.retry_partition` to also revive the partition's
        task."""
        raise NotImplementedError

    def delete(self, partition: str) -> int:
        """Delete the partition's items and its gate record; returns how many items."""
        raise NotImplementedError

    def delete_partitions(self, partitions: Sequence[str]) -> int:
        """Delete the items and gate records of every partition of ``partitions`` that has
        any, at once; returns how many items. What pruning finished tasks calls when the
        tasks live in another store (an etcd coordinator's; see
        :meth:`~metafora.core.retention.RetentionOps.prune_also`)."""
        raise NotImplementedError

    def lease(self, task: Task, node_id: str | None = None, *, claim_fence: bool = False,
              bound: LeaseBound | None = None) -> PartitionLease:
        """The fenced handle of the claim ``task`` (carrying its token) on the partition.

        ``claim_fence`` also checks every write against the coordinator's own claims (only
        when :meth:`beside` it; needs ``node_id``). ``bound``
        (:func:`~metafora.statemachine.store.lease_bound_of` the coordinator) limits every
        fenced write to the time the node still holds the claim (else ClaimLost).
        """
        raise NotImplementedError

    def close(self) -> None:
        """Stop listening and release the store's connections. Idempotent."""
        raise NotImplementedError

    def __enter__(self) -> ItemStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ItemStore({self.name!r})"


_INTERFACE = (
    "name",
    "namespace",
    "poll_interval",
    "beside",
    "subscribe",
    "wait_listening",
    "add",
    "list",
    "get",
    "info",
    "failures",
    "set_gate",
    "reopen",
    "retry",
    "delete",
    "delete_partitions",
    "lease",
    "close",
)
"""What an implementation must define (see :class:`ItemStore`)."""
