"""The item store: partitions' items in SQL (SQLite or PostgreSQL), fenced by claim tokens.

:class:`ItemStore` is the user's and the operator's handle (add, list, retry, move a gate);
:class:`PartitionLease` is the owner's: every item write it makes is **fenced** by the
partition's claim token, so a zombie owner (paused past its lease, its partition claimed
elsewhere) cannot commit anything.

Fencing, in every write statement of a lease::

    ... AND EXISTS (SELECT 1 FROM metafora_partitions fp WHERE fp.namespace = :ns
                    AND fp.partition_id = :p AND fp.token = :token AND fp.status = 'open'
                    [AND <the claim is held>])

``metafora_partitions.token`` is the highest claim token that has opened the partition: a new
owner raises it (:meth:`PartitionLease.open`, ``token <= :token``) before its first item
write, which shuts every older token out. When the items live in the coordinator's own SQL
database (same URL and namespace), ``<the claim is held>`` is also checked against the
coordinator's tables -- ``metafora_tasks`` row claimed under this token by this node, whose
lease is live by the database clock -- so a zombie is refused even before anyone re-claims.
Multi-statement writes end with a fenced ``UPDATE`` of the partition row (the **guard**):
nothing in the transaction commits unless the fence holds at its end, and a newer claim's
:meth:`PartitionLease.open` either waits for that row lock or makes the guard fail. Lock
order, everywhere: item rows first, then the partition row (results and reopened items
before the guard; a new claim's orphans before its open; :meth:`ItemStore.delete` items
before the row), so no two of them can deadlock. A gate move locks only the partition row
(first, as :meth:`ItemStore.add` does) and reads the items, so an item can never slip in
below a gate that is moving.

Crashes: the transaction that takes a batch also records it on the partition row
(``batch_token``, ``batch_gate``, ``batch_first``..``batch_last``). A clean release drops the
record; a new claim's :meth:`PartitionLease.open` turns the items of an older claim's record
that have no result from it into **orphans** (``taken = 1``, an attempt counted). Orphans run
one at a time (``taken = 2``, recorded on the item) once the rest of the gate is done, and an
orphan that already died that way ``max_deaths`` claims in a row fails for good ("process
died while processing"): a poison item cannot stall its partition or keep killing nodes.

Driver errors are translated at this boundary with the SQL coordinator's
:func:`~metafora.coordinators.sql.store.translate_error` (CoordinatorUnavailable, StoreError).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TextClause,
    text,
)
from sqlalchemy import exc as sa_exc

from metafora.config import parse_store_url
from metafora.connect import default_url
from metafora.coordinators.sql.dialect import PostgresDialect
from metafora.coordinators.sql.options import PG_SCHEMES, SQLConfig, parse_config
from metafora.coordinators.sql.store import Database, translate_error
from metafora.errors import ClaimLost, ConfigError, MetaforaError
from metafora.statemachine.gates.model import (
    GateError,
    GateMoveRefused,
    Item,
    ItemBelowGate,
    ItemNotFound,
    ItemStatus,
    NewItem,
    PartitionClosed,
    PartitionInfo,
    PartitionStatus,
    _gate,
)
from metafora.statemachine.gates.schema import (
    GATES_SCHEMA_VERSION,
    check_version,
    current_version,
    migrate,
)
from metafora.statemachine.store import LeaseBound
from metafora.task import Task, validate_task_id

__all__ = ["Advance", "ItemStore", "Outcome", "PartitionLease", "items_channel"]

log = logging.getLogger(__name__)

try:  # psycopg is optional (PostgreSQL only)
    import psycopg

    _DRIVER_ERRORS: tuple[type[BaseException], ...] = (sa_exc.SQLAlchemyError, psycopg.Error)
except ImportError:  # pragma: no cover - depends on the installation
    _DRIVER_ERRORS = (sa_exc.SQLAlchemyError,)

_SQL_SCHEMES = ("sqlite", *PG_SCHEMES)
_COLS = "id, gate, status, data, attempts, error, permanent, token, created_at, updated_at"
_WHERE_P = "namespace = :ns AND partition_id = :p"

_CLAIM = (
    " AND EXISTS (SELECT 1 FROM metafora_tasks ft WHERE ft.namespace = :ns AND ft.id = :p"
    " AND ft.state = 'claimed' AND ft.token = :token AND ft.owner = :node"
    " AND EXISTS (SELECT 1 FROM metafora_nodes fn WHERE fn.namespace = :ns"
    " AND fn.node_id = ft.owner AND fn.lease_until > {now}))"
)
_FENCE = (
    "EXISTS (SELECT 1 FROM metafora_partitions fp WHERE fp.namespace = :ns"
    " AND fp.partition_id = :p AND fp.token = :token AND fp.status = 'open'{claim})"
)

_GUARD_WHERE = " WHERE " + _WHERE_P + " AND token = :token AND status = 'open'{claim} RETURNING gate"

# The owner's statements ({claim} / {fence} differ with the fencing mode).
_OWNER_SQL: dict[str, str] = {
    "ensure": (
        "INSERT INTO metafora_partitions (namespace, partition_id) VALUES (:ns, :p)"
        " ON CONFLICT (namespace, partition_id) DO NOTHING"
    ),
    # An older claim's batch record says which items it had taken: those still available
    # and without a result from it are orphans, and their attempt under it is counted.
    "orphans": (
        "UPDATE metafora_items SET taken = 1, attempts = attempts + 1 WHERE " + _WHERE_P
        + " AND status = 'available' AND taken = 0 AND EXISTS (SELECT 1 FROM metafora_partitions"
        " bp WHERE bp.namespace = :ns AND bp.partition_id = :p AND bp.batch_token <> 0"
        " AND bp.batch_token < :token AND metafora_items.gate = bp.batch_gate"
        " AND metafora_items.id BETWEEN bp.batch_first AND bp.batch_last"
        " AND metafora_items.token <> bp.batch_token)"
    ),
    "open": (
        "UPDATE metafora_partitions SET token = :token, batch_token = 0, updated_at = {now}"
        " WHERE " + _WHERE_P + " AND token <= :token{claim} RETURNING gate, status"
    ),
    "state": (
        "SELECT gate, status, token, CASE WHEN 1 = 1{claim} THEN 1 ELSE 0 END"
        " FROM metafora_partitions WHERE " + _WHERE_P
    ),
    # Locks the partition row for the rest of the transaction (and proves the fence).
    "guard": "UPDATE metafora_partitions SET updated_at = {now}" + _GUARD_WHERE,
    # Unfenced: it runs inside a transaction whose guard (last) proves the fence.
    "take": (
        "SELECT " + _COLS + " FROM metafora_items WHERE " + _WHERE_P + " AND gate = :gate"
        " AND status = 'available' AND taken = 0 ORDER BY id LIMIT :limit"
    ),
    # The guard of a transaction that took a batch (ids first..last at gate), last in it:
    # it locks the partition row, proves the fence and records the batch, whose items'
    # attempt the next claim counts if this one dies (one statement for the three).
    "guard_record": (
        "UPDATE metafora_partitions SET updated_at = {now}, batch_token = :token,"
        " batch_gate = :gate, batch_first = :first, batch_last = :last" + _GUARD_WHERE
    ),
    "guard_unrecord": "UPDATE metafora_partitions SET updated_at = {now}, batch_token = 0" + _GUARD_WHERE,
    # An orphan this claim took on its own and never started (a clean stop came first):
    # an orphan again, its attempt and death under this claim not counted.
    "give_back": (
        "UPDATE metafora_items SET taken = 1, attempts = attempts - 1, deaths = deaths - 1"
        " WHERE " + _WHERE_P + " AND status = 'available' AND taken = 2 AND token = :token"
    ),
    # An item a dead claim had taken (an orphan) that died with it while taken on its own
    # (taken = 2), max_attempts times in a row: failed for good, never handed out again.
    "died": (
        "UPDATE metafora_items SET status = 'failed', error = :died, permanent = 1, taken = 0,"
        " deaths = deaths + 1, token = :token, updated_at = {now} WHERE " + _WHERE_P
        + " AND gate = :gate AND status = 'available' AND taken = 2"
        " AND deaths + 1 >= :max_deaths AND {fence} RETURNING " + _COLS
    ),
    # One orphan, taken on its own (taken = 2) so that only its own death counts; the ones
    # that died fewest times first, so the innocent finish before a poison item fails.
    "orphan": (
        "UPDATE metafora_items SET attempts = attempts + 1, taken = 2, deaths = deaths + 1,"
        " token = :token, updated_at = {now} WHERE id = (SELECT id FROM metafora_items"
        " WHERE " + _WHERE_P + " AND gate = :gate AND status = 'available' AND taken <> 0"
        " ORDER BY deaths, id LIMIT 1) AND {fence} RETURNING " + _COLS
    ),
    # The first try of an item taken on its own (taken = 2) was counted when it was taken.
    "result": (
        "UPDATE metafora_items SET status = :status, gate = :new_gate,"
        " data = CASE WHEN :keep = 1 THEN data ELSE :data END, error = :error,"
        " permanent = :permanent,"
        " attempts = attempts + :tries - CASE WHEN taken = 2 THEN 1 ELSE 0 END,"
        " taken = 0, deaths = 0, token = :token,"
        " updated_at = {now} WHERE " + _WHERE_P + " AND id = :id AND gate = :gate"
        " AND status = 'available' AND {fence}"
    ),
    "spawn": (
        "INSERT INTO metafora_items (namespace, partition_id, gate, status, data, token)"
        " SELECT :ns, :p, :new_gate, 'available', :data, :token WHERE {fence}"
    ),
    "reopen": (
        "UPDATE metafora_items SET status = 'available', updated_at = {now} WHERE " + _WHERE_P
        + " AND gate = :gate AND status = 'failed' AND permanent = 0 AND {fence}"
    ),
    "work": (
        "SELECT (SELECT min(gate) FROM metafora_items WHERE " + _WHERE_P
        + " AND status = 'available' AND gate >= :gate),"
        " (SELECT count(*) FROM metafora_items WHERE " + _WHERE_P
        + " AND status = 'failed' AND gate >= :gate)"
    ),
    "move": (
        "UPDATE metafora_partitions SET gate = :new_gate, updated_at = {now} WHERE " + _WHERE_P
        + " AND token = :token AND status = 'open'"
    ),
    "complete": (
        "UPDATE metafora_partitions SET status = 'completed', updated_at = {now} WHERE " + _WHERE_P
        + " AND token = :token AND status = 'open'"
    ),
    "failed_at": (
        "SELECT " + _COLS + " FROM metafora_items WHERE " + _WHERE_P
        + " AND gate = :gate AND status = 'failed' ORDER BY id LIMIT :limit"
    ),
}

# Statements of users and operators (unfenced: they are not owners).
_SQL: dict[str, str] = {
    "ensure": _OWNER_SQL["ensure"],
    "lock": "SELECT gate, status FROM metafora_partitions WHERE " + _WHERE_P + "{for_update}",
    "partition": "SELECT gate, status, token, updated_at FROM metafora_partitions WHERE " + _WHERE_P,
    "counts": (
        "SELECT gate, status, count(*) FROM metafora_items WHERE " + _WHERE_P + " GROUP BY gate, status"
    ),
    "item": "SELECT " + _COLS + " FROM metafora_items WHERE " + _WHERE_P + " AND id = :id",
    "unfinished_below": (
        "SELECT count(*) FROM metafora_items WHERE " + _WHERE_P
        + " AND status IN ('available', 'failed') AND gate < :gate"
    ),
    "set_gate": (
        "UPDATE metafora_partitions SET gate = :gate, updated_at = {now} WHERE " + _WHERE_P
    ),
    "retry": (
        "UPDATE metafora_items SET status = 'available', error = NULL, permanent = 0,"
        " deaths = 0, updated_at = {now} WHERE " + _WHERE_P + " AND status = 'failed'"
    ),
    "failures": (
        "SELECT count(*), coalesce(sum(permanent), 0) FROM metafora_items WHERE " + _WHERE_P
        + " AND status = 'failed'"
    ),
    "delete_items": "DELETE FROM metafora_items WHERE " + _WHERE_P,
    "delete_partition": "DELETE FROM metafora_partitions WHERE " + _WHERE_P,
    "notify": "SELECT pg_notify(:channel, :payload)",
}

_META = MetaData()
_ITEMS = Table(
    "metafora_items", _META,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("namespace", String),
    Column("partition_id", String),
    Column("gate", Integer),
    Column("status", String),
    Column("data", LargeBinary),
    Column("attempts", Integer),
    Column("error", Text),
    Column("permanent", Integer),
    Column("token", BigInteger),
)


def items_channel(namespace: str) -> str:
    """The PostgreSQL NOTIFY channel of a namespace's items (``i<partition>`` payloads)."""
    return "metafora_items_" + hashlib.sha1(namespace.encode()).hexdigest()[:16]


# -- in-process wake-ups ------------------------------------------------------------------


class _Hub:
    """Who waits for news of which partition, for one store in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}

    def subscribe(self, partition: str, event: threading.Event) -> None:
        """Set ``event`` on news of ``partition``."""
        with self._lock:
            self._waiters.setdefault(partition, set()).add(event)

    def unsubscribe(self, partition: str, event: threading.Event) -> None:
        """Stop setting ``event``."""
        with self._lock:
            waiting = self._waiters.get(partition)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[partition]

    def notify(self, partition: str) -> None:
        """News of ``partition``: wake its waiters."""
        with self._lock:
            events = list(self._waiters.get(partition, ()))
        for event in events:
            event.set()

    def notify_all(self) -> None:
        """Wake every waiter (news may have been missed, e.g. while reconnecting)."""
        with self._lock:
            events = [e for waiting in self._waiters.values() for e in waiting]
        for event in events:
            event.set()


_HUBS: dict[tuple[str, ...], _Hub] = {}
_HUBS_LOCK = threading.Lock()


def _hub_for(config: SQLConfig) -> _Hub:
    if config.kind == "sqlite":
        where = os.path.realpath(config.path or "")
    else:
        where = ",".join(f"{h}:{p or 5432}" for h, p in config.url.hosts) + config.url.path
    key = (config.kind, where, config.namespace)
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None:
            hub = _HUBS[key] = _Hub()
        return hub


# -- results of a batch ---------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What to write for one processed item (see :meth:`PartitionLease.finish`).

    ``status`` available (moved, or retried later), complete or failed; ``gate`` the item's
    gate afterwards; ``data`` None keeps the stored data; ``tries`` the attempts made.
    """

    item_id: int
    status: ItemStatus
    gate: int
    tries: int
    data: bytes | None = None
    error: str | None = None
    permanent: bool = False
    spawn: tuple[NewItem, ...] = ()


@dataclass(frozen=True)
class Advance:
    """What :meth:`PartitionLease.advance` found or did.

    ``kind``: ``work`` (items are available at the current gate), ``failed`` (failed items
    block the gate), ``moved`` (the gate jumped to ``gate``), ``waiting`` (work exists at
    higher gates but gates move by hand), ``completed`` (no work left; the partition is now
    completed), ``idle`` (no work left; the partition stays open).
    """

    kind: str
    gate: int


# -- the store ------------------------------------------------------------------------------


class ItemStore:
    """Items of gated partitions in a SQL database (SQLite or PostgreSQL).

    ``url`` is the SQL coordinator's own URL (then the items live beside its tasks and item
    writes are also fenced by the coordinator's claims), or a SQL URL of their own (when the
    coordinator is etcd); None means ``$METAFORA_URL`` or the embedded SQLite default.
    ``options`` are the SQL store's URL options (``namespace``, ``poll_interval``,
    ``pool_size``, ...). Nothing is touched until the first call, which creates the item
    tables if needed. Thread-safe; :meth:`close` releases the connections.
    """

    def __init__(self, url: str | None = None, **options: Any) -> None:
        parsed = parse_store_url(url or default_url())
        if parsed.scheme not in _SQL_SCHEMES:
            raise ConfigError(
                f"items live in SQL (sqlite:///PATH.db or postgresql://...), not {parsed}; with an "
                "etcd coordinator give the item store a SQL URL of its own"
            )
        self._db = Database(parse_config(parsed, dict(options)))
        self._config = self._db.config
        fragments = self._db.dialect.fragments()
        self._now = fragments["now"]
        self._is_pg = isinstance(self._db.dialect, PostgresDialect)
        self._sql: dict[str, TextClause] = {
            name: text(sql.format(now=self._now, for_update=" FOR UPDATE" if self._is_pg else ""))
            for name, sql in _SQL.items()
        }
        self._owner_sql: dict[bool, dict[str, TextClause]] = {}
        self._hub = _hub_for(self._config)
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

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except MetaforaError:
            raise
        except _DRIVER_ERRORS as exc:
            raise translate_error(exc, self._config) from exc

    def ensure_schema(self, conn: Connection | None = None) -> None:
        """Create or upgrade the item tables (once per store object; cheap afterwards).

        With ``conn`` (the caller's transaction), a missing schema is created on it, so it
        commits or rolls back with the caller's work.
        """
        self._check_open()
        if self._schema_ready:
            return
        if conn is not None:
            with self._translated():
                version = current_version(conn)
                check_version(version, self.name)
                if version < GATES_SCHEMA_VERSION:
                    migrate(conn, self._db.dialect, self.name)
            return
        with self._lock:
            if self._schema_ready:
                return
            with self._db.read() as rconn:
                version = current_version(rconn)
            check_version(version, self.name)
            if version < GATES_SCHEMA_VERSION:
                with self._db.transaction() as wconn:
                    migrate(wconn, self._db.dialect, self.name)
                log.info("item tables of %s are ready", self.name, extra={"action": "schema"})
            self._schema_ready = True

    def _run(self, conn: Connection, name: str, params: dict[str, Any]) -> Any:
        params["ns"] = self._config.namespace
        return conn.execute(self._sql[name], params)

    @contextmanager
    def _transaction(self, conn: Connection | None) -> Iterator[Connection]:
        if conn is None:
            with self._db.transaction() as own:
                yield own
        else:
            with self._translated():
                yield conn

    def owner_statements(self, claim_fence: bool) -> dict[str, TextClause]:
        """The owner's fenced statements (built once per fencing mode)."""
        with self._lock:
            built = self._owner_sql.get(claim_fence)
            if built is None:
                claim = _CLAIM.format(now=self._now) if claim_fence else ""
                fence = _FENCE.format(claim=claim)
                built = {
                    name: text(sql.format(now=self._now, claim=claim, fence=fence))
                    for name, sql in _OWNER_SQL.items()
                }
                self._owner_sql[claim_fence] = built
            return built

    def _item(self, partition: str, row: Any) -> Item:
        conv = self._db.dialect.from_db_time
        return Item(
            partition=partition,
            id=int(row[0]),
            gate=int(row[1]),
            status=ItemStatus(row[2]),
            data=bytes(row[3]) if row[3] is not None else b"",
            attempts=int(row[4]),
            error=row[5],
            permanent=bool(row[6]),
            token=int(row[7]),
            created_at=conv(row[8]),
            updated_at=conv(row[9]),
        )

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
            from metafora.coordinators.sql.listen import Listener

            dialect = PostgresDialect(self._config)
            dialect.channel = self._channel
            hub = self._hub

            def on_notify(payload: str) -> None:
                if payload.startswith("i"):
                    hub.notify(payload[1:])

            self._listener = Listener(dialect, "items", on_notify, hub.notify_all)
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
                raise PartitionClosed(f"partition {partition!r} is completed; it takes no more items")
            low = min(item.gate for item in batch)
            if low < int(gate):
                raise ItemBelowGate(
                    f"cannot add an item at gate {low} to partition {partition!r}: its current gate "
                    f"is {gate}, so the item would never run; add it at gate {gate} or above"
                )
            rows = [
                {"namespace": self._config.namespace, "partition_id": partition, "gate": item.gate,
                 "status": ItemStatus.AVAILABLE.value, "data": item.data, "attempts": 0,
                 "permanent": 0, "token": 0}
                for item in batch
            ]
            result = tx.execute(
                _ITEMS.insert().returning(_ITEMS.c.id, sort_by_parameter_order=True), rows)
            ids = [int(row[0]) for row in result]
            self._notify(tx, partition)
        self._hub.notify(partition)
        log.debug("added %d item(s) to partition %s", len(ids), partition,
                  extra={"task": partition, "action": "add"})
        return ids

    # -- reading ----------------------------------------------------------------------------

    def list(self, partition: str, *, gate: int | None = None,
             status: ItemStatus | str | None = None, limit: int | None = None,
             after: int | None = None) -> list[Item]:
        """The partition's items (at ``gate``, in ``status``), ordered by id; ``after`` an id
        to page from, ``limit`` the most to return."""
        validate_task_id(partition)
        conditions = ["namespace = :ns", "partition_id = :p"]
        params: dict[str, Any] = {"p": partition, "ns": self._config.namespace}
        if gate is not None:
            conditions.append("gate = :gate")
            params["gate"] = _gate(gate)
        if status is not None:
            conditions.append("status = :status")
            params["status"] = ItemStatus(status).value
        if after is not None:
            conditions.append("id > :after")
            params["after"] = int(after)
        sql = f"SELECT {_COLS} FROM metafora_items WHERE {' AND '.join(conditions)} ORDER BY id"
        if limit is not None:
            if limit < 0:
                raise ConfigError(f"limit must be >= 0, got {limit}")
            sql += " LIMIT :limit"
            params["limit"] = int(limit)
        self.ensure_schema()
        with self._db.read() as conn:
            rows = conn.execute(text(sql), params).fetchall()
        return [self._item(partition, row) for row in rows]

    def get(self, partition: str, item_id: int) -> Item:
        """One item. Raises ItemNotFound."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.read() as conn:
            row = self._run(conn, "item", {"p": partition, "id": int(item_id)}).first()
        if row is None:
            raise ItemNotFound(f"no item {item_id} in partition {partition!r} of {self.name}")
        return self._item(partition, row)

    def info(self, partition: str) -> PartitionInfo:
        """The partition's gate, status, owner token and item counts (by gate and status)."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.read() as conn:
            row = self._run(conn, "partition", {"p": partition}).first()
            counts_rows = self._run(conn, "counts", {"p": partition}).fetchall()
        counts: dict[int, dict[ItemStatus, int]] = {}
        for gate, status, count in counts_rows:
            counts.setdefault(int(gate), {})[ItemStatus(status)] = int(count)
        if row is None:
            return PartitionInfo(partition, counts=counts, exists=bool(counts))
        return PartitionInfo(
            partition, gate=int(row[0]), status=PartitionStatus(row[1]), token=int(row[2]),
            counts=counts, exists=True, updated_at=self._db.dialect.from_db_time(row[3]),
        )

    def failures(self, partition: str) -> tuple[int, int]:
        """How many items of the partition are failed, and how many of those permanently."""
        validate_task_id(partition)
        self.ensure_schema()
        with self._db.read() as conn:
            failed, permanent = self._run(conn, "failures", {"p": partition}).one()
        return int(failed), int(permanent)

    # -- operators --------------------------------------------------------------------------

    def set_gate(self, partition: str, gate: int, *, force: bool = False) -> int:
        """Move the partition's gate to ``gate`` (``manual_checkpoint`` partitions wait for
        this); returns the previous gate.

        Refused (:class:`GateMoveRefused`) if items below ``gate`` are still available or failed --
        they would be stranded -- unless ``force``; and for a completed partition
        (:class:`PartitionClosed`). The owner picks the new gate up at once.
        """
        validate_task_id(partition)
        _gate(gate)
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

    def retry(self, partition: str) -> int:
        """Make the partition's failed items available again (error cleared); returns how
        many. See :func:`metafora.statemachine.gates.retry_partition` to also revive the
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

    # -- owners -----------------------------------------------------------------------------

    def lease(self, task: Task, node_id: str | None = None, *, claim_fence: bool = False,
              bound: LeaseBound | None = None) -> PartitionLease:
        """The fenced handle of the claim ``task`` (carrying its token) on the partition.

        ``claim_fence`` also checks every write against the coordinator's own tables (only
        when this store is the SQL coordinator's database; needs ``node_id``). ``bound``
        (:func:`~metafora.statemachine.store.lease_bound_of` the coordinator) limits every
        fenced write to the time the node still holds the claim (else ClaimLost).
        """
        if claim_fence and node_id is None:
            raise ConfigError("claim_fence needs the node id of the claim's owner")
        return PartitionLease(self, task, node_id, claim_fence, bound)

    def read(self) -> Any:
        """A connection for autocommit reads (context manager; errors translated)."""
        return self._db.read()

    def transaction(self, timeout: float | None = None) -> Any:
        """A connection in a transaction (context manager; errors translated), waiting at
        most ``timeout`` seconds for locks when given."""
        return self._db.bounded(timeout)

    def item_from_row(self, partition: str, row: Any) -> Item:
        """An :class:`Item` from a row of the item columns."""
        return self._item(partition, row)

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

    def __enter__(self) -> ItemStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ItemStore({self.name!r})"


class PartitionLease:
    """A claim's fenced access to its partition's items (built by :meth:`ItemStore.lease`).

    Every write is refused with :class:`~metafora.errors.ClaimLost` once the claim is gone:
    a newer claim opened the partition, or (same-database mode) the coordinator no longer
    shows this node holding the task under this token with a live lease.
    """

    def __init__(self, store: ItemStore, task: Task, node_id: str | None, claim_fence: bool,
                 bound: LeaseBound | None = None) -> None:
        self.store = store
        self.task = task
        self.partition = task.id
        self.token = task.token
        self._node = node_id
        self._sql = store.owner_statements(claim_fence)
        self.claim_fence = claim_fence
        self._bound = bound or LeaseBound()

    @contextmanager
    def _transaction(self, what: str) -> Iterator[Connection]:
        """A fenced write's transaction, bounded by the node's lease on the claim."""
        with self._bound.bounding(self.task, what) as timeout, self.store.transaction(timeout) as tx:
            yield tx

    def _params(self, **extra: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"ns": self.store.namespace, "p": self.partition, "token": self.token}
        if self._node is not None:
            params["node"] = self._node
        params.update(extra)
        return params

    def _lost(self, why: str = "") -> ClaimLost:
        return ClaimLost(
            f"partition {self.partition!r} is no longer held with token {self.token}{why}"
        )

    def open(self) -> tuple[int, PartitionStatus]:
        """Take the partition for this claim (raise its token to ours); its gate and status.

        The items an older claim had taken in its last batch and left without a result
        become orphans (see :meth:`take`), their attempt counted. ClaimLost if a newer claim
        already took it (or the claim is not held).
        """
        self.store.ensure_schema()
        with self._transaction("open the partition") as tx:
            tx.execute(self._sql["ensure"], self._params())
            orphans = int(tx.execute(self._sql["orphans"], self._params()).rowcount)
            row = tx.execute(self._sql["open"], self._params()).first()
            if row is None:
                raise self._lost(" (a newer claim took it)")
        if orphans:
            log.warning("partition %s: %d item(s) were in work when their last owner stopped "
                        "without writing them; they run again one at a time", self.partition,
                        orphans, extra={"task": self.partition, "action": "orphans"})
        return int(row[0]), PartitionStatus(row[1])

    def state(self) -> tuple[int, PartitionStatus]:
        """The partition's current gate and status, checking that this claim still holds it."""
        with self.store.read() as conn:
            row = conn.execute(self._sql["state"], self._params()).first()
        if row is None or int(row[2]) != self.token or not int(row[3]):
            raise self._lost()
        return int(row[0]), PartitionStatus(row[1])

    def take(self, gate: int, limit: int, results: Sequence[Outcome] = (), *,
             max_deaths: int = 3) -> list[Item]:
        """Write ``results`` (items processed at ``gate``, as :meth:`finish`), then take up to
        ``limit`` available items of ``gate`` for processing, in one fenced transaction.

        Items are taken in a batch, in id order, and the batch is recorded on the partition
        row in the same transaction: if this claim ends without writing an item's result
        (its process died), the next claim counts that attempt and treats the item as an
        **orphan** (:meth:`open`). When no other item is left, orphans are taken one at a
        time (their attempt recorded on the item), so that only an item that kills its
        process keeps counting deaths; an orphan whose claim died with it taken on its own,
        ``max_deaths`` claims in a row (counting the batch it was first in), is returned
        **failed** instead ("process died while processing", permanent).

        The items are returned as stored, except ``attempts``: the attempts made before
        this one. ClaimLost (nothing written) if the claim is gone.
        """
        with self._transaction("item results and take") as tx:
            # The guard (last, as in every owner write) is also the batch's record.
            self._write(tx, gate, results)
            rows = tx.execute(self._sql["take"], self._params(gate=gate, limit=limit)).fetchall()
            if rows:
                self._guard(tx, "guard_record", gate=gate, first=int(rows[0][0]), last=int(rows[-1][0]))
                return [self.store.item_from_row(self.partition, row) for row in rows]
            self._guard(tx)
            rows = self._take_orphan(tx, gate, max_deaths)
        return [self._alone(self.store.item_from_row(self.partition, row)) for row in rows]

    @staticmethod
    def _alone(item: Item) -> Item:
        """An item taken on its own, as the processor sees it (its attempt counted already)."""
        return item if item.status is ItemStatus.FAILED else replace(item, attempts=item.attempts - 1)

    def _take_orphan(self, tx: Connection, gate: int, max_deaths: int) -> list[Any]:
        died = self._params(gate=gate, max_deaths=max_deaths, died=(
            f"process died while processing this item ({max_deaths} claim(s) in a row ended "
            "without its result; the last one had taken it on its own)"))
        rows = tx.execute(self._sql["died"], died).fetchall()
        if rows:
            log.warning("partition %s: item(s) %s failed: their process died while processing "
                        "them %d time(s) in a row", self.partition, [int(r[0]) for r in rows],
                        max_deaths, extra={"task": self.partition, "action": "item_died"})
            return list(rows)
        return list(tx.execute(self._sql["orphan"], self._params(gate=gate)).fetchall())

    def _guard(self, tx: Connection, statement: str = "guard", **params: Any) -> int:
        """Lock the partition row, proving the fence (last in a write, see the module
        docstring); its gate. ClaimLost if the claim is gone."""
        row = tx.execute(self._sql[statement], self._params(**params)).first()
        if row is None:
            raise self._lost()
        return int(row[0])

    def finish(self, gate: int, outcomes: Sequence[Outcome], *, release: bool = False) -> int:
        """Write the results of items processed at ``gate`` (and their spawned items) in one
        fenced transaction; returns how many items were written.

        An item changed meanwhile (already written, deleted, retried) is skipped with a
        warning, and so are the items it spawned: calling ``finish`` again after a commit
        whose answer was lost writes nothing twice. ``release``: the claim is letting go of
        the partition cleanly, so its batch record is dropped: the items it took and never
        started are not orphans (no attempt counted). ClaimLost (nothing written) if the
        claim is gone.
        """
        if not outcomes and not release:
            return 0
        with self._transaction("item results") as tx:
            written = self._write(tx, gate, outcomes)
            if release:
                tx.execute(self._sql["give_back"], self._params())
            self._guard(tx, "guard_unrecord" if release else "guard")
        return written

    def _write(self, tx: Connection, gate: int, outcomes: Sequence[Outcome]) -> int:
        """Write item results inside ``tx`` (guarded by the caller); how many were written."""
        plain: list[dict[str, Any]] = []
        spawning: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        for out in outcomes:
            row = self._params(
                id=out.item_id, gate=gate, status=out.status.value, new_gate=out.gate,
                keep=1 if out.data is None else 0, data=out.data, error=out.error,
                permanent=1 if out.permanent else 0, tries=out.tries,
            )
            if out.spawn:
                spawning.append((row, [self._params(new_gate=n.gate, data=n.data) for n in out.spawn]))
            else:
                plain.append(row)
        written = 0
        if plain:
            written += int(tx.execute(self._sql["result"], plain).rowcount)
        for row, spawns in spawning:  # one by one: spawn only for a result written now
            if int(tx.execute(self._sql["result"], row).rowcount) != 1:
                continue
            written += 1
            if int(tx.execute(self._sql["spawn"], spawns).rowcount) != len(spawns):
                raise self._lost()
        if written != len(outcomes):
            log.warning("partition %s: %d of %d item result(s) not written (the items changed "
                        "meanwhile)", self.partition, len(outcomes) - written, len(outcomes),
                        extra={"task": self.partition, "action": "finish"})
        return written

    def reopen_failed(self, gate: int) -> int:
        """Make the retryable failed items of ``gate`` available again (a partition retry)."""
        with self._transaction("reopen failed items") as tx:
            reopened = int(tx.execute(self._sql["reopen"], self._params(gate=gate)).rowcount)
            self._guard(tx)
            return reopened

    def failed_items(self, gate: int, limit: int = 5) -> list[Item]:
        """A few failed items of ``gate`` (for error messages)."""
        with self.store.read() as conn:
            rows = conn.execute(self._sql["failed_at"], self._params(gate=gate, limit=limit)).fetchall()
        return [self.store.item_from_row(self.partition, row) for row in rows]

    def peek(self, gate: int) -> tuple[int | None, int]:
        """The lowest gate >= ``gate`` with available items (or None), and the failed count."""
        with self.store.read() as conn:
            low, failed = conn.execute(self._sql["work"], self._params(gate=gate)).one()
        return (None if low is None else int(low)), int(failed)

    def advance(self, gate: int, *, move: bool, close: bool) -> Advance:
        """Decide, atomically with any concurrent add, what follows an empty gate ``gate``.

        In one fenced transaction holding the partition row: if ``gate`` has work again or
        failed items, say so; else jump to the lowest gate with available items (``move``)
        -- not one step per poll; else, with no work left, complete the partition
        (``close``) or report it idle.
        """
        with self._transaction("gate advance") as tx:
            current = self._guard(tx)
            if current != gate:
                return Advance("moved", current)  # moved by an operator meanwhile
            low, failed = tx.execute(self._sql["work"], self._params(gate=gate)).one()
            if int(failed):
                return Advance("failed", gate)
            if low is not None and int(low) == gate:
                return Advance("work", gate)
            if low is not None:
                if not move:
                    return Advance("waiting", gate)
                tx.execute(self._sql["move"], self._params(new_gate=int(low)))
                return Advance("moved", int(low))
            if close:
                tx.execute(self._sql["complete"], self._params())
                return Advance("completed", gate)
            return Advance("idle", gate)
