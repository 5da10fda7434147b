"""The gate handler: a stateful handler that works a partition's items gate by gate.

:func:`handler_func` returns a :data:`~metafora.handler.HandlerFunc` for a
:class:`~metafora.Consumer`. For each claim of a partition (a task) it builds a
:class:`GateTaskHandler`, which runs the state machine
(:class:`~metafora.statemachine.StatefulTaskHandler`) around one step function:

1. take the partition for this claim (raise its fencing token in the item store);
2. loop: take a batch of the current gate's available items (in id order; the batch is
   recorded in the same write, so a death counts an attempt for its items), process them
   with the :class:`Processor` (up to ``concurrency`` at once, each retried up to
   ``max_attempts`` times with back-off); each result is written within ``flush_interval``
   of finishing, or with the next batch's take, whichever comes first (a group commit,
   :mod:`~metafora.statemachine.gates.flush`, fenced like every item write);
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
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar

from metafora.clock import SYSTEM_CLOCK, Clock
from metafora.coordinator import Client, Coordinator, error_text
from metafora.errors import ClaimLost, ConfigError, CoordinatorUnavailable, MetaforaError, TaskNotFound
from metafora.handler import Handler
from metafora.statemachine.errors import ErrorHandler, default_error_handler
from metafora.statemachine.gates.flush import ResultFlusher
from metafora.statemachine.gates.model import (
    Item,
    ItemsFailed,
    ItemStatus,
    PartitionFailed,
    PartitionStatus,
    PermanentError,
    ProcessingError,
    Response,
)
from metafora.statemachine.gates.processor import Processor, callable_processor
from metafora.statemachine.gates.store import ItemStore, Outcome, PartitionLease
from metafora.statemachine.handler import Commands, StatefulTaskHandler
from metafora.statemachine.machine import MAX_ERROR_TEXT, Message, State, StateCode
from metafora.statemachine.store import StateStore, TaskCommands, commands_for, state_store_for
from metafora.task import Task, TaskState

__all__ = [
    "GateHandlerFunc",
    "GateTaskHandler",
    "gate_error_handler",
    "handler_func",
    "retry_partition",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class GateOptions:
    """The validated settings of a gate handler (see :func:`handler_func`)."""

    auto_close: bool = True
    manual_checkpoint: bool = False
    batch_size: int = 100
    concurrency: int = 1
    max_attempts: int = 3
    retry_delay: float = 0.5
    max_retry_delay: float = 30.0
    command_interval: float = 1.0
    store_attempts: int = 5
    store_retry_delay: float = 0.2
    flush_interval: float = 0.2


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_TEXT else text[: MAX_ERROR_TEXT - 3] + "..."


class _PartitionRun:
    """One claim's work on one partition: the step function the state machine calls."""

    def __init__(self, task: Task, processor: Processor, lease: PartitionLease,
                 items: ItemStore, options: GateOptions) -> None:
        self.task = task
        self.lease = lease
        self._processor = processor
        self._items = items
        self._opt = options
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._gate: int | None = None
        self._next_poll = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._extra: dict[str, Any] = {"task": task.id, "token": task.token}
        self._results = ResultFlusher(self._flush_write, options.flush_interval,
                                      f"metafora-gate-flush-{task.id}", self.stop)

    # -- life cycle -----------------------------------------------------------------------

    def open(self) -> None:
        """Subscribe to news of the partition, then take it for this claim."""
        self._unsubscribe = self._items.subscribe(self.task.id, self._wake)
        gate, status = self.call_store("open the partition", self.lease.open)
        log.info("partition %s taken at gate %d (%s)", self.task.id, gate, status.value,
                 extra={**self._extra, "action": "open"})

    def stop(self) -> None:
        """Ask the step to return soon (never blocks)."""
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Unsubscribe and stop the worker and flush threads. Idempotent."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._results.close()

    def _stopping(self, cmds: Commands | None) -> bool:
        return self._stop.is_set() or (cmds is not None and cmds.stopping)

    # -- result writes (group commit) -------------------------------------------------------

    def _flush_write(self, gate: int, results: Sequence[Outcome]) -> None:
        """The background write of results that waited ``flush_interval``."""
        self.call_store("write results", self.lease.finish, gate, results)

    def _take(self, gate: int) -> list[Item]:
        """Write the waiting results and take the next batch, in one fenced transaction."""
        def take(at: int, results: Sequence[Outcome]) -> list[Item]:
            if results and at != gate:  # never: results are written before the gate moves
                raise AssertionError(f"results of gate {at} still waiting at gate {gate}")
            return self.call_store("take items", self.lease.take, gate, self._opt.batch_size,
                                   results, max_deaths=self._opt.max_attempts)
        return self._results.commit(take)

    def _flush(self, *, release: bool = False) -> None:
        """Write the waiting results now (``release``: a clean stop, so the items of the batch
        never started are not treated as a dead owner's)."""
        def finish(at: int, results: Sequence[Outcome]) -> None:
            if results or release:
                self.call_store("write results", self.lease.finish, at, results, release=release)
        self._results.commit(finish)

    # -- the step (called by the state machine while runnable) -----------------------------

    def step(self, task: Task, cmds: Commands) -> Message:
        """The stateful handler: work the partition until a message is due; every result
        is written before it returns."""
        try:
            message = self._step(cmds)
            self._flush()
            return message
        except CoordinatorUnavailable as exc:
            log.error("partition %s: the item store stays unreachable; releasing it: %s", task.id,
                      exc, extra={**self._extra, "action": "release"})
            return Message.release()

    def _step(self, cmds: Commands) -> Message:
        lease = self.lease
        gate, status = self.call_store("read the partition", lease.state)
        if status is PartitionStatus.COMPLETED:
            return Message.complete()
        if self._gate is not None and gate != self._gate:
            return self._moved(gate, "by hand")
        self._gate = gate
        # A new step after a fault is the partition's retry: its retryable failures run again.
        reopened = self.call_store("reopen failed items", lease.reopen_failed, gate)
        if reopened:
            log.info("partition %s: retrying %d failed item(s) at gate %d", self.task.id, reopened,
                     gate, extra={**self._extra, "action": "retry_items"})
        if self.call_store("look for work", lease.peek, gate)[1]:
            return self._items_failed(gate)
        while True:
            if self._stopping(cmds):
                return Message.release()
            message = self._poll(cmds)
            if message is not None:
                return message
            self._wake.clear()
            batch = self._take(gate)
            if any(i.status is ItemStatus.FAILED for i in batch):
                return self._items_failed(gate)  # its process died with it too often
            if batch:
                outcomes = self._process(batch, gate, cmds)
                if len(outcomes) < len(batch):
                    self._flush(release=True)
                    return Message.release()  # stopped in the middle of the batch
                if any(o.status is ItemStatus.FAILED for o in outcomes):
                    self._flush()
                    return self._items_failed(gate)
                continue
            step = self.call_store("advance the gate", lease.advance, gate,
                                   move=not self._opt.manual_checkpoint, close=self._opt.auto_close)
            if step.kind == "moved":
                return self._moved(step.gate, "to the lowest gate with work")
            if step.kind == "completed":
                log.info("partition %s: no work left; completing it", self.task.id,
                         extra={**self._extra, "action": "complete"})
                return Message.complete()
            if step.kind == "failed":
                return self._items_failed(gate)
            if step.kind == "work":
                continue
            message = self._idle(gate, cmds)  # idle or waiting for a manual gate move
            if message is not None:
                return message
            now_gate, status = self.call_store("read the partition", lease.state)
            if status is PartitionStatus.COMPLETED:
                return Message.complete()
            if now_gate != gate:
                return self._moved(now_gate, "by hand")

    def _moved(self, gate: int, how: str) -> Message:
        log.info("partition %s: gate %s -> %d (%s)", self.task.id, self._gate, gate, how,
                 extra={**self._extra, "action": "gate"})
        self._gate = gate
        return Message.checkpoint(str(gate))

    def _items_failed(self, gate: int) -> Message:
        failed = self.call_store("list failed items", self.lease.failed_items, gate)
        detail = "; ".join(f"item {i.id}: {i.error}" for i in failed[:3])
        error = ItemsFailed(_cut(
            f"item(s) failed at gate {gate} of partition {self.task.id!r}"
            + (f" ({detail})" if detail else "")
        ))
        log.warning("partition %s: %s", self.task.id, error, extra={**self._extra, "action": "fault"})
        return Message.error(error)

    def _poll(self, cmds: Commands) -> Message | None:
        """A pending task command, looked for at most every ``command_interval``."""
        now = SYSTEM_CLOCK.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + self._opt.command_interval
        return cmds.poll()

    def _idle(self, gate: int, cmds: Commands) -> Message | None:
        """Wait for news of the partition (or a command, or stop): None to look again.

        News is pushed (NOTIFY, or in-process); the store is also looked at every
        ``poll_interval`` of the item store as a safety net (SQLite's only way).
        """
        log.debug("partition %s: waiting for items at gate %d", self.task.id, gate,
                  extra={**self._extra, "action": "wait"})
        every = self._items.poll_interval
        next_look = SYSTEM_CLOCK.monotonic() + every
        while True:
            timeout = min(next_look, self._next_poll) - SYSTEM_CLOCK.monotonic()
            woke = self._wake.wait(max(0.0, timeout))
            if self._stopping(cmds):
                return Message.release()
            message = self._poll(cmds)
            if message is not None:
                return message
            if woke:
                return None
            if SYSTEM_CLOCK.monotonic() < next_look:
                continue
            next_look = SYSTEM_CLOCK.monotonic() + every
            low, failed = self.call_store("look for work", self.lease.peek, gate)
            if failed or low == gate or (low is not None and not self._opt.manual_checkpoint):
                return None
            if self.call_store("read the partition", self.lease.state)[0] != gate:
                return None

    # -- processing -------------------------------------------------------------------------

    def _process(self, batch: list[Item], gate: int, cmds: Commands) -> list[Outcome]:
        """Process a batch; items not started because of a stop are left out."""
        if self._opt.concurrency == 1 or len(batch) == 1:
            outcomes = []
            for item in batch:
                if self._stopping(cmds):
                    break
                outcomes.append(self._attempt_recorded(item, gate))
            return outcomes
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._opt.concurrency,
                                                thread_name_prefix=f"metafora-gate-{self.task.id}")
        futures: list[Future[Outcome | None]] = [
            self._executor.submit(self._attempt_unless_stopped, item, gate) for item in batch
        ]
        return [o for o in (f.result() for f in futures) if o is not None]

    def _attempt_unless_stopped(self, item: Item, gate: int) -> Outcome | None:
        if self._stop.is_set():  # (worker threads do not touch the machine's Commands)
            return None
        return self._attempt_recorded(item, gate)

    def _attempt_recorded(self, item: Item, gate: int) -> Outcome:
        """Process one item; its result goes to the group commit at once."""
        outcome = self._attempt(item, gate)
        self._results.add(gate, outcome)
        return outcome

    def _attempt(self, item: Item, gate: int) -> Outcome:
        """Process one item, retrying retryable failures with back-off."""
        delay = self._opt.retry_delay
        tries = 0
        while True:
            tries += 1
            try:
                response = self._processor.process(replace(item, attempts=item.attempts + tries - 1))
                if not isinstance(response, Response):
                    raise PermanentError(f"the processor returned {type(response).__name__}, not a Response")
                return self._accept(item, gate, response, tries)
            except Exception as exc:
                permanent = isinstance(exc, ProcessingError) and not exc.retryable
                text = _cut(error_text(exc))
                if permanent or tries >= self._opt.max_attempts:
                    log.warning("partition %s: item %d failed%s after %d attempt(s): %s", self.task.id,
                                item.id, " permanently" if permanent else "", tries, text,
                                extra={**self._extra, "action": "item_failed"})
                    return Outcome(item.id, ItemStatus.FAILED, gate, tries, error=text, permanent=permanent)
                log.info("partition %s: item %d attempt %d failed, retrying in %.2fs: %s", self.task.id,
                         item.id, tries, delay, text, extra={**self._extra, "action": "item_retry"})
                if self._stop.wait(delay):
                    return Outcome(item.id, ItemStatus.AVAILABLE, gate, tries, error=text)
                delay = min(delay * 2, self._opt.max_retry_delay)

    def _accept(self, item: Item, gate: int, response: Response, tries: int) -> Outcome:
        if response.gate < gate:
            return self._refuse(item, gate, tries, f"the processor answered gate {response.gate}, "
                                f"below the current gate {gate}")
        for new in response.spawn:
            if new.gate <= gate:
                return self._refuse(item, gate, tries, f"the processor spawned an item at gate "
                                    f"{new.gate}; spawned items go above the current gate {gate}")
        status = ItemStatus.COMPLETE if response.done else ItemStatus.AVAILABLE
        return Outcome(item.id, status, response.gate, tries, data=response.data, spawn=response.spawn)

    def _refuse(self, item: Item, gate: int, tries: int, why: str) -> Outcome:
        log.warning("partition %s: item %d failed permanently: %s", self.task.id, item.id, why,
                    extra={**self._extra, "action": "item_failed"})
        return Outcome(item.id, ItemStatus.FAILED, gate, tries, error=f"PermanentError: {why}",
                       permanent=True)

    # -- store calls ------------------------------------------------------------------------

    def call_store(self, what: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, retried while the store is unreachable (then
        CoordinatorUnavailable)."""
        delay = self._opt.store_retry_delay
        for attempt in range(1, self._opt.store_attempts + 1):
            try:
                return call(*args, **kwargs)
            except CoordinatorUnavailable as exc:
                if attempt >= self._opt.store_attempts or self._stop.wait(delay):
                    raise
                log.warning("partition %s: %s failed (attempt %d of %d), retrying: %s", self.task.id,
                            what, attempt, self._opt.store_attempts, exc,
                            extra={**self._extra, "action": "retry"})
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")


class GateTaskHandler(Handler):
    """Runs one claim of a partition: the state machine around the gate step.

    Before the machine runs, the partition is taken for this claim (its token raised in
    the item store); a partition whose stored state is ``failed`` -- claimed again, so an
    operator retried it -- starts over with a fresh error budget. When the machine ends in
    ``failed``, :meth:`run` raises :class:`PartitionFailed`, so the coordinator marks the
    task failed (``metafora retry`` / ``metafora items retry`` can bring it back).
    """

    def __init__(self, task: Task, run: _PartitionRun, machine: StatefulTaskHandler,
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
        self._run.open()


class GateHandlerFunc:
    """The :data:`~metafora.handler.HandlerFunc` made by :func:`handler_func`."""

    def __init__(self, processor: Processor, items: ItemStore, states: StateStore,
                 commands: TaskCommands, node_id: str | None, claim_fence: bool,
                 options: GateOptions, error_handler: ErrorHandler, clock: Clock | None,
                 poll_interval: float) -> None:
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

    def __call__(self, task: Task) -> GateTaskHandler:
        lease = self.items.lease(task, self.node_id, claim_fence=self.claim_fence)
        run = _PartitionRun(task, self.processor, lease, self.items, self.options)
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
            return Message.error(ItemsFailed(_cut(
                f"{failed} item(s) of partition {task.id!r} failed permanently"
                + (f" ({detail})" if detail else "")
                + f"; fix them, then 'metafora items retry {task.id}'"
            )))
        return base(task, state, now)

    return handle


def _sql_config(coordinator: object) -> Any:
    # Hook wanted: a public ``database``/``config`` on SQLCoordinator; until then the private
    # handle is read here (as metafora.statemachine.stores.sql does).
    if not type(coordinator).__module__.startswith("metafora.coordinators.sql"):
        return None
    db = getattr(coordinator, "_db", None)
    return getattr(db, "config", None)


def _positive(value: object, name: str, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        raise ConfigError(f"{name} must be a {'whole ' if integer else ''}number, got {value!r}")
    assert isinstance(value, int | float)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


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
    """
    if not isinstance(items, ItemStore):
        raise ConfigError(f"items must be a gates.ItemStore, not {type(items).__name__}")
    if not isinstance(processor, Processor):
        if not callable(processor):
            raise ConfigError("processor must be a gates.Processor or a function item -> Response")
        processor = callable_processor(processor)
    if concurrency is None:
        concurrency = int(getattr(processor, "concurrency", 1) or 1)
    _positive(batch_size, "batch_size", integer=True)
    _positive(concurrency, "concurrency", integer=True)
    _positive(max_attempts, "max_attempts", integer=True)
    _positive(store_attempts, "store_attempts", integer=True)
    _positive(retry_delay, "retry_delay", allow_zero=True)
    _positive(max_retry_delay, "max_retry_delay", allow_zero=True)
    _positive(command_interval, "command_interval")
    _positive(store_retry_delay, "store_retry_delay", allow_zero=True)
    _positive(flush_interval, "flush_interval", allow_zero=True)
    if not isinstance(poll_interval, int | float) or not 0 < poll_interval <= 60:
        raise ConfigError(f"poll_interval must be in (0, 60] seconds, got {poll_interval!r}")
    if (state_store is None or task_commands is None) and coordinator is None:
        raise ConfigError("pass a coordinator, or both state_store and task_commands")
    options = GateOptions(
        auto_close=bool(auto_close), manual_checkpoint=bool(manual_checkpoint),
        batch_size=batch_size, concurrency=concurrency, max_attempts=max_attempts,
        retry_delay=float(retry_delay), max_retry_delay=float(max_retry_delay),
        command_interval=float(command_interval), store_attempts=store_attempts,
        store_retry_delay=float(store_retry_delay), flush_interval=float(flush_interval),
    )
    config = _sql_config(coordinator) if coordinator is not None else None
    claim_fence = config is not None and items.same_database(config)
    return GateHandlerFunc(
        processor, items,
        state_store if state_store is not None else state_store_for(coordinator),
        task_commands if task_commands is not None else commands_for(coordinator),
        coordinator.node_id if coordinator is not None else None,
        claim_fence, options,
        error_handler if error_handler is not None else gate_error_handler(items),
        clock, float(poll_interval),
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
