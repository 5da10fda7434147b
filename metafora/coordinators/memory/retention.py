"""Retention on the in-process memory store (see :mod:`metafora.core.retention`): the policy and
the turn live beside the :class:`MemoryStore` (held under its lock); a batch deletes under
the lock, so no reader sees a task half gone."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from datetime import datetime, timedelta

from metafora.coordinators.members import context_capacity
from metafora.coordinators.memory.store import MemoryStore
from metafora.core.retention import DEFAULT_RETENTION, Cutoffs, Retention, RetentionOps, prunable
from metafora.core.task import TaskState

__all__ = ["MemoryRetention"]


@dataclass
class _Kept:
    policy: Retention = DEFAULT_RETENTION
    next_prune: datetime | None = None


_kept: weakref.WeakKeyDictionary[MemoryStore, _Kept] = weakref.WeakKeyDictionary()


def _of(store: MemoryStore) -> _Kept:
    found = _kept.get(store)
    if found is None:
        found = _kept[store] = _Kept()
    return found


class MemoryRetention(RetentionOps):
    """The retention hooks of the memory client and coordinator."""

    def _retention_store(self) -> MemoryStore:
        raise NotImplementedError

    def _retention_get(self) -> Retention:
        s = self._retention_store()
        with s.cond:
            return _of(s).policy

    def _retention_put(self, policy: Retention) -> None:
        s = self._retention_store()
        with s.cond:
            _of(s).policy = policy

    def _prune_now(self) -> datetime:
        return self._retention_store().clock.now()

    def _prune_turn(self, interval: float) -> tuple[Retention, Cutoffs] | None:
        s = self._retention_store()
        with s.cond:
            kept = _of(s)
            now = s.clock.now()
            if kept.next_prune is not None and kept.next_prune > now:
                return None
            kept.next_prune = now + timedelta(seconds=interval)
            return kept.policy, Cutoffs.at(kept.policy, now)

    def _prune_batch(self, cutoffs: Cutoffs, limit: int) -> int:
        s = self._retention_store()
        with s.cond:
            s.sweep(s.clock.now())
            doomed = []
            for task_id, row in s.tasks.items():
                if row.state is TaskState.PENDING or row.state is TaskState.CLAIMED:
                    continue
                held = s.task_state(task_id)
                if prunable(row.info(), None if held is None else held[1], cutoffs):
                    doomed.append(task_id)
                    if len(doomed) >= limit:
                        break
            for task_id in doomed:
                del s.tasks[task_id]
                s.task_states.pop(task_id, None)
                s.timed.pop(task_id, None)
                s.ready_rows.pop(task_id, None)
        if doomed:
            for delete in self._prune_extras():  # items in a database of their own
                delete(doomed)
        return len(doomed)

    def node_capacities(self) -> dict[str, int]:
        """Live node -> the capacity its context gives (the client's read)."""
        s = self._retention_store()
        with s.cond:
            nodes = list(s.nodes.values())
        return {n.node_id: c for n in nodes if (c := context_capacity(n.ctx)) is not None}

    def namespace_label(self) -> str:
        return self._retention_store().name

    def pending_count(self) -> int:
        s = self._retention_store()
        with s.cond:
            return sum(1 for row in s.tasks.values() if row.state is TaskState.PENDING)
