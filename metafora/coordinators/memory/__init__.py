"""In-process coordinator: every ``memory://NAME`` opened in one process shares one store.

A product feature for users' tests and single-process programs, with the same semantics
as the real stores (see docs/coordinators.md). Nodes hold their claims until ``close()``;
:meth:`MemoryCoordinator.expire_lease` simulates a lost lease. The state machine's states and
task commands: :mod:`metafora.coordinators.memory.states`.
"""

from __future__ import annotations

from metafora.coordinators.memory.client import MemoryClient, open_client
from metafora.coordinators.memory.coordinator import MemoryCoordinator, open_coordinator
from metafora.coordinators.memory.store import MemoryStore, drop_store, get_store

__all__ = ["MemoryClient", "MemoryCoordinator", "MemoryStore", "drop_store", "get_store", "open_client",
           "open_coordinator"]
