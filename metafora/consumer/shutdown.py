"""The consumer's shutdown, in a fixed order, and never longer than its timeout.

1. announce leaving (the others start balancing before this node's tasks come free) and,
   unless the node leaves for good, hold what it releases from now on for its id (a
   restart under the same id takes its tasks back: :mod:`metafora.core.holds`);
2. stop every handler, sharing one deadline; while some still run, release the claims of
   those that returned in bounded batches (``finish_many``), so orphans move at once;
3. abandon the handlers still running at the deadline (cancel the async ones);
4. wait (same deadline) for outcomes being written, then stop the outcome writer;
5. close the coordinator: it releases every claim left and deregisters the node.

The consumer's loop has stopped before this starts; stopping the scheduler, joining the
side threads and closing the HTTP endpoints stay with :class:`~metafora.consumer.Consumer`.
"""

from __future__ import annotations

from collections.abc import Mapping

from metafora.consumer.context import PartsContext
from metafora.consumer.finishing import Finisher
from metafora.consumer.runner import HandlerRunner
from metafora.consumer.running import Running
from metafora.contracts.coordinator import Finish, Outcome
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import MetaforaError

__all__ = ["Shutdown"]

LET_GO_EVERY = 0.1  # seconds between batched releases while handlers stop on shutdown
LET_GO_BATCH = 100  # releases per batch (close() frees the rest in one request)


class Shutdown:
    """The steps of a consumer's shutdown (see the module docstring for their order)."""

    def __init__(self, ctx: PartsContext, *, runner: HandlerRunner, finisher: Finisher) -> None:
        self._coord = ctx.coordinator
        self._running: Mapping[str, Running] = ctx.running
        self._lock = ctx.lock
        self._runner = runner
        self._finisher = finisher
        self._clock = ctx.clock
        self._log = ctx.log
        self._leaving_announced = False
        self.leaving = False  # shutdown(leaving=True): hand tasks off at once, hold nothing

    def announce_leaving(self) -> None:
        """Tell the cluster this node is going, before its handlers stop (issue #92)."""
        if self._leaving_announced:
            return
        self._leaving_announced = True
        try:
            self._coord.announce_leaving()
        except MetaforaError as exc:
            self._log.warning("could not announce leaving: %s", exc, extra={"action": "shutdown"})

    def hold_releases(self, sticky_for: float) -> None:
        """Hold this node's releases for its id for ``sticky_for`` seconds, when the id is
        explicit (a generated one never comes back) and the node is not leaving for good."""
        if not sticky_for or self.leaving or self._coord.node_id_generated:
            return
        try:
            held = self._coord.hold_releases(sticky_for)
        except MetaforaError as exc:
            self._log.warning("could not hold tasks for this node: %s", exc,
                              extra={"action": "shutdown"})
            return
        if held:
            self._log.info("holding this node's tasks for its id for %.1fs", sticky_for,
                           extra={"action": "shutdown"})

    def stop_handlers(self, timeout: float) -> float:
        """Stop every handler, wait up to ``timeout`` s, abandon the rest; return the deadline.

        The deadline (``SYSTEM_CLOCK.monotonic()``) is shared by every handler and by the
        outcome writes :meth:`wait_outcomes` waits for.
        """
        with self._lock:
            entries = list(self._running.values())
            for entry in entries:
                if entry.stopped is None:
                    entry.stopped = self._clock.now()
        self._runner.stop(e.run for e in entries if e.run is not None)
        deadline = SYSTEM_CLOCK.monotonic() + timeout  # one deadline shared by every handler
        waiting = entries
        while True:
            waiting = [e for e in waiting if not e.returned.is_set()]
            left = deadline - SYSTEM_CLOCK.monotonic()
            if not waiting or left <= 0:
                break  # close() releases what is left in one request
            # Orphans move at once: while some handler still runs (maybe a stubborn one),
            # what returned is released now, a bounded batch per pass.
            self.release_let_go()
            waiting[0].returned.wait(min(left, LET_GO_EVERY))
        self._abandon([e for e in entries if not e.returned.is_set()], timeout)
        return deadline

    def release_let_go(self) -> None:
        """Write the releases of handlers that returned during shutdown, in one batch."""
        tasks = self._finisher.take_let_go(LET_GO_BATCH)
        if not tasks:
            return
        try:
            results = self._coord.finish_many([Finish(t, Outcome.RELEASE) for t in tasks])
        except MetaforaError as exc:  # close() frees them anyway (or their lease expires)
            self._log.warning("could not release %d task(s) while shutting down: %s",
                              len(tasks), exc, extra={"action": "release"})
            return
        released = sum(r is None for r in results)
        self._log.info("released %d task(s) while shutting down", released,
                       extra={"action": "release", "released": released})

    def _abandon(self, entries: list[Running], timeout: float) -> None:
        """Handlers that ignored stop() until the deadline: cancel (async) or abandon (thread).

        Their claims are released by the coordinator's close(), with every other claim left.
        """
        with self._lock:
            late = [e for e in entries if not e.returned.is_set()]
            for entry in late:
                entry.abandoned = True  # read under the lock by finish: it writes nothing
        for entry in late:
            fate = ("cancelling it" if entry.run is not None and entry.run.is_async
                    else "abandoning it (its thread may still run)")
            self._log.error("handler of task %s ignored stop() for %.1fs; %s and releasing the "
                            "task", entry.task.id, timeout, fate,
                            extra={"task": entry.task.id, "token": entry.task.token,
                                   "action": "abandon"})
        self._runner.cancel(e.run for e in late if e.run is not None)

    def wait_outcomes(self, deadline: float, timeout: float) -> None:
        """Wait until ``deadline`` for outcomes being written, then stop the writer."""
        finishing = self._finisher.unwritten()
        for entry in finishing:
            entry.finished.wait(max(0.0, deadline - SYSTEM_CLOCK.monotonic()))
        writing = sum(not e.finished.is_set() for e in finishing)
        if writing:
            self._log.warning("%d handler outcome(s) still being written after %.1fs; the "
                              "store releases those claims on close", writing, timeout,
                              extra={"action": "shutdown"})
        self._finisher.writer.stop()  # one more try for what is left, then give up

    def close_store(self) -> None:
        """Close the coordinator: release every claim left and deregister."""
        try:
            self._coord.close()
        except MetaforaError as exc:
            self._log.error("closing the coordinator failed: %s", exc, extra={"action": "close"})
