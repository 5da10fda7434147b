"""The SQL job log: a ready :class:`~metafora.streams.Jobs` for push-style producers.

A log is a named, append-only sequence of jobs in a SQL database (SQLite or PostgreSQL; the
coordinator's own, or one of its own beside an etcd coordinator). Each job has a **key**,
unique in its log, a JSON payload and an **index**: 0, 1, 2, ... with no gap, as
:class:`~metafora.streams.Jobs` requires (every index up to ``head()`` has a job).

**Dense indexes.** The log's row in ``metafora_joblogs`` is its counter. An append, in one
transaction: (1) creates or locks that row and reads the head (PostgreSQL: the row lock, held
to the end of the transaction; SQLite: the database's write lock); (2) looks up which of its
keys the log has already (exact: nobody else can append to the log meanwhile); (3) inserts
the new keys at ``head + 1, head + 2, ...``; (4) writes the new head (and, on PostgreSQL,
NOTIFYs in the same statement). Concurrent appenders of one log queue on the row, each one
starting from the head the previous one committed; a rolled-back append leaves the head where
it was, so the next append reuses its indexes. The head and the jobs under it commit
together, so ``head()`` never shows an index whose job is not visible. With ``conn=`` the
same statements run in the application's transaction: under REPEATABLE READ or SERIALIZABLE
a concurrent append makes the database refuse the later one (a serialization error: retry).

**Keys.** An append of a key the log has returns its existing index and writes nothing (a
stage of a pipeline that runs again appends no duplicate); a key repeated within one call
takes one index (its first payload).

**Reads.** ``head()`` is one primary-key lookup of the counter row; ``at_index(i)`` reads the
jobs ``i .. i + READ_AHEAD - 1`` in one range scan of the primary key and keeps them (a
committed job never changes), so a stream walking its window costs one query per
:data:`READ_AHEAD` jobs; ``at_range(start, stop)`` (what a stream uses) reads the range in one
scan (per :data:`MAX_RANGE` jobs) and keeps nothing. Both read on the bare driver connection
(its tuples, no SQLAlchemy Row per job) and decode a payload as ``append`` stored it with
json's C scanner straight away (see ``SQLJobLog._jobs``): with short jobs a stream's reads
were a third of its CPU.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from json.scanner import make_scanner
from typing import Any, cast

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from metafora.contracts.backends import default_url
from metafora.coordinators.sql.appconn import sync_app_conn
from metafora.coordinators.sql.joblog import wakeups
from metafora.coordinators.sql.joblog.schema import (
    JOBLOG_SCHEMA_VERSION,
    current_version,
    ensure_version,
    migrate,
)
from metafora.coordinators.sql.joblog.statements import JobLogStatements, append_steps, lock_steps
from metafora.coordinators.sql.shared import (
    SQL_SCHEMES,
    Database,
    SQLConfig,
    parse_config,
    schema_not_ready,
)
from metafora.coordinators.sql.submit import run_steps
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError, MetaforaError, StoreError
from metafora.core.jsontext import MAX_DEPTH, check_depth, load_value
from metafora.streams.jobs import Job, Jobs, Wake

__all__ = [
    "DEFAULT_POOL_SIZE",
    "MAX_APPEND",
    "MAX_APPEND_BYTES",
    "MAX_KEY_LENGTH",
    "MAX_PAYLOAD_BYTES",
    "MAX_RANGE",
    "READ_AHEAD",
    "JobLogInfo",
    "SQLJobLog",
    "job_logs",
]

log = logging.getLogger(__name__)

MAX_KEY_LENGTH = 256
"""The longest key of a job (characters)."""
MAX_NAME_LENGTH = 256
"""The longest name of a log (characters)."""
MAX_PAYLOAD_BYTES = 1024 * 1024
"""The largest payload of one job, as JSON."""
MAX_APPEND = 10_000
"""The most items one :meth:`SQLJobLog.append` takes (append more in several calls)."""
MAX_APPEND_BYTES = 16 * 1024 * 1024
"""The most bytes of keys and payloads one :meth:`SQLJobLog.append` takes."""
DEFAULT_POOL_SIZE = 2
"""Connections of the pool the logs of one URL share in a process, unless the URL's
``pool_size`` option says otherwise (on PostgreSQL: twice that at most for reads, as many again
for appends)."""
READ_AHEAD = 128
"""Jobs read by one ``at_index`` that misses (the next ones are kept for the calls after)."""
_KEPT = 4 * READ_AHEAD  # jobs kept at most per log handle
MAX_RANGE = 1024
"""Jobs read by one query of :meth:`SQLJobLog.at_range` (a longer range takes several)."""

try:
    import psycopg
except ImportError:  # pragma: no cover - depends on the installation
    psycopg = None  # type: ignore[assignment]

# json.loads' own C scanner, run straight on a stored payload (see SQLJobLog._jobs).
# (typeshed types make_scanner as the pure-Python class; it returns the C scanner's callable)
_SCAN: Callable[[str, int], tuple[Any, int]] = cast(Any, make_scanner)(json.JSONDecoder())
# JSON text this short cannot nest deeper than MAX_DEPTH (each level takes two brackets).
_SHALLOW = 2 * MAX_DEPTH


@dataclass(frozen=True)
class JobLogInfo:
    """What an operator sees of a log: its name, head (``size`` = head + 1, indexes being
    dense) and when it was created and last appended to (None: the log has no row yet)."""

    name: str
    head: int
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @property
    def size(self) -> int:
        """How many jobs the log holds."""
        return self.head + 1


def _check_text(value: object, what: str, limit: int) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string, not {type(value).__name__}")
    if not value:
        raise ConfigError(f"{what} must not be empty")
    if len(value) > limit:
        raise ConfigError(f"{what} is {len(value)} characters long; the limit is {limit}: {value[:40]!r}...")
    if not value.isprintable():
        raise ConfigError(f"{what} {value!r} contains a control character")
    return value


def _encode(payload: object, key: str) -> str:
    what = f"the payload of job {key!r}"
    check_depth(payload, what, ConfigError, MAX_DEPTH, 0)
    try:
        encoded = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} is not JSON-serialisable: {exc}") from None
    if len(encoded) > MAX_PAYLOAD_BYTES:  # ASCII (json.dumps escapes the rest): len is bytes
        raise ConfigError(f"{what} takes {len(encoded)} bytes as JSON; the limit is {MAX_PAYLOAD_BYTES}")
    return encoded


def check_items(items: Iterable[Any]) -> list[tuple[str, str]]:
    """``items`` (``(key, payload)`` pairs) checked and encoded; ConfigError naming the first
    bad one (nothing is written then)."""
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable):
        raise ConfigError(f"items must be a list of (key, payload) pairs, not {type(items).__name__}")
    batch: list[tuple[str, str]] = []
    size = 0
    for number, item in enumerate(items):
        if number >= MAX_APPEND:
            raise ConfigError(f"one append takes at most {MAX_APPEND} items; append the rest in another call")
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(f"item {number} must be a (key, payload) pair, got {item!r:.80}")
        key = _check_text(item[0], f"the key of item {number}", MAX_KEY_LENGTH)
        payload = _encode(item[1], key)
        size += len(key.encode()) + len(payload)
        if size > MAX_APPEND_BYTES:
            raise ConfigError(f"one append takes at most {MAX_APPEND_BYTES} bytes of keys and payloads;"
                              " append the rest in another call")
        batch.append((key, payload))
    return batch


class _Shared:
    """One :class:`Database` per store URL and options in this process, shared by its logs
    (a stream per log must not mean a connection pool per stream)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dbs: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Database, int]] = {}

    def open(self, url: str, options: dict[str, Any]) -> tuple[Database, Callable[[], None]]:
        key = (url, tuple(sorted((k, repr(v)) for k, v in options.items())))
        with self._lock:
            found = self._dbs.get(key)
            if found is None:
                parsed = parse_store_url(url)
                if parsed.scheme not in SQL_SCHEMES:
                    raise ConfigError(
                        f"a job log needs a SQL store URL (sqlite:///... or postgresql://...), not "
                        f"{parsed.redacted()!r}; beside an etcd coordinator give it a SQL database of its own"
                    )
                chosen = dict(options)
                if "pool_size" not in chosen and "pool_size" not in parsed.query:
                    # Reads and appends are short: a few connections serve every stream of
                    # the process (a PostgreSQL server has few to give: 100 by default).
                    chosen["pool_size"] = DEFAULT_POOL_SIZE
                found = (Database(parse_config(parsed, chosen)), 0)
            db, users = found
            self._dbs[key] = (db, users + 1)

        def release() -> None:
            with self._lock:
                db_now, left = self._dbs[key]
                if left > 1:
                    self._dbs[key] = (db_now, left - 1)
                    return
                del self._dbs[key]
            db_now.close()

        return db, release


_SHARED = _Shared()
_READY: set[tuple[str, str]] = set()  # databases whose job log tables are known current
_READY_LOCK = threading.Lock()


def _ready_key(config: SQLConfig) -> tuple[str, str]:
    return (config.kind, config.path or f"{config.url.hosts}{config.url.path}")


class SQLJobLog(Jobs):
    """A named job log in a SQL store (SQLite or PostgreSQL): a :class:`~metafora.streams.Jobs`
    that producers :meth:`append` to, inside their own transaction if they like.

    ``url`` is a SQL store URL (default: ``$METAFORA_URL`` or the embedded SQLite file); its
    ``namespace`` option separates logs of one database as it separates tasks. The log needs
    no coordinator in that database: beside an etcd coordinator, give it a SQL URL of its own.
    ``options`` are the SQL store's URL options. Handles of one URL in a process share one
    connection pool (``pool_size`` :data:`DEFAULT_POOL_SIZE` unless the URL or ``options`` set
    it) and (PostgreSQL) one LISTEN connection.

    >>> log = SQLJobLog("sqlite:///metafora.db", "chunks")              # doctest: +SKIP
    >>> log.append([("block-7/0", {"size": 512}), ("block-7/1", {"size": 64})])  # doctest: +SKIP
    [0, 1]
    """

    def __init__(self, url: str | None, name: str, **options: Any) -> None:
        self.name = _check_text(name, "the job log name", MAX_NAME_LENGTH)
        self._db, self._release = _SHARED.open(url or default_url(), options)
        self._config = self._db.config
        self._ns = self._config.namespace
        self._postgres = self._config.kind == "postgresql"
        self._sql = JobLogStatements.build(self._db.dialect.fragments()["now"], self._postgres)
        self._lock = threading.Lock()
        self._kept: dict[int, Job] = {}
        self._unlisten: list[Callable[[], None]] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"SQLJobLog({self._db.name!r}, {self.name!r})"

    @property
    def url(self) -> str:
        """The store URL without its password."""
        return self._db.name

    # -- schema -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise MetaforaError(f"the job log {self.name!r} on {self._db.name} is closed")

    def ensure_schema(self, conn: Connection | None = None) -> None:
        """Create or upgrade the job log tables (once per database and process).

        With ``conn`` (a SQLAlchemy connection in the caller's transaction) a missing schema
        is created in it, so it commits or rolls back with the caller's work.
        """
        self._check_open()
        key = _ready_key(self._config)
        if key in _READY:
            return
        with self._db.read() as rconn:
            version = current_version(rconn)
        ensure_version(version, self._db.name)
        if not self._config.migrate and version < JOBLOG_SCHEMA_VERSION:
            # migrate=false: a release step owns the schema ('metafora migrate' applies it)
            raise schema_not_ready(self._db.name, "job log tables' schema", version,
                                   JOBLOG_SCHEMA_VERSION)
        if version < JOBLOG_SCHEMA_VERSION:
            if conn is not None:
                with self._db.translated():
                    migrate(conn, self._db.dialect, self._db.name)
                return  # (not known ready until the caller commits)
            with _READY_LOCK, self._db.transaction() as wconn:
                migrate(wconn, self._db.dialect, self._db.name)
            log.info("job log tables of %s are ready", self._db.name, extra={"action": "schema"})
        _READY.add(key)

    # -- appending --------------------------------------------------------------------------

    def append(self, items: Iterable[tuple[str, Any]], *, conn: Any = None) -> list[int]:
        """Append ``items`` (``(key, payload)`` pairs) in one transaction; their indexes, in order.

        A key the log holds already keeps its index and nothing is written for it; a key
        repeated in ``items`` takes one index. Keys are non-empty strings of at most
        :data:`MAX_KEY_LENGTH` characters; payloads JSON-serialisable, at most
        :data:`MAX_PAYLOAD_BYTES` each; at most :data:`MAX_APPEND` items and
        :data:`MAX_APPEND_BYTES` per call (ConfigError naming the bad item: nothing written).

        ``conn`` joins the application's open transaction (a SQLAlchemy ``Connection`` or
        ``Session``, or a psycopg ``Connection``, on this store's database; not in
        autocommit): the jobs appear when it commits, or never. Streams reading the log are
        woken at the commit (PostgreSQL: NOTIFY; SQLite: the head's move is seen).
        """
        self._check_open()
        batch = check_items(items)
        if not batch:
            return []
        if conn is not None:
            return self._append_in(conn, batch)
        self.ensure_schema()
        with self._db.transaction() as tx:
            head = run_steps(tx, self._db, lock_steps(self._sql, self._ns, self.name))
            indexes = run_steps(tx, self._db, append_steps(self._sql, self._ns, self.name, head, batch))
        wakeups.notify_local(self._config, self._ns, self.name)
        log.debug("appended %d item(s) to job log %s", len(batch), self.name,
                  extra={"action": "append", "log": self.name})
        return indexes

    def _append_in(self, conn: Any, batch: list[tuple[str, str]]) -> list[int]:
        sync_app_conn(conn, self._db)  # the check of every conn=: its kind, never autocommit
        # SQLite: a missing schema is made in the caller's transaction (it may hold the write
        # lock already); PostgreSQL makes it in a transaction of its own.
        sa_conn = conn.connection() if isinstance(conn, Session) else conn
        self.ensure_schema(sa_conn if self._config.kind == "sqlite" else None)
        head = run_steps(conn, self._db, lock_steps(self._sql, self._ns, self.name))
        return run_steps(conn, self._db, append_steps(self._sql, self._ns, self.name, head, batch))

    # -- reading (Jobs) ---------------------------------------------------------------------

    def head(self) -> int:
        """The highest index in the log (-1 when it is empty): one primary-key lookup."""
        self.ensure_schema()
        with self._db.read() as conn:
            row = conn.execute(self._sql.head, {"ns": self._ns, "log": self.name}).first()
        return -1 if row is None else int(row[0])

    def at_index(self, index: int) -> Job | None:
        """The job at ``index`` (``Job(index, key, payload)``), or None if not appended yet."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise ConfigError(f"a job index must be an integer, not {type(index).__name__}")
        if index < 0:
            return None
        with self._lock:
            job = self._kept.get(index)
        if job is not None:
            return job
        self.ensure_schema()
        with self._db.read() as conn:
            rows = self._rows(conn, index, index + READ_AHEAD)
        read: list[Job | None] = [None] * READ_AHEAD
        self._jobs(rows, read, index)
        jobs = {job.index: job for job in read if job is not None}
        if jobs:
            with self._lock:
                if len(self._kept) + len(jobs) > _KEPT:
                    self._kept.clear()  # streams move forward: the old ones are not read again
                self._kept.update(jobs)
        return jobs.get(index)

    def at_range(self, start: int, stop: int) -> list[Job | None]:
        """The jobs at ``start .. stop - 1`` (None where not appended yet): one range scan
        per :data:`MAX_RANGE` jobs, nothing kept."""
        for value in (start, stop):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"a job index must be an integer, not {type(value).__name__}")
        out: list[Job | None] = [None] * max(0, stop - start)
        first = max(0, start)
        if first >= stop:
            return out
        self.ensure_schema()
        with self._db.read() as conn:
            for low in range(first, stop, MAX_RANGE):
                self._jobs(self._rows(conn, low, min(stop, low + MAX_RANGE)), out, start)
        return out

    def _rows(self, conn: Connection, first: int, end: int) -> list[tuple[Any, ...]]:
        """The rows ``(index, key, payload)`` of ``first .. end - 1``, in order, through the
        bare driver connection: the driver's tuples, no SQLAlchemy Row per job (with short
        jobs, reading them was a third of a stream's CPU)."""
        raw: Any = conn.connection.driver_connection
        params = (self._ns, self.name, first, end)
        if self._postgres:
            rows: list[tuple[Any, ...]] = raw.execute(self._sql.read, params,
                                                      prepare=True).fetchall()
            return rows
        cursor = raw.execute(self._sql.read, params)
        try:
            rows = cursor.fetchall()
        finally:
            cursor.close()
        return rows

    def _jobs(self, rows: list[tuple[Any, ...]], out: list[Job | None], start: int) -> None:
        """The jobs of ``rows`` into ``out`` (at ``index - start``).

        A payload as :meth:`append` stores it (compact JSON text, short or shallow) is decoded
        by json.loads' own C scanner run straight on it: the value ``json.loads`` -- and so
        :func:`~metafora.jsontext.load_value`, which walks only text with more than
        ``MAX_DEPTH`` brackets -- would return, without their calls and whitespace matches
        (about a microsecond a job). Anything else (longer and deep, padded, not JSON, not
        text) takes the bounded decode, which refuses it naming the job, or accepts it.
        """
        scan, shallow, make = _SCAN, _SHALLOW, Job
        for index, key, raw in rows:
            try:
                if len(raw) > shallow and (raw.count("{") + raw.count("[") > MAX_DEPTH
                                           or len(raw) > MAX_PAYLOAD_BYTES):
                    raise ValueError("deep or long: the bounded decode judges it")
                value, end = scan(raw, 0)
                if end != len(raw):
                    raise ValueError("padded or extra data: the bounded decode judges it")
            except Exception:  # (StopIteration, ValueError, TypeError, RecursionError, ...)
                value = self._payload(key, raw)
            out[index - start] = make(index, key, value)

    def _payload(self, key: str, raw: str) -> Any:
        try:
            return load_value(raw, "", StoreError)
        except StoreError:  # decoded again to name the job (the name costs time on each job)
            return load_value(raw, f"the stored payload of job {key!r} in log {self.name!r}", StoreError)

    def index_of(self, key: str) -> int | None:
        """The index of the job with ``key``, or None if the log has none."""
        _check_text(key, "the key", MAX_KEY_LENGTH)
        self.ensure_schema()
        with self._db.read() as conn:
            row = conn.execute(self._sql.index_of, {"ns": self._ns, "log": self.name, "key": key}).first()
        return None if row is None else int(row[0])

    def info(self) -> JobLogInfo:
        """The log's head, size and times (an operator's view)."""
        self.ensure_schema()
        with self._db.read() as conn:
            row = conn.execute(self._sql.info, {"ns": self._ns, "log": self.name}).first()
        return _info(self._db, row) if row is not None else JobLogInfo(self.name, -1)

    # -- wake-ups ---------------------------------------------------------------------------

    def listen(self, wake: Wake) -> bool:
        """Call ``wake`` when an append to this log commits (anywhere): PostgreSQL through
        NOTIFY on one LISTEN connection per process; SQLite by watching the database's data
        version, then the logs' heads (one query per commit seen, per process). True."""
        self._check_open()
        with self._lock:
            self._unlisten.append(wakeups.subscribe(self._config, self._ns, self.name, wake))
        return True

    def wait_listening(self, timeout: float = 10.0) -> bool:
        """Block until this process hears appends (PostgreSQL's LISTEN is in place)."""
        return wakeups.feed_for(self._config).wait_listening(timeout)

    def close(self) -> None:
        """Stop listening and release the shared connection pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unlisten, self._unlisten = self._unlisten, []
            self._kept.clear()
        for stop in unlisten:
            stop()
        self._release()


def _info(db: Database, row: Any) -> JobLogInfo:
    conv = db.dialect.from_db_time
    return JobLogInfo(str(row[0]), int(row[1]), conv(row[2]), conv(row[3]))


def job_logs(url: str | None = None, **options: Any) -> list[JobLogInfo]:
    """Every job log of the store ``url``'s namespace, by name (an operator's view)."""
    db, release = _SHARED.open(url or default_url(), options)
    try:
        with db.read() as conn:
            version = current_version(conn)
            if version == 0:
                return []
            ensure_version(version, db.name)
            sql = JobLogStatements.build(db.dialect.fragments()["now"], db.config.kind == "postgresql")
            rows = conn.execute(sql.logs, {"ns": db.config.namespace}).fetchall()
        return [_info(db, row) for row in rows]
    finally:
        release()
