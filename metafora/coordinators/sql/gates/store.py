"""The SQL item store: partitions' items in SQL (SQLite or PostgreSQL), fenced by claim tokens.

:class:`SQLItemStore` is the SQL :class:`~metafora.gates.ItemStore` (the user's and the
operator's handle: add, list, retry, move a gate);
:class:`~metafora.coordinators.sql.gates.lease.SQLPartitionLease` the owner's: every item
write it makes is **fenced** by the partition's claim token, so a zombie owner (paused past
its lease, its partition claimed elsewhere) cannot commit anything.

Fencing, in every write statement of a lease::

    ... AND EXISTS (SELECT 1 FROM metafora_partitions fp WHERE fp.namespace = :ns
                    AND fp.partition_id = :p AND fp.token = :token AND fp.status = 'open'
                    [AND <the claim is held>])

``metafora_partitions.token`` is the highest claim token that has opened the partition: a
new owner raises it (:meth:`~.SQLPartitionLease.take_over`, ``token <= :token``) before its
first item write, which shuts every older token out. When the items live in the
coordinator's own SQL database (same URL and namespace), ``<the claim is held>`` is also
checked against the coordinator's tables -- ``metafora_tasks`` row claimed under this token
by this node, whose lease is live by the database clock -- so a zombie is refused even
before anyone re-claims. Multi-statement writes end with a fenced ``UPDATE`` of the
partition row (the **guard**): nothing in the transaction commits unless the fence holds at
its end, and a newer claim's :meth:`~.SQLPartitionLease.take_over` either waits for that row
lock or makes the guard fail. Lock order, everywhere: item rows first, then the partition
row (results and reopened items before the guard; a new claim's orphans before its open;
:meth:`SQLItemStore.delete` items before the row), so no two of them can deadlock. A gate move
locks only the partition row (first, as :meth:`SQLItemStore.add` does) and reads the items, so
an item can never slip in below a gate that is moving.

Crashes: the transaction that takes a batch also records it on the partition row
(``batch_token``, ``batch_gate``, ``batch_first``..``batch_last``). A clean release drops
the record; a new claim's :meth:`~.SQLPartitionLease.take_over` turns the items of an older
claim's record that have no result from it into **orphans** (``taken = 1``, an attempt
counted). Orphans run one at a time (``taken = 2``, recorded on the item) once the rest of
the gate is done, and an orphan that already died that way ``max_deaths`` claims in a row
fails for good ("process died while processing"): a poison item cannot stall its partition
or keep killing nodes.

Driver errors are translated at this boundary by the database handle the SQL coordinator
uses too (:meth:`~metafora.coordinators.sql.store.Database.translated`: CoordinatorUnavailable,
StoreError).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, TextClause

from metafora.contracts.backends import default_url
from metafora.contracts.client import Client
from metafora.coordinators.sql.gates.lease import SQLPartitionLease
from metafora.coordinators.sql.gates.reads import ItemReads
from metafora.coordinators.sql.gates.schema import (
    GATES_SCHEMA_VERSION,
    check_version,
    current_version,
    migrate,
)
from metafora.coordinators.sql.gates.statements import ITEMS, owner_statements, user_statements
from metafora.coordinators.sql.gates.wakeups import hub_for, items_channel
from metafora.coordinators.sql.options import SQLConfig, parse_config
from metafora.coordinators.sql.schema import current_version as coordinator_version
from metafora.coordinators.sql.shared import database_of, is_postgres, listen, schema_not_ready
from metafora.coordinators.sql.store import Database
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError, MetaforaError
from metafora.core.task import Task, validate_task_id
from metafora.gates.model import (
    GateError,
    GateMoveRefused,
    ItemBelowGate,
    ItemStatus,
    NewItem,
    PartitionClosed,
    PartitionStatus,
    check_gate,
)
from metafora.gates.store import ItemStore
from metafora.statemachine.store import LeaseBound

__all__ = ["SQLItemStore"]

log = logging.getLogger(__name__)

_IN_CHUNK = 500
"""Partitions per statement of :meth:`SQLItemStore.delete_partitions` (bound parameters)."""

class SQLItemStore(ItemReads, ItemStore):
    """Items of gated partitions in a SQL database (SQLite or PostgreSQL): what
    ``ItemStore(url)`` opens for a SQL URL (see :class:`~metafora.gates.ItemStore`)."""

    def __init__(self, url: str | None = None, **options: Any) -> None:
        parsed = parse_store_url(url or default_url())
        self._db = Database(parse_config(parsed, dict(options)))
        self._config = self._db.config
        fragments = self._db.dialect.fragments()
        self._now = fragments["now"]
        self._is_pg = is_postgres(self._db.dialect)
        self._sql = user_statements(self._now, self._is_pg)
        self._owner_sql: dict[bool, dict[str, TextClause]] = {}
        self._hub = hub_for(self._config)
        self._channel = items_channel(self._config.namespace)
        self._lock = threading.Lock()
        self._schema_ready = False
        self._listener: Any = None
        self._closed = False

    # -- identity ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The store URL without its password."""
        return self._db.name

    @property
    def namespace(self) -> str:
        """The namespace the items live in (the URL's ``namespace`` option)."""
        return self._config.namespace

    @property
    def config(self) -> SQLConfig:
        """The validated store configuration."""
        return self._config

    @property
    def poll_interval(self) -> float:
        """Seconds between looks for new items when push notifications are not available."""
        return self._config.poll_interval

    def beside(self, coordinator: object) -> bool:
        """Whether ``coordinator`` is a SQL coordinator keeping its tasks in this database and
        namespace."""
        try:
            config = database_of(coordinator).config
        except ConfigError:
            return False
        return self.same_database(config)

    def same_database(self, config: SQLConfig) -> bool:
        """Whether a SQL coordinator with ``config`` keeps its tasks in this database and namespace."""
        mine = self._config
        if mine.kind != config.kind or mine.namespace != config.namespace:
            return False
        if mine.kind == "sqlite":
            return os.path.realpath(mine.path or "") == os.path.realpath(config.path or "")
        return (mine.url.hosts, mine.url.path) == (config.url.hosts, config.url.path)

    # -- plumbing ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise MetaforaError(f"the item store on {self.name} is closed")


    def ensure_schema(self, conn: Connection | None = None) -> None:
        """Create or upgrade the item tables (once per store object; cheap afterwards).

        With ``conn`` (the caller's transaction), a missing schema is created on it, so it
        commits or rolls back with the caller's work.
        """
        self._check_open()
        if self._schema_ready:
            return
        if conn is not None:
            with self._db.translated():
                version = current_version(conn)
                self._check_schema(version)
                if version < GATES_SCHEMA_VERSION:
                    migrate(conn, self._db.dialect, self.name)
            return
        with self._lock:
            if self._schema_ready:
                return
            with self._db.read() as rconn:
                version = current_version(rconn)
            self._check_schema(version)
            if version < GATES_SCHEMA_VERSION:
                with self._db.transaction() as wconn:
                    migrate(wconn, self._db.dialect, self.name)
                log.info("item tables of %s are ready", self.name, extra={"action": "schema"})
            self._schema_ready = True

    def _check_schema(self, version: int) -> None:
        """Refuse a newer schema; with ``migrate=false`` also a missing or older one."""
        check_version(version, self.name)
        if not self._config.migrate and version < GATES_SCHEMA_VERSION:
            raise schema_not_ready(self.name, "item tables' schema", version, GATES_SCHEMA_VERSION)

    def _run(self, conn: Connection, name: str, params: dict[str, Any]) -> Any:
        params["ns"] = self._config.namespace
        return conn.execute(self._sql[name], params)

    @contextmanager
    def _transaction(self, conn: Connection | None) -> Iterator[Connection]:
        if conn is None:
            with self._db.transaction() as own:
                yield own
        else:
            with self._db.translated():
                yield conn

    def owner_statements(self, claim_fence: bool) -> dict[str, TextClause]:
        """The owner's fenced statements (built once per fencing mode)."""
        with self._lock:
            built = self._owner_sql.get(claim_fence)
            if built is None:
                built = self._owner_sql[claim_fence] = owner_statements(self._now, claim_fence)
            return built

    # -- wake-ups ---------------------------------------------------------------------------

    def _notify(self, conn: Connection, partition: str) -> None:
        if self._is_pg:
            self._run(conn, "notify", {"channel": self._channel, "payload": "i" + partition})

    def subscribe(self, partition: str, event: threading.Event) -> Callable[[], None]:
        """Set ``event`` whenever items are added to ``partition``, retried or its gate is
        moved (by anyone, on PostgreSQL through NOTIFY; in this process at once on SQLite,
        which has no push: its handlers also poll every ``poll_interval``). Returns the
        function that unsubscribes."""
        validate_task_id(partition)
        self._check_open()
        self._start_listener()
        self._hub.subscribe(partition, event)
        return lambda: self._hub.unsubscribe(partition, event)

    def _start_listener(self) -> None:
        if not self._is_pg:
            return
        with self._lock:
            if self._listener is not None or self._closed:
                return
            hub = self._hub

            def on_notify(payload: str) -> None:
                if payload.startswith("i"):
                    hub.notify(payload[1:])

            self._listener = listen(self._config, self._channel, "items", on_notify, hub.notify_all)
        self._listener.start()

    def wait_listening(self, timeout: float = 10.0) -> bool:
        """Block until push notifications are in place (PostgreSQL; True at once elsewhere)."""
        if not self._is_pg:
            return True
        self._start_listener()
        return bool(self._listener.wait_listening(timeout))

    # -- adding -----------------------------------------------------------------------------

    def add(self, partition: str, items: Sequence[NewItem], *, conn: Connection | None = None) -> list[int]:
        """Add ``items`` to ``partition`` in one transaction; returns their ids in order.

        With ``conn`` (a SQLAlchemy Connection in the caller's transaction, on this store's
        database) the items are written in that transaction and appear with the caller's
        other writes, or not at all. Raises :class:`ItemBelowGate` (nothing is written) if
        an item's gate is below the partition's current gate -- it would never run -- and
        :class:`PartitionClosed` if the partition is completed.
        """
        validate_task_id(partition)
        batch = list(items)
        for item in batch:
            if not isinstance(item, NewItem):
                raise GateError(f"items must be NewItem values, got {item!r}")
        if not batch:
            return []
        self.ensure_schema(conn)
        with self._transaction(conn) as tx:
            self._run(tx, "ensure", {"p": partition})
            gate, status = self._run(tx, "lock", {"p": partition}).one()
            if status == PartitionStatus.COMPLETED.value:
                raise PartitionClosed(f"partition {partition!r} is completed; it takes no more items "
                                      f"(reopen it: metafora partition reopen {partition})")
            low = min(item.gate for item in batch)
            if low < int(gate):
                raise ItemBelowGate(
                    f"cannot add an item at gate {low} to partition {partition!r}: its current gate "
                    f"is {gate}, so the item would never run; add it at gate {gate} or above"
                )
            result = tx.execute(
                ITEMS.insert().returning(ITEMS.c.id, sort_by_parameter_order=True),
                self._new_rows(partition, batch))
            ids = [int(row[0]) for row in result]
            self._notify(tx, partition)
        self._hub.notify(partition)
        log.debug("added %d item(s) to partition %s", len(ids), partition,
                  extra={"task": partition, "action": "add"})
        return ids

    def _new_rows(self, partition: str, batch: Sequence[NewItem]) -> list[dict[str, Any]]:
        """The rows of new items (available, no attempt yet)."""
        return [{"namespace": self._config.namespace, "partition_id": partition, "gate": item.gate,
                 "status": ItemStatus.AVAILABLE.value, "data": item.data, "attempts": 0,
                 "permanent": 0, "token": 0} for item in batch]

    # -- operators --------------------------------------------------------------------------

    def set_gate(self, partition: str, gate: int, *, force: bool = False) -> int:
        """Move the partition's gate to ``gate`` (``manual_checkpoint`` partitions wait for
        this); returns the previous gate.

        Refused (:class:`GateMoveRefused`) if items below ``gate`` are still available or failed --
        they would be stranded -- unless ``force``; and for a completed partition
        (:class:`PartitionClosed`). The owner picks the new gate up at once.
        """
        validate_task_id(partition)
        check_gate(gate)
        self.ensure_schema()
        with self._db.transaction() as tx:
            self._run(tx, "ensure", {"p": partition})
            old, status = self._run(tx, "lock", {"p": partition}).one()
            if status == PartitionStatus.COMPLETED.value:
                raise PartitionClosed(f"partition {partition!r} is completed; its gate cannot move")
            if not force:
                stranded = int(self._run(tx, "unfinished_below", {"p": partition, "gate": gate}).scalar_one())
                if stranded:
                    raise GateMoveRefused(
                        f"cannot move partition {partition!r} to gate {gate}: {stranded} item(s) "
                        "below it are still available or failed and would never run (force to skip them)"
                    )
            self._run(tx, "set_gate", {"p": partition, "gate": gate})
            self._notify(tx, partition)
        self._hub.notify(partition)
        log.info("partition %s: gate moved by hand from %s to %s", partition, old, gate,
                 extra={"task": partition, "action": "set_gate"})
        return int(old)

    def reopen(self, partition: str, items: Sequence[NewItem] = ()) -> int:
        """Open a completed partition again, with ``items`` added in the same transaction;
        returns its gate. See :meth:`ItemStore.reopen`."""
        validate_task_id(partition)
        batch = list(items)
        for item in batch:
            if not isinstance(item, NewItem):
                raise GateError(f"items must be NewItem values, got {item!r}")
        self.ensure_schema()
        with self._db.transaction() as tx:
            found = self._run(tx, "lock", {"p": partition}).first()
            if found is None:
                raise GateError(f"no partition {partition!r} in {self.name}: nothing to reopen")
            gate, status = int(found[0]), str(found[1])
            if status == PartitionStatus.COMPLETED.value:
                low = self._run(tx, "lowest_unfinished", {"p": partition}).scalar()
                lows = [int(low)] if low is not None else []
                lows += [item.gate for item in batch]
                # The lowest gate with work; none: gate 0, so new items may go at any gate.
                gate = min(lows, default=0)
                self._run(tx, "reopen_partition", {"p": partition, "gate": gate})
            elif batch and min(item.gate for item in batch) < gate:
                raise ItemBelowGate(
                    f"cannot add an item at gate {min(i.gate for i in batch)} to partition "
                    f"{partition!r}: its current gate is {gate}"
                )
            if batch:
                tx.execute(ITEMS.insert(), self._new_rows(partition, batch))
            self._notify(tx, partition)
        self._hub.notify(partition)
        log.info("partition %s: open again at gate %d (%s)", partition, gate,
                 "reopened" if status == PartitionStatus.COMPLETED.value else "was open",
                 extra={"task": partition, "action": "reopen"})
        return gate

    def tasks_client(self) -> Client | None:
        """A client of the tasks in this database and namespace (where a SQL coordinator on
        the same URL keeps them; the caller closes it), or None when the database holds no
        coordinator tables (the items of an etcd coordinator: none are created here)."""
        from metafora.coordinators.sql import open_client  # this store's own client

        with self._db.read() as conn:
            if coordinator_version(conn) == 0:
                return None
        return open_client(self._config.url, {"namespace": self._config.namespace})

    def retry(self, partition: str) -> int:
        """Make the partition's failed items available again (error cleared); returns how
        many. See :func:`metafora.gates.retry_partition` to also revive the
        partition's task."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.transaction() as tx:
            count = int(self._run(tx, "retry", {"p": partition}).rowcount)
            if count:
                self._notify(tx, partition)
        if count:
            self._hub.notify(partition)
        log.info("partition %s: %d failed item(s) made available again", partition, count,
                 extra={"task": partition, "action": "retry_items"})
        return count

    def delete(self, partition: str) -> int:
        """Delete the partition's items and its gate record; returns how many items."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.transaction() as tx:
            # The owners' lock order, items then the partition row; the second delete takes
            # the items an add committed while the first ran (add locks the row first).
            count = int(self._run(tx, "delete_items", {"p": partition}).rowcount)
            self._run(tx, "lock", {"p": partition}).first()
            count += int(self._run(tx, "delete_items", {"p": partition}).rowcount)
            self._run(tx, "delete_partition", {"p": partition})
        return count

    def delete_partitions(self, partitions: Sequence[str]) -> int:
        """Delete the items and gate records of every partition of ``partitions`` that has
        any, in one transaction; returns how many items."""
        ids = list(dict.fromkeys(partitions))
        for partition in ids:
            validate_task_id(partition)
        if not ids:
            return 0
        self.ensure_schema()
        count = 0
        with self._db.transaction() as tx:
            for start in range(0, len(ids), _IN_CHUNK):
                params = {"ps": ids[start:start + _IN_CHUNK]}
                # delete()'s order: items, the partition rows locked, items an add committed
                # meanwhile, the partition rows.
                count += int(self._run(tx, "delete_items_in", params).rowcount)
                self._run(tx, "lock_in", params).fetchall()
                count += int(self._run(tx, "delete_items_in", params).rowcount)
                self._run(tx, "delete_partitions_in", params)
        return count

    # -- owners -----------------------------------------------------------------------------

    def lease(self, task: Task, node_id: str | None = None, *, claim_fence: bool = False,
              bound: LeaseBound | None = None) -> SQLPartitionLease:
        """The fenced handle of the claim ``task`` (carrying its token) on the partition.

        ``claim_fence`` also checks every write against the coordinator's own tables (only
        when this store is the SQL coordinator's database; needs ``node_id``). ``bound``
        (:func:`~metafora.statemachine.store.lease_bound_of` the coordinator) limits every
        fenced write to the time the node still holds the claim (else ClaimLost).
        """
        if claim_fence and node_id is None:
            raise ConfigError("claim_fence needs the node id of the claim's owner")
        return SQLPartitionLease(self, task, node_id, claim_fence, bound)

    def read(self) -> Any:
        """A connection for autocommit reads (context manager; errors translated)."""
        return self._db.read()

    def transaction(self, timeout: float | None = None) -> Any:
        """A connection in a transaction (context manager; errors translated), waiting at
        most ``timeout`` seconds for locks when given."""
        return self._db.bounded(timeout)

    def close(self) -> None:
        """Stop listening and close pooled connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener = self._listener
        if listener is not None:
            listener.stop()
        self._db.close()
