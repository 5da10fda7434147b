"""State store and task commands for ``memory://`` coordinators (in-process, for tests).

The states live in the coordinator's :class:`~metafora.coordinators.memory.MemoryStore`
(``task_state``/``put_task_state``), the command queues beside it; both share its lock, so
a fenced write checks the claim (owner live, state claimed, token equal) and writes in one
atomic step -- the same guarantee the SQL and etcd stores give with one
statement or one transaction.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from metafora.coordinators.memory.store import MemoryStore
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import ClaimLost, ConfigError
from metafora.core.task import Task, TaskState
from metafora.statemachine.machine import State
from metafora.statemachine.mailbox import CommandBell
from metafora.statemachine.store import StateStore, TaskCommands, parsed_page

__all__ = ["MemoryStateStore", "MemoryTaskCommands"]

_SLICE = 0.05  # real seconds between checks of a cancel event while waiting for a command
_SAFETY = 30.0  # seconds: a memory store's pushes cannot be lost; the net is a formality


@dataclass
class _Tables:
    # Each queue remembers the task row it belongs to (weakly): a task deleted and submitted
    # again under the same id is a new row, and must not inherit the old commands. (States
    # live in the MemoryStore itself, beside the tasks, as they do in the SQL and etcd stores.)
    commands: dict[str, tuple[weakref.ref[Any] | None, deque[str]]] = field(default_factory=dict)
    bell: CommandBell | None = None  # the mailboxes of every node on this store

    def queue(self, store: MemoryStore, task_id: str) -> deque[str] | None:
        entry = self.commands.get(task_id)
        if entry is None:
            return None
        row = store.tasks.get(task_id)
        # A row gone (deleted or pruned, perhaps collected already) takes its queue with it.
        if entry[0] is not None and (row is None or entry[0]() is not row):
            del self.commands[task_id]
            return None
        return entry[1]


_TABLES: weakref.WeakKeyDictionary[MemoryStore, _Tables] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _tables(store: MemoryStore) -> _Tables:
    with _TABLES_LOCK:
        tables = _TABLES.get(store)
        if tables is None:
            tables = _TABLES[store] = _Tables()
        return tables


def _memory_store(obj: object) -> MemoryStore:
    # Hook wanted: a public ``MemoryCoordinator.store`` / ``MemoryClient.store`` property.
    store = getattr(obj, "_store", None)
    if not isinstance(store, MemoryStore):
        raise ConfigError(f"{type(obj).__name__} is not a memory coordinator or client")
    return store


def _check_claim(store: MemoryStore, task: Task) -> None:
    row = store.tasks.get(task.id)
    if (
        row is None
        or row.state is not TaskState.CLAIMED
        or row.token != task.token
        or row.owner not in store.nodes
    ):
        raise ClaimLost(f"task {task.id!r} is no longer claimed with token {task.token}")


class MemoryStateStore(StateStore):
    """Task states beside a :class:`MemoryStore`, fenced by the coordinator's claims."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    @classmethod
    def of(cls, coordinator_or_client: object) -> MemoryStateStore:
        """The state store of a memory coordinator's or client's store."""
        return cls(_memory_store(coordinator_or_client))

    def _fenced(self, task: Task) -> tuple[int, str] | None:
        _check_claim(self._store, task)
        held = self._store.task_state(task.id)
        if held is not None and held[0] > task.token:
            raise ClaimLost(
                f"task {task.id!r}: state was written under token {held[0]} > {task.token}"
            )
        return held

    def load(self, task: Task) -> State:
        return self.load_stored(task) or State()

    def load_stored(self, task: Task) -> State | None:
        with self._store.cond:
            held = self._fenced(task)
        return None if held is None else State.from_json(held[1])

    def store(self, task: Task, state: State) -> None:
        text = state.to_json()
        with self._store.cond:
            self._fenced(task)
            self._store.put_task_state(task.id, task.token, text)

    def get(self, task_id: str) -> State | None:
        with self._store.cond:
            held = self._store.task_state(task_id)
        return None if held is None else State.from_json(held[1])

    def page(self, *, prefix: str = "", after: str | None = None,
             limit: int = 100) -> list[tuple[str, State]] | None:
        """The stored states in id order (only tasks that have one are looked at)."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        rows: list[tuple[str, str]] = []
        with self._store.cond:
            for task_id in sorted(self._store.task_states):
                if not task_id.startswith(prefix) or (after is not None and task_id <= after):
                    continue
                held = self._store.task_state(task_id)  # drops a deleted task's entry
                if held is not None:
                    rows.append((task_id, held[1]))
                    if len(rows) >= limit:
                        break
        return parsed_page(rows)

    def token_of(self, task_id: str) -> int | None:
        """The claim token the task's state was last written under (for tests)."""
        with self._store.cond:
            held = self._store.task_state(task_id)
        return None if held is None else held[0]

    def put_raw(self, task_id: str, token: int, text: str) -> None:
        """Store raw (possibly malformed) state text for an existing task, for fault tests."""
        with self._store.cond:
            self._store.put_task_state(task_id, token, text)


class MemoryTaskCommands(TaskCommands):
    """Per-task command queues beside a :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._tables = _tables(store)
        with _TABLES_LOCK:
            if self._tables.bell is None:  # one per store: pushing is a local call here
                self._tables.bell = CommandBell(
                    "memory", self._take_now, self._pending_ids, _SAFETY)
            self._bell = self._tables.bell

    @classmethod
    def of(cls, coordinator_or_client: object) -> MemoryTaskCommands:
        """The command channel of a memory coordinator's or client's store."""
        return cls(_memory_store(coordinator_or_client))

    def bell(self) -> CommandBell | None:
        return self._bell

    def _pending_ids(self) -> set[str]:
        with self._store.cond:
            return {task_id for task_id in list(self._tables.commands)
                    if self._tables.queue(self._store, task_id)}

    def _push(self, task_id: str, raw: str) -> None:
        s = self._store
        with s.cond:
            queue = self._tables.queue(s, task_id)
            if queue is None:
                row = s.tasks.get(task_id)
                queue = deque()
                self._tables.commands[task_id] = (None if row is None else weakref.ref(row), queue)
            queue.append(raw)
            s.cond.notify_all()
        self._bell.ring(task_id)

    def inject_raw(self, task_id: str, raw: str) -> None:
        """Queue raw (possibly malformed) command text, bypassing validation (fault tests)."""
        self._push(task_id, raw)

    def _pop(self, task_id: str, timeout: float | None, token: int | None,
             cancel: threading.Event | None) -> str | None:
        s = self._store
        deadline = None if timeout is None else SYSTEM_CLOCK.monotonic() + timeout
        with s.cond:
            while True:
                if cancel is not None and cancel.is_set():
                    return None
                if token is not None:
                    _check_claim(s, Task(task_id, token=token))
                queue = self._tables.queue(s, task_id)
                if queue:
                    raw = queue.popleft()
                    if not queue:
                        del self._tables.commands[task_id]
                    return raw
                left = None if deadline is None else deadline - SYSTEM_CLOCK.monotonic()
                if left is not None and left <= 0:
                    return None
                s.cond.wait(_SLICE if left is None else min(_SLICE, left))

    def pending(self, task_id: str) -> int:
        with self._store.cond:
            return len(self._tables.queue(self._store, task_id) or ())
