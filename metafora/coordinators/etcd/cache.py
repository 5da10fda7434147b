"""The watch cache's view of tasks, and what a claim is judged and fenced on.

Every node keeps one :class:`Entry` per task of its namespace, built by a re-list and kept
current by the watch (:mod:`metafora.coordinators.etcd.watch`); a claim copies it into an
immutable :class:`Known` so the claim txn compares against the revisions the offer was judged on.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from metafora.coordinators.etcd.layout import (
    StoredProps,
    TaskRecord,
    crashes_of,
    decode_json,
    hold_of,
    parse_iso,
    props_of,
)
from metafora.coordinators.etcd.ops import KeyValue
from metafora.coordinators.etcd.queries import Registration, launch_and_expiry
from metafora.core.errors import InvalidProps
from metafora.core.retention import Cutoffs
from metafora.core.task import Task

__all__ = ["Entry", "Known", "Outcome", "Subscriber", "TaskCache", "offer_for"]


@dataclass(frozen=True)
class Known:
    """A task as a claim sees it: its props and the revisions the claim is fenced on."""

    props: dict[str, Any]
    damage: str | None
    props_mod: int
    running_mod: int
    crashes_before: int | None  # None: the previous claim had an outcome (or there was none)
    stored: StoredProps | None = None  # placement (selector, priority, prefer, spread)
    valid: bool = False  # the props made a Task already (no need to check them again)
    held_for: str | None = None  # released held for this node (metafora.core.holds)

    @property
    def selector(self) -> Mapping[str, str]:
        """The task's selector ({} when unknown)."""
        return self.stored.selector if self.stored is not None else {}

    def task(self, task_id: str, token: int = 0) -> Task:
        """The task these props describe, carrying ``token``."""
        if self.stored is None:
            return Task(task_id, self.props, token)
        return self.stored.task(task_id, token)

    def crashes(self) -> int:
        """This claim's count of crashes in a row (the previous claim died if it left its key)."""
        return 0 if self.crashes_before is None else self.crashes_before + 1


@dataclass
class Entry:
    """The watch cache's view of one task."""

    props: dict[str, Any] | None = None
    props_error: str | None = None  # the damage of a props value written around metafora
    props_valid: bool = False  # these props made a Task when offered
    props_mod: int = 0
    launch_at: datetime | None = None
    expires_at: datetime | None = None
    outcome: Outcome | None = None  # a finished task's outcome record (its state key)
    owner: str | None = None
    owner_rev: int = 0
    stored: StoredProps | None = None

    running_mod: int = 0  # of the running key (0: absent, the last claim had an outcome)
    running_crashes: int | None = None
    held_for: str | None = None  # the running key holds the task for this node (holds.py)

    @property
    def finished(self) -> bool:
        """Whether the task has an outcome (done, failed or expired)."""
        return self.outcome is not None

    def known(self) -> Known:
        """What a claim is judged and fenced on."""
        assert self.props is not None
        return Known(self.props, self.props_error, self.props_mod, self.running_mod,
                      self.running_crashes, self.stored, self.props_valid, self.held_for)

    def set_running(self, kv: KeyValue | None) -> None:
        """Take the running key (None: deleted, the last claim had an outcome)."""
        self.running_mod = 0 if kv is None else kv.mod_revision
        self.running_crashes = crashes_of(kv)
        hold = hold_of(kv)
        self.held_for = None if hold is None else hold[0]

    def set_props(self, kv: KeyValue, task_id: str) -> None:
        """Take a put of the props key (decoded once here, not at every offer)."""
        stored = props_of(kv, task_id)
        self.props, self.props_error = stored.props, stored.error
        self.stored = stored
        self.props_valid = False
        self.props_mod = kv.mod_revision
        self.launch_at, self.expires_at = launch_and_expiry(self.props)

    @classmethod
    def from_record(cls, task_id: str, rec: TaskRecord) -> Entry:
        """The entry of a task as a range read it."""
        entry = cls()
        if rec.props is not None:
            entry.set_props(rec.props, task_id)
        entry.outcome = None if rec.state is None else Outcome.of(rec.state)
        entry.set_running(rec.running)
        if rec.owner is not None:
            entry.owner = rec.owner.value.decode(errors="replace")
            entry.owner_rev = rec.owner.create_revision
        return entry


class TaskCache:
    """What the watch knows of the namespace: one :class:`Entry` per task, the live nodes,
    and who holds what. Guarded by the node's lock (:class:`~.node.NodeState`); written by
    the watch, read by the claims and the balancers' counts.
    """

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.ready = False  # a first re-list has filled it
        self.revision = 0  # the store revision it reflects
        self.live = False  # a watch stream is confirmed: the cache follows the store
        # The newest key revision a direct read of the members or owners returned (made while
        # the cache was not live): counts and members are answered from the cache once it has
        # reached it. A stream is confirmed before the events since the re-list arrive; a node
        # seen by such a read must not vanish from the view that follows it.
        self.floor = 0
        # Who holds what, as the cache saw it: the balancers' counts without reading every
        # owner key (a read that grows with the tasks held, made every second by every node).
        self._live_nodes: dict[str, Registration] = {}  # live node -> what its registration says
        self._held_by: Counter[str] = Counter()  # node -> owner keys naming it
        # What the claimable count adds up, kept as entries change (see track): walking every
        # entry for it, once a second per node while offers flowed, was a tenth of a storm's CPU.
        self._open: set[str] = set()  # with props, unfinished, unowned
        self._timed: set[str] = set()  # those of _open with a launch_at or an expires_at
        # Finished tasks -> their outcome, oldest first: the periodic pruner's candidates
        # without reading every task (see prunable).
        self._finished: dict[str, Outcome] = {}

    def replace(self, entries: dict[str, Entry], members: dict[str, Registration], revision: int) -> None:
        """Take a re-list's view (``members``: live node -> what its registration says)."""
        self.entries = entries
        self._live_nodes = members
        self._held_by = Counter(e.owner for e in entries.values() if e.owner is not None)
        self._open, self._timed, self._finished = set(), set(), {}
        for task_id, entry in entries.items():
            self.track(task_id, entry)
        self._finished = dict(sorted(self._finished.items(), key=lambda f: f[1].revision))
        self.revision = revision
        self.ready = True

    def track(self, task_id: str, entry: Entry | None) -> None:
        """Take a change of ``task_id``'s entry (None: dropped) into the claimable count."""
        if entry is not None and entry.props is not None and not entry.finished and entry.owner is None:
            self._open.add(task_id)
            if entry.launch_at is not None or entry.expires_at is not None:
                self._timed.add(task_id)
            else:
                self._timed.discard(task_id)
        else:
            self._open.discard(task_id)
            self._timed.discard(task_id)
        outcome = entry.outcome if entry is not None and entry.props is not None else None
        if outcome is None:
            self._finished.pop(task_id, None)
        elif self._finished.get(task_id) is not outcome:  # a new outcome: now the newest
            self._finished.pop(task_id, None)
            self._finished[task_id] = outcome

    def prunable(self, cutoffs: Cutoffs, limit: int) -> list[str]:
        """Up to ``limit`` finished tasks that ``cutoffs`` may prune, oldest outcome first,
        looking no further than the first one finished after the latest cut-off (outcomes are
        kept in revision order: every later one finished after it, give or take the nodes'
        clock skew, and such a task waits for the next turn). The prune reads and judges
        each again (its state machine may make a done task killed or failed)."""
        latest = cutoffs.oldest()
        found: list[str] = []
        if latest is None:
            return found
        for task_id, outcome in self._finished.items():
            state, finished_at = outcome.read()
            if finished_at is None:
                continue  # an unreadable record: no prune takes it
            if finished_at > latest:
                break
            cut = cutoffs.latest_for(state)
            if cut is not None and finished_at <= cut:
                found.append(task_id)
                if len(found) >= limit:
                    break
        return found

    def seen_taken(self, task_id: str) -> bool:
        """Whether the cache saw an owner or a finish of ``task_id``."""
        entry = self.entries.get(task_id)
        return entry is not None and (entry.owner is not None or entry.finished)

    def member_put(self, node_id: str, member: Registration) -> None:
        """A node's registration key was put (``member``: what its record says)."""
        self._live_nodes[node_id] = member

    def member_gone(self, node_id: str) -> None:
        """A node's registration key was deleted (left, or its lease expired)."""
        self._live_nodes.pop(node_id, None)

    def set_owner(self, entry: Entry, kv: KeyValue | None) -> None:
        """The owner key of ``entry`` was put (``kv``) or deleted (None)."""
        if entry.owner is not None:
            left = self._held_by[entry.owner] - 1
            if left > 0:
                self._held_by[entry.owner] = left
            else:
                del self._held_by[entry.owner]
        if kv is None:
            entry.owner = None
            entry.owner_rev = 0
            return
        entry.owner = kv.value.decode(errors="replace")
        self._held_by[entry.owner] += 1
        entry.owner_rev = kv.create_revision

    def following(self) -> bool:
        """Whether a watch stream follows the store and the cache has reached what the node
        last read directly (:attr:`floor`): counts and members come from it."""
        return self.live and self.ready and self.revision >= self.floor

    def counts(self, active: bool) -> dict[str, int] | None:
        """Live node -> tasks it holds (without ``leaving`` nodes when ``active``); None
        while no watch stream follows the store (see :meth:`following`)."""
        if not self.following():
            return None
        return {node: self._held_by.get(node, 0)
                for node, m in sorted(self._live_nodes.items()) if not (active and m.leaving)}

    def members(self, active: bool) -> dict[str, Registration] | None:
        """Live node -> what its registration says (without ``leaving`` nodes when
        ``active``); None while no watch stream follows the store (see :meth:`following`)."""
        if not self.following():
            return None
        return {node: m for node, m in self._live_nodes.items() if not (active and m.leaving)}

    def claimable(self, now: datetime) -> int | None:
        """How many tasks are claimable now (unfinished, unowned or owned by a node that is
        gone, launched, not expired); None before a first re-list filled the cache.

        Kept as entries change (:meth:`track`): a walk of the tasks with a launch or expiry
        time only, and of every entry only while a node that is gone still owns some.
        A cache filled but not yet confirmed live answers too: the offers a node starts with
        come from that same re-list.
        """
        if not self.ready:
            return None
        count = len(self._open) - len(self._timed)
        for task_id in self._timed:
            e = self.entries[task_id]
            if _timely(e, now):
                count += 1
        live = self._live_nodes
        if any(node not in live for node in self._held_by):
            for e in self.entries.values():  # a node gone: its claims are claimable
                if (e.owner is not None and e.owner not in live and not e.finished
                        and e.props is not None and _timely(e, now)):
                    count += 1
        return count


@dataclass(slots=True)
class Outcome:
    """A finished task's outcome as its state key holds it: the key's revision and value, read
    when the pruner first asks (not at every finish: every node keeps every task's)."""

    revision: int
    value: bytes
    _read: tuple[str, datetime | None] | None = None

    @classmethod
    def of(cls, kv: KeyValue) -> Outcome:
        """The outcome a state key records (its key not kept: a few bytes per finished task
        on every node)."""
        return cls(kv.mod_revision, kv.value)

    def read(self) -> tuple[str, datetime | None]:
        """The coordinator state it records and when the task finished (None: unreadable)."""
        if self._read is None:
            data = decode_json(self.value) or {}
            self._read = (str(data.get("state")), parse_iso(data.get("finished_at")))
        return self._read


def _timely(entry: Entry, now: datetime) -> bool:
    """Launched and not expired at ``now``."""
    return (entry.launch_at is None or entry.launch_at <= now) and (
        entry.expires_at is None or entry.expires_at > now)


@dataclass
class Subscriber:
    """One running ``watch(out)``: which task ids to re-evaluate."""

    event: threading.Event = field(default_factory=threading.Event)
    ids: set[str] = field(default_factory=set)
    everything: bool = True

    def mark(self, ids: set[str] | None) -> None:
        """Ask for ``ids`` (None: every task) to be evaluated again, and wake the watch."""
        if ids is None:
            self.everything = True
        elif ids:
            self.ids |= ids
        else:
            return
        self.event.set()


def offer_for(task_id: str, entry: Entry) -> tuple[Task, bool]:
    """The task to offer, and whether its props are valid; without them if they are not
    (the claim then fails it)."""
    try:
        task = entry.stored.task(task_id) if entry.stored is not None else Task(task_id)
        return task, entry.stored is not None
    except InvalidProps:
        return Task(task_id), False


