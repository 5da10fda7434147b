"""The consumer's side threads, supervised.

Each side loop runs in a named daemon thread (``metafora-<name>-<node>``). Two kinds:

- **essential** (the watch, the command feed, the outcome writer): a node whose view of the
  store is gone must not keep claiming, so the first failure is kept as the consumer's fatal
  error (``run()`` raises it) and stops the consumer;
- **background** (the scheduler, the pruner, the cluster gauges, the claim-at-risk watch): an
  error there says nothing about this node's claims -- a bad stored value would otherwise stop
  every node of the namespace, one per turn -- so it is logged with its cause, counted
  (``metafora_loop_errors_total`` on ``/metrics``) and the loop is started again after a
  back-off. Only the lease and the handler supervision decide a node's life.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from metafora.consumer.events import CommandArrived, Event
from metafora.consumer.running import NodeLog
from metafora.contracts.coordinator import Coordinator
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.errors import CoordinatorClosed, MetaforaError

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "Supervisor", "command_feed"]

SIDE_THREAD_JOIN = 5.0  # seconds the shutdown waits for each side thread
BACKOFF_FIRST = 1.0
"""Seconds before a background loop that raised is started again (doubled per failure in a row)."""
BACKOFF_MAX = 60.0
"""The longest wait between two starts of a failing background loop."""


class Supervisor:
    """Starts side threads, keeps the first fatal error, and stops the consumer on it."""

    def __init__(self, node_id: str, *, stopping: threading.Event, wake: threading.Event,
                 log: NodeLog, clock: Clock = SYSTEM_CLOCK,
                 on_error: Callable[[str], None] | None = None) -> None:
        self._node_id = node_id
        self._clock = clock
        self._on_error = on_error
        self._stopping = stopping
        self._wake = wake
        self._log = log
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._fatal: BaseException | None = None

    @property
    def fatal(self) -> BaseException | None:
        """The error that stopped the consumer, if one did."""
        return self._fatal

    def keep(self, exc: BaseException) -> None:
        """Keep ``exc`` as the fatal error unless one was kept already."""
        with self._lock:
            if self._fatal is None:
                self._fatal = exc

    def start(self, name: str, target: Callable[[], None], *, background: bool = False) -> None:
        """Run ``target`` in a named, supervised daemon thread; a ``background`` loop is
        restarted after an error (see the module docstring), another stops the consumer.

        A thread that cannot start (the process is out of threads or memory) is a fatal error
        that names the loop; it is not kept for :meth:`join`, which could not join it.
        """
        thread = threading.Thread(
            target=self._restarting if background else self._supervised, args=(name, target),
            name=f"metafora-{name}-{self._node_id}", daemon=True,
        )
        try:
            thread.start()
        except (RuntimeError, MemoryError) as exc:
            raise MetaforaError(f"cannot start the {name} loop of consumer {self._node_id}: "
                                f"{exc}") from exc
        self._threads.append(thread)

    def _supervised(self, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except CoordinatorClosed:
            if not self._stopping.is_set():
                self.fail_fast(name, CoordinatorClosed(f"coordinator closed under the {name} loop"))
        except BaseException as exc:
            if not self._stopping.is_set():
                self.fail_fast(name, exc)
        else:
            if not self._stopping.is_set() and name == "watch":
                self.fail_fast(name, MetaforaError("the coordinator's watch returned unexpectedly"))

    def _restarting(self, name: str, target: Callable[[], None]) -> None:
        backoff = BACKOFF_FIRST
        while not self._stopping.is_set():
            started = self._clock.monotonic()
            try:
                target()
                return
            except CoordinatorClosed:
                return  # the store is closed: the consumer is shutting down
            except Exception as exc:
                if self._stopping.is_set():
                    return
                if self._clock.monotonic() - started > BACKOFF_MAX:
                    backoff = BACKOFF_FIRST  # it ran a while: a new streak
                self.loop_error(name, exc, backoff)
            self._clock.wait(self._stopping, backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    def loop_error(self, name: str, exc: BaseException, retry_in: float) -> None:
        """The background loop ``name`` failed with ``exc``: log it with its cause and count it."""
        self._log.error("the %s loop of consumer %s failed (the node keeps running; retrying "
                        "in %.0fs): %s", name, self._node_id, retry_in, exc, exc_info=exc,
                        extra={"action": "loop-error"})
        if self._on_error is not None:
            self._on_error(name)

    def fail_fast(self, name: str, exc: BaseException) -> None:
        """The ``name`` loop died of ``exc``: keep the error and stop the consumer."""
        self._log.error("the %s loop of consumer %s died; shutting down: %s", name,
                        self._node_id, exc, exc_info=exc, extra={"action": "fatal"})
        self.keep(exc)
        self._stopping.set()
        self._wake.set()

    def join(self) -> None:
        """Wait a while for each side thread (they end once the coordinator is closed)."""
        for thread in self._threads:
            thread.join(SIDE_THREAD_JOIN)
            if thread.is_alive():
                self._log.error("side thread %s did not stop", thread.name,
                                extra={"action": "shutdown"})


def command_feed(coordinator: Coordinator, *, stopping: threading.Event, clock: Clock,
                 post: Callable[[Event], None],
                 log: NodeLog) -> None:
    """Read this node's commands until ``stopping`` and post each to the loop."""
    backoff = 0.1
    while not stopping.is_set():
        try:
            command = coordinator.command(timeout=1.0)
        except CoordinatorClosed:
            raise
        except MetaforaError as exc:  # unreachable, or an odd store error: back off, retry
            log.warning("cannot read commands: %s", exc, extra={"action": "command"})
            clock.wait(stopping, backoff)
            backoff = min(backoff * 2, 5.0)
            continue
        backoff = 0.1
        if command is not None:
            post(CommandArrived(command))
