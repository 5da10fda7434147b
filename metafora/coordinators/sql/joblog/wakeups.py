"""Wake-ups of the job logs: one feed per database in this process, shared by every log.

PostgreSQL: an append NOTIFYs the channel :data:`~.statements.CHANNEL` inside its transaction
(delivered at commit, never on a rollback) with the log's namespace and name; one LISTEN
connection per process and database hears it for every log and wakes the streams reading
that log. After a reconnect every listener is woken (a notification may have been missed).

SQLite has no NOTIFY: the feed watches ``PRAGMA data_version`` (a few microseconds, no pages
read; it changes when any other connection, in any process, commits) and on a change reads
the heads of the logs (one query) and wakes the listeners of the logs whose head moved. An
append through the log's own transaction also wakes this process's listeners at once.

The feed starts with its first listener and stops with its last.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable

from metafora.coordinators.sql.joblog.statements import CHANNEL
from metafora.coordinators.sql.listen import SQLiteChanges
from metafora.coordinators.sql.shared import ChangeFeed, SQLConfig, listen

__all__ = ["LogFeed", "feed_for", "notify_local", "subscribe"]

log = logging.getLogger(__name__)

Wake = Callable[[], None]
LogKey = tuple[str, str]  # (namespace, log name)

_HEADS = "SELECT namespace, name, head FROM metafora_joblogs"


def _where(config: SQLConfig) -> tuple[str, str]:
    if config.kind == "sqlite":
        return config.kind, os.path.realpath(config.path or "")
    hosts = ",".join(f"{h}:{p or 5432}" for h, p in config.url.hosts)
    return config.kind, hosts + config.url.path


class LogFeed:
    """Who in this process listens to which log of one database, and the push that wakes them."""

    def __init__(self, config: SQLConfig, key: tuple[str, str]) -> None:
        self._config = config
        self._key = key
        self._lock = threading.Lock()
        self._waiters: dict[LogKey, dict[int, Wake]] = {}
        self._next = 0
        self._source: ChangeFeed | None = None
        self._heads: dict[LogKey, int] = {}
        self._reader: sqlite3.Connection | None = None

    # -- listeners --------------------------------------------------------------------------

    def _add(self, what: LogKey, wake: Wake) -> int:
        with self._lock:
            self._next += 1
            self._waiters.setdefault(what, {})[self._next] = wake
            return self._next

    def _remove(self, what: LogKey, ticket: int) -> bool:
        """Drop a listener; whether the feed has none left."""
        with self._lock:
            waiting = self._waiters.get(what)
            if waiting is not None:
                waiting.pop(ticket, None)
                if not waiting:
                    del self._waiters[what]
                    self._heads.pop(what, None)
            return not self._waiters

    def wake(self, what: LogKey) -> None:
        """News of one log: call its listeners (outside the lock)."""
        with self._lock:
            wakes = list(self._waiters.get(what, {}).values())
        _call(wakes)

    def wake_all(self) -> None:
        """News may have been missed: call every listener."""
        with self._lock:
            wakes = [w for waiting in self._waiters.values() for w in waiting.values()]
        _call(wakes)

    # -- the push ---------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._source is not None:
                return
            if self._config.kind == "postgresql":
                self._source = listen(self._config, CHANNEL, "joblogs", self._on_notify, self.wake_all)
            else:
                self._source = SQLiteChanges(self._config.path or "", "joblogs", self._on_change)
            source = self._source
        source.start()

    def wait_listening(self, timeout: float) -> bool:
        """Block until the push is in place (or ``timeout``); whether it is."""
        with self._lock:
            source = self._source
        return source is not None and source.wait_listening(timeout)

    def _stop(self) -> None:
        with self._lock:
            source, self._source = self._source, None
            reader, self._reader = self._reader, None
        if source is not None:
            source.stop()
        if reader is not None:
            reader.close()

    def _on_notify(self, payload: str) -> None:
        namespace, _, name = payload.partition("\n")
        self.wake((namespace, name))

    def _on_change(self, _payload: str) -> None:
        """SQLite: something committed; wake the listeners of the logs whose head moved."""
        with self._lock:
            if not self._waiters:
                return
        try:
            if self._reader is None:
                self._reader = sqlite3.connect(self._config.path or "", isolation_level=None,
                                               check_same_thread=False)
            rows = self._reader.execute(_HEADS).fetchall()
        except sqlite3.Error as exc:  # e.g. no log was ever appended: no table yet
            log.debug("reading the job log heads of %s failed: %s", self._config.name, exc)
            return
        moved: list[Wake] = []
        with self._lock:
            heads = {(str(ns), str(name)): int(head) for ns, name, head in rows}
            for what, waiting in self._waiters.items():
                head = heads.get(what, -1)
                if self._heads.get(what) != head:
                    self._heads[what] = head
                    moved.extend(waiting.values())
        _call(moved)


def _call(wakes: list[Wake]) -> None:
    for wake in wakes:
        try:
            wake()
        except Exception:  # a listener's bug must not stop the others or the feed
            log.exception("a job log wake-up failed")


_FEEDS: dict[tuple[str, str], LogFeed] = {}
_FEEDS_LOCK = threading.Lock()


def feed_for(config: SQLConfig) -> LogFeed:
    """The feed of ``config``'s database in this process (made on first use)."""
    key = _where(config)
    with _FEEDS_LOCK:
        feed = _FEEDS.get(key)
        if feed is None:
            feed = _FEEDS[key] = LogFeed(config, key)
        return feed


def subscribe(config: SQLConfig, namespace: str, name: str, wake: Wake) -> Callable[[], None]:
    """Call ``wake`` on news of the log ``name``; returns the function that stops it."""
    what = (namespace, name)
    key = _where(config)
    with _FEEDS_LOCK:  # (so that the last listener's leaving never stops a feed joined meanwhile)
        feed = _FEEDS.get(key)
        if feed is None:
            feed = _FEEDS[key] = LogFeed(config, key)
        ticket = feed._add(what, wake)
    feed._start()

    def unsubscribe() -> None:
        with _FEEDS_LOCK:
            if not feed._remove(what, ticket):
                return
            if _FEEDS.get(feed._key) is feed:
                del _FEEDS[feed._key]
        feed._stop()

    return unsubscribe


def notify_local(config: SQLConfig, namespace: str, name: str) -> None:
    """An append committed in this process: wake its listeners here at once (others hear
    the NOTIFY or see the head move)."""
    with _FEEDS_LOCK:
        feed = _FEEDS.get(_where(config))
    if feed is not None:
        feed.wake((namespace, name))

