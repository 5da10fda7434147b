"""One claim's work on one partition: the step function the gate handler's machine calls.

A :class:`PartitionRun` takes the partition over for its claim, then, step by step, takes
batches of the current gate's items, processes them with the :class:`Processor` (retries,
back-off, ``concurrency`` at once), has their results written by the group commit
(:mod:`~metafora.gates.flush`) and moves the gate when it is empty -- as
described in :mod:`metafora.gates.handler`, which builds it for each claim.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from metafora.contracts.coordinator import error_text
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import ConfigError, CoordinatorUnavailable
from metafora.core.metrics import GateOutcome, GateStats
from metafora.core.task import Task
from metafora.gates.flush import ResultFlusher
from metafora.gates.lease import PartitionLease
from metafora.gates.model import (
    Item,
    ItemResult,
    ItemsFailed,
    ItemStatus,
    PartitionStatus,
    PermanentError,
    ProcessingError,
    Response,
)
from metafora.gates.processor import BatchProcessor, Processor
from metafora.gates.store import ItemStore
from metafora.statemachine.handler import Commands
from metafora.statemachine.machine import MAX_ERROR_TEXT, Message

__all__ = ["GateOptions", "PartitionRun", "short_error"]

log = logging.getLogger("metafora.gates.handler")  # the handler's log, as before

T = TypeVar("T")


@dataclass(frozen=True)
class GateOptions:
    """The validated settings of a gate handler (see
    :func:`~metafora.gates.handler.handler_func`)."""

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

    @classmethod
    def validated(cls, *, auto_close: object, manual_checkpoint: object, batch_size: int,
                  concurrency: int, max_attempts: int, retry_delay: float,
                  max_retry_delay: float, command_interval: float, store_attempts: int,
                  store_retry_delay: float, flush_interval: float) -> GateOptions:
        """The options, each checked (ConfigError naming the first one out of range)."""
        _positive(batch_size, "batch_size", integer=True)
        _positive(concurrency, "concurrency", integer=True)
        _positive(max_attempts, "max_attempts", integer=True)
        _positive(store_attempts, "store_attempts", integer=True)
        _positive(retry_delay, "retry_delay", allow_zero=True)
        _positive(max_retry_delay, "max_retry_delay", allow_zero=True)
        _positive(command_interval, "command_interval")
        _positive(store_retry_delay, "store_retry_delay", allow_zero=True)
        _positive(flush_interval, "flush_interval", allow_zero=True)
        return cls(
            auto_close=bool(auto_close), manual_checkpoint=bool(manual_checkpoint),
            batch_size=batch_size, concurrency=concurrency, max_attempts=max_attempts,
            retry_delay=float(retry_delay), max_retry_delay=float(max_retry_delay),
            command_interval=float(command_interval), store_attempts=store_attempts,
            store_retry_delay=float(store_retry_delay), flush_interval=float(flush_interval),
        )


def _positive(value: object, name: str, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        raise ConfigError(f"{name} must be a {'whole ' if integer else ''}number, got {value!r}")
    assert isinstance(value, int | float)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def short_error(text: str) -> str:
    """``text`` cut to the length a state's error record keeps."""
    return text if len(text) <= MAX_ERROR_TEXT else text[: MAX_ERROR_TEXT - 3] + "..."


class PartitionRun:
    """One claim's work on one partition: the step function the state machine calls."""

    def __init__(self, task: Task, processor: Processor, lease: PartitionLease,
                 items: ItemStore, options: GateOptions, stats: GateStats | None = None) -> None:
        self.task = task
        self._stats = stats
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

    def start(self) -> None:
        """Subscribe to news of the partition, then take it over for this claim."""
        self._unsubscribe = self._items.subscribe(self.task.id, self._wake)
        gate, status = self.call_store("open the partition", self.lease.take_over)
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

    def _flush_write(self, gate: int, results: Sequence[ItemResult]) -> None:
        """The background write of results that waited ``flush_interval``."""
        self.call_store("write results", self.lease.finish, gate, results)

    def _take(self, gate: int) -> list[Item]:
        """Write the waiting results and take the next batch, in one fenced transaction."""
        def take(at: int, results: Sequence[ItemResult]) -> list[Item]:
            if results and at != gate:  # never: results are written before the gate moves
                raise AssertionError(f"results of gate {at} still waiting at gate {gate}")
            return self.call_store("take items", self.lease.take, gate, self._opt.batch_size,
                                   results, max_deaths=self._opt.max_attempts)
        return self._results.commit(take)

    def _flush(self, *, release: bool = False) -> None:
        """Write the waiting results now (``release``: a clean stop, so the items of the batch
        never started are not treated as a dead owner's)."""
        def finish(at: int, results: Sequence[ItemResult]) -> None:
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
        error = ItemsFailed(short_error(
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

    def _process(self, batch: list[Item], gate: int, cmds: Commands) -> list[ItemResult]:
        """Process a batch; items not started because of a stop are left out. A
        :class:`BatchProcessor` gets the items in calls of up to its ``max_batch``; any other
        processor one item per call."""
        size = 1
        if isinstance(self._processor, BatchProcessor):
            size = self._processor.max_batch or len(batch)
        calls = [batch[at:at + size] for at in range(0, len(batch), size)]
        if self._opt.concurrency == 1 or len(calls) == 1:
            outcomes: list[ItemResult] = []
            for call in calls:
                if self._stopping(cmds):
                    break
                outcomes.extend(self._attempt_recorded(call, gate))
            return outcomes
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._opt.concurrency,
                                                thread_name_prefix=f"metafora-gate-{self.task.id}")
        futures: list[Future[list[ItemResult]]] = [
            self._executor.submit(self._attempt_unless_stopped, call, gate) for call in calls
        ]
        return [o for f in futures for o in f.result()]

    def _attempt_unless_stopped(self, call: list[Item], gate: int) -> list[ItemResult]:
        if self._stop.is_set():  # (worker threads do not touch the machine's Commands)
            return []
        return self._attempt_recorded(call, gate)

    def _attempt_recorded(self, call: list[Item], gate: int) -> list[ItemResult]:
        """Process one call's items; their results go to the group commit at once."""
        outcomes = self._attempt(call, gate)
        for outcome in outcomes:
            self._results.add(gate, outcome)
        return outcomes

    def _answers(self, call: list[Item], tries: int) -> list[Response]:
        """The processor's answers for ``call`` (attempt ``tries``), one per item, checked."""
        sent = [replace(item, attempts=item.attempts + tries - 1) for item in call]
        if isinstance(self._processor, BatchProcessor):
            answers: object = self._processor.process_batch(sent)
            if (not isinstance(answers, list) or len(answers) != len(call)
                    or not all(isinstance(a, Response) for a in answers)):
                raise PermanentError(f"process_batch answered {type(answers).__name__} for "
                                     f"{len(call)} item(s), not a list of as many Responses")
            return answers
        response = self._processor.process(sent[0])
        if not isinstance(response, Response):
            raise PermanentError(f"the processor returned {type(response).__name__}, not a Response")
        return [response]

    def _attempt(self, call: list[Item], gate: int) -> list[ItemResult]:
        """Process one call's items (one item, or a batch processor's batch), retrying
        retryable failures of the whole call with back-off."""
        delay = self._opt.retry_delay
        tries = 0
        began = SYSTEM_CLOCK.monotonic()
        what = f"item {call[0].id}" if len(call) == 1 else f"{len(call)} items ({call[0].id}..{call[-1].id})"
        while True:
            tries += 1
            try:
                answers = self._answers(call, tries)
                outcomes = [self._accept(item, gate, answer, tries)
                            for item, answer in zip(call, answers, strict=True)]
                self._counted(outcomes, began)
                return outcomes
            except Exception as exc:
                permanent = isinstance(exc, ProcessingError) and not exc.retryable
                text = short_error(error_text(exc))
                if permanent or tries >= self._opt.max_attempts:
                    log.warning("partition %s: %s failed%s after %d attempt(s): %s", self.task.id,
                                what, " permanently" if permanent else "", tries, text,
                                extra={**self._extra, "action": "item_failed"})
                    outcomes = [ItemResult(item.id, ItemStatus.FAILED, gate, tries, error=text,
                                           permanent=permanent) for item in call]
                    self._counted(outcomes, began)
                    return outcomes
                log.info("partition %s: %s attempt %d failed, retrying in %.2fs: %s", self.task.id,
                         what, tries, delay, text, extra={**self._extra, "action": "item_retry"})
                if self._stats is not None:
                    self._stats.count(GateOutcome.RETRIED, len(call))
                if self._stop.wait(delay):
                    return [ItemResult(item.id, ItemStatus.AVAILABLE, gate, tries, error=text)
                            for item in call]
                delay = min(delay * 2, self._opt.max_retry_delay)

    def _counted(self, outcomes: list[ItemResult], began: float) -> None:
        """Count finished items by outcome, and the time they took, in the node's stats."""
        if self._stats is None:
            return
        took = SYSTEM_CLOCK.monotonic() - began
        failed = sum(1 for o in outcomes if o.status is ItemStatus.FAILED)
        if failed:
            self._stats.count(GateOutcome.FAILED, failed)
        if len(outcomes) > failed:
            self._stats.count(GateOutcome.DONE, len(outcomes) - failed)
        for _ in outcomes:
            self._stats.item_seconds.observe(took)

    def _accept(self, item: Item, gate: int, response: Response, tries: int) -> ItemResult:
        if response.gate < gate:
            return self._refuse(item, gate, tries, f"the processor answered gate {response.gate}, "
                                f"below the current gate {gate}")
        for new in response.spawn:
            if new.gate <= gate:
                return self._refuse(item, gate, tries, f"the processor spawned an item at gate "
                                    f"{new.gate}; spawned items go above the current gate {gate}")
        status = ItemStatus.COMPLETE if response.done else ItemStatus.AVAILABLE
        return ItemResult(item.id, status, response.gate, tries, data=response.data, spawn=response.spawn)

    def _refuse(self, item: Item, gate: int, tries: int, why: str) -> ItemResult:
        log.warning("partition %s: item %d failed permanently: %s", self.task.id, item.id, why,
                    extra={**self._extra, "action": "item_failed"})
        return ItemResult(item.id, ItemStatus.FAILED, gate, tries, error=f"PermanentError: {why}",
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
