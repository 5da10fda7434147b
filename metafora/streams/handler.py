"""``stream_handler``: the :data:`~metafora.contracts.handler.HandlerFunc` running streams of indexed jobs.

Each claimed task is one stream, run by the state machine (:mod:`metafora.statemachine`) as an
async stateful handler on the consumer's event loop (:mod:`metafora.streams.run`): its progress
is the machine's cursor (fenced by the claim token, in the coordinator's own store: memory,
SQL or etcd), its commands come through the machine's pushed mailbox, and what the machine
does anyway comes along: ``metafora pause|resume|kill ID``, ``metafora state ID``, and the
error policy for a stream that cannot even start (a ``jobs`` factory that raises, a damaged
progress): a few attempts with back-off, then the task is ``failed`` with the reason.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from metafora.contracts.binding import NodeBinding
from metafora.contracts.coordinator import Coordinator
from metafora.contracts.handler import AsyncHandler, Handler, _is_coroutine_fn
from metafora.core.clock import Clock
from metafora.core.errors import ConfigError
from metafora.core.task import Task
from metafora.statemachine.aio import AsyncCommands
from metafora.statemachine.errors import ErrorHandler, ErrorPolicy
from metafora.statemachine.factory import StatefulHandlerFunc, handler_func
from metafora.statemachine.machine import Message
from metafora.statemachine.store import StateStore, TaskCommands
from metafora.streams.jobs import Jobs
from metafora.streams.threads import DEFAULT_THREAD_IDLE, ElasticPool
from metafora.streams.work import JobContext, Work

__all__ = [
    "DEFAULT_FLUSH_EVERY",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_POLL_EVERY",
    "DEFAULT_STOP_GRACE",
    "JobContext",
    "StreamHandlerFunc",
    "StreamOptions",
    "stream_handler",
]

DEFAULT_MAX_ATTEMPTS = 5
"""Attempts of one job before the stream pauses, failing on it."""
DEFAULT_RETRY_DELAY = 0.5
"""Seconds before a failed job's second attempt (doubling for each further one)."""
DEFAULT_MAX_RETRY_DELAY = 30.0
"""The longest wait between two attempts of a job, in seconds."""
DEFAULT_POLL_EVERY = 5.0
"""Seconds between looks at ``head()`` of a source that cannot push (``Jobs.listen`` is False)."""
DEFAULT_FLUSH_EVERY = 0.5
"""Least seconds between two writes of the processed index (at most one is in flight)."""
DEFAULT_STOP_GRACE = 5.0
"""Seconds a stopping stream lets its running jobs finish before it abandons them."""

STREAM_ERROR_POLICY = ErrorPolicy(max_errors=3, base_delay=1.0, max_delay=30.0)
"""The default error policy of a stream that cannot start (its factory raises, its progress is
damaged): 3 errors within 4 hours fail the task; 1 s, then 2 s between tries."""

_MAX_PROCESSING = 10_000
_MAX_SEARCH_AHEAD = 10_000_000
_MAX_SECONDS = 86_400.0


JobsFactory = Callable[[Task], Jobs]
"""``jobs(task) -> Jobs``: builds a stream's source from its task (props)."""


def _whole(name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{name} must be from {low} to {high}, got {value}")
    return value


def _seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    low_ok = value >= 0 if allow_zero else value > 0  # NaN: False
    if not low_ok or not value <= _MAX_SECONDS:  # NaN fails both
        bound = "[0" if allow_zero else "(0"
        raise ConfigError(f"{name} must be in {bound}, {_MAX_SECONDS:g}] seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StreamOptions:
    """The validated options of :func:`stream_handler` (see there)."""

    max_processing: int = 4
    max_search_ahead: int = 100
    start: int = 0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_delay: float = DEFAULT_RETRY_DELAY
    max_retry_delay: float = DEFAULT_MAX_RETRY_DELAY
    poll_every: float = DEFAULT_POLL_EVERY
    flush_every: float = DEFAULT_FLUSH_EVERY
    stop_grace: float = DEFAULT_STOP_GRACE

    def __post_init__(self) -> None:
        _whole("max_processing", self.max_processing, 1, _MAX_PROCESSING)
        _whole("max_search_ahead", self.max_search_ahead, 1, _MAX_SEARCH_AHEAD)
        if self.max_search_ahead < self.max_processing:
            raise ConfigError(
                f"max_search_ahead ({self.max_search_ahead}) must be at least max_processing "
                f"({self.max_processing}): the window could never hold a full pool")
        _whole("start", self.start, 0, 2**63 - 1)
        _whole("max_attempts", self.max_attempts, 1, 1000)
        object.__setattr__(self, "retry_delay", _seconds("retry_delay", self.retry_delay,
                                                         allow_zero=True))
        object.__setattr__(self, "max_retry_delay",
                           _seconds("max_retry_delay", self.max_retry_delay, allow_zero=True))
        if self.max_retry_delay < self.retry_delay:
            raise ConfigError(f"max_retry_delay ({self.max_retry_delay:g}s) must not be less "
                              f"than retry_delay ({self.retry_delay:g}s)")
        object.__setattr__(self, "poll_every", _seconds("poll_every", self.poll_every))
        object.__setattr__(self, "flush_every", _seconds("flush_every", self.flush_every,
                                                         allow_zero=True))
        object.__setattr__(self, "stop_grace", _seconds("stop_grace", self.stop_grace,
                                                        allow_zero=True))

    def backoff(self, failures: int) -> float:
        """Seconds before the next attempt of a job that failed ``failures`` times."""
        return min(self.max_retry_delay, self.retry_delay * 2.0 ** min(62, max(0, failures - 1)))


class StreamHandlerFunc:
    """The :data:`~metafora.contracts.handler.HandlerFunc` made by :func:`stream_handler`.

    It needs a coordinator's stores: given as ``coordinator=`` (or ``state_store`` and
    ``task_commands``), or else each :class:`~metafora.Consumer` it is given to runs a copy
    bound to its own coordinator (:meth:`bind_coordinator`), so one handler may serve several
    consumers of a process. :meth:`lags` is what a node's ``metafora_stream_lag`` sums.
    """

    def __init__(self, jobs: JobsFactory, work: Work, options: StreamOptions, *,
                 error_handler: ErrorHandler, clock: Clock | None,
                 state_store: StateStore | None, task_commands: TaskCommands | None) -> None:
        self.jobs = jobs
        self.work = work
        self.options = options
        self.is_async = _is_coroutine_fn(work)
        self._error_handler = error_handler
        self._clock = clock
        self._state_store = state_store
        self._task_commands = task_commands
        self._machine: StatefulHandlerFunc | None = None
        self._lock = threading.Lock()
        self._lags: dict[str, int] = {}
        # Bound by consumers, for lags(); weak: a consumer dropped takes its copy (and the
        # copy's stores) along instead of leaving it here for the process's life.
        self._copies: weakref.WeakSet[StreamHandlerFunc] = weakref.WeakSet()
        self._left: dict[str, set[Future[Any]]] = {}  # abandoned jobs' threads, by stream
        self._pool: ElasticPool | None = None  # every stream's source calls and plain jobs

    thread_idle: float = DEFAULT_THREAD_IDLE
    """Seconds a thread of the handler's shared pool waits for work before it ends (an idle
    node holds no stream thread). Set it before the handler is given to a consumer."""

    def pool(self) -> ElasticPool:
        """The threads every stream of this (bound) handler shares: its sources' calls (one
        :class:`~metafora.streams.threads.Strand` per stream) and its plain ``work``."""
        with self._lock:
            if self._pool is None:
                self._pool = ElasticPool("metafora-stream", self.thread_idle)
            return self._pool

    def _bind(self, coordinator: Coordinator | None) -> None:
        self._machine = handler_func(
            self._step, coordinator, error_handler=self._error_handler, clock=self._clock,
            state_store=self._state_store, task_commands=self._task_commands)

    def bind_coordinator(self, coordinator: Coordinator) -> StreamHandlerFunc:
        """The handler func a Consumer of ``coordinator`` runs: this one when it was given
        its stores, else a copy on ``coordinator``'s state store and task commands."""
        if self._machine is not None:
            return self
        copy = StreamHandlerFunc(self.jobs, self.work, self.options,
                                 error_handler=self._error_handler, clock=self._clock,
                                 state_store=None, task_commands=None)
        copy.thread_idle = self.thread_idle
        copy._bind(coordinator)
        with self._lock:
            self._copies.add(copy)
        return copy

    def bind_node(self, node: NodeBinding) -> StreamHandlerFunc:
        """The handler func a Consumer runs on ``node`` (:class:`~metafora.contracts.binding.BindsToNode`):
        :meth:`bind_coordinator` of its coordinator, whose :meth:`gauges` the node's
        ``/metrics`` shows."""
        bound = self.bind_coordinator(node.coordinator)
        node.add_gauges(bound.gauges)
        return bound

    @property
    def state_store(self) -> StateStore:
        """Where the streams' progress is kept (ConfigError before :meth:`bind_coordinator`)."""
        return self._bound().state_store

    def _bound(self) -> StatefulHandlerFunc:
        machine = self._machine
        if machine is None:
            raise ConfigError("stream_handler has no store yet: pass coordinator=, or give it "
                              "to a Consumer (which binds it to its coordinator)")
        return machine

    def __call__(self, task: Task) -> Handler | AsyncHandler:
        return self._bound()(task)

    async def _step(self, task: Task, cmds: AsyncCommands) -> Message:
        from metafora.streams.run import StreamRun  # the engine, loaded with the first stream

        return await StreamRun(self, task, cmds).run()

    # -- jobs a stopped run left running ----------------------------------------------------

    def leave_running(self, task_id: str, threads: list[Future[Any]]) -> None:
        """A run of ``task_id`` ended with these jobs' threads still running (abandoned):
        the stream's next run here counts them against ``max_processing``."""
        for thread in threads:
            with self._lock:
                self._left.setdefault(task_id, set()).add(thread)
            thread.add_done_callback(functools.partial(self._thread_ended, task_id))

    def _thread_ended(self, task_id: str, thread: Future[Any]) -> None:
        with self._lock:
            left = self._left.get(task_id)
            if left is not None:
                left.discard(thread)
                if not left:
                    del self._left[task_id]

    def left_running(self, task_id: str) -> list[Future[Any]]:
        """The threads of ``task_id``'s jobs that an earlier run here abandoned, still running."""
        with self._lock:
            return list(self._left.get(task_id, ()))

    # -- the node's gauge ------------------------------------------------------------------

    def report_lag(self, task_id: str, lag: int | None) -> None:
        """Record a running stream's lag (None: it stopped running here)."""
        with self._lock:
            if lag is None:
                self._lags.pop(task_id, None)
            else:
                self._lags[task_id] = lag

    def lags(self) -> dict[str, int]:
        """The lag of each stream running here (and in the consumers' bound copies), by task
        id: jobs that exist and are not processed yet."""
        with self._lock:
            found, copies = dict(self._lags), list(self._copies)
        for copy in copies:
            found.update(copy.lags())
        return found

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The node-level gauges of this handler: ``metafora_stream_lag`` (summed over the
        streams running here: /metrics labels are ``node`` only, never a task id)."""
        lags = self.lags()
        total, count = sum(lags.values()), len(lags)
        return {"metafora_stream_lag": ("Jobs that exist and are not processed yet, summed "
                                        "over the streams this node runs", float(total)),
                "metafora_streams": ("Streams this node runs", float(count))}


def stream_handler(
    jobs: JobsFactory,
    work: Work,
    *,
    max_processing: int = 4,
    max_search_ahead: int = 100,
    start: int = 0,
    coordinator: Coordinator | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    retry_delay: float = DEFAULT_RETRY_DELAY,
    max_retry_delay: float = DEFAULT_MAX_RETRY_DELAY,
    poll_every: float = DEFAULT_POLL_EVERY,
    flush_every: float = DEFAULT_FLUSH_EVERY,
    stop_grace: float = DEFAULT_STOP_GRACE,
    error_handler: ErrorHandler | None = None,
    clock: Clock | None = None,
    state_store: StateStore | None = None,
    task_commands: TaskCommands | None = None,
) -> StreamHandlerFunc:
    """A HandlerFunc running each claimed task as a stream of indexed jobs (see docs/streams.md).

    ``jobs(task) -> Jobs`` builds the stream's source from its task; ``work(job, ctx)`` does
    one job -- a plain function runs on the stream's pool of ``max_processing`` threads, an
    ``async def`` on the consumer's event loop. Returning means done; raising means retried
    (``retry_delay`` doubling up to ``max_retry_delay``), never skipped: after
    ``max_attempts`` the stream pauses, failing on that job, until ``metafora stream retry``.

    At most ``max_processing`` jobs run at once, and no index above the processed index +
    ``max_search_ahead`` starts. The processed index is written fenced by the claim token,
    at most one write in flight and at least ``flush_every`` seconds apart, and when the
    stream stops; a new owner resumes at processed + 1 (at least once: finished jobs above it
    run again). ``head()`` is read at start, on ``Client.check_stream``, when a job finishes
    and the window has caught up with the known head, when the source pushes
    (``Jobs.listen``), and -- only for a source that cannot push -- every ``poll_every``
    seconds. A stopping stream starts nothing more, gives its running jobs ``stop_grace``
    seconds, then abandons them (they re-run on the next owner) and writes its progress.

    ``coordinator``: whose store keeps the progress and carries the commands (a Consumer
    binds its own if not given; or pass ``state_store`` and ``task_commands``).
    ``error_handler``: what a stream that cannot start does (default: 3 tries, then failed).
    Bad options raise :class:`~metafora.core.errors.ConfigError` here.
    """
    if not callable(jobs):
        raise ConfigError("jobs must be callable: (task) -> Jobs")
    if not callable(work):
        raise ConfigError("work must be callable: (job, ctx) -> None (or an async def)")
    if inspect.isclass(jobs) and not issubclass(jobs, Jobs):
        raise ConfigError(f"jobs must build a metafora.streams.Jobs, and {jobs.__name__} is not one")
    options = StreamOptions(max_processing=max_processing, max_search_ahead=max_search_ahead,
                            start=start, max_attempts=max_attempts, retry_delay=retry_delay,
                            max_retry_delay=max_retry_delay, poll_every=poll_every,
                            flush_every=flush_every, stop_grace=stop_grace)
    if error_handler is not None and not callable(error_handler):
        raise ConfigError("error_handler must be callable: (task, state, now) -> Message")
    made = StreamHandlerFunc(jobs, work, options, error_handler=error_handler or STREAM_ERROR_POLICY,
                             clock=clock, state_store=state_store, task_commands=task_commands)
    if coordinator is not None or (state_store is not None and task_commands is not None):
        made._bind(coordinator)
    return made
