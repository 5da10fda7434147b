"""In-process coordinator: every ``memory://NAME`` opened in one process shares one store.

A product feature for users' tests and single-process programs, with the same semantics
as the real stores (see docs/coordinators.md). Nodes hold their claims until ``close()``;
:meth:`MemoryCoordinator.expire_lease` simulates a lost lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metafora.coordinators.memory.client import MemoryClient, open_client
from metafora.coordinators.memory.coordinator import MemoryCoordinator, open_coordinator
from metafora.coordinators.memory.store import MemoryStore, drop_store, get_store

if TYPE_CHECKING:
    from metafora.statemachine.store import StateStore, TaskCommands

__all__ = ["MemoryClient", "MemoryCoordinator", "MemoryStore", "drop_store", "get_store", "open_client",
           "open_coordinator", "state_store", "task_commands"]


def state_store(owner: MemoryCoordinator | MemoryClient) -> StateStore:
    """Backend hook for :func:`metafora.statemachine.state_store_for`: the states of the
    state machine's tasks, kept in this store (:mod:`metafora.coordinators.memory.states`)."""
    from metafora.coordinators.memory.states import MemoryStateStore

    return MemoryStateStore.of(owner)


def task_commands(owner: MemoryCoordinator | MemoryClient) -> TaskCommands:
    """Backend hook for :func:`metafora.statemachine.commands_for`: the task command channel
    kept in this store (:mod:`metafora.coordinators.memory.states`)."""
    from metafora.coordinators.memory.states import MemoryTaskCommands

    return MemoryTaskCommands.of(owner)
