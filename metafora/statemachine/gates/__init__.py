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

>>> from metafora.statemachine import gates
>>> items = gates.ItemStore("sqlite:///metafora.db")                   # doctest: +SKIP
>>> items.add("job-42", [gates.NewItem(gate=0, data=b"...")] * 100
...                     + [gates.NewItem(gate=1, data=b"rank")])         # doctest: +SKIP
>>> client.submit_task(Task("job-42"))                                   # doctest: +SKIP
>>> consumer = Consumer(coord, gates.handler_func(step, coord, items))   # doctest: +SKIP

Modules: :mod:`~metafora.statemachine.gates.model` (values and errors),
:mod:`~metafora.statemachine.gates.store` (:class:`ItemStore`),
:mod:`~metafora.statemachine.gates.lease` (the fenced :class:`PartitionLease`),
:mod:`~metafora.statemachine.gates.statements` (their SQL),
:mod:`~metafora.statemachine.gates.wakeups` (news of partitions),
:mod:`~metafora.statemachine.gates.processor`,
:mod:`~metafora.statemachine.gates.run` (one claim's step loop),
:mod:`~metafora.statemachine.gates.handler` (:func:`handler_func`),
:mod:`~metafora.statemachine.gates.schema` (the tables). The SQL coordinator is reached only
through its seam, :mod:`metafora.coordinators.sql.shared`.
"""

from __future__ import annotations

from metafora.statemachine.gates.handler import (
    GateHandlerFunc,
    GateOptions,
    GateTaskHandler,
    gate_error_handler,
    handler_func,
    retry_partition,
)
from metafora.statemachine.gates.lease import PartitionLease
from metafora.statemachine.gates.model import (
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
from metafora.statemachine.gates.processor import (
    CallableProcessor,
    HTTPProcessor,
    Processor,
    callable_processor,
)
from metafora.statemachine.gates.schema import GATES_SCHEMA_VERSION
from metafora.statemachine.gates.store import ItemStore
from metafora.statemachine.gates.wakeups import items_channel

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
