"""The namespace watch: re-list into the cache, fold events in, feed ``watch(out)``.

See :mod:`metafora.coordinators.etcd.coordinator` for the watch thread's contract.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from datetime import datetime

from metafora.contracts.coordinator import TaskCommandListener, TaskSink, as_sink, rotated
from metafora.coordinators.etcd.cache import Entry, Subscriber, TaskCache, offer_for
from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.driver import EtcdDriver, WatchHandle
from metafora.coordinators.etcd.fold import Folder, Seen
from metafora.coordinators.etcd.layout import Keys
from metafora.coordinators.etcd.node import BACKOFF_MAX, BACKOFF_START, NodeState
from metafora.coordinators.etcd.ops import WatchBatch, WatchCompacted, WatchFailure
from metafora.coordinators.etcd.queries import Registration, read_snapshot
from metafora.core.clock import Clock
from metafora.core.errors import CoordinatorUnavailable, InvalidTaskId, MetaforaError
from metafora.core.heap import gc_paused
from metafora.core.retention import Cutoffs
from metafora.core.task import Task, validate_task_id

__all__ = ["NamespaceWatch"]

log = logging.getLogger(__name__)

_TIMER_CAP = 60.0  # re-check wall-clock timers at least this often (clock jumps)
# A safety-net re-list comes no more often than tasks / this many seconds: at most 100 keys a
# second per node whatever the cluster holds (etcd's watch delivers every event of a live stream
# in order, and a broken or compacted one re-lists at once: the net is for the unforeseen).
_RELIST_TASKS_PER_S = 100.0
_STOP = object()  # tells the watch loop to end
_EVALUATE_CHUNK = 1000  # tasks judged per hold of the lock (see NamespaceWatch._evaluate)


class NamespaceWatch:
    """The watch thread, the task cache it keeps, the offers it makes, and the listeners it
    rings (membership, task commands, schedules).

    ``expire`` moves a task past its ``expires_at`` to expired (the claims' rule);
    ``commands_queued`` wakes :meth:`~.commands.NodeCommands.command` (a command for this
    node was put, or the watch re-listed).
    """

    def __init__(self, driver: EtcdDriver, keys: Keys, config: EtcdConfig, clock: Clock,
                 state: NodeState, cache: TaskCache, *, expire: Callable[[str, int], None],
                 commands_queued: Callable[[], None]) -> None:
        self._driver = driver
        self._keys = keys
        self._cfg = config
        self._clock = clock
        self._state = state
        self._cache = cache
        self._expire = expire
        self._commands_queued = commands_queued
        self._folder = Folder(keys, state, cache)
        # all guarded by the node's lock
        self._subs: list[Subscriber] = []
        self._unusable: dict[str, int] = {}  # stored ids no Task may have -> props revision logged
        self._queue: queue.Queue[object] | None = None
        self._gen = 0  # which watch stream may fold events into the cache
        self._started = False
        self._member_listeners: list[Callable[[], None]] = []
        self._task_cmd_listeners: list[TaskCommandListener] = []
        self._schedule_listeners: list[Callable[[], None]] = []

    def ensure_started(self) -> None:
        """Start the watch thread once."""
        with self._state.lock:
            if self._started or self._state.closed:
                return
            self._started = True
        self._state.start_thread("watch", self._run)

    def reoffer_all(self) -> None:
        """Offer every claimable task again (after a re-registration)."""
        with self._state.lock:
            for sub in self._subs:
                sub.mark(None)

    def close(self) -> None:
        """Wake every ``watch(out)`` (they see the node closed) and end the watch loop."""
        with self._state.lock:
            for sub in self._subs:
                sub.event.set()
            wq = self._queue
        if wq is not None:
            wq.put(_STOP)

    def listen_membership(self, listener: Callable[[], None]) -> bool:
        """Call ``listener`` when the namespace watch sees a registration key change (a
        join, a leave or lease expiry, a ``leaving`` flag) and whenever it re-lists."""
        with self._state.lock:
            self._member_listeners.append(listener)
        self.ensure_started()
        return True

    def _members_changed(self) -> None:
        with self._state.lock:
            listeners = list(self._member_listeners)
        for listener in listeners:
            listener()

    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        """Offer claimable tasks to ``out`` until the node closes (``Coordinator.watch``)."""
        sink = as_sink(out)
        sub = Subscriber()
        sub.event.set()  # the first round offers every claimable task
        with self._state.lock:
            if self._state.closed:
                return
            self._subs.append(sub)
        self.ensure_started()
        timers: dict[str, datetime] = {}
        try:
            while True:
                now = self._clock.now()
                wait = _TIMER_CAP
                if timers:
                    wait = min(wait, max(0.0, (min(timers.values()) - now).total_seconds()))
                sub.event.wait(wait)
                offers, expiring = self._evaluate(sub, timers)
                for task_id, props_mod in expiring:
                    if self._state.closed:
                        return
                    self._expire(task_id, props_mod)
                for task in offers:  # the collector is on: a sink may block (a full queue)
                    if self._state.closed:
                        return
                    sink(task)
                if self._state.closed:
                    return
        finally:
            with self._state.lock:
                if sub in self._subs:
                    self._subs.remove(sub)

    def _evaluate(
        self, sub: Subscriber, timers: dict[str, datetime]
    ) -> tuple[list[Task], list[tuple[str, int]]]:
        """Which of the marked or due tasks to offer, and which to expire.

        Judged :data:`_EVALUATE_CHUNK` tasks per hold of the node's lock: a re-list marks
        every task, and judging 100,000 of them in one hold kept the lease thread (which
        takes the lock at every beat) waiting past its renewal at a storm's start.
        """
        now = self._clock.now()
        offers: list[Task] = []
        expiring: list[tuple[str, int]] = []
        unusable: list[tuple[str, InvalidTaskId]] = []
        with self._state.lock:
            sub.event.clear()
            if self._state.closed or not self._cache.ready:
                return offers, expiring  # the first listing marks everything again
            candidates = set(self._cache.entries) if sub.everything else sub.ids
            sub.ids = set()
            sub.everything = False
            for task_id, due in list(timers.items()):
                if due <= now:
                    candidates.add(task_id)
                    del timers[task_id]
        ordered = sorted(candidates)
        with gc_paused(len(ordered)):  # an offer is built for most of them
            for start in range(0, len(ordered), _EVALUATE_CHUNK):
                with self._state.lock:
                    if self._state.closed:
                        return [], []
                    for task_id in ordered[start:start + _EVALUATE_CHUNK]:
                        self._judge(task_id, now, timers, offers, expiring, unusable)
        for task_id, reason in unusable:
            log.warning("node %s: not offering the task stored as %r (an invalid id): %s",
                        self._state.node_id, task_id[:80], reason, extra=self._state.extra)
        # From a random place (racing nodes start in different regions), highest priority
        # first (the sort is stable: each priority keeps its rotation).
        offers = rotated(offers)
        offers.sort(key=lambda t: -t.priority)
        return offers, expiring

    def _judge(self, task_id: str, now: datetime, timers: dict[str, datetime], offers: list[Task],
               expiring: list[tuple[str, int]], unusable: list[tuple[str, InvalidTaskId]]) -> None:
        """Judge one marked or due task (called holding the lock): offer it, expire it, set
        its timer, or drop it."""
        entry = self._cache.entries.get(task_id)
        if entry is None or entry.props is None or entry.finished or entry.owner:
            timers.pop(task_id, None)
            if entry is None:
                self._unusable.pop(task_id, None)
            return
        try:
            validate_task_id(task_id)
        except InvalidTaskId as bad_id:
            # A key written by hand: no Task can carry this id. Skip it (log once).
            timers.pop(task_id, None)
            if self._unusable.get(task_id) != entry.props_mod:
                self._unusable[task_id] = entry.props_mod
                unusable.append((task_id, bad_id))
            return
        if entry.held_for is not None and entry.held_for != self._state.node_id:
            # Held for a node that stopped gracefully (holds.py): etcd deletes the hold with
            # its lease at the end of the window, and that event offers the task again.
            timers.pop(task_id, None)
        elif entry.expires_at is not None and entry.expires_at <= now:
            expiring.append((task_id, entry.props_mod))
            timers.pop(task_id, None)
        elif entry.launch_at is not None and entry.launch_at > now:
            timers[task_id] = entry.launch_at
        else:
            offer, entry.props_valid = offer_for(task_id, entry)
            offers.append(offer)
            if entry.expires_at is not None:
                timers[task_id] = entry.expires_at
            else:
                timers.pop(task_id, None)

    def _run(self) -> None:
        backoff = BACKOFF_START
        failing = False
        while not self._state.stop.is_set():
            handle: WatchHandle | None = None
            try:
                with self._state.lock:  # from now on, a late event of the old stream is dropped
                    self._gen += 1
                    gen = self._gen
                revision = self._relist()
                wq: queue.Queue[object] = queue.Queue()
                with self._state.lock:
                    if self._state.closed:
                        return
                    self._queue = wq

                def deliver(item: WatchBatch | WatchFailure, gen: int = gen,
                            wq: queue.Queue[object] = wq) -> None:
                    # Events are folded in on the stream's reader thread: one thread hop
                    # less between a submit and its offer. Failures go to this loop.
                    if isinstance(item, WatchBatch):
                        self._apply(item, gen)
                    else:
                        wq.put(item)

                handle = self._driver.watch_prefix(self._keys.root, revision + 1, deliver,
                                                   skip=self._keys.is_claim)
                # Schedule changes while no watch ran were not pushed: the schedulers look once.
                with self._state.lock:
                    self._cache.live = True
                    wakes = list(self._schedule_listeners)
                for wake in wakes:
                    wake()
                if failing:
                    log.info("node %s: watch recovered", self._state.node_id, extra=self._state.extra)
                failing = False
                backoff = BACKOFF_START
                relist_at = self._clock.monotonic() + self._relist_every()
                while True:
                    left = relist_at - self._clock.monotonic()
                    if left <= 0:
                        break  # safety net: re-list now and then, in case a change was missed
                    try:
                        item = wq.get(timeout=left)
                    except queue.Empty:
                        break
                    if item is _STOP:
                        return
                    if isinstance(item, WatchFailure):
                        if item.compacted:
                            raise WatchCompacted(revision + 1)
                        raise CoordinatorUnavailable(f"etcd watch ended: {item.error!r}")
            except WatchCompacted:
                self._watch_ended()
                log.info("node %s: watch history compacted; re-listing", self._state.node_id,
                         extra=self._state.extra)
            except Exception as exc:
                self._watch_ended()
                if self._state.stop.is_set():
                    return
                level = logging.DEBUG if failing else logging.WARNING
                if not isinstance(exc, MetaforaError):
                    level = logging.ERROR
                log.log(level, "node %s: watch failed (%s: %s); retrying in %.2fs", self._state.node_id,
                        type(exc).__name__, exc, backoff, extra=self._state.extra,
                        exc_info=not isinstance(exc, MetaforaError))
                failing = True
                self._state.stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
            finally:
                if handle is not None:
                    handle.cancel()

    def _watch_ended(self) -> None:
        """The stream failed: until a new one is confirmed, counts are read from etcd.

        (A safety-net re-list keeps serving them from the cache: it replaces the cache in one
        step, and reading every owner key meanwhile is what the cache is there to avoid.)
        """
        with self._state.lock:
            self._cache.live = False

    def _relist_every(self) -> float:
        """Seconds to the safety-net re-list: ``poll_interval``, spaced by the cache's size.

        A re-list reads and decodes every task and re-offers the whole backlog; with every
        node doing it each ``poll_interval``, a large backlog kept etcd and the nodes busy
        with it instead of claiming, and an idle cluster read its whole namespace again and
        again (at 100,000 tasks: once every 1,000 s per node, 100 keys a second).
        """
        with self._state.lock:
            tasks = len(self._cache.entries)
        return max(self._cfg.poll_interval, tasks / _RELIST_TASKS_PER_S)

    def _relist(self) -> int:
        """Rebuild the cache from one consistent read; returns its revision."""
        with gc_paused():  # the whole namespace, read and decoded: bulk work
            records, members, revision = read_snapshot(self._driver, self._keys)
            entries = {task_id: Entry.from_record(task_id, rec) for task_id, rec in records.items()}
            del records
        lost: list[Task] = []
        with self._state.lock:
            self._cache.replace(entries, members, revision)
            for task_id, held in list(self._state.held.items()):
                if held.task.token > revision:
                    continue  # claimed after this read
                entry = entries.get(task_id)
                if entry is None or entry.owner_rev != held.task.token:
                    del self._state.held[task_id]
                    if not held.finishing:
                        lost.append(held.task)
            for sub in self._subs:
                sub.mark(None)
            listeners = list(self._task_cmd_listeners)
        self._commands_queued()  # the watch restarts: a command queued meanwhile may be unseen
        self._state.notify_lost(lost)
        for listener in listeners:
            listener.recheck()  # likewise for a task command
        self._members_changed()  # and for a node that came or went meanwhile
        return revision

    def cached_task_count(self, active: bool) -> dict[str, int] | None:
        """Live node -> tasks it holds, from the watch cache (without ``leaving`` nodes when
        ``active``); None while no watch stream follows the store (then read it instead).

        As of the cache's revision: it lags the store by the watch's delivery, as every
        balancer's view of the others does anyway.
        """
        with self._state.lock:
            return self._cache.counts(active)

    def read_directly(self, newest: int) -> None:
        """The node read the members or owners from etcd (the cache did not answer); the
        newest key it read was at revision ``newest``: the cache answers again once it is
        there (a view never older than one already given)."""
        with self._state.lock:
            self._cache.floor = max(self._cache.floor, newest)

    def cached_members(self, active: bool) -> tuple[dict[str, int], dict[str, Registration]] | None:
        """Like :meth:`cached_task_count`, with what the nodes' registrations say (weights,
        frozen), both as of the same revision of the cache; None while no stream follows."""
        with self._state.lock:
            counts, found = self._cache.counts(active), self._cache.members(active)
        return None if counts is None or found is None else (counts, found)

    def prunable(self, cutoffs: Cutoffs, limit: int) -> list[str] | None:
        """The periodic pruner's candidates (:meth:`TaskCache.prunable`); None before the
        cache's first re-list."""
        with self._state.lock:
            return self._cache.prunable(cutoffs, limit) if self._cache.ready else None

    def cached_claimable(self, now: datetime) -> int | None:
        """Tasks claimable now as the watch cache sees them; None before its first re-list."""
        with self._state.lock:
            return self._cache.claimable(now)

    def listen_task_commands(self, listener: TaskCommandListener) -> bool:
        """Ring ``listener`` for every task command the namespace watch sees queued, and
        ask it to recheck whenever the watch re-lists."""
        with self._state.lock:
            self._task_cmd_listeners.append(listener)
        return True

    def listen_schedules(self, wake: Callable[[], None]) -> bool:
        """Woken by the node's watch (it covers the namespace); False before ``init``."""
        with self._state.lock:
            if self._state.ctx is None:
                return False
            self._schedule_listeners.append(wake)
        return True

    def _apply(self, batch: WatchBatch, gen: int) -> None:
        """Fold watch events into the cache; collect offers, lost claims, command wake-ups.

        ``gen`` is the stream's: events of a stream replaced since (a late delivery racing
        its cancel) are dropped, the re-list that replaced it has read past them.
        """
        seen = Seen()
        with self._state.lock:
            if gen != self._gen:
                return
            for event in batch.events:
                self._folder.fold(event, seen)
            self._cache.revision = max(self._cache.revision, batch.revision)
            if seen.dirty:
                for sub in self._subs:
                    sub.mark(seen.dirty)
            listeners = list(self._task_cmd_listeners) if seen.task_commands else []
            wakes = list(self._schedule_listeners) if seen.schedules else []
        if seen.commands:
            self._commands_queued()
        for wake in wakes:
            wake()
        self._state.notify_lost(seen.lost)
        if seen.members:
            self._members_changed()
        for listener in listeners:
            for task_id in seen.task_commands:
                listener.ring(task_id)
