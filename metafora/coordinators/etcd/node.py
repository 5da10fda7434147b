"""The state a node's coordinator shares between its concerns (lease, watch, claims,
commands), guarded by one lock, and the helpers they all use."""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metafora.clock import SYSTEM_CLOCK, Clock
from metafora.coordinator import CoordinatorContext, Finish, TaskCommandListener
from metafora.coordinators.etcd.cache import Entry, Subscriber
from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import Keys
from metafora.coordinators.etcd.outcomes import ITEMS_PER_TXN, GroupCommit, OutcomeWriter
from metafora.errors import CoordinatorClosed, MetaforaError
from metafora.task import Task, validate_task_id

__all__ = ["NodeBase", "fence_margin"]

log = logging.getLogger(__name__)

_BACKOFF_START = 0.05
_BACKOFF_MAX = 2.0
_STOP = object()  # tells the watch loop to end

_COMMIT_BATCH = 4 * ITEMS_PER_TXN
"""Outcomes of concurrent done/release/fail calls written together at most (4 txns in flight)."""


@dataclass
class Held:
    """A claim this node holds."""

    task: Task
    finishing: bool = False  # a release/done/fail of this claim is in flight


def fence_margin(lease_ttl: float) -> float:
    """Seconds before the lease could expire at which a node stops its handlers."""
    return max(0.5, lease_ttl / 4)


class NodeBase:
    """The shared state of :class:`~metafora.coordinators.etcd.coordinator.EtcdCoordinator`
    and the helpers every concern uses; the concerns are mixed in by the coordinator."""

    def __init__(self, config: EtcdConfig, node_id: str, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._cfg = config
        self._node_id = validate_task_id(node_id)
        self._node_bytes = self._node_id.encode()
        self._keys = Keys(config.namespace)
        self._clock = clock
        self._driver = EtcdDriver(config.connection)
        self._extra = {"node": self._node_id}
        self._lock = threading.Lock()
        self._ctx: CoordinatorContext | None = None
        self._closed = False
        self._stop = threading.Event()
        # lease
        self._lease_id: int | None = None
        self._old_lease: int | None = None  # dropped after a fence, revoked on re-register
        self._old_lease_until = 0.0  # monotonic: when the dropped lease expires by itself
        self._renewed_at = 0.0
        self._beat_wake = threading.Event()
        self._keepalive_paused = False
        self._fence_after = config.lease_ttl - fence_margin(config.lease_ttl)
        self._alive_rev = 0  # create revision of our registration key
        self._started_at = clock.now()
        self._frozen = False
        self._leaving = False
        self._member_listeners: list[Callable[[], None]] = []
        self._labels: dict[str, str] = {}  # placement labels, from init(ctx)
        # claims this node holds
        self._held: dict[str, Held] = {}
        self._schedule_listeners: list[Callable[[], None]] = []
        # watch cache
        self._cache: dict[str, Entry] = {}
        self._cache_ready = False
        self._cache_rev = 0
        self._subs: list[Subscriber] = []
        self._unusable: dict[str, int] = {}  # stored ids no Task may have -> props revision logged
        self._watch_queue: queue.Queue[object] | None = None
        self._watch_gen = 0  # which watch stream may fold events into the cache
        # Who holds what, as the cache saw it: the balancers' counts without reading every
        # owner key (a read that grows with the tasks held, made every second by every node).
        self._live_nodes: dict[str, bool] = {}  # live node -> its registration says leaving
        self._held_by: Counter[str] = Counter()  # node -> owner keys naming it
        self._watch_live = False  # a watch stream is confirmed: the cache follows the store
        # commands
        self._cmd_cond = threading.Condition(self._lock)
        self._cmd_seq = 0
        self._cmd_seen_seq = -1  # the _cmd_seq of the last look at the node's commands
        self._cmd_check_at = 0.0  # monotonic: next safety-net look at the node's commands
        self._cmd_failing = False
        self._task_cmd_listeners: list[TaskCommandListener] = []
        # outcomes: done/release/fail of concurrent callers share txns
        self._outcomes = OutcomeWriter(self._driver, self._keys, self._node_id, clock)
        self._commit: GroupCommit[Finish, MetaforaError | None] = GroupCommit(
            self._outcomes.write, _COMMIT_BATCH
        )
        # threads
        self._threads: list[threading.Thread] = []
        self._watcher_started = False

    # -- identity ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The store URL without its password."""
        return self._cfg.name

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._node_id

    @property
    def config(self) -> EtcdConfig:
        """The validated configuration."""
        return self._cfg

    @property
    def driver(self) -> EtcdDriver:
        """This node's etcd connection (for stores that keep their data beside the tasks,
        such as :mod:`metafora.statemachine.stores.etcd`)."""
        return self._driver

    @property
    def keys(self) -> Keys:
        """The key layout of this namespace."""
        return self._keys

    def __repr__(self) -> str:
        return f"EtcdCoordinator({self.name!r}, node_id={self._node_id!r})"

    def _start_thread(self, role: str, target: Any) -> None:
        thread = threading.Thread(
            target=target, name=f"metafora-etcd-{role}[{self._node_id}]", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _check_open(self) -> None:
        if self._closed:
            raise CoordinatorClosed(f"coordinator {self._node_id!r} on {self.name} is closed")

    def _require_init(self) -> None:
        self._check_open()
        if self._ctx is None:
            raise CoordinatorClosed("init(ctx) must be called before using the coordinator")

    def _members_changed(self) -> None:
        with self._lock:
            listeners = list(self._member_listeners)
        for listener in listeners:
            listener()

    def _notify_lost(self, tasks: list[Task]) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        for task in tasks:
            if self._closed:
                return
            log.info("node %s lost task %s (token %d)", self._node_id, task.id, task.token,
                     extra={"node": self._node_id, "task": task.id})
            try:
                ctx.lost(task)
            except Exception:
                log.exception("ctx.lost(%s) raised", task.id,
                              extra={"node": self._node_id, "task": task.id})

    def holds_claim(self, task_id: str) -> bool:
        """Whether this node knows it holds a claim of ``task_id`` (its local view, no I/O)."""
        with self._lock:
            return task_id in self._held

    # -- hooks one concern provides to the others -----------------------------------------

    def _ensure_watcher(self) -> None:
        """Start the watch thread once (:class:`~.watch.WatchMixin`)."""
        raise NotImplementedError

    def _fence(self, reason: str) -> None:
        """Drop the lease and lose every claim (:class:`~.lease.LeaseMixin`)."""
        raise NotImplementedError

    def _expire(self, task_id: str, props_mod: int) -> None:
        """Move a task past its ``expires_at`` to expired (:class:`~.claims.ClaimsMixin`)."""
        raise NotImplementedError
