"""The Consumer: claims tasks, runs their handlers, balances and obeys commands.

One serialized loop (:meth:`Consumer._loop`) owns every decision: offers from the
coordinator's watch, commands, balance ticks and ignore deadlines all arrive as typed events
(:mod:`metafora.consumer.events`) on one queue. The loop hands the decisions to the parts:

- :mod:`~metafora.consumer.offers`: which offers to claim, when and in what order;
- :mod:`~metafora.consumer.balancing`: when to balance, and the cluster's membership;
- :mod:`~metafora.consumer.handoff`: releases asked of handlers, claims lost under them;
- :mod:`~metafora.consumer.finishing`: a handler's end and its outcome's write;
- :mod:`~metafora.consumer.shutdown`: the shutdown, in a fixed order.

Handlers are run by :mod:`metafora.consumer.runner` (sync ones each on a thread of their
own, async ones on the node's event loop); their outcomes are group-committed by the writer
of :mod:`metafora.consumer.outcomes`. The watch, the command feed and that writer run in
named side threads whose failure stops the consumer (a node must not keep claiming when its
view of the store is gone).
"""

from __future__ import annotations

import inspect
import logging
import queue
import random
import threading
from collections.abc import Mapping
from typing import Any

from metafora.balancers.fair import FairBalancer
from metafora.consumer.balancing import Rebalancer
from metafora.consumer.capacity import Capacity
from metafora.consumer.cluster_metrics import ClusterGauges
from metafora.consumer.context import PartsContext
from metafora.consumer.events import CommandArrived, Event, Finished, Offer, Signal
from metafora.consumer.finishing import Finisher
from metafora.consumer.handoff import Handoffs
from metafora.consumer.http import InfoServer, render_metrics
from metafora.consumer.launch import Launcher
from metafora.consumer.offers import OfferRouter
from metafora.consumer.options import ConsumerOptions, option_fields
from metafora.consumer.registration import NodeContext, register
from metafora.consumer.risk import RiskWatch
from metafora.consumer.runner import HandlerRunner
from metafora.consumer.running import NodeLog
from metafora.consumer.schedule import Scheduler
from metafora.consumer.shutdown import Shutdown
from metafora.consumer.status import NodeStatus
from metafora.consumer.supervisor import Supervisor, command_feed
from metafora.contracts.balancer import Balancer, BalancerContext, RecentRuns, RunningTask, SelectorKey
from metafora.contracts.binding import Gauges, NodeBinding, bind_handler_func
from metafora.contracts.coordinator import Coordinator
from metafora.contracts.handler import HandlerFunc
from metafora.core import commands as cmds
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.durations import seconds
from metafora.core.errors import (
    ConfigError,
    MetaforaError,
)
from metafora.core.heap import gc_paced
from metafora.core.retention import Pruner

__all__ = ["Consumer"]

# Every part logs as "metafora.consumer", the name this logger had before it was a package.
log = logging.getLogger("metafora.consumer")

_DRAIN_MAX = 1000  # events taken per pass of the loop, so deadlines are not starved


class Consumer:
    """Runs tasks from ``coordinator`` with handlers made by ``handler_func``.

    ``run()`` blocks until ``shutdown()``. The keyword arguments are the options of
    :class:`~metafora.consumer.options.ConsumerOptions`, which documents each of them (the
    defaults are the ``DEFAULT_*`` names of :mod:`metafora.consumer.options`; the signature
    lists them, made from its fields), or ``options=`` one ``ConsumerOptions``, and:

    - ``balancer``: what this node claims and gives back; a :class:`~metafora.balancers.FairBalancer`
      by default (each node near its fair share; ``DumbBalancer()`` never gives back);
    - ``clock``, ``rng``: injectable time and randomness (see :mod:`metafora.testing`).
    """

    # What runs the handlers (a subclass may make its threads fail, as a full process does).
    _runner_class: type[HandlerRunner] = HandlerRunner

    def __init__(
        self,
        coordinator: Coordinator,
        handler_func: HandlerFunc,
        balancer: Balancer | None = None,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        options: ConsumerOptions | None = None,
        **values: Any,
    ) -> None:
        if not isinstance(coordinator, Coordinator):
            raise ConfigError("coordinator must be a metafora Coordinator (see open_coordinator)")
        if not callable(handler_func):
            raise ConfigError("handler_func must be callable: Task -> Handler")
        if options is not None and values:
            raise ConfigError("give the consumer's options as options= or as keyword arguments, not both")
        # ConsumerOptions checks every option (and makes durations seconds).
        self._options = options if options is not None else ConsumerOptions.parse(values)
        self._coord = coordinator
        self._handler_func = handler_func
        self._balancer = balancer if balancer is not None else FairBalancer()
        self._clock = clock or SYSTEM_CLOCK
        self._runs = RecentRuns(clock=self._clock)  # finished runs' times, for the balancer
        self._runs_seen: float | None = None  # the latest run end the balancer was told of
        self._rng = rng or random.Random()
        self._build_parts()

    def _build_parts(self) -> None:
        """The consumer's state shared by its parts (one :class:`PartsContext`), and the parts,
        each given the context and only the other parts it works with."""
        coord, options, clock = self._coord, self._options, self._clock
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        ctx = self._ctx = PartsContext(coord, options, NodeLog(log, {"node": coord.node_id}), self._post,
                                       clock=clock, rng=self._rng)
        self._log, self.stats, self._running, self._lock = ctx.log, ctx.stats, ctx.running, ctx.lock
        self._wake, self._stopping, self._done = ctx.wake, ctx.stopping, ctx.done
        self._http: InfoServer | None = None
        # A handler func that needs the node (streams, gates, a Router) is bound to it once.
        self._gauges: list[Gauges] = []
        self._handler_func = bind_handler_func(self._handler_func,
                                               NodeBinding(coord, self.stats, self._gauges.append))
        # Any node may materialise due ticks of periodic schedules (metafora.consumer.schedule).
        self._scheduler = Scheduler(coord, clock, logger=self._log, on_error=self.stats.loop_error)
        # Any node may take the prune turn of the retention policy (metafora.core.retention).
        self._pruner = Pruner(coord, clock, interval=options.prune_every, logger=self._log,
                              on_error=self.stats.loop_error)
        self._cluster = ClusterGauges(coord, clock, logger=self._log, on_error=self.stats.loop_error)
        self._started = False
        self._supervisor = Supervisor(coord.node_id, stopping=self._stopping, wake=self._wake,
                                      log=self._log, clock=clock, on_error=self.stats.loop_error)
        self._timeout_override: float | None = None
        self._runner = self._runner_class(coord.node_id, slow_callback=options.slow_callback,
                                          on_fatal=self._supervisor.fail_fast)
        self._risk = RiskWatch(ctx)
        capacity = Capacity(max_tasks=options.max_tasks, thread_cap=options.thread_cap,
                            busy_threads=lambda: self._runner.busy_threads,
                            monotonic=clock.monotonic, log=self._log)
        self._offers = offers = OfferRouter(ctx, self._balancer, capacity=capacity)
        self._finisher = Finisher(ctx, capacity=capacity, back_off=offers.back_off,
                                  forget_releases=offers.forget_releases, ran=self._runs.add)
        offers.fuse_outcomes(self._finisher.writer)  # claims take queued outcomes along
        self._handoffs = Handoffs(ctx, runner=self._runner, back_off=offers.back_off,
                                  record=self._finisher.record)
        self._balancing = Rebalancer(ctx, self._balancer, offers=offers,
                                     release=self._handoffs.request_release)
        self._launcher = Launcher(ctx, self._handler_func, runner=self._runner, capacity=capacity,
                                  handoffs=self._handoffs, finisher=self._finisher,
                                  back_off=offers.back_off, risk=self._risk)
        offers.starts_with(self._launcher.start)
        self._status = NodeStatus(ctx, offers=offers, supervisor=self._supervisor)
        self._shutdown = Shutdown(ctx, runner=self._runner, finisher=self._finisher)
        self._node = NodeContext(ctx, handoffs=self._handoffs, risk=self._risk, capacity=capacity)

    # -- public surface -------------------------------------------------------------

    @property
    def node_id(self) -> str:
        """This node's id (from the coordinator)."""
        return self._coord.node_id

    @property
    def labels(self) -> Mapping[str, str]:
        """This node's placement labels (a copy)."""
        return dict(self._options.labels)

    @property
    def weight(self) -> float:
        """This node's weight: its fair share of the work is proportional to it."""
        return self._options.weight

    @property
    def frozen(self) -> bool:
        """Whether the node is frozen: it claims nothing new and its periodic and membership
        balances release nothing (the ``balance`` command and ``stop_task`` still act)."""
        return self._offers.frozen

    def tasks(self) -> list[RunningTask]:
        """The tasks running on this node, oldest first."""
        with self._lock:
            entries = [e.view() for e in self._running.values()]
        return sorted(entries, key=lambda r: r.started)

    def _task_count(self) -> int:
        # Offers approved and not yet claimed count: a wave approves a burst before claiming
        # it, and the balancer must not approve a whole wave against the same count.
        with self._lock:
            return len(self._running) + self._offers.approved

    def _held_selectors(self) -> frozenset[SelectorKey]:
        # The map's tally: O(distinct selectors), where tasks() is O(tasks held).
        with self._lock:
            return self._running.selectors()

    def ignores(self) -> list[str]:
        """Ids of tasks this node ignores for now (refused by the balancer, or released)."""
        with self._lock:
            return [k for k, _ in sorted(self._offers.ignores.items(), key=lambda item: item[1][0])]

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the HTTP endpoints once serving (None when off)."""
        return self._http.address if self._http is not None else None

    def info(self) -> dict[str, Any]:
        """What ``/info`` shows: the node, its state and its running tasks."""
        return self._status.info()

    def healthy(self) -> bool:
        """Alive: running, its loop and side threads unfailed, through a graceful shutdown
        too (what ``/healthz`` answers)."""
        return bool(self.probes()["alive"])

    def ready(self) -> bool:
        """Ready for work: registered, its lease fresh, not shutting down (``/readyz``)."""
        return bool(self.probes()["ready"])

    def probes(self) -> dict[str, Any]:
        """What the probes check, as ``/healthz`` and ``/readyz`` show it (no I/O).

        ``alive``: started, no side thread failed, and the run loop not ended; ``ready``:
        alive, registered, not shutting down, and the lease fresh (``lease_left_s``: seconds
        to the node's fencing deadline by its own clock; None on a store without leases).
        """
        return self._status.probes()

    def run(self) -> None:
        """Register the node and run until ``shutdown()``. Raises the error that stopped it, if any."""
        with self._lock:
            if self._started:
                raise RuntimeError("Consumer.run() may be called only once")
            self._started = True
            self._status.run_thread = threading.current_thread()
        try:
            registered = register(self._node, self._ctx)
        except BaseException:
            self._coord.close()
            self._done.set()
            raise
        if not registered:  # shutdown() while the store was unreachable
            self._coord.close()
            self._done.set()
            return
        self._status.started_at = self._clock.now()
        self._log.info("consumer %s started on %s", self.node_id, self._coord.name,
                       extra={"action": "start"})
        with gc_paced():  # its tasks in flight would cost a full heap walk per ~1,300 tasks
            self._serve()
        if self._supervisor.fatal is not None:
            raise self._supervisor.fatal

    def _serve(self) -> None:
        """The node's side threads and its loop, then the shutdown sequence."""
        try:
            self._start_http()
            self._balancer.init(BalancerContext(self.node_id, self._coord, self.tasks, self._clock,
                                                self._task_count, runs=self._runs,
                                                selector_source=self._held_selectors))
            self._supervisor.start("outcomes", self._finisher.writer.run)
            self._supervisor.start("watch", self._watch)
            pushed = self._balancing.listen(self._post)
            self._supervisor.start("commands", self._command_feed)
            # Background loops: an error is logged, counted and retried, never the node's end.
            self._supervisor.start("schedules", self._scheduler.run, background=True)
            self._supervisor.start("prune", self._pruner.run, background=True)
            if self._http is not None:
                self._supervisor.start("cluster-metrics", self._cluster.run, background=True)
            self._supervisor.start("risk", self._risk.run, background=True)
            self._balancing.schedule_first(pushed)
            self._status.serving = True
            self._loop()
        except BaseException as exc:
            self._supervisor.keep(exc)
            raise
        finally:
            self._shutdown_sequence()

    def shutdown(self, timeout: float | None = None, *, leaving: bool = False) -> None:
        """Stop claiming, stop every handler, wait up to ``timeout`` s, release, deregister.

        With an explicit node id and ``sticky_for``, the released tasks are held for this
        node id for that window (a restart under the same id takes them back);
        ``leaving=True`` says the node is not coming back (a scale-down): its tasks go to
        the others at once. Safe from any thread, including a signal handler in the thread
        running ``run()`` (then it only starts the shutdown and returns). A handler that
        ignores ``stop()`` is abandoned after the timeout with an error log; shutdown never
        hangs.
        """
        if leaving:
            self._shutdown.leaving = True
        if timeout is not None:
            self._timeout_override = seconds(timeout, "timeout", allow_zero=True)
        self._stopping.set()
        self._wake.set()
        with self._lock:
            started = self._started
            self._started = True  # a run() after shutdown() must not start
        if not started:
            self._coord.close()
            self._done.set()
            return
        if threading.current_thread() is self._status.run_thread:
            return
        limit = (self._timeout_override or self._options.shutdown_timeout) + 30.0
        if not self._done.wait(limit):
            self._log.error("consumer %s did not finish shutting down within %.0fs",
                            self.node_id, limit, extra={"action": "shutdown"})

    def _start_http(self) -> None:
        if self._options.http_addr is None:
            return
        self._http = InfoServer(self._options.http_addr, self.info,
                                lambda: render_metrics(self.node_id, self.stats, len(self._running),
                                                       pruned=self._pruner.pruned,
                                                       cluster=self._cluster.last,
                                                       gauges=self._handler_gauges()),
                                self.probes)
        self._http.start()
        self._log.info("serving /info, /metrics, /healthz, /readyz on http://%s", self._http.address,
                       extra={"action": "http"})

    def _handler_gauges(self) -> dict[str, tuple[str, float]]:
        """Node-level gauges the handler func registered (``metafora_stream_lag``); a source
        that fails is logged and left out."""
        found: dict[str, tuple[str, float]] = {}
        for source in self._gauges:
            try:
                found.update(source())
            except Exception:  # a metrics scrape must not fail on a handler's bug
                self._log.exception("the handler's gauges failed", extra={"action": "metrics"})
        return found

    # -- side threads ---------------------------------------------------------------

    def _watch(self) -> None:
        self._coord.watch(lambda task: self._post(Offer(task)))

    def _command_feed(self) -> None:
        command_feed(self._coord, stopping=self._stopping, clock=self._clock, post=self._post,
                     log=self._log)

    def _post(self, event: Event) -> None:
        self._events.put(event)
        if not self._wake.is_set():  # set() takes a lock: paid once per offer otherwise
            self._wake.set()

    # -- the loop -------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._drain()
            if self._stopping.is_set():
                break
            now = self._clock.monotonic()
            self._offers.expire_ignores(now)
            self._offers.release_held(now)
            self._handoffs.expire(now)
            self._balancing.tick(now)
            deadline = self._balancing.next_balance
            offer_due = self._offers.next_due()
            if offer_due is not None:
                deadline = min(deadline, offer_due)
            with self._lock:
                handoff_due = self._handoffs.next_due()
            if handoff_due is not None:
                deadline = min(deadline, handoff_due)
            if self._events.empty():
                self._clock.wait(self._wake, max(0.0, deadline - self._clock.monotonic()))

    def _drain(self) -> None:
        # Bounded per pass so ignore deadlines and balance ticks are not starved by a flood.
        batch: list[Event] = []
        for _ in range(_DRAIN_MAX):
            try:
                batch.append(self._events.get_nowait())
            except queue.Empty:
                break
        else:
            self._wake.set()  # more left: come back after deadlines are checked
        offers = [e.task for e in batch if isinstance(e, Offer)]
        self._offers.arrange(offers)
        room = ended = False
        for event in batch:
            if self._stopping.is_set():
                return
            if isinstance(event, CommandArrived):
                self._command(event.command)
            elif event is Signal.MEMBERS:
                self._balancing.members_changed()
            elif event is Signal.ROOM or isinstance(event, Finished):
                room = True  # once per drain, not once per finished task
                if isinstance(event, Finished):
                    ended = True  # its run time is in self._runs already (see Finisher)
                    if event.task.group is not None:
                        self._offers.group_freed(event.task.group)
        if room:
            self._offers.retry_deferred()
        latest = self._runs.latest()
        if ended or latest != self._runs_seen:
            # A run ended (its Finished event may still be queued behind offers): ask now,
            # before this batch's offers are judged, whether refused offers may be retried.
            self._runs_seen = latest
            self._balancing.tasks_ended()
        self._offers.offer_wave(offers)

    def _command(self, command: cmds.Command) -> None:
        extra = {"action": f"command:{command.name}"}
        self._log.info("command %s %s", command.name, dict(command.params), extra=extra)
        if command.name in (cmds.FREEZE, cmds.UNFREEZE):
            self._offers.freeze(frozen := command.name == cmds.FREEZE)
            try:
                self._coord.report_frozen(frozen)
            except MetaforaError as exc:
                self._log.warning("could not publish frozen=%s: %s", frozen, exc, extra=extra)
            if not frozen:
                self._offers.redo_deferred()
        elif command.name == cmds.BALANCE:
            self._balancing.balance()
        elif command.name == cmds.STOP_TASK:
            if not self._handoffs.request_release(str(command.params["task"])):
                self._log.warning("stop_task: task %s is not running here", command.params["task"],
                                  extra=extra)
        else:  # a newer peer's command: ignore, never crash
            self._log.warning("ignoring unknown command %r", command.name, extra=extra)

    # -- shutdown -------------------------------------------------------------------

    def _shutdown_sequence(self) -> None:
        """Stop in a fixed order (see :mod:`metafora.consumer.shutdown`), then close up."""
        self._stopping.set()
        self._risk.close()
        self._shutdown.announce_leaving()
        # Sticky return is for a graceful stop: a node ending on a fatal error (an Exception;
        # not Ctrl-C) holds nothing, or a crash loop would keep its tasks from everyone.
        crashed = isinstance(self._supervisor.fatal, Exception)
        self._shutdown.hold_releases(0.0 if crashed else self._options.sticky_for)
        self._scheduler.stop()
        self._pruner.stop()
        self._cluster.stop()
        timeout = self._timeout_override
        if timeout is None:
            timeout = self._options.shutdown_timeout
        deadline = self._shutdown.stop_handlers(timeout)
        self._shutdown.wait_outcomes(deadline, timeout)
        self._shutdown.close_store()
        self._supervisor.join()
        self._runner.close()
        if self._http is not None:
            self._http.close()
        self._log.info("consumer %s stopped", self.node_id, extra={"action": "stop"})
        self._done.set()


# What the keyword argument of an option of this kind takes (the field keeps it normalised).
_ANNOTATIONS = {"seconds": "float | timedelta", "labels": "Mapping[str, str] | None"}


def _signature() -> inspect.Signature:
    """``Consumer.__init__``'s signature with every option a keyword argument at its default
    (made from the options' fields, so help() and editors list them as before)."""
    init = inspect.signature(Consumer.__init__)
    keyword = inspect.Parameter.KEYWORD_ONLY
    made = [inspect.Parameter(f.name, keyword, default=None if f.name == "labels" else f.default,
                              annotation=_ANNOTATIONS.get(f.metadata["kind"], f.type))
            for f in option_fields()]
    params = [p for p in init.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return init.replace(parameters=[*params[:4], *made, *params[4:]])


Consumer.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
