"""The namespace watch: re-list into the cache, fold events in, feed ``watch(out)``.

See :mod:`metafora.coordinators.etcd.coordinator` for the watch thread's contract.
"""

from __future__ import annotations

import logging
import queue
from collections import Counter
from collections.abc import Callable
from datetime import datetime

from metafora.coordinator import TaskCommandListener, TaskSink, as_sink, rotated
from metafora.coordinators.etcd.cache import Entry, Subscriber, offer_for
from metafora.coordinators.etcd.driver import WatchBatch, WatchCompacted, WatchFailure, WatchHandle
from metafora.coordinators.etcd.node import _BACKOFF_MAX, _BACKOFF_START, _STOP, NodeBase
from metafora.coordinators.etcd.queries import is_leaving, read_snapshot
from metafora.errors import CoordinatorUnavailable, InvalidTaskId, MetaforaError
from metafora.task import Task, validate_task_id

__all__ = ["WatchMixin"]

log = logging.getLogger(__name__)

_TIMER_CAP = 60.0  # re-check wall-clock timers at least this often (clock jumps)
_RELIST_TASKS_PER_S = 1000.0  # a safety-net re-list comes no more often than tasks / this many s


class WatchMixin(NodeBase):
    """The watch thread, the task cache it keeps, and the offers it makes."""

    def _ensure_watcher(self) -> None:
        with self._lock:
            if self._watcher_started or self._closed:
                return
            self._watcher_started = True
        self._start_thread("watch", self._watch_loop)

    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        sink = as_sink(out)
        sub = Subscriber()
        sub.event.set()  # the first round offers every claimable task
        with self._lock:
            if self._closed:
                return
            self._subs.append(sub)
        self._ensure_watcher()
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
                    if self._closed:
                        return
                    self._expire(task_id, props_mod)
                for task in offers:
                    if self._closed:
                        return
                    sink(task)
                if self._closed:
                    return
        finally:
            with self._lock:
                if sub in self._subs:
                    self._subs.remove(sub)

    def _evaluate(
        self, sub: Subscriber, timers: dict[str, datetime]
    ) -> tuple[list[Task], list[tuple[str, int]]]:
        """Which of the marked or due tasks to offer, and which to expire."""
        now = self._clock.now()
        offers: list[Task] = []
        expiring: list[tuple[str, int]] = []
        unusable: list[tuple[str, InvalidTaskId]] = []
        with self._lock:
            sub.event.clear()
            if self._closed or not self._cache_ready:
                return offers, expiring  # the first listing marks everything again
            candidates = set(self._cache) if sub.everything else sub.ids
            sub.ids = set()
            sub.everything = False
            for task_id, due in list(timers.items()):
                if due <= now:
                    candidates.add(task_id)
                    del timers[task_id]
            for task_id in sorted(candidates):
                entry = self._cache.get(task_id)
                if entry is None or entry.props is None or entry.finished or entry.owner:
                    timers.pop(task_id, None)
                    if entry is None:
                        self._unusable.pop(task_id, None)
                    continue
                try:
                    validate_task_id(task_id)
                except InvalidTaskId as bad_id:
                    # A key written by hand: no Task can carry this id. Skip it (log once).
                    timers.pop(task_id, None)
                    if self._unusable.get(task_id) != entry.props_mod:
                        self._unusable[task_id] = entry.props_mod
                        unusable.append((task_id, bad_id))
                    continue
                if entry.expires_at is not None and entry.expires_at <= now:
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
        for task_id, reason in unusable:
            log.warning("node %s: not offering the task stored as %r (an invalid id): %s",
                        self._node_id, task_id[:80], reason, extra=self._extra)
        # From a random place (racing nodes start in different regions), highest priority
        # first (the sort is stable: each priority keeps its rotation).
        offers = rotated(offers)
        offers.sort(key=lambda t: -t.priority)
        return offers, expiring

    def _watch_loop(self) -> None:
        backoff = _BACKOFF_START
        failing = False
        while not self._stop.is_set():
            handle: WatchHandle | None = None
            try:
                with self._lock:  # from now on, a late event of the old stream is dropped
                    self._watch_gen += 1
                    gen = self._watch_gen
                revision = self._relist()
                wq: queue.Queue[object] = queue.Queue()
                with self._lock:
                    if self._closed:
                        return
                    self._watch_queue = wq

                def deliver(item: WatchBatch | WatchFailure, gen: int = gen,
                            wq: queue.Queue[object] = wq) -> None:
                    # Events are folded in on the stream's reader thread: one thread hop
                    # less between a submit and its offer. Failures go to this loop.
                    if isinstance(item, WatchBatch):
                        self._apply(item, gen)
                    else:
                        wq.put(item)

                handle = self._driver.watch_prefix(self._keys.root, revision + 1, deliver)
                # Schedule changes while no watch ran were not pushed: the schedulers look once.
                with self._lock:
                    self._watch_live = True
                    wakes = list(self._schedule_listeners)
                for wake in wakes:
                    wake()
                if failing:
                    log.info("node %s: watch recovered", self._node_id, extra=self._extra)
                failing = False
                backoff = _BACKOFF_START
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
                log.info("node %s: watch history compacted; re-listing", self._node_id,
                         extra=self._extra)
            except Exception as exc:
                self._watch_ended()
                if self._stop.is_set():
                    return
                level = logging.DEBUG if failing else logging.WARNING
                if not isinstance(exc, MetaforaError):
                    level = logging.ERROR
                log.log(level, "node %s: watch failed (%s: %s); retrying in %.2fs", self._node_id,
                        type(exc).__name__, exc, backoff, extra=self._extra,
                        exc_info=not isinstance(exc, MetaforaError))
                failing = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
            finally:
                if handle is not None:
                    handle.cancel()

    def _watch_ended(self) -> None:
        """The stream failed: until a new one is confirmed, counts are read from etcd.

        (A safety-net re-list keeps serving them from the cache: it replaces the cache in one
        step, and reading every owner key meanwhile is what the cache is there to avoid.)
        """
        with self._lock:
            self._watch_live = False

    def _relist_every(self) -> float:
        """Seconds to the safety-net re-list: ``poll_interval``, spaced by the cache's size.

        A re-list reads and decodes every task and re-offers the whole backlog; with every
        node doing it each ``poll_interval``, a large backlog kept etcd and the nodes busy
        with it instead of claiming (the SQL watch spaces its full scan the same way).
        """
        with self._lock:
            tasks = len(self._cache)
        return max(self._cfg.poll_interval, tasks / _RELIST_TASKS_PER_S)

    def _relist(self) -> int:
        """Rebuild the cache from one consistent read; returns its revision."""
        records, members, revision = read_snapshot(self._driver, self._keys)
        cache = {task_id: Entry.from_record(task_id, rec) for task_id, rec in records.items()}
        owned = Counter(entry.owner for entry in cache.values() if entry.owner is not None)
        lost: list[Task] = []
        with self._lock:
            self._cache = cache
            self._live_nodes = members
            self._held_by = owned
            self._cache_rev = revision
            self._cache_ready = True
            for task_id, held in list(self._held.items()):
                if held.task.token > revision:
                    continue  # claimed after this read
                entry = cache.get(task_id)
                if entry is None or entry.owner_rev != held.task.token:
                    del self._held[task_id]
                    if not held.finishing:
                        lost.append(held.task)
            for sub in self._subs:
                sub.mark(None)
            self._cmd_seq += 1
            self._cmd_cond.notify_all()
            listeners = list(self._task_cmd_listeners)
        self._notify_lost(lost)
        for listener in listeners:
            listener.recheck()  # the watch restarts: a put meanwhile may be unseen
        self._members_changed()  # likewise for a node that came or went meanwhile
        return revision

    def _disown(self, entry: Entry) -> None:
        """Take ``entry``'s owner out of the counts (called holding the lock)."""
        if entry.owner is not None:
            left = self._held_by[entry.owner] - 1
            if left > 0:
                self._held_by[entry.owner] = left
            else:
                del self._held_by[entry.owner]

    def cached_task_count(self, active: bool) -> dict[str, int] | None:
        """Live node -> tasks it holds, from the watch cache (without ``leaving`` nodes when
        ``active``); None while no watch stream follows the store (then read it instead).

        As of the cache's revision: it lags the store by the watch's delivery, as every
        balancer's view of the others does anyway.
        """
        with self._lock:
            if not (self._watch_live and self._cache_ready):
                return None
            return {node: self._held_by.get(node, 0)
                    for node, leaving in sorted(self._live_nodes.items()) if not (active and leaving)}

    def listen_task_commands(self, listener: TaskCommandListener) -> bool:
        """Ring ``listener`` for every task command the namespace watch sees queued, and
        ask it to recheck whenever the watch re-lists."""
        with self._lock:
            self._task_cmd_listeners.append(listener)
        return True

    def listen_schedules(self, wake: Callable[[], None]) -> bool:
        """Woken by the node's watch (it covers the namespace); False before :meth:`init`."""
        with self._lock:
            if self._ctx is None:
                return False
            self._schedule_listeners.append(wake)
        return True

    def _apply(self, batch: WatchBatch, gen: int) -> None:
        """Fold watch events into the cache; collect offers, lost claims, command wake-ups.

        ``gen`` is the stream's: events of a stream replaced since (a late delivery racing
        its cancel) are dropped, the re-list that replaced it has read past them.
        """
        dirty: set[str] = set()
        lost: list[Task] = []
        commands = False
        schedules_changed = False
        members = False
        task_commands: list[str] = []
        with self._lock:
            if gen != self._watch_gen:
                return
            for event in batch.events:
                parsed = self._keys.parse(event.kv.key)
                if parsed is None:
                    continue
                kind, name, part = parsed
                put = event.kind == "put"
                if kind == "command":
                    commands = commands or (put and name == self._node_id)
                    continue
                if kind == "alive":
                    members = members or name != self._node_id
                    if put:
                        self._live_nodes[name] = is_leaving(event.kv.value)
                    else:
                        self._live_nodes.pop(name, None)
                    continue
                if kind == "taskcmd":
                    if put:
                        task_commands.append(name)
                    continue
                if kind == "schedule":
                    schedules_changed = True
                    continue
                if kind not in ("task", "owner") or part == "claim":
                    continue  # the claim key (who claimed last, when) is not cached
                entry = self._cache.setdefault(name, Entry())
                if kind == "owner":
                    held = self._held.get(name)
                    self._disown(entry)
                    if put:
                        entry.owner = event.kv.value.decode(errors="replace")
                        self._held_by[entry.owner] += 1
                        entry.owner_rev = event.kv.create_revision
                        if held is not None and event.kv.create_revision > held.task.token:
                            del self._held[name]  # someone else holds it now
                            if not held.finishing:
                                lost.append(held.task)
                    else:
                        entry.owner = None
                        entry.owner_rev = 0
                        dirty.add(name)
                        if held is not None and event.kv.mod_revision > held.task.token:
                            del self._held[name]
                            if not held.finishing:
                                lost.append(held.task)
                elif part == "props":
                    if put:
                        entry.set_props(event.kv, name)
                        dirty.add(name)
                    else:
                        entry.props = None
                elif part == "running":
                    entry.set_running(event.kv if put else None)
                elif part == "state":
                    entry.finished = put
                    if not put:
                        dirty.add(name)
                if entry.props is None and entry.owner is None:
                    del self._cache[name]
            self._cache_rev = max(self._cache_rev, batch.revision)
            if dirty:
                for sub in self._subs:
                    sub.mark(dirty)
            if commands:
                self._cmd_seq += 1
                self._cmd_cond.notify_all()
            listeners = list(self._task_cmd_listeners) if task_commands else []
            wakes = list(self._schedule_listeners) if schedules_changed else []
        for wake in wakes:
            wake()
        self._notify_lost(lost)
        if members:
            self._members_changed()
        for listener in listeners:
            for task_id in task_commands:
                listener.ring(task_id)


