"""The gate handler: a stateful handler that works a partition's items gate by gate.

:func:`handler_func` returns a :data:`~metafora.contracts.handler.HandlerFunc` for a
:class:`~metafora.Consumer`. For each claim of a partition (a task) it builds a
:class:`GateTaskHandler`, which runs the state machine
(:class:`~metafora.statemachine.StatefulTaskHandler`) around one step function (a
:class:`~metafora.gates.run.PartitionRun`):

1. take the partition for this claim (raise its fencing token in the item store);
2. loop: take a batch of the current gate's available items (in id order; the batch is
   recorded in the same write, so a death counts an attempt for its items), process them
   with the :class:`Processor` (up to ``concurrency`` at once, each retried up to
   ``max_attempts`` times with back-off); each result is written within ``flush_interval``
   of finishing, or with the next batch's take, whichever comes first (a group commit,
   :mod:`~metafora.gates.flush`, fenced like every item write);
3. when the gate has no available items and none failed: jump to the lowest gate that has
   work (a checkpoint: persisted and fenced, the gate also saved as the state's cursor);
   when no work is left: complete the partition (``auto_close``) or sleep until items are
   added -- woken by a notification (PostgreSQL NOTIFY; in-process on SQLite, which also
   polls every ``poll_interval``).

Crashes: items a dead owner had taken are taken again one at a time after the rest of the
gate, so an item that kills its process (a *poison* item) is failed -- "process died while
processing", permanently -- once ``max_attempts`` claims in a row died with it, and the
error policy decides (the default fails the partition); other partitions are unaffected.

Failures: an item that failed (retries exhausted, or non-retryable) faults the partition
as soon as its batch is written (the rest of the gate waits: a failing downstream service
is not hammered with every item);
the error handler decides (default: :class:`~metafora.statemachine.ErrorPolicy`: back off,
then retry the retryable failed items, and after too many errors ``failed``; items that
failed permanently fail the partition at once). A failed partition's task is marked
*failed* in the coordinator; ``metafora items retry PARTITION`` (:func:`retry_partition`)
makes the items available and the task pending again, and the next claim starts over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from metafora.contracts.binding import NodeBinding
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator
from metafora.contracts.handler import Handler
from metafora.core.clock import Clock
from metafora.core.errors import (
    ClaimLost,
    ConfigError,
    CoordinatorUnavailable,
    InvalidTaskState,
    MetaforaError,
    TaskNotFound,
)
from metafora.core.metrics import ConsumerStats, GateStats
from metafora.core.task import Task, TaskState
from metafora.core.task_retry import RetrySnapshot
from metafora.gates.model import (
    Item,
    ItemsFailed,
    ItemStatus,
    NewItem,
    PartitionFailed,
    Response,
)
from metafora.gates.processor import Processor, callable_processor
from metafora.gates.run import GateOptions, PartitionRun, short_error
from metafora.gates.store import ItemStore
from metafora.statemachine.errors import ErrorHandler, default_error_handler
from metafora.statemachine.handler import StatefulTaskHandler
from metafora.statemachine.machine import Message, State, StateCode
from metafora.statemachine.store import (
    LeaseBound,
    StateStore,
    TaskCommands,
    commands_for,
    lease_bound_of,
    state_store_for,
)

__all__ = [
    "GateHandlerFunc",
    "GateOptions",
    "GateTaskHandler",
    "gate_error_handler",
    "handler_func",
    "reopen_partition",
    "retry_partition",
]

log = logging.getLogger(__name__)


class GateTaskHandler(Handler):
    """Runs one claim of a partition: the state machine around the gate step.

    Before the machine runs, the partition is taken for this claim (its token raised in
    the item store); a partition whose stored state is ``failed`` -- claimed again, so an
    operator retried it -- starts over with a fresh error budget. When the machine ends in
    ``failed``, :meth:`run` raises :class:`PartitionFailed`, so the coordinator marks the
    task failed (``metafora retry`` / ``metafora items retry`` can bring it back).
    """

    def __init__(self, task: Task, run: PartitionRun, machine: StatefulTaskHandler,
                 states: StateStore, options: GateOptions) -> None:
        self.task = task
        self.machine = machine
        self._run = run
        self._states = states
        self._opt = options
        self._extra: dict[str, Any] = {"task": task.id, "token": task.token}

    @property
    def state(self) -> State | None:
        """The partition's state-machine state (None before ``run`` loaded it)."""
        return self.machine.state

    def stop(self) -> None:
        """Ask ``run`` to return (release) soon. Never blocks."""
        self._run.stop()
        self.machine.stop()

    def run(self) -> bool:
        """Run the partition; True when it reached a terminal state, False to release it."""
        try:
            try:
                self._prepare()
            except ClaimLost as exc:
                log.warning("partition %s: claim lost before starting: %s", self.task.id, exc,
                            extra={**self._extra, "action": "lost"})
                return False
            except CoordinatorUnavailable as exc:
                log.error("partition %s: store unreachable; releasing it: %s", self.task.id, exc,
                          extra={**self._extra, "action": "release"})
                return False
            done = self.machine.run()
            state = self.machine.state
            if done and state is not None and state.code is StateCode.FAILED:
                last = state.errors[-1].text if state.errors else "failed"
                raise PartitionFailed(f"partition {self.task.id!r} failed: {last}")
            return done
        finally:
            self._run.close()

    def _prepare(self) -> None:
        state = self._run.call_store("load the state", self._states.load, self.task)
        if state.code is StateCode.FAILED:
            log.info("partition %s was failed and is claimed again (retried): starting over",
                     self.task.id, extra={**self._extra, "action": "revive"})
            self._run.call_store("revive the state", self._states.store, self.task,
                                State(cursor=state.cursor))
        self._run.start()


class GateHandlerFunc:
    """The :data:`~metafora.contracts.handler.HandlerFunc` made by :func:`handler_func`."""

    def __init__(self, processor: Processor, items: ItemStore, states: StateStore,
                 commands: TaskCommands, node_id: str | None, claim_fence: bool,
                 options: GateOptions, error_handler: ErrorHandler, clock: Clock | None,
                 poll_interval: float, bound: LeaseBound | None = None) -> None:
        self.processor = processor
        self.items = items
        self.state_store = states
        self.task_commands = commands
        self.node_id = node_id
        self.claim_fence = claim_fence
        self.options = options
        self._error_handler = error_handler
        self._clock = clock
        self._poll_interval = poll_interval
        self.bound = bound or LeaseBound()
        self.stats = GateStats()

    def attach_stats(self, stats: ConsumerStats) -> None:
        """Count items into the consumer's ``stats`` (its ``/metrics``:
        ``metafora_gate_items_total{outcome}``, ``metafora_gate_item_seconds``). Called by
        the consumer; a handler func shared by consumers counts for them all."""
        stats.gates = self.stats

    def bind_node(self, node: NodeBinding) -> GateHandlerFunc:
        """Run on ``node`` (:class:`~metafora.contracts.binding.BindsToNode`): count items into its
        stats (:meth:`attach_stats`)."""
        self.attach_stats(node.stats)
        return self

    def __call__(self, task: Task) -> GateTaskHandler:
        lease = self.items.lease(task, self.node_id, claim_fence=self.claim_fence,
                                 bound=self.bound)
        run = PartitionRun(task, self.processor, lease, self.items, self.options, self.stats)
        machine = StatefulTaskHandler(
            task, run.step, self.state_store, self.task_commands,
            error_handler=self._error_handler, clock=self._clock,
            poll_interval=self._poll_interval, store_attempts=self.options.store_attempts,
            store_retry_delay=self.options.store_retry_delay,
        )
        return GateTaskHandler(task, run, machine, self.state_store, self.options)


def gate_error_handler(items: ItemStore, base: ErrorHandler = default_error_handler) -> ErrorHandler:
    """The gates' error handler: a partition whose failed items all failed permanently
    fails at once (retrying cannot help); anything else goes to ``base`` (back-off, retry,
    then failed)."""

    def handle(task: Task, state: State, now: datetime) -> Message:
        try:
            failed, permanent = items.failures(task.id)
        except MetaforaError as exc:
            log.warning("partition %s: cannot count failed items: %s", task.id, exc,
                        extra={"task": task.id, "action": "error_handler"})
            return base(task, state, now)
        if failed and failed == permanent:
            try:
                some = items.list(task.id, status=ItemStatus.FAILED, limit=3)
            except MetaforaError:
                some = []
            detail = "; ".join(f"item {i.id}: {i.error}" for i in some)
            return Message.error(ItemsFailed(short_error(
                f"{failed} item(s) of partition {task.id!r} failed permanently"
                + (f" ({detail})" if detail else "")
                + f"; fix them, then 'metafora items retry {task.id}'"
            )))
        return base(task, state, now)

    return handle


def _as_processor(processor: Processor | Callable[[Item], Response]) -> Processor:
    """``processor`` as a :class:`Processor` (a function ``item -> Response`` wrapped)."""
    if isinstance(processor, Processor):
        return processor
    if not callable(processor):
        raise ConfigError("processor must be a gates.Processor or a function item -> Response")
    return callable_processor(processor)


def _fenced_by_claims(coordinator: Coordinator | None, items: ItemStore) -> bool:
    """Whether item writes are fenced by ``coordinator``'s claims directly (the items beside
    its tasks); else the coordinator's pruning is told to delete the items too."""
    claim_fence = coordinator is not None and items.beside(coordinator)
    if coordinator is not None and not claim_fence:
        # The items live in another database than the tasks (an etcd coordinator's): the
        # coordinator's pruning deletes a pruned partition's items through the item store.
        coordinator.prune_also(items.delete_partitions)
    return claim_fence


def handler_func(
    processor: Processor | Callable[[Item], Response],
    coordinator: Coordinator | None,
    items: ItemStore,
    *,
    auto_close: bool = True,
    manual_checkpoint: bool = False,
    batch_size: int = 100,
    concurrency: int | None = None,
    max_attempts: int = 3,
    retry_delay: float = 0.5,
    max_retry_delay: float = 30.0,
    error_handler: ErrorHandler | None = None,
    command_interval: float = 1.0,
    poll_interval: float = 1.0,
    clock: Clock | None = None,
    state_store: StateStore | None = None,
    task_commands: TaskCommands | None = None,
    store_attempts: int = 5,
    store_retry_delay: float = 0.2,
    flush_interval: float = 0.2,
) -> GateHandlerFunc:
    """A HandlerFunc working gated partitions: each task is a partition of ``items``.

    ``processor`` is a :class:`Processor` (or a function ``item -> Response``, wrapped by
    :func:`callable_processor`). ``coordinator`` gives the node id, the state store and the
    task commands (pass ``state_store`` and ``task_commands`` to use others); when it is a
    SQL coordinator on the item store's database and namespace, item writes are also fenced
    by its claims directly.

    ``auto_close``: complete the partition when no work is left (else wait for new items);
    add a partition's items before submitting its task, or a partition with no items yet
    completes at once.
    ``manual_checkpoint``: never move the gate; :meth:`ItemStore.set_gate` (``metafora gate``)
    does. ``batch_size`` items are taken per round, processed ``concurrency`` at a time
    (default: the processor's ``concurrency``, else 1). A retryable failure is tried up to
    ``max_attempts`` times, ``retry_delay`` seconds apart (doubling up to ``max_retry_delay``);
    an item whose process died with it ``max_attempts`` claims in a row (the last time taken
    on its own) fails permanently with "process died while processing".
    ``flush_interval``: each item's result is written at most this many seconds after it
    finished (with the next batch's take if that comes first), so a kill -9 re-runs at most
    the items in work and those finished within the last ``flush_interval``.
    ``error_handler`` decides what a faulted partition does (default:
    :func:`gate_error_handler` around the state machine's default policy).
    ``command_interval`` bounds how long a task command (pause, kill...) waits to be seen;
    ``poll_interval`` is the machine's re-check interval while paused or sleeping.

    When the items live in another database than ``coordinator``'s tasks (an etcd
    coordinator), the coordinator's pruning of finished tasks also deletes their partitions'
    items (:meth:`~metafora.core.retention.RetentionOps.prune_also`).
    """
    if not isinstance(items, ItemStore):
        raise ConfigError(f"items must be a gates.ItemStore, not {type(items).__name__}")
    processor = _as_processor(processor)
    if concurrency is None:
        concurrency = int(getattr(processor, "concurrency", 1) or 1)
    options = GateOptions.validated(
        auto_close=auto_close, manual_checkpoint=manual_checkpoint, batch_size=batch_size,
        concurrency=concurrency, max_attempts=max_attempts, retry_delay=retry_delay,
        max_retry_delay=max_retry_delay, command_interval=command_interval,
        store_attempts=store_attempts, store_retry_delay=store_retry_delay,
        flush_interval=flush_interval,
    )
    if not isinstance(poll_interval, int | float) or not 0 < poll_interval <= 60:
        raise ConfigError(f"poll_interval must be in (0, 60] seconds, got {poll_interval!r}")
    if (state_store is None or task_commands is None) and coordinator is None:
        raise ConfigError("pass a coordinator, or both state_store and task_commands")
    claim_fence = _fenced_by_claims(coordinator, items)
    return GateHandlerFunc(
        processor, items,
        state_store if state_store is not None else state_store_for(coordinator),
        task_commands if task_commands is not None else commands_for(coordinator),
        coordinator.node_id if coordinator is not None else None,
        claim_fence, options,
        error_handler if error_handler is not None else gate_error_handler(items),
        clock, float(poll_interval),
        # Item writes last no longer than the node holds the claim (else ClaimLost).
        lease_bound_of(coordinator) if coordinator is not None else None,
    )


def retry_partition(items: ItemStore, partition: str, client: Client | None = None) -> int:
    """Make the partition's failed items available again and revive its task; returns how
    many items.

    With ``client`` (the coordinator's store): a *failed* task is made pending again (the
    next claim starts the partition over); a pending or claimed one that is faulted or
    sleeping (backing off) is sent ``resume``, so it retries now.
    """
    count = items.retry(partition)
    if client is None:
        return count
    from metafora.statemachine import get_state, send_task_command

    try:
        info = client.get_task(partition)
    except TaskNotFound:
        return count
    if info.state is TaskState.FAILED:
        client.retry_task(partition)
        log.info("partition %s: task made pending again", partition,
                 extra={"task": partition, "action": "retry"})
    elif info.state in (TaskState.PENDING, TaskState.CLAIMED):
        state = get_state(client, partition)
        if state is not None and state.code in (StateCode.FAULT, StateCode.SLEEPING):
            send_task_command(client, partition, Message.run())
            log.info("partition %s: sent resume (was %s)", partition, state.code.value,
                     extra={"task": partition, "action": "resume"})
    return count


def reopen_partition(items: ItemStore, partition: str, client: Client | None = None, *,
                     new_items: Sequence[NewItem] = ()) -> int:
    """Reopen a completed partition (Go Feed's reopen); returns its gate.

    The partition is open again with its items kept: done items stay done, the gate is the
    lowest gate with unfinished items (``new_items`` included, added in the same
    transaction), else 0; items added afterwards are processed by the next claim. With
    ``client`` (the coordinator's store) the partition's *done* task is made pending again,
    its state machine's ``completed`` state replaced by a runnable one at that gate, in one
    atomic step; a task still pending or claimed is left running (it picks the items up);
    one that ended otherwise (failed, killed) is refused with InvalidTaskState before
    anything is written (``metafora items retry`` / ``metafora retry`` are for those).
    """
    batch = list(new_items)
    if client is not None:
        _check_reopenable(client, partition)
    gate = items.reopen(partition, batch)
    if client is None:
        return gate
    states = state_store_for(client)

    def rewrite(found: RetrySnapshot) -> str | bytes | None:
        if found.state is not TaskState.DONE:
            raise InvalidTaskState(f"task {partition!r} is {found.state.value}, not done")
        token = found.token
        if found.body is not None:
            token, _ = states.decode_stored(partition, found.body, token)
        return states.encode_stored(token, State(cursor=str(gate)))

    try:
        if client.get_task(partition).state is TaskState.DONE:
            client.retry_with_state(partition, rewrite)
            log.info("partition %s: task made pending again at gate %d", partition, gate,
                     extra={"task": partition, "action": "reopen"})
    finally:
        states.close()
    return gate


def _check_reopenable(client: Client, partition: str) -> None:
    """InvalidTaskState unless the partition's task is done with a completed state machine,
    or still pending or claimed (TaskNotFound when there is no task)."""
    from metafora.statemachine import get_state

    info = client.get_task(partition)
    if info.state in (TaskState.PENDING, TaskState.CLAIMED):
        return
    state = get_state(client, partition) if info.state is TaskState.DONE else None
    if state is None or state.code is not StateCode.COMPLETED:
        ended = state.code.value if state is not None else info.state.value
        raise InvalidTaskState(
            f"partition {partition!r} ended {ended}, not completed: retry it instead "
            f"(metafora items retry {partition})"
        )
