"""Starting the handler of a task this node just claimed.

The claim may have been lost between ``claim_many`` and now (a paused process, a lease that
ran out): then the handler is not started and the claim released, in case only this node's
view was stale. Otherwise the handler is made by ``handler_func`` (a failure fails the
task), entered in the consumer's ``running`` map and handed to the runner; a stop or a lost
claim that came while it was starting is delivered once it has a run.

A handler the runner cannot start (no thread, no memory, the event loop gone) is not the
task's fault: its task is released at once (an ordinary release, no failure, no crash) and
the node's capacity drops to what it runs (:mod:`metafora.consumer.capacity`).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from metafora.consumer.capacity import Capacity
from metafora.consumer.context import PartsContext
from metafora.consumer.finishing import Finisher
from metafora.consumer.handoff import Handoffs
from metafora.consumer.risk import RiskWatch
from metafora.consumer.runner import CannotStart, HandlerRunner
from metafora.consumer.running import Running
from metafora.contracts.coordinator import Finish, Outcome, error_text
from metafora.contracts.handler import HandlerFunc
from metafora.core import tracing
from metafora.core.errors import MetaforaError
from metafora.core.task import Task

__all__ = ["Launcher"]


class Launcher:
    """Starts handlers of claimed tasks (``running`` and ``lock`` are the consumer's)."""

    def __init__(
        self,
        ctx: PartsContext,
        handler_func: HandlerFunc,
        *,
        runner: HandlerRunner,
        capacity: Capacity,
        handoffs: Handoffs,
        finisher: Finisher,
        back_off: Callable[[Task], None],
        risk: RiskWatch | None = None,
    ) -> None:
        self._coord = ctx.coordinator
        self._handler_func = handler_func
        self._running: MutableMapping[str, Running] = ctx.running
        self._lock = ctx.lock
        self._runner = runner
        self._capacity = capacity
        self._handoffs = handoffs
        self._finisher = finisher
        self._back_off = back_off
        self._stats = ctx.stats
        self._clock = ctx.clock
        self._log = ctx.log
        self._risk = risk

    def start(self, claimed: Task) -> None:
        """Start the handler of ``claimed``, unless its claim was lost meanwhile."""
        self._stats.incr("claims")
        extra = {"task": claimed.id, "token": claimed.token, "action": "claim"}
        if self._handoffs.lost_before_start(claimed) or not self._coord.holds(claimed):
            # Lost between the claim and now (e.g. the process was paused): do not start.
            self._stats.incr("lost")
            self._log.warning("claim on task %s (token %d) was lost before its handler started",
                              claimed.id, claimed.token, extra=extra)
            with self._lock:
                self._back_off(claimed)
            try:  # in case only our view was stale: never keep a claim nobody runs
                self._coord.release(claimed)
            except MetaforaError:
                pass  # lost for real: the store already freed it
            return
        if self._risk is not None:  # task.valid_until() / at_risk() for the handler
            self._risk.attach(claimed)
        try:
            handler = self._handler_func(claimed)
        except Exception as exc:
            self._log.exception("handler_func failed for task %s", claimed.id, extra=extra)
            self._finisher.record(Finish(claimed, Outcome.FAIL, error_text(exc)))
            return
        entry = Running(claimed, handler, self._clock.now())
        with self._lock:
            self._running[claimed.id] = entry
        self._log.info("claimed task %s (token %d)", claimed.id, claimed.token, extra=extra)
        try:
            run = self._runner.start(
                f"metafora-task-{claimed.id}", handler,
                lambda result, error, span: self._finisher.finish(entry, result, error, span),
                lambda: tracing.run_span(claimed.id, claimed.token, self._coord.node_id,
                                         claimed.props),
            )
        except CannotStart as exc:
            self._cannot_start(entry, exc)
            return
        with self._lock:
            entry.run = run
            stopped, lost = entry.stopped is not None, entry.lost
            self._capacity.started(len(self._running), "async" if run.is_async else "thread")
        if stopped:  # a stop or a lost claim came while it was starting
            self._handoffs.stop_handler(entry, cancel=lost)
        elif self._risk is not None:
            self._risk.started(entry)  # warned at once if its node is at risk

    def _cannot_start(self, entry: Running, exc: CannotStart) -> None:
        """Give the task of a handler that could not start back at once; claim no more."""
        task = entry.task
        with self._lock:
            if self._running.get(task.id) is entry:
                del self._running[task.id]
            self._back_off(task)  # other nodes take it first
            self._capacity.start_failed(len(self._running), exc.kind, exc.cause, task.id)
        entry.returned.set()
        entry.finished.set()
        self._finisher.record(Finish(task, Outcome.RELEASE))
