"""Folding the namespace watch's events into the task cache (:mod:`.cache`), noting what
each batch changed for :class:`~metafora.coordinators.etcd.watch.NamespaceWatch` to act on
once the node's lock is released."""

from __future__ import annotations

from dataclasses import dataclass, field

from metafora.coordinators.etcd.cache import Entry, Outcome, TaskCache
from metafora.coordinators.etcd.layout import Keys
from metafora.coordinators.etcd.node import NodeState
from metafora.coordinators.etcd.ops import WatchEvent
from metafora.coordinators.etcd.queries import member_of
from metafora.core.task import Task

__all__ = ["Folder", "Seen"]


@dataclass
class Seen:
    """What one watch batch changed, acted on once the lock is released."""

    dirty: set[str] = field(default_factory=set)  # tasks to evaluate again
    lost: list[Task] = field(default_factory=list)  # claims of this node gone
    commands: bool = False  # a command for this node was queued
    schedules: bool = False
    members: bool = False  # another node's registration changed
    task_commands: list[str] = field(default_factory=list)  # tasks with a command queued


class Folder:
    """Folds watch events into ``cache`` (called holding the node's lock)."""

    def __init__(self, keys: Keys, state: NodeState, cache: TaskCache) -> None:
        self._keys = keys
        self._state = state
        self._cache = cache

    def fold(self, event: WatchEvent, seen: Seen) -> None:
        """Fold one event into the cache and ``seen`` (called holding the lock)."""
        parsed = self._keys.parse(event.kv.key)
        if parsed is None:
            return
        kind, name, part = parsed
        put = event.kind == "put"
        if kind in {"task", "owner"}:  # nearly every event: first
            if part != "claim":  # the claim key is not cached
                self._fold_task(kind, name, part, event, put, seen)
        elif kind == "command":
            seen.commands = seen.commands or (put and name == self._state.node_id)
        elif kind == "alive":
            seen.members = seen.members or name != self._state.node_id
            if put:
                self._cache.member_put(name, member_of(event.kv.value, name))
            else:
                self._cache.member_gone(name)
        elif kind == "taskcmd":
            if put:
                seen.task_commands.append(name)
        elif kind == "schedule":
            seen.schedules = True

    def _fold_task(self, kind: str, name: str, part: str, event: WatchEvent, put: bool,
                   seen: Seen) -> None:
        """Fold an event of a task's key or its owner key into its entry."""
        entry = self._cache.entries.get(name)
        if entry is None:  # (not setdefault: an Entry built for every event, mostly unused)
            entry = self._cache.entries[name] = Entry()
        if kind == "owner":
            self._fold_owner(name, entry, event, seen)
        elif part == "props":
            if put:
                entry.set_props(event.kv, name)
                seen.dirty.add(name)
            else:
                entry.props = None
        elif part == "running":
            if not put and entry.held_for is not None:
                seen.dirty.add(name)  # a hold ended (its lease expired or was revoked)
            entry.set_running(event.kv if put else None)
        elif part == "state":
            entry.outcome = Outcome.of(event.kv) if put else None
            if not put:
                seen.dirty.add(name)
        if entry.props is None and entry.owner is None:
            del self._cache.entries[name]
            self._cache.track(name, None)
        else:
            self._cache.track(name, entry)

    def _fold_owner(self, name: str, entry: Entry, event: WatchEvent, seen: Seen) -> None:
        """An owner key was put or deleted: a claim of this node's may be lost."""
        held = self._state.held.get(name)
        if event.kind == "put":
            self._cache.set_owner(entry, event.kv)
            # a newer owner key than our claim's: someone else holds it now
            gone = held is not None and event.kv.create_revision > held.task.token
        else:
            self._cache.set_owner(entry, None)
            seen.dirty.add(name)
            gone = held is not None and event.kv.mod_revision > held.task.token
        if gone:
            assert held is not None
            del self._state.held[name]
            if not held.finishing:
                seen.lost.append(held.task)
