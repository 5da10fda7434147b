"""The floors of the package: every module's floor, in one place (docs/architecture.md draws it).

A module may import modules of its own floor and of the floors below it, never above
(tests/unit/test_layout.py checks every import, a function's too). The floors, from the
ground up:

1. ``ground``: values and errors, and the rules every part shares (tasks, durations, clocks,
   URLs and options, masking, metrics, the lease rules, the retention policy).
2. ``contracts``: the interfaces the rest is written against: the task handler, the balancer,
   the coordinator, the client and the async client, the stores' registry
   (:mod:`metafora.contracts.backends`), and each feature's storage interface (what a store implements
   for the state machine, the gates and the streams).
3. ``stores``: ``metafora.coordinators.<store>``, each owning all its storage, found by URL
   scheme through the entry-point group ``metafora.stores``; a store imports no other store.
4. ``consumer``: a node: the Consumer and its parts, the balancers, the duties every node
   runs (schedules), its own info server (``/info``, ``/metrics``).
5. ``features``: built on the public client and coordinator: the state machine, the gated
   partitions, streams, typed messages, waiting reasons.
6. ``surfaces``: what people and programs open: ``connect`` (``open_coordinator`` /
   ``open_client`` / ``open_async_client``), the CLI, the dashboard, the demo, the testing
   helpers and the package's face (``metafora/__init__.py``).

Besides the floors: the consumer and the features import no store (they reach one through
the registry and the contracts) and no surface.
"""

from __future__ import annotations

from typing import Final

__all__ = ["FLOORS", "MODULES", "floor_of"]

FLOORS: Final = ("ground", "contracts", "stores", "consumer", "features", "surfaces")
"""The floors from the ground up."""

MODULES: Final[dict[str, str]] = {
    # ground: values, errors, shared rules
    "metafora.core": "ground",
    "metafora.core._layout": "ground",
    "metafora.core._moved": "ground",
    "metafora.core.errors": "ground",
    "metafora.core.clock": "ground",
    "metafora.core.durations": "ground",
    "metafora.core.heap": "ground",
    "metafora.core.hosts": "ground",
    "metafora.core.masking": "ground",
    "metafora.core.metrics": "ground",
    "metafora.core.tracing": "ground",
    "metafora.core.jsontext": "ground",
    "metafora.core.logs": "ground",
    "metafora.core.node": "ground",
    "metafora.core.config": "ground",
    "metafora.core.groupcommit": "ground",
    "metafora.core.submitting": "ground",
    "metafora.core.task": "ground",
    "metafora.core.task_retry": "ground",
    "metafora.core.bulk": "ground",
    "metafora.core.commands": "ground",
    "metafora.core.limits": "ground",
    "metafora.core.schedule_model": "ground",
    "metafora.core.retention": "ground",
    "metafora.core.leases": "ground",
    "metafora.core.holds": "ground",
    # contracts: the interfaces, and each feature's storage interface
    "metafora.contracts": "contracts",
    "metafora.contracts.handler": "contracts",
    "metafora.contracts.binding": "contracts",
    "metafora.contracts.balancer": "contracts",
    "metafora.contracts.coordinator": "contracts",
    "metafora.contracts.client": "contracts",
    "metafora.contracts.aio": "contracts",
    "metafora.contracts.registry": "contracts",
    "metafora.contracts.recipes": "contracts",
    "metafora.contracts.backends": "contracts",
    "metafora.statemachine.machine": "contracts",
    "metafora.statemachine.mailbox": "contracts",
    "metafora.statemachine.store": "contracts",
    "metafora.gates.model": "contracts",
    "metafora.gates.lease": "contracts",
    "metafora.gates.store": "contracts",
    "metafora.streams.jobs": "contracts",
    # stores
    "metafora.coordinators": "stores",
    # the consumer: a node
    "metafora.consumer": "consumer",
    "metafora.balancers": "consumer",
    # features, on the public client and coordinator
    "metafora.statemachine": "features",
    "metafora.gates": "features",
    "metafora.streams": "features",
    "metafora.messages": "features",
    "metafora.features": "features",
    # surfaces
    "metafora": "surfaces",
    "metafora.__main__": "surfaces",
    "metafora.surfaces": "surfaces",
    "metafora.cli": "surfaces",
    "metafora.web": "surfaces",
    "metafora.demo": "surfaces",
    "metafora.testing": "surfaces",
}
"""Module or package -> its floor; a module not named is on the floor of its nearest
package that is (``metafora.consumer.offers`` is on ``metafora.consumer``'s)."""


def floor_of(module: str) -> str:
    """The floor of ``module`` (a dotted name under ``metafora``); KeyError for a module
    outside the package."""
    name = module
    while name not in MODULES:
        if "." not in name:
            raise KeyError(f"{module} is not a module of metafora")
        name = name.rpartition(".")[0]
    return MODULES[name]
