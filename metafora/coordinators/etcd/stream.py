"""One etcd watch stream: its gRPC call, the thread reading it, and how it ends."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import grpc

from metafora.coordinators.etcd.messages import events_from
from metafora.coordinators.etcd.ops import WatchBatch, WatchCallback, WatchFailure
from metafora.core.errors import StoreError

__all__ = ["WatchHandle"]

log = logging.getLogger(__name__)


class WatchHandle:
    """One watch: its own gRPC stream and reader thread. :meth:`cancel` ends both.

    (The library's ``Watcher`` only half-closes its stream on ``close()``; etcd keeps such a
    stream open, so every re-watch would leak a thread. Cancelling the call does not.)
    """

    def __init__(self, call: Any, requests: queue.SimpleQueue[Any], callback: WatchCallback,
                 name: str, skip: Callable[[bytes], bool] | None = None) -> None:
        self._call = call
        self._skip = skip
        self._requests = requests
        self._callback = callback
        self._lock = threading.Lock()
        self._cancelled = False
        self._finished = False
        self._created = threading.Event()
        self.failure: WatchFailure | None = None  # why the stream ended, if it did
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start reading the stream."""
        self._thread.start()

    def wait_created(self, timeout: float) -> bool:
        """Wait until etcd confirms the watch (False on timeout or if the stream ended)."""
        return self._created.wait(timeout) and self.failure is None

    def _run(self) -> None:
        try:
            for response in self._call:
                if response.compact_revision:
                    self._finish(WatchFailure(None, compacted=True))
                    return
                if response.canceled:
                    reason = getattr(response, "cancel_reason", "") or "cancelled by etcd"
                    self._finish(WatchFailure(StoreError(f"etcd cancelled the watch: {reason}")))
                    return
                if response.created:
                    self._created.set()
                if response.events and not self._cancelled:
                    self._callback(WatchBatch(int(response.header.revision),
                                              events_from(response.events, self._skip)))
        except grpc.RpcError as exc:
            self._finish(WatchFailure(exc))
        except Exception as exc:  # a callback bug must not kill the stream silently
            log.exception("etcd watch reader failed")
            self._finish(WatchFailure(exc))
        else:
            self._finish(WatchFailure(None))  # the server ended the stream

    def _finish(self, failure: WatchFailure) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            cancelled = self._cancelled
            self.failure = failure
        self._created.set()
        if not cancelled:
            self._callback(failure)

    def cancel(self) -> None:
        """Stop delivering events and end the stream (idempotent, never raises)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
        self._requests.put(None)
        try:
            self._call.cancel()
        except Exception:  # pragma: no cover - already finished
            log.debug("ignoring error while cancelling a watch", exc_info=True)
