"""The floors of the package: each floor is a folder, and a module's folder says its floor
(docs/architecture.md draws it).

A module may import modules of its own floor and of the floors below it, never above
(tests/unit/test_layout.py checks every import, a function's too). The floors, from the
ground up, and their folders under ``metafora/``:

1. ``ground`` (``core/``): values and errors, and the rules every part shares (tasks,
   durations, clocks, URLs and options, masking, metrics, the lease rules, the retention
   policy).
2. ``contracts`` (``contracts/``): the interfaces the rest is written against: the task
   handler, the balancer, the coordinator, the client and the async client, the stores'
   registry and backend table (:mod:`metafora.contracts.backends`). Each feature's storage
   interface (what a store implements for the state machine, the gates and the streams)
   stands in its feature's published package: those modules are the rows of :data:`MODULES`.
3. ``stores`` (``coordinators/``): ``metafora.coordinators.<store>``, each owning all its
   storage, found by URL scheme through the entry-point group ``metafora.stores``; a store
   imports no other store.
4. ``consumer`` (``consumer/``, ``balancers/``): a node: the Consumer and its parts, the
   balancers, the duties every node runs (schedules), its own info server (``/info``,
   ``/metrics``).
5. ``features`` (``features/`` and the published ``statemachine/``, ``gates/``,
   ``streams/``, ``messages/``): built on the public client and coordinator.
6. ``surfaces`` (``surfaces/`` and ``cli/``, ``web/``, ``demo/``, ``testing/``): what people
   and programs open: ``connect`` (``open_coordinator`` / ``open_client`` /
   ``open_async_client``), the CLI, the dashboard, the demo, the testing helpers and the
   package's face (``metafora/__init__.py``, ``__main__.py``).

Besides the floors: the consumer and the features import no store (they reach one through
the registry and the contracts) and no surface. Nothing else stands at the top level: a new
module goes into the folder of its floor (the old top-level names of the modules that moved
keep working: :mod:`metafora.core._moved`).
"""

from __future__ import annotations

from typing import Final

__all__ = ["FLOORS", "FOLDERS", "MODULES", "floor_of"]

FLOORS: Final = ("ground", "contracts", "stores", "consumer", "features", "surfaces")
"""The floors from the ground up."""

FOLDERS: Final[dict[str, str]] = {
    "core": "ground",
    "contracts": "contracts",
    "coordinators": "stores",
    "consumer": "consumer",
    "balancers": "consumer",
    "features": "features",
    "statemachine": "features",
    "gates": "features",
    "streams": "features",
    "messages": "features",
    "surfaces": "surfaces",
    "cli": "surfaces",
    "web": "surfaces",
    "demo": "surfaces",
    "testing": "surfaces",
}
"""Each folder (package) at the package's top level -> the floor of every module in it."""

MODULES: Final[dict[str, str]] = {
    # the package's face, beside the folders
    "metafora": "surfaces",
    "metafora.__main__": "surfaces",
    # each feature's storage interface, in its feature's published package
    "metafora.statemachine.machine": "contracts",
    "metafora.statemachine.mailbox": "contracts",
    "metafora.statemachine.store": "contracts",
    "metafora.gates.model": "contracts",
    "metafora.gates.lease": "contracts",
    "metafora.gates.store": "contracts",
    "metafora.streams.jobs": "contracts",
}
"""What a folder cannot say: module -> its floor, where that is not its folder's."""


def floor_of(module: str) -> str:
    """The floor of ``module`` (a dotted name under ``metafora``): its own row of
    :data:`MODULES`, else its nearest package's row, else its top-level folder's floor;
    KeyError for a module outside the package or standing at its top level outside a
    folder."""
    name = module
    while True:
        if name in MODULES:
            return MODULES[name]
        top, _, folder = name.partition(".")
        if top == "metafora" and folder in FOLDERS:
            return FOLDERS[folder]
        if name.count(".") <= 1:
            raise KeyError(f"{module} is not a module of metafora's folders")
        name = name.rpartition(".")[0]
