"""What the parts of a node's etcd coordinator share: its identity, its context, the claims
it holds, its current lease, and the one lock guarding them (and every part's own state).

The parts (:mod:`.lease`, :mod:`.watch`, :mod:`.claims`, :mod:`.outcomes`, :mod:`.commands`)
are objects composed by :class:`~metafora.coordinators.etcd.coordinator.EtcdCoordinator`;
each gets this state, and the others it calls, as constructor arguments. One lock for all of
them keeps the checks that span parts atomic (a claim is recorded only if the lease it was
made under is still current, the node is open and the watch has not seen it go).

The lease thread does not take that lock to renew: it waits on :attr:`NodeState.lease_lock`
only, never held for more than a few assignments, so work over every task or claim under the
node's lock (a re-list, a watch batch, a fence) cannot starve the renewal into a fence.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from metafora.contracts.coordinator import CoordinatorContext
from metafora.core.errors import CoordinatorClosed
from metafora.core.task import Task

__all__ = ["BACKOFF_MAX", "BACKOFF_START", "Held", "NodeState"]

log = logging.getLogger(__name__)

BACKOFF_START = 0.05
"""Seconds before the lease or watch loop tries again after its first failure (doubling)."""
BACKOFF_MAX = 2.0
"""The longest pause between two tries of the lease or watch loop."""


@dataclass
class Held:
    """A claim this node holds."""

    task: Task
    finishing: bool = False  # a release/done/fail of this claim is in flight


class NodeState:
    """A node's shared state; every attribute but the identity is guarded by :attr:`lock`,
    but for the lease: ``lease_id`` changes holding :attr:`lock` and then :attr:`lease_lock`
    (so either is enough to read it), ``renewed_at`` holding :attr:`lease_lock` (a reader
    holding only :attr:`lock` may see it one renewal late: on the safe side)."""

    def __init__(self, node_id: str, name: str) -> None:
        self.node_id = node_id
        self.node_bytes = node_id.encode()
        self.name = name  # the store URL without its password
        self.extra = {"node": node_id}  # the log records' extra
        self.lock = threading.Lock()
        # Taken after `lock` (never the other way round), held for a few assignments only:
        # the lease thread reads and renews under it alone (see the module docstring).
        self.lease_lock = threading.Lock()
        self.stop = threading.Event()  # set by close: every loop ends
        self.closed = False
        self.ctx: CoordinatorContext | None = None
        self.labels: dict[str, str] = {}  # placement labels, from init(ctx)
        self.weight = 1.0  # the node's weight (its fair share is proportional), from init(ctx)
        self.held: dict[str, Held] = {}
        self.lease_id: int | None = None  # None while the node has no lease (fenced, closed)
        self.renewed_at = 0.0  # monotonic: the start of the last good renewal
        # Told of lost claims before the context is (the limits free their slots).
        self.on_lost: Callable[[list[Task]], None] | None = None
        self._threads: list[threading.Thread] = []

    def check_open(self) -> None:
        """Raise CoordinatorClosed once the coordinator is closed."""
        if self.closed:
            raise CoordinatorClosed(f"coordinator {self.node_id!r} on {self.name} is closed")

    def require_init(self) -> None:
        """Raise CoordinatorClosed when closed or not initialised yet."""
        self.check_open()
        if self.ctx is None:
            raise CoordinatorClosed("init(ctx) must be called before using the coordinator")

    def holds_claim(self, task_id: str) -> bool:
        """Whether this node knows it holds a claim of ``task_id`` (its local view, no I/O)."""
        with self.lock:
            return task_id in self.held

    def drop_held(self) -> list[Task]:
        """Forget every claim held; the tasks (called holding the lock)."""
        tasks = [held.task for held in self.held.values()]
        self.held.clear()
        return tasks

    def notify_lost(self, tasks: list[Task]) -> None:
        """Tell the context each of ``tasks`` is lost (not holding the lock)."""
        if tasks and self.on_lost is not None:
            self.on_lost(tasks)
        ctx = self.ctx
        if ctx is None:
            return
        for task in tasks:
            if self.closed:
                return
            log.info("node %s lost task %s (token %d)", self.node_id, task.id, task.token,
                     extra={"node": self.node_id, "task": task.id})
            try:
                ctx.lost(task)
            except Exception:
                log.exception("ctx.lost(%s) raised", task.id,
                              extra={"node": self.node_id, "task": task.id})

    def start_thread(self, role: str, target: Callable[[], None]) -> None:
        """Start the named daemon thread ``metafora-etcd-<role>[<node>]``."""
        thread = threading.Thread(
            target=target, name=f"metafora-etcd-{role}[{self.node_id}]", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def join_threads(self, timeout: float) -> None:
        """Wait for the started threads to end (but the calling one), ``timeout`` each."""
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(timeout)
