"""The Consumer: claims tasks, runs their handlers, balances and obeys commands.

One serialized loop (this module's ``Consumer._loop``) owns every decision: offers from the
coordinator's watch, commands, balance ticks and ignore deadlines all arrive as events on
one queue. Handlers are run by :mod:`metafora.runner` (sync ones each on a thread of their
own, async ones on the node's event loop); their outcomes are group-committed by the
writer of :mod:`metafora.outcomes`. The watch, the command feed and that writer run in named
side threads whose failure stops the consumer (a node must not keep claiming when its view
of the store is gone).
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import math
import queue
import random
import threading
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from metafora import commands as cmds
from metafora import tracing
from metafora.balancer import Balancer, BalancerContext, RunningTask
from metafora.balancers.dumb import DumbBalancer
from metafora.clock import SYSTEM_CLOCK, Clock
from metafora.coordinator import (
    DEFAULT_MAX_CRASHES,
    Coordinator,
    CoordinatorContext,
    Finish,
    Outcome,
    error_text,
)
from metafora.errors import (
    ClaimLost,
    ConfigError,
    CoordinatorClosed,
    CoordinatorUnavailable,
    InvalidProps,
    MetaforaError,
    NodeExists,
)
from metafora.handler import AsyncHandler, Handler, HandlerFunc
from metafora.http import InfoServer, parse_addr, render_metrics
from metafora.masking import mask_url
from metafora.metrics import ConsumerStats
from metafora.outcomes import OutcomeWriter, Pending
from metafora.preference import Preference
from metafora.runner import HandlerRunner, Run
from metafora.schedule import Scheduler
from metafora.task import Task, matches, validate_labels

__all__ = ["Consumer"]

log = logging.getLogger(__name__)

# With max_tasks, one claim_many gets this many offers per free slot (and a limit of the free
# slots): offers another node took meanwhile are skipped inside the statement instead of
# costing a round trip each.
_OVERFETCH = 4
_LET_GO_EVERY = 0.1  # seconds between batched releases while handlers stop on shutdown
_LET_GO_BATCH = 100  # releases per batch (close() frees the rest in one request)
_FINISH_RETRY_MAX = 5.0  # seconds between retries of a done/release/fail the store refused
_WAVE = 100  # offers in one pass of the loop that make a wave (split by rendezvous preference)
_MAX_HOLD = 10  # a held-back offer is tried at most this many rendezvous_waits after it was held

_COUNTER = {Outcome.DONE: "done", Outcome.RELEASE: "releases", Outcome.FAIL: "failed"}
# How log messages say an outcome ("task t4 failed"); the `action` field keeps the enum's value.
_PHRASE = {Outcome.DONE: "done", Outcome.RELEASE: "released", Outcome.FAIL: "failed"}


def _handler_state(handler: Handler | AsyncHandler) -> str | None:
    """A state-machine handler's current state, for /info (None for plain handlers)."""
    state = getattr(handler, "state", None)
    if callable(state):
        try:
            state = state()
        except Exception:
            return None
    if state is None:
        return None
    return str(getattr(state, "value", getattr(getattr(state, "code", None), "value", state)))


@dataclass(eq=False)
class _Running:
    task: Task
    handler: Handler | AsyncHandler
    started: datetime
    run: Run | None = None  # set once the runner started it
    stopped: datetime | None = None
    lost: bool = False
    abandoned: bool = False
    returned: threading.Event = field(default_factory=threading.Event)  # run() ended
    finished: threading.Event = field(default_factory=threading.Event)  # outcome written

    def view(self) -> RunningTask:
        return RunningTask(self.task, self.started, self.stopped)


class _NodeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Adds ``node`` to every record's extra, merged with the call's own extra."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


def _by_priority(task: Task) -> int:
    return -task.priority


class _Deferred:
    """Offers waiting for a free slot: highest priority first, oldest first within one.

    Taking ``n`` costs O(n + priority levels), not a walk of the whole backlog, so a node far
    over ``max_tasks`` does not re-sort it after every finished task.
    """

    def __init__(self) -> None:
        self._levels: dict[int, dict[str, Task]] = {}
        self._level_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._level_of)

    def put(self, task: Task, *, replace: bool = True) -> None:
        """Defer ``task`` (a newer offer of a deferred id replaces it unless ``replace`` is off)."""
        level = self._level_of.get(task.id)
        if level is not None:
            if not replace:
                return
            del self._levels[level][task.id]
            if not self._levels[level]:
                del self._levels[level]
        self._levels.setdefault(task.priority, {})[task.id] = task
        self._level_of[task.id] = task.priority

    def take(self, count: int | None) -> list[Task]:
        """Remove and return up to ``count`` (None: all) deferred tasks, in order."""
        taken: list[Task] = []
        for level in sorted(self._levels, reverse=True):
            tasks = self._levels[level]
            want = len(tasks) if count is None else min(len(tasks), count - len(taken))
            for task_id in list(itertools.islice(tasks, want)):
                taken.append(tasks.pop(task_id))
                del self._level_of[task_id]
            if not tasks:
                del self._levels[level]
            if count is not None and len(taken) >= count:
                break
        return taken


class _Ignores:
    """Offers ignored until a deadline (refused by the balancer, released, held back for
    placement): the earliest deadline and the expired ones without a walk of them all (a
    node refusing a storm's offers ignores tens of thousands).
    """

    def __init__(self) -> None:
        self._due: dict[str, tuple[float, Task]] = {}
        self._heap: list[tuple[float, str]] = []  # may hold stale entries: checked on pop

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._due

    def get(self, task_id: str) -> tuple[float, Task] | None:
        return self._due.get(task_id)

    def items(self) -> list[tuple[str, tuple[float, Task]]]:
        return list(self._due.items())

    def put(self, task: Task, due: float) -> None:
        """Ignore ``task`` until ``due`` (a newer deadline replaces an older one)."""
        old = self._due.get(task.id)
        self._due[task.id] = (due, task)
        if old is None or old[0] != due:
            heapq.heappush(self._heap, (due, task.id))
        if len(self._heap) > 2 * len(self._due) + 1024:  # too many stale entries: rebuild
            self._heap = [(d, i) for i, (d, _) in self._due.items()]
            heapq.heapify(self._heap)

    def keep_offer(self, task: Task) -> None:
        """Keep the newest offer of an ignored task (same deadline)."""
        self._due[task.id] = (self._due[task.id][0], task)

    def next_due(self) -> float | None:
        while self._heap:
            due, task_id = self._heap[0]
            entry = self._due.get(task_id)
            if entry is not None and entry[0] == due:
                return due
            heapq.heappop(self._heap)  # stale
        return None

    def pop_due(self, now: float) -> list[Task]:
        """Remove and return the tasks whose deadline has passed."""
        out: list[Task] = []
        while self._heap and self._heap[0][0] <= now:
            due, task_id = heapq.heappop(self._heap)
            entry = self._due.get(task_id)
            if entry is not None and entry[0] == due:
                del self._due[task_id]
                out.append(entry[1])
        return out


def _seconds(value: float | timedelta, name: str, *, allow_zero: bool = False) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


class _Context(CoordinatorContext):
    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def lost(self, task: Task) -> None:
        self._consumer._lost(task)

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger("metafora.coordinator").getChild(self._consumer.node_id)

    def renewed(self, seconds: float) -> None:
        self._consumer.stats.renewal_latency.observe(seconds)
        tracing.record_renewal(self._consumer.node_id, seconds)

    @property
    def max_crashes(self) -> int | None:
        return self._consumer._max_crashes

    @property
    def labels(self) -> Mapping[str, str]:
        return self._consumer.labels


class Consumer:
    """Runs tasks from ``coordinator`` with handlers made by ``handler_func``.

    ``run()`` blocks until ``shutdown()``. Options:

    - ``balance_every``: seconds (or timedelta) between balancer runs, jittered by
      ``balance_jitter`` (a fraction) so nodes do not balance in lockstep.
    - ``rebalance_window``: when the store reports that a node joined, left or announced
      leaving (``Coordinator.listen_membership``), balance after a random delay between half
      this window and all of it (default 3 s), not only every ``balance_every``; every event
      of a burst falls into the same window, so repeated joins coalesce into one balance.
      One more balance follows a few seconds later (twice the window, at least 2 s), once
      the released tasks found their new owners. 0 balances at once on each change.
    - ``max_tasks``: at most this many tasks run at once on this node.
    - ``max_crashes``: a task whose last claims ended this many times in a row with their node
      dead (a handler that kills its process) is failed instead of run again (default 5;
      None or 0 turns it off).
    - ``shutdown_timeout``: how long ``shutdown()`` waits for handlers by default.
    - ``start_timeout``: how long ``run()`` waits for a store that cannot be reached when it
      starts (``CoordinatorUnavailable``), retrying with back-off, before it raises that error
      (default 30 s; 0 raises at once). Other errors (bad configuration, a live node with the
      same id) are raised at once.
    - ``handoff_timeout``: how long a handler asked to give its task up by the balancer or
      ``metafora stop`` may take to return (a stateful handler's final checkpoint, see
      :meth:`metafora.statemachine.handler.Commands.handoff`); past it the handler is
      abandoned (an async one cancelled) and the claim released, so the task moves anyway
      (its writes are fenced: a late one is refused). Default 30 s.
    - ``release_backoff`` / ``release_backoff_max``: after this node releases a task it
      ignores it for a back-off that doubles per release, so it is not re-claimed in a hot
      loop and other nodes get it first.
    - ``refuse_retry``: when the balancer refuses a task without a deadline, re-offer it
      after this many seconds.
    - ``slow_callback``: warn when an async handler holds the node's event loop (a blocking
      call) longer than this many seconds.
    - ``labels``: this node's placement labels (``{"zone": "eu", "gpu": "1"}``), published
      with its registration: it claims only tasks whose selector they match (see
      docs/placement.md). Offers are tried highest ``Task.priority`` first.
    - ``rendezvous_wait``: in a wave of offers (a backlog at start-up, a bulk submit), each
      task is tried first by the node that rendezvous hashing ranks first for it among the
      live nodes; the others leave it to that node and try it once this many seconds passed
      with no new wave (at most ten times as long after they held it back), so a task is
      never left waiting for a node that is gone, full or frozen (see
      :mod:`metafora.preference`). Off by default (0: every node races for every offer):
      it cuts the offers lost to races 2-4x, but held-back shares made the 100,000-task storm
      slower on a quiet 2-core machine (PostgreSQL 56-63 s against 36 s, SQLite 101 s against
      62 s), so it is for stores where a lost race is expensive.
    - ``placement_wait``: seconds this node holds back, once, before it takes a task whose
      soft placement it does not fit (``Task.prefer`` names labels it lacks while a live
      node has them, or it already runs a task of the task's ``spread`` group), so a better
      placed node may take it first (0 ignores soft placement).
    - ``http_addr``: ``"127.0.0.1:PORT"`` serves ``/info``, ``/metrics`` and ``/healthz``
      (see :mod:`metafora.http`); off by default.
    - ``clock``, ``rng``: injectable time and randomness (see :mod:`metafora.testing`).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        handler_func: HandlerFunc,
        balancer: Balancer | None = None,
        *,
        balance_every: float | timedelta = 60.0,
        balance_jitter: float = 0.1,
        rebalance_window: float | timedelta = 3.0,
        max_tasks: int | None = None,
        max_crashes: int | None = DEFAULT_MAX_CRASHES,
        shutdown_timeout: float | timedelta = 30.0,
        start_timeout: float | timedelta = 30.0,
        handoff_timeout: float | timedelta = 30.0,
        release_backoff: float | timedelta = 1.0,
        release_backoff_max: float | timedelta = 60.0,
        refuse_retry: float | timedelta = 1.0,
        slow_callback: float | timedelta = 0.25,
        http_addr: str | None = None,
        labels: Mapping[str, str] | None = None,
        placement_wait: float | timedelta = 2.0,
        rendezvous_wait: float | timedelta = 0.0,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not isinstance(coordinator, Coordinator):
            raise ConfigError("coordinator must be a metafora Coordinator (see open_coordinator)")
        if not callable(handler_func):
            raise ConfigError("handler_func must be callable: Task -> Handler")
        if max_tasks is not None and (not isinstance(max_tasks, int) or max_tasks < 1):
            raise ConfigError(f"max_tasks must be a positive integer or None, got {max_tasks!r}")
        if max_crashes is not None and (
            not isinstance(max_crashes, int) or isinstance(max_crashes, bool) or max_crashes < 0
        ):
            raise ConfigError(f"max_crashes must be a non-negative integer or None, got {max_crashes!r}")
        if not 0 <= balance_jitter < 1:
            raise ConfigError(f"balance_jitter must be in [0, 1), got {balance_jitter!r}")
        try:
            self._labels = validate_labels(labels or {}, "labels")
        except InvalidProps as exc:
            raise ConfigError(str(exc)) from None
        self._placement_wait = _seconds(placement_wait, "placement_wait", allow_zero=True)
        hold = _seconds(rendezvous_wait, "rendezvous_wait", allow_zero=True)
        self._preference = Preference(coordinator.node_id, hold=hold, max_hold=_MAX_HOLD * hold,
                                      wave=_WAVE)
        # task id -> (until when soft placement holds it back, group tasks running then)
        self._held_back: dict[str, tuple[float, int]] = {}
        self._node_labels: tuple[float, list[dict[str, str]]] | None = None
        self._coord = coordinator
        self._handler_func = handler_func
        self._balancer = balancer if balancer is not None else DumbBalancer()
        self._balance_every = _seconds(balance_every, "balance_every")
        self._balance_jitter = balance_jitter
        self._rebalance_window = _seconds(rebalance_window, "rebalance_window", allow_zero=True)
        self._max_tasks = max_tasks
        self._max_crashes = max_crashes or None
        self._shutdown_timeout = _seconds(shutdown_timeout, "shutdown_timeout", allow_zero=True)
        self._start_timeout = _seconds(start_timeout, "start_timeout", allow_zero=True)
        self._handoff_timeout = _seconds(handoff_timeout, "handoff_timeout", allow_zero=True)
        self._release_backoff = _seconds(release_backoff, "release_backoff", allow_zero=True)
        self._release_backoff_max = _seconds(release_backoff_max, "release_backoff_max", allow_zero=True)
        self._refuse_retry = _seconds(refuse_retry, "refuse_retry")
        self._clock = clock or SYSTEM_CLOCK
        self._rng = rng or random.Random()
        self._log = _NodeLog(log, {"node": coordinator.node_id})
        if http_addr is not None:
            parse_addr(http_addr)  # a bad address is a ConfigError now, not at run()
        self._http_addr = http_addr
        self._http: InfoServer | None = None
        self.stats = ConsumerStats()
        # Any node may materialise due ticks of periodic schedules (metafora.schedule).
        self._scheduler = Scheduler(coordinator, self._clock, logger=self._log)
        self._started_at: datetime | None = None

        self._lock = threading.RLock()
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._running: dict[str, _Running] = {}
        self._ignores = _Ignores()
        self._deferred = _Deferred()
        self._releases: dict[str, int] = {}
        self._lost_early: dict[str, int] = {}
        self._finishing: set[_Running] = set()
        self._frozen = False
        self._started = False
        self._run_thread: threading.Thread | None = None
        self._runner = HandlerRunner(coordinator.node_id,
                                     slow_callback=_seconds(slow_callback, "slow_callback"),
                                     on_fatal=self._fail_fast)
        self._side_threads: list[threading.Thread] = []
        self._fatal: BaseException | None = None
        self._timeout_override: float | None = None
        self._next_balance = 0.0
        # Handlers' outcomes are group-committed by one writer thread (see metafora.outcomes).
        self._outcomes = OutcomeWriter(coordinator, retry_max=_FINISH_RETRY_MAX, clock=self._clock,
                                       on_retry=self._outcome_retry)
        # Offers approved by the balancer are claimed this many per claim_many call.
        self._claim_burst = max(1, int(getattr(coordinator, "claim_burst", 32)))
        self._members: set[str] | None = None  # active nodes at the last membership event
        self._leaving_announced = False
        self._follow_up = False  # a membership balance is followed by one settling balance
        self._handoffs: dict[str, tuple[float, _Running]] = {}  # releases asked, by deadline
        self._let_go: list[Task] = []  # released by handlers during shutdown, not yet written

    # -- public surface -------------------------------------------------------------

    @property
    def node_id(self) -> str:
        """This node's id (from the coordinator)."""
        return self._coord.node_id

    @property
    def labels(self) -> Mapping[str, str]:
        """This node's placement labels (a copy)."""
        return dict(self._labels)

    @property
    def frozen(self) -> bool:
        """Whether the node is frozen (claims nothing new; balance and stop_task still work)."""
        return self._frozen

    def tasks(self) -> list[RunningTask]:
        """The tasks running on this node, oldest first."""
        with self._lock:
            entries = [e.view() for e in self._running.values()]
        return sorted(entries, key=lambda r: r.started)

    def _task_count(self) -> int:
        with self._lock:
            return len(self._running)

    def ignores(self) -> list[str]:
        """Ids of tasks this node ignores for now (refused by the balancer, or released)."""
        with self._lock:
            return [k for k, _ in sorted(self._ignores.items(), key=lambda item: item[1][0])]

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the HTTP endpoints once serving (None when off)."""
        return self._http.address if self._http is not None else None

    def info(self) -> dict[str, Any]:
        """What ``/info`` shows: the node, its state and its running tasks."""
        with self._lock:
            entries = sorted(self._running.values(), key=lambda e: e.started)
            rows = [
                {
                    "id": e.task.id,
                    "token": e.task.token,
                    "started": e.started.isoformat(),
                    "stopped": e.stopped.isoformat() if e.stopped else None,
                    "state": _handler_state(e.handler),
                }
                for e in entries
            ]
            ignores = sorted(k for k, _ in self._ignores.items())
        return {
            "node": self.node_id,
            "store": mask_url(self._coord.name, brief=True),
            "frozen": self._frozen,
            "labels": dict(self._labels),
            "started": self._started_at.isoformat() if self._started_at else None,
            "stopping": self._stopping.is_set(),
            "tasks": rows,
            "ignores": ignores,
            "counters": self.stats.counters(),
        }

    def healthy(self) -> bool:
        """Running and not shutting down (what ``/healthz`` answers)."""
        return self._started_at is not None and not self._stopping.is_set() and self._fatal is None

    def run(self) -> None:
        """Register the node and run until ``shutdown()``. Raises the error that stopped it, if any."""
        with self._lock:
            if self._started:
                raise RuntimeError("Consumer.run() may be called only once")
            self._started = True
            self._run_thread = threading.current_thread()
        try:
            registered = self._register()
        except BaseException:
            self._coord.close()
            self._done.set()
            raise
        if not registered:  # shutdown() while the store was unreachable
            self._coord.close()
            self._done.set()
            return
        self._started_at = self._clock.now()
        self._log.info("consumer %s started on %s", self.node_id, self._coord.name,
                       extra={"action": "start"})
        try:
            self._start_http()
            self._balancer.init(
                BalancerContext(self.node_id, self._coord, self.tasks, self._clock, self._task_count)
            )
            self._start_side_thread("outcomes", self._outcomes.run)
            self._start_side_thread("watch", self._watch)
            pushed = self._listen_membership()
            self._start_side_thread("commands", self._command_feed)
            self._start_side_thread("schedules", self._scheduler.run)
            self._next_balance = self._clock.monotonic() + self._balance_interval()
            if pushed:
                # Joining is a membership change too: the tasks the others release race to
                # their new owners, and this node may take more than its share of them.
                self._next_balance = min(self._next_balance,
                                         self._clock.monotonic() + self._settle_after())
            self._loop()
        except BaseException as exc:
            if self._fatal is None:
                self._fatal = exc
            raise
        finally:
            self._shutdown_sequence()
        if self._fatal is not None:
            raise self._fatal

    def _register(self) -> bool:
        """``Coordinator.init``, waiting up to ``start_timeout`` for an unreachable store.

        Returns False when ``shutdown()`` came first. A node starting beside a store that is
        restarting, or overloaded, waits for it instead of exiting. A retried attempt that
        meets ``NodeExists`` goes on retrying too: the attempt that seemed to fail may have
        registered this node, and that registration expires with its lease.
        """
        deadline = self._clock.monotonic() + self._start_timeout
        pause = 0.1
        retried = False
        while True:
            try:
                self._coord.init(_Context(self))
                return True
            except CoordinatorUnavailable as exc:
                error: MetaforaError = exc
            except NodeExists as exc:
                if not retried:
                    raise
                error = exc
            left = deadline - self._clock.monotonic()
            if left <= 0:
                raise error
            self._log.warning("cannot register on %s yet (%s); retrying for up to %.0fs",
                              mask_url(self._coord.name, brief=True), error, left,
                              extra={"action": "start"})
            if self._clock.wait(self._stopping, min(pause * self._rng.uniform(0.8, 1.2), left)):
                return False
            pause = min(pause * 2, 5.0)
            retried = True

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop claiming, stop every handler, wait up to ``timeout`` s, release, deregister.

        Safe from any thread, including a signal handler in the thread running ``run()``
        (then it only starts the shutdown and returns). A handler that ignores ``stop()`` is
        abandoned after the timeout with an error log; shutdown never hangs.
        """
        if timeout is not None:
            self._timeout_override = _seconds(timeout, "timeout", allow_zero=True)
        self._stopping.set()
        self._wake.set()
        with self._lock:
            started = self._started
            self._started = True  # a run() after shutdown() must not start
        if not started:
            self._coord.close()
            self._done.set()
            return
        if threading.current_thread() is self._run_thread:
            return
        limit = (self._timeout_override or self._shutdown_timeout) + 30.0
        if not self._done.wait(limit):
            self._log.error("consumer %s did not finish shutting down within %.0fs",
                            self.node_id, limit, extra={"action": "shutdown"})

    def _start_http(self) -> None:
        if self._http_addr is None:
            return
        self._http = InfoServer(
            self._http_addr,
            self.info,
            lambda: render_metrics(self.node_id, self.stats, len(self._running)),
            self.healthy,
        )
        self._http.start()
        self._log.info("serving /info, /metrics, /healthz on http://%s", self._http.address,
                       extra={"action": "http"})

    # -- side threads ---------------------------------------------------------------

    def _start_side_thread(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(
            target=self._supervised, args=(name, target),
            name=f"metafora-{name}-{self.node_id}", daemon=True,
        )
        self._side_threads.append(thread)
        thread.start()

    def _supervised(self, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except CoordinatorClosed:
            if not self._stopping.is_set():
                self._fail_fast(name, CoordinatorClosed(f"coordinator closed under the {name} loop"))
        except BaseException as exc:
            if not self._stopping.is_set():
                self._fail_fast(name, exc)
        else:
            if not self._stopping.is_set() and name == "watch":
                self._fail_fast(name, MetaforaError("the coordinator's watch returned unexpectedly"))

    def _fail_fast(self, name: str, exc: BaseException) -> None:
        self._log.error("the %s loop of consumer %s died; shutting down: %s", name,
                        self.node_id, exc, exc_info=exc, extra={"action": "fatal"})
        with self._lock:
            if self._fatal is None:
                self._fatal = exc
        self._stopping.set()
        self._wake.set()

    def _watch(self) -> None:
        self._coord.watch(lambda task: self._post("offer", task))

    def _command_feed(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                command = self._coord.command(timeout=1.0)
            except CoordinatorClosed:
                raise
            except MetaforaError as exc:  # unreachable, or an odd store error: back off, retry
                self._log.warning("cannot read commands: %s", exc, extra={"action": "command"})
                self._clock.wait(self._stopping, backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            if command is not None:
                self._post("command", command)

    def _post(self, kind: str, payload: Any) -> None:
        self._events.put((kind, payload))
        if not self._wake.is_set():  # set() takes a lock: 100,000 offers paid it each
            self._wake.set()

    # -- the loop -------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._drain()
            if self._stopping.is_set():
                break
            now = self._clock.monotonic()
            self._expire_ignores(now)
            self._release_held(now)
            self._expire_handoffs(now)
            if now >= self._next_balance:
                self._balance()
                self._next_balance = now + self._balance_interval()
                if self._follow_up:
                    # Released tasks race to new owners; a node at its share may take one
                    # too many. One more look once they settled, not a whole period later.
                    self._follow_up = False
                    self._next_balance = min(self._next_balance, now + self._settle_after())
            deadline = self._next_balance
            held_due = self._preference.next_due()
            if held_due is not None:
                deadline = min(deadline, held_due)
            with self._lock:
                ignore_due = self._ignores.next_due()
                if ignore_due is not None:
                    deadline = min(deadline, ignore_due)
                if self._handoffs:
                    deadline = min(deadline, *(d for d, _ in self._handoffs.values()))
            if self._events.empty():
                self._clock.wait(self._wake, max(0.0, deadline - self._clock.monotonic()))

    def _drain(self) -> None:
        # Bounded per pass so ignore deadlines and balance ticks are not starved by a flood.
        batch: list[tuple[str, Any]] = []
        for _ in range(1000):
            try:
                batch.append(self._events.get_nowait())
            except queue.Empty:
                break
        else:
            self._wake.set()  # more left: come back after deadlines are checked
        offers = [p for k, p in batch if k == "offer"]
        # Every node hears the same offers in the same order; shuffling them makes nodes
        # try different tasks first, so fewer claims are lost to a race (one round trip each).
        self._rng.shuffle(offers)
        # Higher priority first; the sort is stable, so each priority stays shuffled.
        offers.sort(key=_by_priority)
        room = False
        for kind, payload in batch:
            if self._stopping.is_set():
                return
            if kind == "command":
                self._command(payload)
            elif kind in ("finished", "room"):
                room = True  # once per drain, not once per finished task
            elif kind == "members":
                self._members_changed()
        if room:
            self._retry_deferred()
        # A wave: this node tries its own share first and holds the others' share back.
        self._offer(*self._preference.split(offers, self._clock.monotonic()))

    def _release_held(self, now: float) -> None:
        """Offers held back for their preferred node that are due: try those still claimable.

        Most were taken meanwhile: a coordinator that can tell which are left in one read
        (``claimable``, SQL) saves a claim attempt on each of the others.
        """
        due = self._preference.due(now, 1000)  # bounded per pass, as a drain is
        claimable = getattr(self._coord, "claimable", None)
        if due and claimable is not None:
            try:
                due = claimable(due)
            except CoordinatorClosed:
                raise
            except MetaforaError as exc:  # then try them all: a claim skips the taken ones
                self._log.warning("could not check %d held-back offers: %s", len(due), exc,
                                  extra={"action": "claim"})
        if due:
            self._offer(*due)

    # -- membership events -------------------------------------------------------------

    def _listen_membership(self) -> bool:
        try:
            self._members = set(self._coord.active_task_count())
            self._preference.members(self._members)
        except MetaforaError as exc:  # only the first diff is less precise
            self._log.warning("could not read the cluster's nodes: %s", exc,
                              extra={"action": "members"})
        if not self._coord.listen_membership(lambda: self._post("members", None)):
            self._log.debug("store %s reports no membership changes: balancing every %.0fs only",
                            mask_url(self._coord.name, brief=True), self._balance_every,
                            extra={"action": "members"})
            return False
        return True

    def _members_changed(self) -> None:
        """A node may have joined, left or announced leaving: see who, then act on it.

        A leave frees orphans, which are claimed at once (the balancer stops refusing after
        its own releases, and offers it refused are tried again); any change schedules a
        balance within the dampening window, unless one is due sooner already.
        """
        try:
            now_members = set(self._coord.active_task_count())
        except MetaforaError as exc:
            self._log.warning("could not read the cluster's nodes: %s", exc,
                              extra={"action": "members"})
            return
        before = self._members
        self._members = now_members
        self._preference.members(now_members)
        if before is not None and before == now_members:
            return  # spurious, or already handled
        joined = sorted(now_members - before) if before is not None else []
        left = sorted(before - now_members) if before is not None else []
        self._log.info("cluster membership changed: joined %s, left %s", joined or "-",
                       left or "-", extra={"action": "members"})
        try:
            self._balancer.nodes_changed(bool(left))
        except Exception as exc:
            self._log.exception("balancer failed on nodes_changed: %s", exc,
                                extra={"action": "members"})
        now = self._clock.monotonic()
        if left:
            with self._lock:
                # Offers the balancer refused may be the leaver's orphans: try them now. Our
                # own release back-offs stay (they stop a released task from coming back).
                for task_id, (due, task) in self._ignores.items():
                    if task_id not in self._releases and due > now:
                        self._ignores.put(task, now)
        delay = self._rebalance_window * self._rng.uniform(0.5, 1.0)
        self._next_balance = min(self._next_balance, now + delay)
        self._follow_up = True
        self._wake.set()

    def _settle_after(self) -> float:
        return max(2 * self._rebalance_window, 2.0) * self._rng.uniform(1.0, 1.5)

    def _balance_interval(self) -> float:
        spread = self._balance_jitter * self._balance_every
        return self._balance_every + self._rng.uniform(-spread, spread)

    def _offer(self, *tasks: Task) -> None:
        """The claim pipeline: ignored? -> balancer.can_claim -> claim (batched) -> handler."""
        approved: list[Task] = []
        approved_ids: set[str] = set()
        # Running tasks per spread group, counted once per claim burst (not once per offer).
        spreads: dict[str | None, int] | None = None
        for task in tasks:
            if self._stopping.is_set():
                return
            if task.selector and not matches(task.selector, self._labels):
                continue  # placement: another node's task (the claim would refuse it too)
            with self._lock:
                if task.id in self._running or task.id in approved_ids:
                    continue
                if task.id in self._ignores:
                    self._ignores.keep_offer(task)
                    continue
                slots = self._free_slots()
                if self._frozen or (slots is not None and slots <= 0):
                    self._deferred.put(task)
                    continue
            if task.spread is not None and spreads is None:
                with self._lock:
                    spreads = collections.Counter(e.task.spread for e in self._running.values())
            wait = self._hold_back(task, approved, spreads)
            if wait is not None:
                self._ignore(task, wait)
                continue
            try:
                ok, until = self._balancer.can_claim(task)
            except Exception as exc:
                self._log.exception("balancer failed on can_claim(%s): %s", task.id, exc,
                                    extra={"task": task.id, "action": "can_claim"})
                ok, until = False, None
            if not ok:
                self._ignore(task, until)
                continue
            approved.append(task)
            approved_ids.add(task.id)
            burst = self._claim_burst if slots is None else min(self._claim_burst,
                                                                 slots * _OVERFETCH)
            if len(approved) >= burst:
                self._claim(approved, len(approved) if slots is None else slots)
                approved = []
                approved_ids.clear()
                spreads = None  # the burst started handlers: count again when next needed
        if approved:
            with self._lock:
                slots = self._free_slots()
            self._claim(approved, len(approved) if slots is None else max(1, slots))

    def _free_slots(self) -> int | None:
        """Handlers this node may still start (None: no max_tasks). Called holding the lock."""
        if self._max_tasks is None:
            return None
        return self._max_tasks - len(self._running)

    def _hold_back(self, task: Task, approved: list[Task],
                   spreads: Mapping[str | None, int] | None) -> float | None:
        """Seconds to hold ``task`` back for its soft placement, or None to go on claiming.

        ``spread``: a node running ``n`` tasks of the group (``spreads``: running tasks per
        group, counted by the caller) waits ``n * placement_wait``, so
        nodes running fewer take it first; a task of a group another task of this offer wave
        was approved from waits only ``refuse_retry`` (that claim may be lost). ``prefer``: a
        node without the labels waits ``placement_wait`` while a live node has them. Offered
        again after its wait, nobody better placed took it, so this node does: best effort,
        never a task left waiting.
        """
        if (not task.prefer and task.spread is None) or not self._placement_wait:
            return None
        in_wave = task.spread is not None and any(t.spread == task.spread for t in approved)
        running = spreads.get(task.spread, 0) if task.spread is not None and spreads else 0
        now = self._clock.monotonic()
        misplaced = (bool(task.prefer) and not matches(task.prefer, self._labels)
                     and self._preferred_node_live(task.prefer, now))
        held = self._held_back.get(task.id)
        if not (in_wave or running or misplaced):
            self._held_back.pop(task.id, None)
            return None
        if held is not None and now >= held[0] and not in_wave and running <= held[1]:
            del self._held_back[task.id]
            return None
        if held is None or now >= held[0] or running > held[1]:
            if len(self._held_back) > 10_000:  # forget holds long past (tasks taken elsewhere)
                self._held_back = {k: h for k, h in self._held_back.items() if h[0] > now - 60}
            wait = max(running * self._placement_wait, self._placement_wait if misplaced else 0.0)
            held = self._held_back[task.id] = (now + (wait or self._refuse_retry), running)
        return max(0.0, held[0] - now)

    def _preferred_node_live(self, prefer: Mapping[str, str], now: float) -> bool:
        """Whether a live node has the ``prefer`` labels (node labels cached for 5 s)."""
        cached = self._node_labels
        if cached is None or now - cached[0] > 5.0:
            try:
                cached = self._node_labels = (now, list(self._coord.node_labels().values()))
            except MetaforaError:
                return True  # unsure: hold back once, as if one did
        return any(matches(prefer, labels) for labels in cached[1])

    def _ignore(self, task: Task, until: datetime | float | None) -> None:
        if until is None:
            delay = self._refuse_retry
        elif isinstance(until, datetime):
            delay = (until - self._clock.now()).total_seconds()
        else:
            delay = until
        with self._lock:
            self._ignores.put(task, self._clock.monotonic() + max(0.0, delay))
        self._wake.set()

    def _expire_ignores(self, now: float) -> None:
        with self._lock:
            due = self._ignores.pop_due(now)
        due.sort(key=_by_priority)
        self._offer(*due)

    def _redo_deferred(self) -> None:
        """Re-offer deferred tasks, a few per free slot (highest priority first, then
        oldest; see ``_OVERFETCH``).

        Not the whole map: with a backlog far beyond ``max_tasks`` that would re-walk it
        after every finished task (quadratic). Slots still free after a round (offers refused
        or lost to a race) take another round; the map shrinks every round (offers go back
        only when a claim filled every free slot, which ends the rounds).
        """
        while True:
            with self._lock:
                if self._frozen or not self._deferred or self._stopping.is_set():
                    return
                slots = self._free_slots()
                if slots is not None and slots <= 0:
                    return
                waiting = self._deferred.take(None if slots is None else slots * _OVERFETCH)
            self._offer(*waiting)

    def _claim(self, tasks: list[Task], limit: int) -> None:
        began = SYSTEM_CLOCK.monotonic()
        try:
            with tracing.claim_span(self.node_id, len(tasks)) as span:
                claimed = self._coord.claim_many(tasks, limit)
                span.set_attribute("metafora.claimed", len(claimed))
        except CoordinatorClosed:
            raise
        except MetaforaError as exc:  # one failed claim must not take the node down
            self._log.warning("claiming %d task(s) failed, will retry: %s", len(tasks), exc,
                              extra={"action": "claim"})
            for task in tasks:
                self._ignore(task, self._refuse_retry)
            return
        self.stats.claim_latency.observe(SYSTEM_CLOCK.monotonic() - began)
        if len(claimed) < limit:  # every offer was tried: those not won went to others
            self.stats.incr("races_lost", len(tasks) - len(claimed))
        elif len(claimed) < len(tasks):
            # The limit was reached: offers past it may not have been tried. Defer them again
            # (a slot freeing up re-offers them); stale ones drop out once a claim tries all.
            won = {t.id for t in claimed}
            with self._lock:
                for task in tasks:
                    if task.id not in won:
                        self._deferred.put(task, replace=False)
        for task in claimed:
            self._start(task)
        with self._lock:
            room = bool(self._deferred) and (
                self._max_tasks is None or len(self._running) < self._max_tasks
            )
        if room:
            # Offers met while this batch filled the free slots were deferred. The tasks we
            # did not win (or did not start) leave slots free, and no handler may ever finish
            # to retry the deferred offers: retry them now (through the loop, not recursively).
            self._post("room", None)

    def _start(self, claimed: Task) -> None:
        self.stats.incr("claims")
        extra = {"task": claimed.id, "token": claimed.token, "action": "claim"}
        with self._lock:
            lost_early = self._lost_early.pop(claimed.id, None) == claimed.token
        if lost_early or not self._coord.holds(claimed):
            # Lost between the claim and now (e.g. the process was paused): do not start.
            self.stats.incr("lost")
            self._log.warning("claim on task %s (token %d) was lost before its handler started",
                              claimed.id, claimed.token, extra=extra)
            with self._lock:
                self._back_off(claimed)
            try:  # in case only our view was stale: never keep a claim nobody runs
                self._coord.release(claimed)
            except MetaforaError:
                pass  # lost for real: the store already freed it
            return
        try:
            handler = self._handler_func(claimed)
        except Exception as exc:
            self._log.exception("handler_func failed for task %s", claimed.id, extra=extra)
            self._write(Finish(claimed, Outcome.FAIL, error_text(exc)),
                        lambda result: self._recorded(Outcome.FAIL, claimed, result))
            return
        entry = _Running(claimed, handler, self._clock.now())
        with self._lock:
            self._running[claimed.id] = entry
        self._log.info("claimed task %s (token %d)", claimed.id, claimed.token, extra=extra)
        run = self._runner.start(
            f"metafora-task-{claimed.id}", handler,
            lambda result, error, span: self._finish(entry, result, error, span),
            lambda: tracing.run_span(claimed.id, claimed.token, self.node_id, claimed.props),
        )
        with self._lock:
            entry.run = run
            stopped, lost = entry.stopped is not None, entry.lost
        if stopped:  # a stop or a lost claim came while it was starting
            self._stop_handler(entry, cancel=lost)

    def _command(self, command: cmds.Command) -> None:
        extra = {"action": f"command:{command.name}"}
        self._log.info("command %s %s", command.name, dict(command.params), extra=extra)
        if command.name in (cmds.FREEZE, cmds.UNFREEZE):
            self._frozen = command.name == cmds.FREEZE
            try:
                self._coord.report_frozen(self._frozen)
            except MetaforaError as exc:
                self._log.warning("could not publish frozen=%s: %s", self._frozen, exc, extra=extra)
            if not self._frozen:
                self._redo_deferred()
        elif command.name == cmds.BALANCE:
            self._balance()
        elif command.name == cmds.STOP_TASK:
            if not self._request_release(str(command.params["task"])):
                self._log.warning("stop_task: task %s is not running here", command.params["task"],
                                  extra=extra)
        else:  # a newer peer's command: ignore, never crash
            self._log.warning("ignoring unknown command %r", command.name, extra=extra)

    def _balance(self) -> None:
        try:
            ids = self._balancer.balance()
        except Exception as exc:
            self._log.exception("balancer failed: %s", exc, extra={"action": "balance"})
            return
        for task_id in ids:
            self._request_release(task_id)

    def _request_release(self, task_id: str) -> bool:
        with self._lock:
            entry = self._running.get(task_id)
            if entry is None or entry.stopped is not None:
                return entry is not None
            entry.stopped = self._clock.now()
            due = self._clock.monotonic() + self._handoff_timeout
            self._handoffs[task_id] = (due, entry)
        self._stop_handler(entry)
        return True

    def _expire_handoffs(self, now: float) -> None:
        """Handlers asked to give their task up that did not return within the handoff
        timeout: abandon them and release the claim, so the task moves anyway."""
        with self._lock:
            due = [e for d, e in self._handoffs.values() if d <= now]
            late = []
            for entry in due:
                del self._handoffs[entry.task.id]
                if entry.returned.is_set() or entry.lost:
                    continue
                entry.abandoned = True  # read under the lock by _finish: it writes nothing
                if self._running.get(entry.task.id) is entry:
                    del self._running[entry.task.id]
                self._back_off(entry.task)
                late.append(entry)
        for entry in late:
            extra = {"task": entry.task.id, "token": entry.task.token, "action": "abandon"}
            self._log.error("handler of task %s did not return within the handoff timeout "
                            "(%.1fs); abandoning it and releasing the task", entry.task.id,
                            self._handoff_timeout, extra=extra)
            if entry.run is not None:
                self._runner.cancel([entry.run])
            self._write(Finish(entry.task, Outcome.RELEASE),
                        functools.partial(self._recorded, Outcome.RELEASE, entry.task))

    def _stop_handler(self, entry: _Running, *, cancel: bool = False) -> None:
        """Deliver stop() (and, for an async handler of a lost claim, cancellation)."""
        run = entry.run
        if run is None:
            return  # still starting: _start stops it once it has a run
        self._runner.stop([run])
        if cancel:
            self._runner.cancel([run])

    def _lost(self, task: Task) -> None:
        with self._lock:
            entry = self._running.get(task.id)
            if entry is None:
                # Possibly claimed but not started yet: _start checks this before starting.
                self._lost_early[task.id] = task.token
                if len(self._lost_early) > 10_000:
                    self._lost_early.pop(next(iter(self._lost_early)))
                return
            if task.token and task.token != entry.task.token:
                return
            entry.lost = True
            self.stats.incr("lost")
            if entry.stopped is None:
                entry.stopped = self._clock.now()
        self._log.warning("lost the claim on task %s (token %d); stopping its handler",
                          task.id, entry.task.token,
                          extra={"task": task.id, "token": entry.task.token, "action": "lost"})
        # An async handler is cancelled too: nothing it does from now on can be written.
        self._stop_handler(entry, cancel=True)

    # -- handler outcomes ---------------------------------------------------------------

    def _finish(self, entry: _Running, result: bool | None, error: BaseException | None,
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
                self._log.error("handler of task %s raised: %s", entry.task.id, error,
                                exc_info=error, extra={"task": entry.task.id,
                                                       "token": entry.task.token, "action": "fail"})
        stopping = self._stopping.is_set()
        with self._lock:
            if self._running.get(entry.task.id) is entry:
                del self._running[entry.task.id]
            self._finishing.add(entry)  # shutdown waits for its outcome to be written
            entry.returned.set()
            skip = entry.lost or entry.abandoned
            if stopping:
                pass  # no more claims: back-offs would only cost time with 10,000 handlers
            elif outcome is Outcome.RELEASE or entry.lost:
                # Back off before the store sees the release, so its offer is ignored.
                self._back_off(entry.task)
            else:
                self._releases.pop(entry.task.id, None)
        if span is not None:
            span.set_attribute("metafora.outcome", "lost" if entry.lost else outcome.value)
        if not stopping and self._max_tasks is not None:
            # The slot is free now, not when the outcome is written: claims for it overlap
            # the group commit instead of waiting for it.
            self._post("room", None)
        # Shutting down: the shutdown sequence releases the claims of returned handlers in
        # batches (finish_many), so thousands of handlers stopping at once do not each wait
        # for a release write, and a handler still blocked does not hold the others' back.
        if skip or (stopping and outcome is Outcome.RELEASE):
            if not skip:
                self.stats.incr(_COUNTER[outcome])
                with self._lock:
                    self._let_go.append(entry.task)
            self._ended(entry, outcome)
            return None
        return lambda: self._queue_outcome(entry, outcome, error)

    def _queue_outcome(self, entry: _Running, outcome: Outcome,
                       error: BaseException | None) -> None:
        """Hand the outcome to the group commit (runs in the run's context, off the loop)."""
        end_span = tracing.start_outcome_span(outcome.value)

        def settle(result: MetaforaError | None) -> None:
            try:
                self._recorded(outcome, entry.task, result)
            finally:
                end_span()
                self._ended(entry, outcome)

        self._write(Finish(entry.task, outcome, None if error is None else error_text(error)),
                    settle)

    def _ended(self, entry: _Running, outcome: Outcome) -> None:
        with self._lock:
            self._finishing.discard(entry)
        entry.finished.set()
        if not self._stopping.is_set():
            self._post("finished", (entry.task, outcome))

    def _abandon(self, entries: list[_Running], timeout: float) -> None:
        """Handlers that ignored stop() until the deadline: cancel (async) or abandon (thread).

        Their claims are released by the coordinator's close(), with every other claim left.
        """
        with self._lock:
            late = [e for e in entries if not e.returned.is_set()]
            for entry in late:
                entry.abandoned = True  # read under the lock by _finish: it writes nothing
        for entry in late:
            fate = ("cancelling it" if entry.run is not None and entry.run.is_async
                    else "abandoning it (its thread may still run)")
            self._log.error("handler of task %s ignored stop() for %.1fs; %s and releasing the "
                            "task", entry.task.id, timeout, fate,
                            extra={"task": entry.task.id, "token": entry.task.token,
                                   "action": "abandon"})
        self._runner.cancel(e.run for e in late if e.run is not None)

    def _write(self, finish: Finish, settle: Callable[[MetaforaError | None], None]) -> None:
        """Queue an outcome for the group commit; ``settle`` is told how it ended.

        The writer retries while the store is unreachable, until shutdown gives up. After it
        stopped (a handler returning after shutdown), the outcome is written right here.
        """
        if self._outcomes.put(Pending(finish, settle)):
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
            self.stats.incr(_COUNTER[outcome])
            self._log.info("task %s %s", task.id, _PHRASE[outcome], extra=extra)
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

    def _back_off(self, task: Task) -> None:
        count = self._releases.get(task.id, 0) + 1
        self._releases[task.id] = count
        backoff = min(self._release_backoff * 2 ** (count - 1), self._release_backoff_max)
        if backoff > 0:
            self._ignore(task.with_token(0), backoff * self._rng.uniform(0.8, 1.2))

    def _retry_deferred(self) -> None:
        if self._deferred and not self._frozen:
            self._redo_deferred()

    # -- shutdown -------------------------------------------------------------------

    def _release_let_go(self) -> None:
        """Write the releases of handlers that returned during shutdown, in one batch."""
        with self._lock:
            tasks, self._let_go = self._let_go[:_LET_GO_BATCH], self._let_go[_LET_GO_BATCH:]
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

    def _announce_leaving(self) -> None:
        """Tell the cluster this node is going, before its handlers stop (issue #92)."""
        if self._leaving_announced:
            return
        self._leaving_announced = True
        try:
            self._coord.announce_leaving()
        except MetaforaError as exc:
            self._log.warning("could not announce leaving: %s", exc, extra={"action": "shutdown"})

    def _shutdown_sequence(self) -> None:
        self._stopping.set()
        self._announce_leaving()
        self._scheduler.stop()
        timeout = self._timeout_override
        if timeout is None:
            timeout = self._shutdown_timeout
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
            self._release_let_go()
            waiting[0].returned.wait(min(left, _LET_GO_EVERY))
        self._abandon([e for e in entries if not e.returned.is_set()], timeout)
        with self._lock:
            finishing = list(self._finishing)
        for entry in finishing:
            entry.finished.wait(max(0.0, deadline - SYSTEM_CLOCK.monotonic()))
        writing = sum(not e.finished.is_set() for e in finishing)
        if writing:
            self._log.warning("%d handler outcome(s) still being written after %.1fs; the "
                              "store releases those claims on close", writing, timeout,
                              extra={"action": "shutdown"})
        self._outcomes.stop()  # one more try for what is left, then give up
        try:
            self._coord.close()
        except MetaforaError as exc:
            self._log.error("closing the coordinator failed: %s", exc, extra={"action": "close"})
        for thread in self._side_threads:
            thread.join(5.0)
            if thread.is_alive():
                self._log.error("side thread %s did not stop", thread.name,
                                extra={"action": "shutdown"})
        self._runner.close()
        if self._http is not None:
            self._http.close()
        self._log.info("consumer %s stopped", self.node_id, extra={"action": "stop"})
        self._done.set()
