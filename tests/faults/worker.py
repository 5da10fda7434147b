"""The consumer process of the campaign: a Consumer whose handlers do fenced writes.

:func:`worker_main` is the target of a ``spawn`` process (gRPC and fork do not mix). Its
handler (:class:`LedgerHandler`) writes the task's state through the fenced state store
(:func:`metafora.statemachine.store.state_store_for`) several times, pacing the writes, and
records every start, end and write outcome in the :class:`~tests.faults.ledger.Ledger`.

``WorkerSpec.broken`` builds a broken consumer on purpose, for the campaign's negative
controls (each shows that one checker fires; never used outside tests/faults/):

- ``unfenced``: handlers ignore ``stop()`` and write without the fenced store (stale writes).
- ``no_self_fence``: nothing tells a handler its claim is gone (no ``stop()``, writes unfenced):
  a cut goes unnoticed.
- ``lose``: tasks whose id ends in ``3`` are reported done without their handler running.
- ``quiet_malformed``: malformed commands are dropped without the log line.
- ``fragile``: the first consumer (``n1``) exits when its store goes away (instead of
  riding it out; the others carry the load on): as soon as a session it holds open to the
  store breaks (PostgreSQL only: a restart ends every session, whether or not ``n1`` runs a
  task or its own calls fall into the short outage), or a handler's write finds the store
  unreachable.
- ``no_takeover``: no node claims a task that already ran on another node (expired claims
  are never taken over).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from metafora import Consumer, Task, open_coordinator
from metafora.balancers import DumbBalancer
from metafora.contracts.handler import Handler
from metafora.core.errors import ClaimLost, MetaforaError
from metafora.statemachine.machine import State
from metafora.statemachine.store import StateStore, state_store_for
from tests.faults.ledger import Ledger

__all__ = ["LedgerHandler", "PinBalancer", "WorkerSpec", "worker_main"]

log = logging.getLogger("campaign.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """What one consumer process runs (pickled to the spawned child)."""

    url: str
    node: str
    ledger: str
    log: str
    max_tasks: int
    write_every: float
    broken: str = ""  # a negative control's broken build (see the module doc); "" is the product


class PinBalancer(DumbBalancer):
    """Claims everything except tasks pinned (prop ``pin``) to another node."""

    def __init__(self, node: str, ledger: Ledger | None = None) -> None:
        super().__init__()
        self._node = node
        self._ran_before = ledger  # the no_takeover control: refuse tasks run by another node

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Refuse a task pinned elsewhere (it is offered again later, never dropped)."""
        ok, until = super().can_claim(task)
        log.debug("offered %s", task.id)
        pin = task.props.get("pin")
        if pin is not None and pin != self._node:
            return False, None
        if self._ran_before is not None and any(
                e["e"] == "start" and e["k"] == task.id and e["n"] != self._node
                for e in self._ran_before.events()):
            return False, None
        return ok, until


class UnfencedStore(StateStore):
    """Writes states without any check (the negative control: proves the checks have teeth)."""

    def __init__(self, coordinator: Any) -> None:
        self._coord = coordinator
        self._fenced = state_store_for(coordinator)

    def load(self, task: Task) -> State:
        """Not used by the campaign."""
        raise NotImplementedError

    def get(self, task_id: str) -> State | None:
        """Not used by the campaign."""
        raise NotImplementedError

    def store(self, task: Task, state: State) -> None:
        """Overwrite the state whoever holds the task (SQL ``put_raw``; a bare etcd put)."""
        put_raw = getattr(self._fenced, "put_raw", None)
        if put_raw is not None:
            put_raw(task.id, task.token, state.to_json())
            return
        from metafora.coordinators.etcd.driver import Put

        value = json.dumps({"token": task.token, "state": state.to_dict()}).encode()
        self._coord.driver.txn([], [Put(self._coord.keys.task(task.id).machine, value)])


class LedgerHandler(Handler):
    """Writes the task's state ``writes`` times (fenced), recording each outcome in the ledger.

    Props: ``writes`` (default 5); ``sentinel`` (run until stopped, then report done: a
    task that only a ``stop_task`` command ends). A refused write ends the run at once
    (the claim is gone); an unreachable store is retried until ``stop()``.
    """

    def __init__(self, task: Task, node: str, ledger: Ledger, store: StateStore,
                 write_every: float, *, deaf: bool = False, unheard: bool = False,
                 fragile: bool = False) -> None:
        self._task = task
        self._node = node
        self._ledger = ledger
        self._store = store
        self._every = write_every
        self._stop = threading.Event()
        self._deaf = deaf  # ignores stop() (the negative control)
        self._unheard = unheard  # stop() never reaches the handler: not even recorded
        self._fragile = fragile  # the process exits on an unreachable store

    def _note(self, kind: str, **fields: Any) -> None:
        self._ledger.append(kind, n=self._node, k=self._task.id, tok=self._task.token, **fields)

    def run(self) -> bool:
        """Write, pace, repeat; True when all writes are in (or a sentinel is stopped)."""
        sentinel = bool(self._task.props.get("sentinel"))
        writes = int(self._task.props.get("writes", 5))
        self._note("start")
        done = 0
        while True:
            if self._stop.is_set():
                self._note("end", why="stopped")
                return sentinel
            if not sentinel and done >= writes:
                self._note("end", why="done")
                return True
            state = State(cursor=f"{self._node}:{self._task.token}:{done}")
            m0 = time.monotonic()
            try:
                self._store.store(self._task, state)
            except ClaimLost as exc:
                self._note("refused", m0=m0, m1=time.monotonic(), i=done, err=str(exc)[:200])
                self._note("end", why="refused")
                return False
            except MetaforaError as exc:  # unreachable store (or a store error): try again
                if self._fragile:
                    os._exit(3)  # the fragile control: gone with its store
                self._note("unavailable", m0=m0, m1=time.monotonic(), i=done,
                           err=f"{type(exc).__name__}: {exc}"[:200])
                self._stop.wait(self._every)
                continue
            self._note("write", m0=m0, m1=time.monotonic(), i=done)
            done += 1
            self._stop.wait(self._every)  # pacing the fake work between writes

    def stop(self) -> None:
        """Ask ``run`` to return soon (unless the handler is deaf); the call is recorded."""
        if self._unheard:
            return
        if not self._stop.is_set():
            self._note("stop")
        if not self._deaf:
            self._stop.set()


class _Skipped(Handler):
    """The lost-task control's handler: reports done at once, runs nothing, records nothing."""

    def run(self) -> bool:
        """Done, without any work."""
        return True

    def stop(self) -> None:
        """Nothing to stop."""


def _die_with_the_store(url: str) -> None:
    """The fragile control's trigger: hold a PostgreSQL session open (connected before this
    returns) and ``os._exit(3)`` the moment it breaks.

    Its handlers' writes alone made the control flaky: a restart lasts well under a second,
    and ``n1`` often ran no task then, or its pool had reconnected before its next write, so
    it rode the restart out and the survivor check had nothing to catch. Every restart
    (SIGQUIT to the postmaster) ends every session, so this one breaks every time.
    """
    import psycopg

    parts = urlsplit(url)  # the store URL less metafora's own query options
    conn = psycopg.connect(urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")),
                           autocommit=True, connect_timeout=10)

    def watch() -> None:
        try:
            while True:
                conn.execute("SELECT pg_sleep(3600)")
        except psycopg.Error:
            os._exit(3)  # gone with its store

    threading.Thread(target=watch, name="fragile-watch", daemon=True).start()


def worker_main(spec: WorkerSpec) -> None:
    """A consumer process: run until SIGTERM; log warnings to ``spec.log``."""
    level = os.environ.get("METAFORA_FAULTS_LOG", "INFO").upper()  # DEBUG to trace a failure
    logging.basicConfig(filename=spec.log, level=level,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    ledger = Ledger(spec.ledger)
    coord = open_coordinator(spec.url, node_id=spec.node)
    broken = spec.broken
    # no_self_fence: nothing tells the handler its claim is gone, neither stop() nor a refused
    # write (the fenced store refuses locally once the node has fenced itself).
    unfenced = broken in ("unfenced", "no_self_fence")
    store = UnfencedStore(coord) if unfenced else state_store_for(coord)
    if broken == "quiet_malformed":  # on the handler: a logger's filter misses its children
        for log_handler in logging.getLogger().handlers:
            log_handler.addFilter(lambda record: "malformed command" not in record.getMessage())

    fragile = broken == "fragile" and spec.node == "n1"
    if fragile:
        if not spec.url.startswith("postgresql"):
            raise ValueError("the fragile control runs on PostgreSQL only")
        _die_with_the_store(spec.url)

    def make(task: Task) -> Handler:
        if broken == "lose" and task.id.endswith("3"):
            return _Skipped()  # done without running: the lost-task control
        # Called by the consumer right after a claim succeeded, before the handler starts.
        ledger.append("made", n=spec.node, k=task.id, tok=task.token)
        return LedgerHandler(task, spec.node, ledger, store, spec.write_every,
                             deaf=broken in ("unfenced", "no_self_fence"),
                             unheard=broken == "no_self_fence",
                             fragile=fragile)

    # The campaign kills nodes on purpose: the tasks they held are victims, not poison, so
    # the crash limit (tested in tests/integration/test_crash_loops.py) is off here.
    balancer = PinBalancer(spec.node, ledger if broken == "no_takeover" else None)
    consumer = Consumer(coord, make, balancer, max_tasks=spec.max_tasks,
                        shutdown_timeout=5, release_backoff=0.2, release_backoff_max=2.0,
                        max_crashes=None)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    ledger.append("up", n=spec.node, pid=os.getpid())
    try:
        consumer.run()
    except BaseException as exc:
        ledger.append("crash", n=spec.node, err=f"{type(exc).__name__}: {exc}"[:500])
        logging.getLogger("campaign").exception("consumer %s died", spec.node)
        raise
    ledger.append("exit", n=spec.node)
