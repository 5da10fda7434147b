"""A node's command queue on a SQL store: read only when woken, or once per safety-net period."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from metafora.coordinators.sql.store import Database
from metafora.core.commands import Command
from metafora.core.errors import InvalidCommand

__all__ = ["NodeCommands"]

log = logging.getLogger(__name__)


class NodeCommands:
    """Takes this node's commands off the store's queue, oldest first.

    ``wake()`` is called by the change feed (a NOTIFY, a SQLite commit) and at close; without
    one the store is still read once per ``command_recheck`` as a safety net -- never per call.
    """

    def __init__(self, db: Database, node_id: str, *, closed: threading.Event,
                 before_read: Callable[[], None]) -> None:
        self._db = db
        self._node_id = node_id
        self._closed = closed
        self._before_read = before_read  # schema and the change feed, started on first need
        self._wake = threading.Event()
        self._check_at = 0.0  # monotonic: the next safety-net look

    def wake(self) -> None:
        """Something may have arrived (or the node is closing): look at the store again."""
        self._wake.set()

    def next(self, timeout: float | None = None) -> Command | None:
        """The next command, waiting up to ``timeout`` (None: until one comes or close)."""
        if self._closed.is_set():
            return None
        self._before_read()
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = self._db.config.command_recheck
        while not self._closed.is_set():
            now = time.monotonic()
            if self._wake.is_set() or now >= self._check_at:
                self._wake.clear()  # before the look: a wake-up during it is kept
                self._check_at = now + poll
                command = self._take()
                if command is not None:
                    self._wake.set()  # more may be queued behind it
                    return command
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            wait = max(0.0, self._check_at - time.monotonic())
            self._wake.wait(wait if left is None else min(wait, left))
        return None

    def _take(self) -> Command | None:
        db, params = self._db, {"node": self._node_id}
        for _ in range(100):  # bounded: malformed commands are dropped one by one
            with db.read() as conn:
                if db.execute(conn, "command_peek", dict(params)).scalar() is None:
                    return None
            with db.write() as conn:
                row = db.execute(conn, "command_take", dict(params)).first()
            if row is None:
                continue  # taken by a concurrent reader; look again
            try:
                return Command.from_json(str(row[1]))
            except InvalidCommand as exc:
                log.warning("dropping malformed command %s for node %s: %s", row[0],
                            self._node_id, exc, extra={"node": self._node_id})
        return None
