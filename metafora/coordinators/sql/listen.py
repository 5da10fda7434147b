"""Wake-ups: PostgreSQL LISTEN on its own connection; SQLite ``PRAGMA data_version`` polling.

PostgreSQL: a dedicated autocommit psycopg connection LISTENs, in a named thread.

Notifications carry one letter and a name: ``t<task id>`` (a task became claimable: submit,
release, retry, a freed registration), ``c<node id>`` (a command was queued for that node),
``n<node id>`` (one of that node's claims was deleted under it), ``m<task id>`` (a command
was queued for that task: its owner dispatches it in-process). The channel is per
namespace (:func:`~metafora.coordinators.sql.dialect.channel_name`). When the connection
drops, the listener reconnects with back-off and reports it (``on_connect``), so its users
rescan: a notification lost meanwhile costs one scan, never a task.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
from collections.abc import Callable
from typing import Protocol

from metafora.coordinators.sql.dialect import Dialect, PostgresDialect
from metafora.coordinators.sql.store import translate_error

__all__ = ["ChangeFeed", "Listener", "SQLiteChanges", "make_feed"]

log = logging.getLogger(__name__)

_POLL = 0.25  # seconds between checks of the stop flag while waiting for notifications
_DATA_VERSION_POLL = 0.01  # seconds between PRAGMA data_version checks (a few microseconds each)


class ChangeFeed(Protocol):
    """What the coordinator needs from a source of wake-ups."""

    def start(self) -> None:
        """Start delivering (once)."""

    def wait_listening(self, timeout: float) -> bool:
        """Block until changes are being watched (or ``timeout``)."""

    def stop(self, timeout: float = 5.0) -> None:
        """Stop delivering. Idempotent."""


class Listener:
    """Delivers the payloads of one channel to ``on_notify``; ``on_connect`` after (re)connects."""

    def __init__(
        self,
        dialect: PostgresDialect,
        node_id: str,
        on_notify: Callable[[str], None],
        on_connect: Callable[[], None],
    ) -> None:
        self._dialect = dialect
        self._node_id = node_id
        self._on_notify = on_notify
        self._on_connect = on_connect
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the listening thread (once)."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._run, name=f"metafora-sql-listen-{self._node_id}", daemon=True
            )
            self._thread.start()

    def wait_listening(self, timeout: float) -> bool:
        """Block until LISTEN is in place (or ``timeout``); whether it is."""
        return self._listening.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening and join the thread. Idempotent."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        import psycopg
        from psycopg import sql

        backoff = 0.1
        extra = {"node": self._node_id}
        config = self._dialect.config
        while not self._stop.is_set():
            try:
                conn = psycopg.connect(**self._dialect.connect_kwargs(), autocommit=True)
            except psycopg.Error as exc:
                log.warning("LISTEN connection to %s failed, retrying in %.1fs: %s",
                            config.name, backoff, translate_error(exc, config), extra=extra)
                self._stop.wait(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, 5.0)
                continue
            try:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._dialect.channel)))
                self._listening.set()
                backoff = 0.1
                self._on_connect()
                while not self._stop.is_set():
                    for notify in conn.notifies(timeout=_POLL):
                        self._on_notify(notify.payload)
            except psycopg.Error as exc:
                if not self._stop.is_set():
                    log.warning("LISTEN connection to %s lost: %s", config.name,
                                translate_error(exc, config), extra=extra)
            except Exception:
                log.exception("LISTEN dispatch failed on %s", config.name, extra=extra)
            finally:
                self._listening.clear()
                try:
                    conn.close()
                except psycopg.Error:
                    pass


class SQLiteChanges:
    """SQLite has no NOTIFY: watch ``PRAGMA data_version`` of a connection that never writes.

    The value changes whenever another connection (any process) commits, so the check is a
    few microseconds and reads no pages; every change is reported as ``on_notify("")``
    ("something changed: look"), at most every 10 ms. The watch and ``command()`` then look
    at once instead of at their next ``poll_interval``.
    """

    def __init__(self, path: str, node_id: str, on_notify: Callable[[str], None]) -> None:
        self._path = path
        self._node_id = node_id
        self._on_notify = on_notify
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        self._last: int | None = None

    def start(self) -> None:
        """Start the polling thread (once), from the current data version on."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            # Read the starting version here, so a commit right after start() is seen.
            self._conn, self._last = self._connect()
            self._thread = threading.Thread(
                target=self._run, name=f"metafora-sql-changes-{self._node_id}", daemon=True
            )
            self._thread.start()

    def wait_listening(self, timeout: float) -> bool:
        """Changes are seen from :meth:`start` on."""
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling and join the thread. Idempotent."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _connect(self) -> tuple[sqlite3.Connection | None, int | None]:
        try:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            log.debug("cannot open %s to watch for changes: %s", self._path, exc,
                      extra={"node": self._node_id})
            return None, None
        try:
            return conn, int(conn.execute("PRAGMA data_version").fetchone()[0])
        except sqlite3.Error:
            conn.close()
            return None, None

    def _run(self) -> None:
        conn, last = self._conn, self._last
        try:
            while not self._stop.wait(_DATA_VERSION_POLL):
                if conn is None:
                    conn, version = self._connect()
                    if conn is None:
                        self._stop.wait(1.0)
                        continue
                else:
                    try:
                        version = int(conn.execute("PRAGMA data_version").fetchone()[0])
                    except sqlite3.Error as exc:
                        log.debug("data_version check on %s failed: %s", self._path, exc,
                                  extra={"node": self._node_id})
                        conn.close()
                        conn = None
                        continue
                if version != last:
                    last = version
                    self._on_notify("")  # (also after a reconnect: we may have missed one)
        except Exception:
            log.exception("SQLite change poller of %s failed", self._path,
                          extra={"node": self._node_id})
        finally:
            if conn is not None:
                conn.close()


def make_feed(
    dialect: Dialect,
    node_id: str,
    on_notify: Callable[[str], None],
    on_connect: Callable[[], None],
) -> ChangeFeed:
    """The wake-up source of a store: LISTEN on PostgreSQL, data_version on SQLite."""
    if isinstance(dialect, PostgresDialect):
        return Listener(dialect, node_id, on_notify, on_connect)
    assert dialect.config.path is not None
    return SQLiteChanges(dialect.config.path, node_id, on_notify)
