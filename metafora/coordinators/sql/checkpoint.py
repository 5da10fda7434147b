"""SQLite's WAL checkpoints, run by a thread of their own instead of by whichever commit
crosses the threshold.

SQLite copies the write-ahead log back into the database file (a *checkpoint*) when a commit
leaves the log longer than ``wal_autocheckpoint`` pages (1,000 by default), inside that
commit's call: the write lock is already released, but the committing thread waits for up to
a thousand page writes and two fsyncs. On the hot path that thread is the consumer's loop,
which claims and finishes every task: two processes running short tasks ran at 5,010 tasks/s
with it and 6,060 without any checkpoint (medians of 4 runs of the peers throughput workload on
SQLite, 20,000 tasks, with the hot path's lock waits of 100 us).

So every connection of a store's engine checkpoints only as a backstop (``BACKSTOP`` pages:
a log four times the default, reached only when this thread cannot keep up), and
:class:`Checkpointer` runs a ``PASSIVE`` checkpoint on a pooled connection every ``EVERY``
commits of this process: it takes no lock a writer needs, so writers go on meanwhile, and it
never waits (a checkpoint another connection is running makes it skip one turn). Nothing
here runs while nothing is written: an idle store costs no checkpoint. The log's file is cut
back to ``JOURNAL_LIMIT`` bytes whenever the log starts over.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["BACKSTOP", "EVERY", "JOURNAL_LIMIT", "Checkpointer"]

log = logging.getLogger(__name__)

BACKSTOP = 4000
"""``wal_autocheckpoint`` of every connection of a store's engine (pages)."""

JOURNAL_LIMIT = BACKSTOP * 4096
"""``journal_size_limit`` of every connection (bytes): when the log starts over after a
complete checkpoint, its file is cut back to this size, so a burst (a bulk submit of a million
tasks) does not leave a log file of its peak size on disk for good."""

EVERY = 200
"""Commits of this process between checkpoints (a hot commit writes a handful of pages: about
the log SQLite's default threshold of 1,000 pages would checkpoint)."""


class Checkpointer:
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` with ``connect()``'s connections on a daemon
    thread, after every ``every`` calls of :meth:`committed`; started at the first such turn."""

    def __init__(self, connect: Any, name: str, every: int = EVERY) -> None:
        self._connect = connect  # () -> a DBAPI connection (pooled: close() gives it back)
        self._name = name
        self._every = every
        self._commits = 0
        self._due = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.runs = 0  # checkpoints run (for tests and the curious)
        self._failing = False  # the last checkpoint failed

    def committed(self) -> None:
        """A transaction of this process committed (called by the store; no I/O)."""
        # Unlocked: writers of one process are serialised already, and a lost count only
        # moves a checkpoint by one commit.
        self._commits += 1
        if self._commits >= self._every:
            self._commits = 0
            self._start()
            self._due.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="metafora-checkpoint")
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._due.wait()
            if self._closed.is_set():
                return
            self._due.clear()
            self.checkpoint()

    def checkpoint(self) -> tuple[int, int, int] | None:
        """One passive checkpoint now: SQLite's (busy, log pages, pages checkpointed), or None
        when it failed (logged: the next turn, or the backstop, does the work)."""
        try:
            conn = self._connect()
            try:
                cursor = conn.cursor()
                try:
                    cursor.execute("PRAGMA wal_checkpoint(PASSIVE)")
                    row = cursor.fetchone()
                finally:
                    cursor.close()
            finally:
                conn.close()
        except Exception as exc:  # a store error must not end the thread
            # The first failure of a streak is a warning (the log grows until one succeeds);
            # the rest, one per turn while the store is away, only debug.
            level = logging.DEBUG if self._failing else logging.WARNING
            self._failing = True
            log.log(level, "checkpoint of %s failed (the next turn tries again): %s", self._name,
                    exc, extra={"action": "checkpoint"})
            return None
        self._failing = False
        self.runs += 1
        result = (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)
        log.debug("checkpoint of %s: busy %d, log %d pages, %d checkpointed", self._name,
                  *result, extra={"action": "checkpoint"})
        return result

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (a checkpoint running finishes first). Idempotent."""
        with self._lock:
            self._closed.set()
            thread = self._thread
        self._due.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
