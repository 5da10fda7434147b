"""PostgreSQL LISTEN on a dedicated autocommit psycopg connection, in a named thread.

Notifications carry one letter and a name: ``t<task id>`` (a task became claimable: submit,
release, retry, a freed registration), ``c<node id>`` (a command was queued for that node),
``n<node id>`` (one of that node's claims was deleted under it). The channel is per
namespace (:func:`~metafora.coordinators.sql.dialect.channel_name`). When the connection
drops, the listener reconnects with back-off and reports it (``on_connect``), so its users
rescan: a notification lost meanwhile costs one scan, never a task.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

import psycopg
from psycopg import sql

from metafora.coordinators.sql.dialect import PostgresDialect
from metafora.coordinators.sql.store import translate_error

__all__ = ["Listener"]

log = logging.getLogger(__name__)

_POLL = 0.25  # seconds between checks of the stop flag while waiting for notifications


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
