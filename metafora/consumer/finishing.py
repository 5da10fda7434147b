"""A handler's end: book its outcome, write it through the group commit, log how it went.

The runner calls :meth:`Finisher.finish` where the handler ended (its thread, or the event
loop): booking takes the consumer's lock and does no I/O; the store write it returns is run
off the event loop and only queues the outcome on the :class:`OutcomeWriter` (one writer
thread, :mod:`metafora.consumer.outcomes`). While the node shuts down, released claims are
gathered instead (:meth:`Finisher.take_let_go`) and released in batches by the shutdown.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from metafora.consumer.capacity import Capacity
from metafora.consumer.context import PartsContext
from metafora.consumer.events import Finished, Signal
from metafora.consumer.outcomes import OutcomeWriter, Pending
from metafora.consumer.running import Running
from metafora.contracts.coordinator import Finish, Outcome, error_text
from metafora.core import tracing
from metafora.core.errors import (
    ClaimCompleted,
    ClaimLost,
    CoordinatorUnavailable,
    InvalidProps,
    MetaforaError,
)
from metafora.core.task import Task

__all__ = ["Finisher"]

FINISH_RETRY_MAX = 5.0  # seconds between retries of a done/release/fail the store refused

_COUNTER = {Outcome.DONE: "done", Outcome.RELEASE: "releases", Outcome.FAIL: "failed"}
# How log messages say an outcome ("task t4 failed"); the `action` field keeps the enum's value.
_PHRASE = {Outcome.DONE: "done", Outcome.RELEASE: "released", Outcome.FAIL: "failed"}


class Finisher:
    """Books handlers' ends and writes their outcomes (``writer`` runs in a side thread).

    ``running`` and ``lock`` are the consumer's; ``back_off`` / ``forget_releases`` keep the
    release back-off of a task, ``post`` tells the loop a slot is free; ``capacity`` (the
    node's :class:`~metafora.consumer.capacity.Capacity`) says whether a slot can be short.
    """

    def __init__(
        self,
        ctx: PartsContext,
        *,
        capacity: Capacity,
        back_off: Callable[[Task], None],
        forget_releases: Callable[[str], None],
        ran: Callable[[float], None] | None = None,
    ) -> None:
        coordinator, clock = ctx.coordinator, ctx.clock
        self._coord = coordinator
        self._running: MutableMapping[str, Running] = ctx.running
        self._lock = ctx.lock
        self._stopping = ctx.stopping
        self._capacity = capacity
        self._back_off = back_off
        self._forget_releases = forget_releases
        self._ran = ran
        self._post = ctx.post
        self._stats = ctx.stats
        self._log = ctx.log
        self._finishing: set[Running] = set()  # returned, outcome not written yet
        self._let_go: list[Task] = []  # released by handlers during shutdown, not yet written
        # Handlers' outcomes are group-committed by one writer thread.
        self._clock = clock
        self.writer = OutcomeWriter(coordinator, retry_max=FINISH_RETRY_MAX, clock=clock,
                                    on_retry=self._outcome_retry)

    def finish(self, entry: Running, result: bool | None, error: BaseException | None,
               span: tracing.SpanLike | None) -> Callable[[], None] | None:
        """A handler ended: book it (no I/O) and return the store write to do, if any.

        The runner calls this on the handler's thread or on the event loop, inside the run's
        span, and runs the returned write off the loop: only the write blocks.
        """
        if error is None:
            outcome = Outcome.DONE if result else Outcome.RELEASE
        else:
            outcome = Outcome.FAIL
            if span is not None:
                span.record_exception(error)
                span.set_error(f"{type(error).__name__}: {error}")
            if not entry.lost and not entry.abandoned:
                # Bad task data (InvalidProps: an unknown message type, a field that does not
                # decode) is the task's fault, said in one line; anything else gets its traceback.
                trace = None if isinstance(error, InvalidProps) else error
                self._log.error("handler of task %s raised: %s", entry.task.id, error,
                                exc_info=trace, extra={"task": entry.task.id,
                                                       "token": entry.task.token, "action": "fail"})
        stopping = self._stopping.is_set()
        # How long it ran, for runs that ended on their own: balancers tell short tasks from
        # long ones by it (RecentRuns). A run this node stopped (a release, a shutdown) or lost
        # says nothing of how long its tasks run, and a move must not look like a short task.
        if entry.stopped is None and not entry.lost and not entry.abandoned:
            entry.ran = (self._clock.now() - entry.started).total_seconds()
            if self._ran is not None:
                # Told now, not when the loop drains its Finished event: at a cold start that
                # event waits behind thousands of refused offers, and so did the verdict
                # that short tasks need no refusals (up to a second of 5,000 no-op tasks).
                self._ran(entry.ran)
        with self._lock:
            if self._running.get(entry.task.id) is entry:
                del self._running[entry.task.id]
            self._finishing.add(entry)  # shutdown waits for its outcome to be written
            entry.returned.set()
            skip = entry.lost or entry.abandoned
            # Any bound (max_tasks, the thread cap, a capacity reduced after a failed start):
            # the slot this handler held may be what a deferred offer waits for.
            bounded = self._capacity.bounded()
            if stopping:
                pass  # no more claims: back-offs would only cost time with 10,000 handlers
            elif outcome is Outcome.RELEASE or entry.lost:
                # Back off before the store sees the release, so its offer is ignored.
                self._back_off(entry.task)
            else:
                self._forget_releases(entry.task.id)
        if span is not None:
            span.set_attribute("metafora.outcome", "lost" if entry.lost else outcome.value)
        if not stopping and bounded:
            # The slot is free now, not when the outcome is written: claims for it overlap
            # the group commit instead of waiting for it.
            self._post(Signal.ROOM)
        # Shutting down: the shutdown sequence releases the claims of returned handlers in
        # batches (finish_many), so thousands of handlers stopping at once do not each wait
        # for a release write, and a handler still blocked does not hold the others' back.
        if skip or (stopping and outcome is Outcome.RELEASE):
            if not skip:
                self._stats.incr(_COUNTER[outcome])
                with self._lock:
                    self._let_go.append(entry.task)
            self._ended(entry, outcome)
            return None
        return _OutcomeWrite(self, entry, outcome, error)

    def _queue_outcome(self, entry: Running, outcome: Outcome, error: BaseException | None,
                       *, queue_only: bool = False) -> bool:
        """Hand the outcome to the group commit (runs in the run's context).

        ``queue_only``: never block (the event loop calls it): False, with nothing done, when
        the writer has stopped and the outcome would have to be written right here.
        """
        end_span = tracing.start_outcome_span(outcome.value)

        def settle(result: MetaforaError | None) -> None:
            try:
                self._recorded(outcome, entry.task, result)
            finally:
                end_span()
                self._ended(entry, outcome)

        finish = Finish(entry.task, outcome, None if error is None else error_text(error))
        if queue_only:
            if self.writer.put(Pending(finish, settle)):
                return True
            end_span()
            return False
        self._write(finish, settle)
        return True

    def _ended(self, entry: Running, outcome: Outcome) -> None:
        with self._lock:
            self._finishing.discard(entry)
        entry.finished.set()
        if not self._stopping.is_set():
            self._post(Finished(entry.task, outcome, entry.ran))

    def record(self, finish: Finish) -> None:
        """Write one outcome that no handler's end books (a failed start, an abandon)."""
        self._write(finish, lambda result: self._recorded(finish.outcome, finish.task, result))

    def _write(self, finish: Finish, settle: Callable[[MetaforaError | None], None]) -> None:
        """Queue an outcome for the group commit; ``settle`` is told how it ended.

        The writer retries while the store is unreachable, until shutdown gives up. After it
        stopped (a handler returning after shutdown), the outcome is written right here.
        """
        if self.writer.put(Pending(finish, settle)):
            return
        try:
            (result,) = self._coord.finish_many([finish])
        except MetaforaError as exc:
            result = exc
        settle(result)

    def _recorded(self, outcome: Outcome, task: Task, result: MetaforaError | None) -> None:
        """Count and log how one outcome's write ended."""
        extra = {"task": task.id, "token": task.token, "action": outcome.value}
        if result is None:
            self._stats.incr(_COUNTER[outcome])
            self._log.info("task %s %s", task.id, _PHRASE[outcome], extra=extra)
        elif isinstance(result, ClaimCompleted):
            # The application's transaction completed it (complete_task): that wins.
            self._stats.incr("done")
            self._log.info("task %s done (completed in the application's transaction; the "
                           "handler's %s is moot)", task.id, outcome.value,
                           extra={**extra, "action": "done"})
        elif isinstance(result, ClaimLost):
            self._log.warning("could not record task %s as %s: %s", task.id, _PHRASE[outcome],
                              result, extra=extra)
        elif isinstance(result, CoordinatorUnavailable):
            self._log.error("gave up recording task %s as %s: %s", task.id, _PHRASE[outcome],
                            result, extra=extra)
        else:
            self._log.error("could not record task %s as %s: %s", task.id, _PHRASE[outcome],
                            result, extra=extra)

    def _outcome_retry(self, count: int, error: MetaforaError, delay: float) -> None:
        self._log.warning("store unavailable recording %d outcome(s), retrying in %.1fs: %s",
                          count, delay, error, extra={"action": "outcome"})

    # -- for the shutdown ----------------------------------------------------------------

    def take_let_go(self, count: int) -> list[Task]:
        """Remove and return up to ``count`` tasks released during shutdown, not written yet."""
        with self._lock:
            tasks, self._let_go = self._let_go[:count], self._let_go[count:]
        return tasks

    def unwritten(self) -> list[Running]:
        """Handlers that returned and whose outcome is still being written."""
        with self._lock:
            return list(self._finishing)


class _OutcomeWrite:
    """The store write of one handler's outcome, as :meth:`Finisher.finish` returns it.

    Calling it queues the outcome for the group commit (or, once the writer stopped, writes
    it: that blocks). :meth:`queue` never blocks, so the runner calls it on the event loop
    itself and saves async handlers a hop through a writer thread for every short task.
    """

    __slots__ = ("_entry", "_error", "_finisher", "_outcome")

    def __init__(self, finisher: Finisher, entry: Running, outcome: Outcome,
                 error: BaseException | None) -> None:
        self._finisher = finisher
        self._entry = entry
        self._outcome = outcome
        self._error = error

    def __call__(self) -> None:
        self._finisher._queue_outcome(self._entry, self._outcome, self._error)

    def queue(self) -> bool:
        """Queue it without blocking; False (nothing done) when only a blocking write is left."""
        return self._finisher._queue_outcome(self._entry, self._outcome, self._error,
                                             queue_only=True)
