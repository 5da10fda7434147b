"""Rendezvous preference: in a wave of offers, each task is tried first by one node.

Every node hears every offer. When a wave arrives at once (the backlog at start-up, a bulk
submit), racing for all of it makes each claim won cost about one lost claim per other node:
the nodes all try the same rows. Instead each node ranks every offered task over the live
members (highest-random-weight, or rendezvous, hashing of the task id with each node id:
every node computes the same ranking without talking to the others) and

- tries at once the tasks it ranks first for (about ``1 / nodes`` of the wave);
- holds the others back, so their preferred nodes take them unopposed, and tries them once
  ``hold`` seconds passed with no wave arriving (by then its own share is claimed, and so,
  mostly, are the others'), or ``max_hold`` seconds after it held them back, whatever comes:
  a task is never left waiting because its preferred node is gone, full, frozen or
  refusing. A held-back task is tried once without preference afterwards.

Priorities still come first: while a task of higher priority is held back, this node holds
back its own lower-priority ones too, so it never claims a lower-priority task before a
higher one it was offered. Small waves (fewer than ``wave`` offers), tasks with placement
(a selector, ``prefer`` or ``spread``: :mod:`metafora.consumer.offers` has its own hold-back for
those) and a node alone are not held back here: a lone submit goes one node first, the others
after a short delay (:mod:`metafora.consumer.first_offer`). Nothing here touches the store.
"""

from __future__ import annotations

import collections
import hashlib
import zlib
from collections.abc import Iterable, Sequence

from metafora.core.task import Task

__all__ = ["Preference", "preferred_node", "weight"]

_MASK = (1 << 64) - 1
_ODD1 = 0x9E3779B97F4A7C15  # odd 64-bit constants of splitmix64
_ODD2 = 0xBF58476D1CE4E5B9
_FORGET = 60.0  # seconds a released offer is remembered (it is not held back again meanwhile)


def _task_key(task_id: str) -> int:
    # CRC-32 is C-fast (one per offer); the multiply spreads it over 64 bits.
    return (zlib.crc32(task_id.encode()) * _ODD1) & _MASK


def _node_key(node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=8).digest(), "big")


def _weight(task_key: int, node_key: int) -> int:
    x = ((task_key ^ node_key) * _ODD2) & _MASK
    return x ^ (x >> 31)


def weight(task_id: str, node_id: str) -> int:
    """The rendezvous weight of ``node_id`` for ``task_id`` (the same on every node)."""
    return _weight(_task_key(task_id), _node_key(node_id))


def preferred_node(task_id: str, nodes: Iterable[str]) -> str:
    """The node ranked first for ``task_id`` (the highest weight; ties by node id)."""
    return max(nodes, key=lambda node: (weight(task_id, node), node))


class Preference:
    """One node's rendezvous ranking and its held-back offers (used by the consumer's loop).

    Not thread-safe: the consumer's loop owns it.
    """

    def __init__(self, node_id: str, *, hold: float, max_hold: float, wave: int) -> None:
        self._node_id = node_id
        self._me = _node_key(node_id)
        self._others: list[tuple[int, str]] = []  # (key, id) of the other live nodes
        self._hold = hold
        self._max_hold = max(hold, max_hold)
        self._wave = wave
        # Held-back offers in the order held: (held at, task). One hold time for all, so the
        # deque is ordered by due time as well.
        self._held: collections.deque[tuple[float, Task]] = collections.deque()
        self._held_ids: dict[str, int] = {}  # id -> times queued (a re-offer is queued again)
        self._levels: collections.Counter[int] = collections.Counter()  # priorities held
        self._released: dict[str, float] = {}  # id -> when it was released (not held again)
        self._last_wave = float("-inf")
        self._flush = False  # a node left: try everything held back now

    @property
    def enabled(self) -> bool:
        """Whether anything is held back at all (a hold of 0 turns preference off)."""
        return self._hold > 0

    @property
    def alone(self) -> bool:
        """Whether this node knows no other live node (it ranks first for every task)."""
        return not self._others

    def members(self, nodes: Iterable[str]) -> bool:
        """The live nodes (this one is always counted); whether a node left. When one left,
        everything held back is due at once: some of it was left to that node."""
        before = {n for _, n in self._others}
        self._others = sorted((_node_key(n), n) for n in set(nodes) if n != self._node_id)
        left = bool(before - {n for _, n in self._others})
        if left and self._held:
            self._flush = True
        return left

    def mine(self, task_id: str) -> bool:
        """Whether this node ranks first for ``task_id`` among the live nodes."""
        if not self._others:
            return True
        task = _task_key(task_id)
        own = _weight(task, self._me)
        for key, node in self._others:  # most tasks are another node's: out at the first
            other = _weight(task, key)
            if other > own or (other == own and node > self._node_id):
                return False
        return True

    def __len__(self) -> int:
        return len(self._held)

    def split(self, offers: Sequence[Task], now: float) -> list[Task]:
        """The offers (highest priority first) to try now, in order; the rest are held back."""
        if not self.enabled or not self._others or len(offers) < self._wave:
            if not self._held:
                return list(offers)
            return [t for t in offers if not self._hold_behind(t, now)]
        self._last_wave = now
        self._prune(now)
        return [t for t in offers if not self._holds(t, now)]

    def _holds(self, task: Task, now: float) -> bool:
        if task.selector or task.prefer or task.spread is not None or task.id in self._released:
            return self._hold_behind(task, now)
        if self.mine(task.id):
            return self._hold_behind(task, now)
        self._put(task, now)
        return True

    def _hold_behind(self, task: Task, now: float) -> bool:
        """Hold ``task`` back behind a held-back task of higher priority (if there is one)."""
        if self._levels and max(self._levels) > task.priority:
            self._put(task, now)
            return True
        return False

    def _put(self, task: Task, now: float) -> None:
        self._held.append((now, task))
        self._held_ids[task.id] = self._held_ids.get(task.id, 0) + 1
        self._levels[task.priority] += 1

    def due(self, now: float, limit: int) -> list[Task]:
        """Up to ``limit`` held-back offers to try now, highest priority first (see the
        module docstring)."""
        if not self._held:
            self._flush = False
            return []
        quiet = now - self._last_wave >= self._hold
        out: list[Task] = []
        while self._held and len(out) < limit:
            held_at, task = self._held[0]
            if (not self._flush and not (quiet and now - held_at >= self._hold)
                    and now - held_at < self._max_hold):
                break
            self._held.popleft()
            self._levels[task.priority] -= 1
            if not self._levels[task.priority]:
                del self._levels[task.priority]
            left = self._held_ids[task.id] - 1
            if left:
                self._held_ids[task.id] = left
                continue  # a later offer of the same task is still queued: that one goes
            del self._held_ids[task.id]
            self._released[task.id] = now
            out.append(task)
        if not self._held:
            self._flush = False
        out.sort(key=lambda t: -t.priority)
        return out

    def next_due(self) -> float | None:
        """When :meth:`due` may return something next (None: nothing is held back)."""
        if not self._held:
            return None
        held_at = self._held[0][0]
        if self._flush:
            return held_at
        return min(max(held_at, self._last_wave) + self._hold, held_at + self._max_hold)

    def _prune(self, now: float) -> None:
        if len(self._released) > 4 * len(self._held) + 1024:
            self._released = {k: t for k, t in self._released.items() if now - t < _FORGET}
