"""Gated partitions: fan-out / fan-in with checkpoints, as a stateful handler (Go Feed's model).

A task is a **partition**; it owns **items** kept in SQL (SQLite or PostgreSQL: the SQL
coordinator's database, or a database of their own when the coordinator is etcd), so they
are queryable with plain SQL and with ``metafora items PARTITION``. Each item has a
``gate``, a ``status`` (available, complete, failed), ``data`` bytes, ``attempts`` and an
``error``. The handler processes the available items of the partition's current gate with
a :class:`Processor` (a Python function through :func:`callable_processor`, or
:class:`HTTPProcessor`), which answers :class:`Response` ``(gate, done, data, spawn)`` -- or a
:class:`BatchProcessor` (:class:`HTTPBatchProcessor`), which gets the items taken together. When
the current gate has no available items and none failed, the gate jumps to the lowest gate
that still has work (a fenced checkpoint); when no work is left the partition completes
(``auto_close``) or waits for more items. Every item write is fenced by the claim token.

>>> from metafora import gates
>>> items = gates.ItemStore("sqlite:///metafora.db")                   # doctest: +SKIP
>>> items.add("job-42", [gates.NewItem(gate=0, data=b"...")] * 100
...                     + [gates.NewItem(gate=1, data=b"rank")])         # doctest: +SKIP
>>> client.submit_task(Task("job-42"))                                   # doctest: +SKIP
>>> consumer = Consumer(coord, gates.handler_func(step, coord, items))   # doctest: +SKIP

The items are kept by a store: ``ItemStore(url)`` opens the implementation of the store
``url`` names (items live in SQL: :mod:`metafora.coordinators.sql.gates`), found in
:mod:`metafora.contracts.backends` (the store's backend object names it); this package owns the
model and the interfaces and imports no store's internals. Modules:
:mod:`~metafora.gates.model` (values and errors),
:mod:`~metafora.gates.store` (the :class:`ItemStore` interface),
:mod:`~metafora.gates.lease` (the fenced :class:`PartitionLease` interface),
:mod:`~metafora.gates.processor`, :mod:`~metafora.gates.flush` (the results' group commit),
:mod:`~metafora.gates.run` (one claim's step loop), :mod:`~metafora.gates.handler`
(:func:`handler_func`). First shipped as ``metafora.statemachine.gates``, a name that now
fails loudly, naming this one.
"""

from __future__ import annotations

from metafora.contracts.recipes import register
from metafora.core._moved import names_moved
from metafora.gates.handler import (
    GateHandlerFunc,
    GateOptions,
    GateTaskHandler,
    gate_error_handler,
    handler_func,
    reopen_partition,
    retry_partition,
)
from metafora.gates.lease import PartitionLease
from metafora.gates.model import (
    MAX_GATE,
    Advance,
    GateError,
    GateMoveRefused,
    Item,
    ItemBelowGate,
    ItemNotFound,
    ItemResult,
    ItemsFailed,
    ItemStatus,
    NewItem,
    PartitionClosed,
    PartitionFailed,
    PartitionInfo,
    PartitionStatus,
    PermanentError,
    ProcessingError,
    Response,
)
from metafora.gates.processor import (
    BatchProcessor,
    CallableProcessor,
    HTTPBatchProcessor,
    HTTPProcessor,
    Processor,
    callable_processor,
)
from metafora.gates.store import ItemStore

__all__ = [
    "MAX_GATE",
    "Advance",
    "BatchProcessor",
    "CallableProcessor",
    "GateError",
    "GateHandlerFunc",
    "GateMoveRefused",
    "GateOptions",
    "GateTaskHandler",
    "HTTPBatchProcessor",
    "HTTPProcessor",
    "Item",
    "ItemBelowGate",
    "ItemNotFound",
    "ItemResult",
    "ItemStatus",
    "ItemStore",
    "ItemsFailed",
    "NewItem",
    "PartitionClosed",
    "PartitionFailed",
    "PartitionInfo",
    "PartitionLease",
    "PartitionStatus",
    "PermanentError",
    "ProcessingError",
    "Processor",
    "Response",
    "callable_processor",
    "gate_error_handler",
    "handler_func",
    "reopen_partition",
    "retry_partition",
]

# Names of the SQL store's item tables, moved to the store package that owns them (the one
# policy for moved names: metafora.core._moved).
__getattr__ = names_moved(__name__, {"GATES_SCHEMA_VERSION": "metafora.coordinators.sql.gates",
                                     "items_channel": "metafora.coordinators.sql.gates"},
                          "the SQL store owns the item tables")

# ItemStore.reopen_partition (an interface the stores implement) runs this recipe
# (metafora.contracts.recipes).
register("reopen_partition", reopen_partition)
