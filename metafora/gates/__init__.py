"""Gated partitions: fan-out / fan-in with checkpoints, as a stateful handler (Go Feed's model).

A task is a **partition**; it owns **items** kept in SQL (SQLite or PostgreSQL: the SQL
coordinator's database, or a database of their own when the coordinator is etcd), so they
are queryable with plain SQL and with ``metafora items PARTITION``. Each item has a
``gate``, a ``status`` (available, complete, failed), ``data`` bytes, ``attempts`` and an
``error``. The handler processes the available items of the partition's current gate with
a :class:`Processor` (a Python function through :func:`callable_processor`, or
:class:`HTTPProcessor`), which answers :class:`Response` ``(gate, done, data, spawn)``. When
the current gate has no available items and none failed, the gate jumps to the lowest gate
that still has work (a fenced checkpoint); when no work is left the partition completes
(``auto_close``) or waits for more items. Every item write is fenced by the claim token.

>>> from metafora import gates
>>> items = gates.ItemStore("sqlite:///metafora.db")                   # doctest: +SKIP
>>> items.add("job-42", [gates.NewItem(gate=0, data=b"...")] * 100
...                     + [gates.NewItem(gate=1, data=b"rank")])         # doctest: +SKIP
>>> client.submit_task(Task("job-42"))                                   # doctest: +SKIP
>>> consumer = Consumer(coord, gates.handler_func(step, coord, items))   # doctest: +SKIP

Modules: :mod:`~metafora.gates.model` (values and errors),
:mod:`~metafora.gates.store` (:class:`ItemStore`),
:mod:`~metafora.gates.lease` (the fenced :class:`PartitionLease`),
:mod:`~metafora.gates.statements` (their SQL),
:mod:`~metafora.gates.wakeups` (news of partitions),
:mod:`~metafora.gates.processor`,
:mod:`~metafora.gates.run` (one claim's step loop),
:mod:`~metafora.gates.handler` (:func:`handler_func`),
:mod:`~metafora.gates.schema` (the tables). The SQL coordinator is reached only
through its seam, :mod:`metafora.coordinators.sql.shared`.
"""

from __future__ import annotations

from metafora.gates.handler import (
    GateHandlerFunc,
    GateOptions,
    GateTaskHandler,
    gate_error_handler,
    handler_func,
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
    CallableProcessor,
    HTTPProcessor,
    Processor,
    callable_processor,
)
from metafora.gates.schema import GATES_SCHEMA_VERSION
from metafora.gates.store import ItemStore
from metafora.gates.wakeups import items_channel

__all__ = [
    "GATES_SCHEMA_VERSION",
    "MAX_GATE",
    "Advance",
    "CallableProcessor",
    "GateError",
    "GateHandlerFunc",
    "GateMoveRefused",
    "GateOptions",
    "GateTaskHandler",
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
    "items_channel",
    "retry_partition",
]
