"""What a node shows about itself: ``/info``, and what the probes ``/healthz`` and ``/readyz`` check."""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

from metafora.consumer.context import PartsContext
from metafora.consumer.offers import OfferRouter
from metafora.consumer.running import handler_state
from metafora.consumer.supervisor import Supervisor
from metafora.core.masking import mask_url

__all__ = ["NodeStatus"]


class NodeStatus:
    """The node's lifecycle marks (when it registered, which thread runs it) and its views.

    Reads shared state only under the consumer's lock and does no store I/O: the probes are
    asked every few seconds by an orchestrator and must answer even when the store does not.
    """

    def __init__(self, ctx: PartsContext, *, offers: OfferRouter, supervisor: Supervisor) -> None:
        self._coord, self._running, self._lock = ctx.coordinator, ctx.running, ctx.lock
        self._offers, self._supervisor, self._stats = offers, supervisor, ctx.stats
        self._stopping, self._done, self._options = ctx.stopping, ctx.done, ctx.options
        self.started_at: datetime | None = None  # set once registered
        self.run_thread: threading.Thread | None = None  # the thread in Consumer.run()
        self.serving = False  # set once every side thread is up and the loop is about to run

    def info(self) -> dict[str, Any]:
        """What ``/info`` shows: the node, its state and its running tasks."""
        with self._lock:
            entries = sorted(self._running.values(), key=lambda e: e.started)
            rows = [
                {
                    "id": e.task.id,
                    "token": e.task.token,
                    "started": e.started.isoformat(),
                    "stopped": e.stopped.isoformat() if e.stopped else None,
                    "state": handler_state(e.handler),
                }
                for e in entries
            ]
            ignores = sorted(k for k, _ in self._offers.ignores.items())
            capacity = self._offers.capacity.info()
        return {
            "node": self._coord.node_id,
            "store": mask_url(self._coord.name, brief=True),
            "frozen": self._offers.frozen,
            "labels": dict(self._options.labels),
            "started": self.started_at.isoformat() if self.started_at else None,
            "stopping": self._stopping.is_set(),
            "tasks": rows,
            "ignores": ignores,
            "capacity": capacity,
            "counters": self._stats.counters(),
        }

    def probes(self) -> dict[str, Any]:
        """What the probes check (see :meth:`metafora.consumer.Consumer.probes`)."""
        fatal = self._supervisor.fatal
        thread = self.run_thread
        alive = (self.started_at is not None and fatal is None and not self._done.is_set()
                 and thread is not None and thread.is_alive())
        left = self._coord.lease_time_left()
        stopping = self._stopping.is_set()
        ready = alive and self.serving and not stopping and (left is None or left > 0)
        return {"alive": alive, "ready": ready, "node": self._coord.node_id,
                "registered": self.started_at is not None, "stopping": stopping,
                "lease_left_s": None if left is None else round(left, 3),
                "error": None if fatal is None else type(fatal).__name__}
