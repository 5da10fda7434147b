"""Handoff: asking a running handler to give its task up, and a claim lost under it.

A release is asked by the balancer or by ``metafora stop``: the handler gets ``stop()`` and
``handoff_timeout`` seconds to return (a stateful handler's final checkpoint); past it the
handler is abandoned (an async one cancelled) and the claim released, so the task moves
anyway -- its late writes are fenced. A lost claim (the store says another node may own the
task) stops and cancels the handler at once: nothing it does from then on can be written.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from metafora.consumer.context import PartsContext
from metafora.consumer.runner import HandlerRunner
from metafora.consumer.running import Running
from metafora.contracts.coordinator import Finish, Outcome
from metafora.core.task import Task

__all__ = ["Handoffs"]

_LOST_EARLY_MAX = 10_000  # claims lost before their handler started, remembered at most


class Handoffs:
    """Releases asked of running handlers (by deadline) and claims lost under them.

    ``running`` and ``lock`` are the consumer's; ``back_off`` ignores a let-go task for a
    while, ``record`` writes an outcome through the group commit and logs how it ended.
    """

    def __init__(
        self,
        ctx: PartsContext,
        *,
        runner: HandlerRunner,
        back_off: Callable[[Task], None],
        record: Callable[[Finish], None],
    ) -> None:
        self._running: MutableMapping[str, Running] = ctx.running
        self._lock = ctx.lock
        self._runner = runner
        self._timeout = ctx.options.handoff_timeout
        self._back_off = back_off
        self._record = record
        self._stats = ctx.stats
        self._clock = ctx.clock
        self._log = ctx.log
        self._due: dict[str, tuple[float, Running]] = {}  # releases asked, by deadline
        self._lost_early: dict[str, int] = {}  # task id -> token of a claim lost before start

    def request_release(self, task_id: str) -> bool:
        """Ask the handler of ``task_id`` to give it up; False when it does not run here."""
        with self._lock:
            entry = self._running.get(task_id)
            if entry is None or entry.stopped is not None:
                return entry is not None
            entry.stopped = self._clock.now()
            due = self._clock.monotonic() + self._timeout
            self._due[task_id] = (due, entry)
        self.stop_handler(entry)
        return True

    def next_due(self) -> float | None:
        """The earliest handoff deadline, or None. Called holding the lock."""
        return min((d for d, _ in self._due.values()), default=None)

    def expire(self, now: float) -> None:
        """Handlers asked to give their task up that did not return within the handoff
        timeout: abandon them and release the claim, so the task moves anyway."""
        with self._lock:
            due = [e for d, e in self._due.values() if d <= now]
            late = []
            for entry in due:
                del self._due[entry.task.id]
                if entry.returned.is_set() or entry.lost:
                    continue
                entry.abandoned = True  # read under the lock by finish: it writes nothing
                if self._running.get(entry.task.id) is entry:
                    del self._running[entry.task.id]
                self._back_off(entry.task)
                late.append(entry)
        for entry in late:
            extra = {"task": entry.task.id, "token": entry.task.token, "action": "abandon"}
            self._log.error("handler of task %s did not return within the handoff timeout "
                            "(%.1fs); abandoning it and releasing the task", entry.task.id,
                            self._timeout, extra=extra)
            if entry.run is not None:
                self._runner.cancel([entry.run])
            self._record(Finish(entry.task, Outcome.RELEASE))

    def stop_handler(self, entry: Running, *, cancel: bool = False) -> None:
        """Deliver stop() (and, for an async handler of a lost claim, cancellation)."""
        run = entry.run
        if run is None:
            return  # still starting: the consumer stops it once it has a run
        self._runner.stop([run])
        if cancel:
            self._runner.cancel([run])

    def lost_before_start(self, task: Task) -> bool:
        """Whether the claim on ``task`` was reported lost before its handler started."""
        with self._lock:
            return self._lost_early.pop(task.id, None) == task.token

    def lost(self, task: Task) -> None:
        """The store reports the claim on ``task`` lost: stop (and cancel) its handler."""
        with self._lock:
            entry = self._running.get(task.id)
            if entry is None:
                # Possibly claimed but not started yet: the start checks this first.
                self._lost_early[task.id] = task.token
                if len(self._lost_early) > _LOST_EARLY_MAX:
                    self._lost_early.pop(next(iter(self._lost_early)))
                return
            if task.token and task.token != entry.task.token:
                return
            entry.lost = True
            self._stats.incr("lost")
            if entry.stopped is None:
                entry.stopped = self._clock.now()
        self._log.warning("lost the claim on task %s (token %d); stopping its handler",
                          task.id, entry.task.token,
                          extra={"task": task.id, "token": entry.task.token, "action": "lost"})
        # An async handler is cancelled too: nothing it does from now on can be written.
        self.stop_handler(entry, cancel=True)
