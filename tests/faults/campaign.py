"""The fault campaign's machinery: consumer processes, a ledger outside the store, faults, checks.

Each consumer is a separate process (multiprocessing ``spawn``: gRPC and fork do not mix)
running :func:`worker_main`. Its handler writes the task's state through the fenced state
store (:func:`metafora.statemachine.store.state_store_for`) several times while it runs and
records, in an append-only JSON-lines :class:`Ledger` outside the store, every start and end
of a run and every write the store ACCEPTED or REFUSED, with its token and the system-wide
monotonic time before and after the call (``CLOCK_MONOTONIC`` is shared by the processes
of one machine, so times from different processes compare).

:class:`Campaign` drives one scenario on one store (:class:`PostgresStore`, :class:`EtcdStore`)
and :func:`analyze` judges the ledger afterwards:

- **stale writes accepted**: an accepted write of token T that began after a run of the same
  task with a token T' > T had started (so after the store handed out T'), or after a write
  of T' was accepted. The store must refuse such a write; this is the primary proof of
  fencing, and it covers a zombie's writes after SIGCONT.
- **overlaps**: two runs of one task whose valid periods intersect. A run is valid from its
  start until the earliest of its end, its node's SIGKILL, its node's SIGSTOP (a frozen
  handler does nothing; what it does after SIGCONT is judged by its writes) and the
  moment a write of its was refused (the store said the claim was gone).
- **lost**: a task not done or failed by the deadline, or done without a handler run that
  finished it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from metafora import Consumer, Task, open_client, open_coordinator
from metafora.balancers import DumbBalancer
from metafora.commands import stop_task
from metafora.coordinator import Client
from metafora.errors import ClaimLost, MetaforaError, TaskExists
from metafora.handler import Handler
from metafora.statemachine.machine import State
from metafora.statemachine.store import StateStore, state_store_for
from metafora.task import TaskState

__all__ = [
    "Campaign",
    "EtcdStore",
    "Ledger",
    "PostgresStore",
    "Report",
    "Size",
    "Store",
    "analyze",
    "worker_main",
]

T = TypeVar("T")

_INF = float("inf")
_UP_DEADLINE = 90.0  # seconds for a spawned consumer to import, register and report
_STOP_DEADLINE = 20.0  # seconds for a consumer to shut down after SIGTERM
_FINISH_STATES = (TaskState.DONE, TaskState.FAILED)


# ------------------------------------------------------------------------- small tools


def poll(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    """Call ``predicate`` every ``every`` s until it is truthy; AssertionError after ``timeout``.

    Store errors raised by the predicate (the store may be coming back) count as "not yet".
    """
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except MetaforaError as exc:
            last = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last})" if last is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")
        gate.wait(every)


def hold(seconds: float) -> None:
    """Keep a fault in place for ``seconds`` (a duration, not a synchronisation)."""
    time.sleep(seconds)  # noqa: sleep-ok holding a fault (SIGSTOP, a stopped store) for a set time


# ------------------------------------------------------------------------- the ledger


class Ledger:
    """An append-only JSON-lines file shared by every process of one scenario.

    Each record is one ``os.write`` on an ``O_APPEND`` descriptor (atomic for these small
    lines), so records from many processes never interleave, even across SIGKILL.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def append(self, kind: str, **fields: Any) -> None:
        """Append one record ``{"e": kind, "m": monotonic, ...fields}``."""
        record = {"e": kind, "m": time.monotonic(), **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def events(self) -> list[dict[str, Any]]:
        """Every complete record, in file order (a line cut short is skipped)."""
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    continue
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


# ------------------------------------------------------------------------- the worker process


@dataclass(frozen=True)
class WorkerSpec:
    """What one consumer process runs (pickled to the spawned child)."""

    url: str
    node: str
    ledger: str
    log: str
    max_tasks: int
    write_every: float


class PinBalancer(DumbBalancer):
    """Claims everything except tasks pinned (prop ``pin``) to another node."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self._node = node

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Refuse a task pinned elsewhere (it is offered again later, never dropped)."""
        ok, until = super().can_claim(task)
        pin = task.props.get("pin")
        if pin is not None and pin != self._node:
            return False, None
        return ok, until


class LedgerHandler(Handler):
    """Writes the task's state ``writes`` times (fenced), recording each outcome in the ledger.

    Props: ``writes`` (default 5); ``sentinel`` (run until stopped, then report done: a
    task that only a ``stop_task`` command ends). A refused write ends the run at once
    (the claim is gone); an unreachable store is retried until ``stop()``.
    """

    def __init__(self, task: Task, node: str, ledger: Ledger, store: StateStore,
                 write_every: float) -> None:
        self._task = task
        self._node = node
        self._ledger = ledger
        self._store = store
        self._every = write_every
        self._stop = threading.Event()

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
                self._note("unavailable", m0=m0, m1=time.monotonic(), i=done,
                           err=f"{type(exc).__name__}: {exc}"[:200])
                self._stop.wait(self._every)
                continue
            self._note("write", m0=m0, m1=time.monotonic(), i=done)
            done += 1
            self._stop.wait(self._every)  # pacing the fake work between writes

    def stop(self) -> None:
        """Ask ``run`` to return soon."""
        self._stop.set()


def worker_main(spec: WorkerSpec) -> None:
    """A consumer process: run until SIGTERM; log warnings to ``spec.log``."""
    logging.basicConfig(filename=spec.log, level=logging.WARNING,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    ledger = Ledger(spec.ledger)
    coord = open_coordinator(spec.url, node_id=spec.node)
    store = state_store_for(coord)

    def make(task: Task) -> Handler:
        return LedgerHandler(task, spec.node, ledger, store, spec.write_every)

    consumer = Consumer(coord, make, PinBalancer(spec.node), max_tasks=spec.max_tasks,
                        shutdown_timeout=5, release_backoff=0.2, release_backoff_max=2.0)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    ledger.append("up", n=spec.node, pid=os.getpid())
    try:
        consumer.run()
    except BaseException as exc:
        ledger.append("crash", n=spec.node, err=f"{type(exc).__name__}: {exc}"[:500])
        logging.getLogger("campaign").exception("consumer %s died", spec.node)
        raise
    ledger.append("exit", n=spec.node)


# ------------------------------------------------------------------------- faults and the fleet


@dataclass
class FaultLog:
    """What the campaign did to the cluster, with monotonic times."""

    injected: list[tuple[str, str, float]] = field(default_factory=list)
    killed: dict[str, float] = field(default_factory=dict)
    frozen: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    cuts: list[tuple[float, float]] = field(default_factory=list)

    def add(self, kind: str, target: str) -> None:
        """Count one fault."""
        self.injected.append((kind, target, time.monotonic()))


class Fleet:
    """Consumer processes on one store, signalled by pid; always stopped in ``stop_all``."""

    def __init__(self, url: str, workdir: Path, ledger: Ledger, faults: FaultLog,
                 client: Client, max_tasks: int, write_every: float) -> None:
        self.url = url
        self.workdir = workdir
        self.ledger = ledger
        self.faults = faults
        self.client = client
        self._max_tasks = max_tasks
        self._every = write_every
        self._ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, Any] = {}
        self._seq = 0
        self._stopped: set[str] = set()

    def log_path(self, node: str) -> Path:
        """The node's log file (warnings and errors)."""
        return self.workdir / f"{node}.log"

    def start(self, count: int) -> list[str]:
        """Start ``count`` new consumers; return their ids once each is up and registered."""
        nodes = []
        for _ in range(count):
            self._seq += 1
            node = f"n{self._seq}"
            spec = WorkerSpec(self.url, node, self.ledger.path, str(self.log_path(node)),
                              self._max_tasks, self._every)
            proc = self._ctx.Process(target=worker_main, args=(spec,), name=f"campaign-{node}",
                                     daemon=True)
            proc.start()
            self.procs[node] = proc
            nodes.append(node)
        for node in nodes:
            self._wait_up(node)
        return nodes

    def _wait_up(self, node: str) -> None:
        proc = self.procs[node]

        def up() -> bool:
            if not proc.is_alive():
                raise AssertionError(f"consumer {node} exited at start:\n{self.log_tail(node)}")
            return node in self.client.nodes()

        poll(up, _UP_DEADLINE, f"consumer {node} to register")

    def log_tail(self, node: str, lines: int = 40) -> str:
        """The last lines of a node's log."""
        try:
            text = self.log_path(node).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> list[str]:
        """Nodes whose process runs (frozen ones included), never killed by us."""
        return [n for n, p in self.procs.items() if n not in self.faults.killed and p.is_alive()]

    def survivors(self) -> list[str]:
        """Nodes never killed by the campaign (they must all still run at the end)."""
        return [n for n in self.procs if n not in self.faults.killed]

    def kill(self, node: str) -> None:
        """SIGKILL a consumer and reap it; its runs end at the recorded time."""
        proc = self.procs[node]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(_STOP_DEADLINE)
        self.faults.killed[node] = time.monotonic()
        self.faults.add("sigkill", node)

    def freeze(self, node: str) -> float:
        """SIGSTOP a consumer; returns the time it was seen stopped."""
        pid = self.procs[node].pid
        os.kill(pid, signal.SIGSTOP)
        self._stopped.add(node)
        poll(lambda: _proc_state(pid) in ("T", "t"), 10, f"{node} to stop", every=0.01)
        return time.monotonic()

    def thaw(self, node: str) -> float:
        """SIGCONT a frozen consumer; returns the time just before."""
        at = time.monotonic()
        os.kill(self.procs[node].pid, signal.SIGCONT)
        self._stopped.discard(node)
        return at

    def stop_all(self) -> None:
        """SIGCONT the frozen, SIGTERM every live consumer, wait, SIGKILL what is left."""
        for node in list(self._stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[node].pid, signal.SIGCONT)
        self._stopped.clear()
        for proc in self.procs.values():
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_DEADLINE
        for proc in self.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)


def _proc_state(pid: int) -> str:
    """The one-letter state of a process (``T`` stopped), or ``?``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


# ------------------------------------------------------------------------- stores


class Store(Protocol):
    """A store the campaign can break: restart, cut off, write raw garbage into."""

    kind: str

    def url(self, namespace: str, lease_ttl: int) -> str:
        """A URL of this store with its own namespace."""

    def restart(self, index: int) -> str:
        """Restart (part of) the store under load; returns what was done."""

    def cut(self, seconds: float) -> tuple[float, float]:
        """Make the store unreachable for ``seconds``; returns (begin, end) monotonic times."""

    def inject_command(self, namespace: str, node: str, raw: bytes) -> None:
        """Queue raw command bytes for ``node``, bypassing every check."""

    def inject_task(self, namespace: str, task_id: str, raw_props: bytes) -> None:
        """Write a pending task with raw props bytes, bypassing every check."""

    def bad_commands(self) -> list[bytes]:
        """Malformed commands this store can hold."""


_BAD_COMMANDS = [
    b"{not json",
    b"[]",
    b'{"command": 5}',
    b'{"command": "explode", "parameters": {}}',
    b'{"command": "stop_task", "parameters": {"task": 5}}',
    b'{"command": "freeze", "parameters": [], "extra": 1}',
]

MALFORMED_PROPS: dict[str, bytes] = {
    "bad-json": b"{not json",
    "bad-list": b"[1, 2]",
    "bad-launch": b'{"launch_at": "garbage"}',
}
"""Tasks with valid ids and malformed props (SQL: the props text; etcd: inside the record)."""

INVALID_IDS = ["bad\x01id", "x" * 300]
"""Raw task ids no metafora task may have (a control character; longer than 256)."""


class PostgresStore:
    """A private PostgreSQL (``TempCluster``) that may be killed and restarted."""

    kind = "postgresql"

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def url(self, namespace: str, lease_ttl: int) -> str:
        """``postgresql://...?namespace=NS&lease_ttl=TTL``."""
        return f"{self.cluster.url}?namespace={namespace}&lease_ttl={lease_ttl}"

    def restart(self, index: int) -> str:
        """Immediate shutdown (SIGQUIT to the postmaster), then start again."""
        self.cluster.kill()
        self.cluster.start()
        return "postgresql killed and restarted"

    def cut(self, seconds: float) -> tuple[float, float]:
        """Stop the server for ``seconds`` (every connection refused), then start it."""
        self.cluster.kill()
        begin = time.monotonic()
        hold(seconds)
        end = time.monotonic()
        self.cluster.start()
        return begin, end

    def _execute(self, sql: str, params: Sequence[object]) -> None:
        import psycopg

        with psycopg.connect(self.cluster.url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql, params)  # type: ignore[arg-type]

    def inject_command(self, namespace: str, node: str, raw: bytes) -> None:
        """INSERT into ``metafora_commands``."""
        self._execute("INSERT INTO metafora_commands (namespace, node_id, body, created_at)"
                      " VALUES (%s, %s, %s, now())", (namespace, node, raw.decode()))

    def inject_task(self, namespace: str, task_id: str, raw_props: bytes) -> None:
        """INSERT a pending row into ``metafora_tasks``."""
        self._execute("INSERT INTO metafora_tasks (namespace, id, props, state, token, ready,"
                      " created_at, updated_at) VALUES (%s, %s, %s, 'pending', 0, 0, now(), now())",
                      (namespace, task_id, raw_props.decode()))

    def bad_commands(self) -> list[bytes]:
        """Malformed JSON and malformed commands (PostgreSQL text holds no invalid UTF-8)."""
        return list(_BAD_COMMANDS)


class EtcdStore:
    """A 3-member etcd cluster whose members may be stopped and started again."""

    kind = "etcd"

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def url(self, namespace: str, lease_ttl: int) -> str:
        """``etcd://m1,m2,m3/NS?lease_ttl=TTL&timeout=2`` (requests give up after 2 s)."""
        return f"{self.cluster.url(namespace)}?lease_ttl={lease_ttl}&timeout=2"

    def _leader(self) -> int:
        return int(poll(self._try_leader, 30, "an etcd leader") - 1)

    def _try_leader(self) -> int:
        try:
            return int(self.cluster.leader()) + 1
        except Exception:
            return 0

    def restart(self, index: int) -> str:
        """Odd faults stop a follower, even ones the leader; each is started again."""
        leader = self._leader()
        if index % 2 == 0:
            member = next(i for i in range(len(self.cluster.members)) if i != leader)
            role = "follower"
        else:
            member, role = leader, "leader"
        if index % 4 == 3:
            self.cluster.kill(member)  # SIGKILL now and then, SIGTERM otherwise
            how = "killed"
        else:
            self.cluster.stop(member)
            how = "stopped"
        self.cluster.start(member)
        return f"etcd {role} m{member} {how} and restarted"

    def cut(self, seconds: float) -> tuple[float, float]:
        """Stop the leader and one follower (no quorum) for ``seconds``, then start both."""
        leader = self._leader()
        other = next(i for i in range(len(self.cluster.members)) if i != leader)
        for i in (leader, other):
            self.cluster.stop(i)
        begin = time.monotonic()
        hold(seconds)
        end = time.monotonic()
        for i in (leader, other):
            member = self.cluster.members[i]
            member.cluster_state = "existing"
            member.start(wait=False)  # a lone member is never healthy: start both, then wait
        for i in (leader, other):
            self.cluster.members[i].wait_healthy()
        return begin, end

    def _driver(self, namespace: str) -> tuple[Any, Any]:
        from metafora.config import parse_store_url
        from metafora.coordinators.etcd.config import EtcdConfig
        from metafora.coordinators.etcd.driver import EtcdDriver
        from metafora.coordinators.etcd.layout import Keys

        config = EtcdConfig.from_url(parse_store_url(self.cluster.url(namespace)), {})
        driver = EtcdDriver(config.connection)
        driver.connect()
        return driver, Keys(namespace)

    def inject_command(self, namespace: str, node: str, raw: bytes) -> None:
        """Put a key under the node's command queue, on the node's lease (as the client does)."""
        from metafora.coordinators.etcd.driver import Put, Range

        driver, keys = self._driver(namespace)
        try:
            alive, _ = driver.range(Range(keys.node_alive(node)))
            if not alive:
                raise MetaforaError(f"node {node} is not live")
            key = keys.node_commands(node) + f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}".encode()
            driver.txn([], [Put(key, raw, alive[0].lease)])
        finally:
            driver.close()

    def inject_task(self, namespace: str, task_id: str, raw_props: bytes) -> None:
        """Put ``tasks/<id>/props``: the raw bytes, or ``{"props": <raw>}`` if they are JSON."""
        from metafora.coordinators.etcd.driver import Put

        try:
            json.loads(raw_props)
            value = b'{"props": ' + raw_props + b', "created_at": "2030-01-01T00:00:00+00:00"}'
        except ValueError:
            value = raw_props
        driver, keys = self._driver(namespace)
        try:
            driver.txn([], [Put(keys.task(task_id).props, value)])
        finally:
            driver.close()

    def bad_commands(self) -> list[bytes]:
        """Malformed JSON, malformed commands and bytes that are not UTF-8."""
        return [*_BAD_COMMANDS, b"\xff\xfe\x00garbage"]


# ------------------------------------------------------------------------- analysis


@dataclass
class Run:
    """One handler run of one claim, as the ledger saw it."""

    task: str
    node: str
    token: int
    start: float
    end: float | None = None
    why: str | None = None
    writes: list[tuple[float, float]] = field(default_factory=list)
    refused: list[tuple[float, float]] = field(default_factory=list)
    unavailable: int = 0

    def valid_until(self, faults: FaultLog) -> float:
        """The end of the period in which this run may have acted under a valid token."""
        ends = [self.end if self.end is not None else _INF]
        killed = faults.killed.get(self.node)
        if killed is not None and killed >= self.start:
            ends.append(killed)
        for stopped, _ in faults.frozen.get(self.node, []):
            if stopped >= self.start:
                ends.append(stopped)
        if self.refused:
            ends.append(min(m1 for _, m1 in self.refused))
        return min(ends)


@dataclass
class Report:
    """The figures and the failures of one scenario."""

    store: str
    scenario: str
    faults: int = 0
    tasks: int = 0
    runs: int = 0
    writes: int = 0
    refused: int = 0
    overlaps: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No overlap, no stale write, nothing lost, no other problem."""
        return not (self.overlaps or self.stale or self.lost or self.problems)

    def figures(self) -> dict[str, Any]:
        """The row printed in the campaign summary."""
        return {"store": self.store, "scenario": self.scenario, "faults": self.faults,
                "tasks": self.tasks, "runs": self.runs, "writes": self.writes,
                "refused": self.refused, "overlaps": len(self.overlaps), "stale": len(self.stale),
                "lost": len(self.lost), "seconds": self.seconds, "notes": "; ".join(self.notes)}

    def explain(self) -> str:
        """Every failure, for the assertion message."""
        parts = []
        for name in ("overlaps", "stale", "lost", "problems"):
            items: list[str] = getattr(self, name)
            if items:
                parts.append(f"{name} ({len(items)}):\n  " + "\n  ".join(items[:20]))
        return "\n".join(parts) or "ok"


def runs_of(events: Iterable[dict[str, Any]]) -> tuple[dict[tuple[str, str, int], Run], list[str]]:
    """Fold ledger records into runs keyed by (task, node, token); also anomalies found."""
    runs: dict[tuple[str, str, int], Run] = {}
    anomalies: list[str] = []
    for e in events:
        if e["e"] not in ("start", "end", "write", "refused", "unavailable"):
            continue
        key = (e["k"], e["n"], int(e["tok"]))
        if e["e"] == "start":
            if key in runs:
                anomalies.append(f"run {key} started twice")
            runs[key] = Run(key[0], key[1], key[2], float(e["m"]))
            continue
        run = runs.get(key)
        if run is None:
            anomalies.append(f"{e['e']} of {key} without a start")
            continue
        if e["e"] == "end":
            run.end, run.why = float(e["m"]), str(e["why"])
        elif e["e"] == "write":
            run.writes.append((float(e["m0"]), float(e["m1"])))
        elif e["e"] == "refused":
            run.refused.append((float(e["m0"]), float(e["m1"])))
        else:
            run.unavailable += 1
    return runs, anomalies


def analyze(report: Report, events: list[dict[str, Any]], faults: FaultLog) -> list[Run]:
    """Fill ``report`` with the ledger's verdicts (overlaps, stale writes); returns the runs."""
    runs, anomalies = runs_of(events)
    report.problems.extend(anomalies)
    by_task: dict[str, list[Run]] = {}
    for run in runs.values():
        by_task.setdefault(run.task, []).append(run)
    report.runs = len(runs)
    report.writes = sum(len(r.writes) for r in runs.values())
    report.refused = sum(len(r.refused) for r in runs.values())
    for task_runs in by_task.values():
        task_runs.sort(key=lambda r: r.token)
        for i, a in enumerate(task_runs):
            a_until = a.valid_until(faults)
            for b in task_runs[i + 1:]:
                if b.token == a.token:
                    report.overlaps.append(f"{a.task}: token {a.token} handed to {a.node} and {b.node}")
                    continue
                b_until = b.valid_until(faults)
                if b.start < a_until and a.start < b_until:
                    report.overlaps.append(
                        f"{a.task}: {a.node} (token {a.token}, valid until {a_until:.3f}) and "
                        f"{b.node} (token {b.token}, from {b.start:.3f})")
                # A write of a that began after b (a newer claim) had started is stale: the
                # store must refuse it. (This also covers "after a write of b was accepted".)
                for m0, _m1 in a.writes:
                    if m0 > b.start:
                        report.stale.append(
                            f"{a.task}: write of token {a.token} by {a.node} at {m0:.3f} accepted "
                            f"after token {b.token} started on {b.node} at {b.start:.3f}")
    return list(runs.values())


# ------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Size:
    """How big a scenario is (the short form runs in CI; ``--long`` by hand)."""

    tasks: int = 40
    nodes: int = 3
    max_tasks: int = 6
    writes: tuple[int, int] = (5, 12)
    write_every: float = 0.2
    faults: int = 2
    lease_ttl: int = 3
    deadline: float = 120.0

    @classmethod
    def short(cls) -> Size:
        """The CI form: a few minutes for the whole campaign on 2 cores."""
        return cls()

    @classmethod
    def long(cls) -> Size:
        """The long form: more tasks, more nodes, repeated faults."""
        return cls(tasks=200, nodes=4, max_tasks=8, writes=(5, 25), faults=6, deadline=600.0)


class Campaign:
    """One scenario on one store: start the fleet, load it, inject faults, check everything."""

    SCENARIOS = ("sigkill", "zombie", "store_restart", "network_cut", "malformed")

    def __init__(self, store: Store, scenario: str, size: Size, workdir: Path,
                 seed: int | None = None) -> None:
        if scenario not in self.SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}")
        self.store = store
        self.scenario = scenario
        self.size = size
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.namespace = "f" + uuid.uuid4().hex[:10]
        self.url = store.url(self.namespace, size.lease_ttl)
        self.ledger = Ledger(workdir / "ledger.jsonl")
        self.faults = FaultLog()
        self.report = Report(store.kind, scenario)
        self.expected: dict[str, str] = {}  # task id -> "done" | "failed" | "finished"
        self._next_task = 0
        self.client: Client | None = None
        self.fleet: Fleet | None = None

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> Report:
        """Run the scenario end to end; every process is stopped before this returns."""
        began = time.monotonic()
        self.client = open_client(self.url)
        self.fleet = Fleet(self.url, self.workdir, self.ledger, self.faults, self.client,
                           self.size.max_tasks, self.size.write_every)
        try:
            self.fleet.start(self.size.nodes)
            getattr(self, f"_scenario_{self.scenario}")()
            self._submit(self.size.tasks - self._next_task)  # whatever is left
            self._recovery()
            self._wait_finished()
            self._wait_runs_ended()
            self._check_nodes()
        finally:
            self.fleet.stop_all()
            self.report.seconds = time.monotonic() - began
        runs = analyze(self.report, self.ledger.events(), self.faults)
        self._check_lost(runs)
        self._scenario_checks(runs)
        self.report.faults = len(self.faults.injected)
        self.report.tasks = len(self.expected)
        with contextlib.suppress(MetaforaError):
            self.client.close()
        return self.report

    # -- load ----------------------------------------------------------------------------

    def _submit(self, count: int, **props: Any) -> list[str]:
        """Submit ``count`` tasks (random number of writes); returns their ids."""
        assert self.client is not None
        ids = []
        for _ in range(max(0, count)):
            task_id = f"t{self._next_task:04d}"
            self._next_task += 1
            body = {"writes": self.rng.randint(*self.size.writes), **props}
            self._submit_one(Task(task_id, body))
            self.expected[task_id] = "done"
            ids.append(task_id)
        return ids

    def _submit_one(self, task: Task) -> None:
        assert self.client is not None
        client = self.client

        def submit() -> bool:
            try:
                client.submit_task(task)
            except TaskExists:
                pass  # an earlier attempt went through before its answer was lost
            return True

        poll(submit, 60, f"submitting {task.id}")

    def _batch(self) -> int:
        """Tasks to submit between two faults."""
        return max(1, (self.size.tasks // 2) // max(1, self.size.faults))

    def _open_runs(self) -> dict[str, list[Run]]:
        """Runs started and not ended, per node (from the ledger)."""
        runs, _ = runs_of(self.ledger.events())
        out: dict[str, list[Run]] = {}
        for run in runs.values():
            if run.end is None and run.node not in self.faults.killed:
                out.setdefault(run.node, []).append(run)
        return out

    def _starts(self) -> int:
        return sum(1 for e in self.ledger.events() if e["e"] == "start")

    def _wait_progress(self, starts: int, timeout: float = 60.0) -> None:
        """Wait until ``starts`` more runs have started (the cluster works)."""
        target = self._starts() + starts
        poll(lambda: self._starts() >= target, timeout, f"{starts} more runs to start")

    def _wait_busy(self, nodes: Sequence[str] | None = None) -> str:
        """Wait until one of ``nodes`` (default: the live ones) runs a task; returns it."""
        assert self.fleet is not None
        fleet = self.fleet

        def busy() -> str | None:
            candidates = list(nodes) if nodes is not None else fleet.alive()
            open_runs = self._open_runs()
            loaded = [n for n in candidates if open_runs.get(n)]
            return self.rng.choice(loaded) if loaded else None

        return poll(busy, 60, "a node running tasks")

    # -- scenarios ------------------------------------------------------------------------

    def _scenario_sigkill(self) -> None:
        """SIGKILL a random busy consumer, start a replacement; repeated."""
        assert self.fleet is not None
        self._submit(self.size.tasks // 2)
        for _ in range(self.size.faults):
            victim = self._wait_busy()
            self.fleet.kill(victim)
            self._submit(self._batch())
            self.fleet.start(1)
            self._wait_progress(2)

    def _scenario_zombie(self) -> None:
        """SIGSTOP a busy consumer past its lease until its tasks run elsewhere, then SIGCONT."""
        assert self.fleet is not None
        self._submit(self.size.tasks // 2)
        ttl = self.size.lease_ttl
        for _ in range(self.size.faults):
            victim = self._wait_busy()
            frozen = {(r.task, r.token) for r in self._open_runs().get(victim, [])}
            stopped = self.fleet.freeze(victim)
            self.faults.add("sigstop", victim)
            hold(ttl + 1.0)
            # Keep it frozen until one of its tasks runs under a newer token (a true zombie).
            with contextlib.suppress(AssertionError):
                poll(lambda f=frozen: self._taken_over(f), 3 * ttl + 10, "a frozen task to move")
            resumed = self.fleet.thaw(victim)
            self.faults.frozen.setdefault(victim, []).append((stopped, resumed))
            poll(lambda f=frozen, v=victim: self._old_runs_ended(v, f), 30,
                 f"the zombie {victim}'s old runs to end")
            self._submit(self._batch())
            self._wait_progress(2)

    def _old_runs_ended(self, node: str, frozen: set[tuple[str, int]]) -> bool:
        return not any((r.task, r.token) in frozen for r in self._open_runs().get(node, []))

    def _taken_over(self, frozen: set[tuple[str, int]]) -> bool:
        runs, _ = runs_of(self.ledger.events())
        tokens = dict(frozen)
        return any(run.task in tokens and run.token > tokens[run.task] for run in runs.values())

    def _scenario_store_restart(self) -> None:
        """Restart the store (PostgreSQL; an etcd follower, then the leader) under load."""
        self._submit(self.size.tasks // 2)
        for index in range(self.size.faults):
            self._wait_busy()
            done = self.store.restart(index)
            self.faults.add("store_restart", done)
            if index < 2:
                self.report.notes.append(done)
            self._submit(self._batch())
            self._wait_progress(2)

    def _scenario_network_cut(self) -> None:
        """Take the store away for longer than the lease TTL, then bring it back."""
        self._submit(self.size.tasks // 2)
        for _ in range(max(1, self.size.faults // 2)):
            self._wait_busy()
            begin, end = self.store.cut(self.size.lease_ttl + 2.0)
            self.faults.cuts.append((begin, end))
            self.faults.add("network_cut", self.store.kind)
            self._submit(self._batch())
            self._wait_progress(2)

    def _scenario_malformed(self) -> None:
        """Raw malformed commands to every node and raw malformed tasks, under load."""
        assert self.fleet is not None
        nodes = self.fleet.alive()
        sentinels = {}
        for node in nodes:
            task_id = f"sentinel-{node}"
            self._submit_one(Task(task_id, {"sentinel": True, "pin": node}))
            self.expected[task_id] = "done"
            sentinels[node] = task_id
        self._submit(self.size.tasks // 2)
        poll(lambda: all(any(r.task == sentinels[n] for r in self._open_runs().get(n, []))
                         for n in nodes), 60, "every sentinel to run on its node")
        bad = self.store.bad_commands()
        for node in nodes:
            for raw in bad:
                self.store.inject_command(self.namespace, node, raw)
                self.faults.add("bad_command", node)
        for task_id, raw in MALFORMED_PROPS.items():
            self.store.inject_task(self.namespace, task_id, raw)
            self.faults.add("bad_props", task_id)
            self.expected[task_id] = "finished"
        for task_id in INVALID_IDS:
            self.store.inject_task(self.namespace, task_id, b"{}")
            self.faults.add("bad_id", task_id[:20])
        self._submit(self._batch())
        # A valid command after the garbage: the command feed still works.
        assert self.client is not None
        client = self.client
        for node in nodes:
            sentinel = sentinels[node]

            def stopped(node: str = node, sentinel: str = sentinel) -> bool:
                if client.get_task(sentinel).state is TaskState.DONE:
                    return True
                client.submit_command(node, stop_task(sentinel))  # again, if it was between runs
                return False

            poll(stopped, 60, f"{sentinel} to be stopped by a command", every=3.0)
        self._bad_per_node = len(bad)

    # -- the end --------------------------------------------------------------------------

    def _recovery(self) -> None:
        """One task pinned to each surviving node: each must claim and finish work again."""
        assert self.fleet is not None
        for node in self.fleet.survivors():
            task_id = f"after-{node}"
            self._submit_one(Task(task_id, {"pin": node, "writes": 3}))
            self.expected[task_id] = "done"

    def _finished(self) -> bool:
        assert self.client is not None
        states = {i.id: i.state for i in self.client.tasks()}
        return all(states.get(t) in _FINISH_STATES for t in self.expected)

    def _wait_finished(self) -> None:
        with contextlib.suppress(AssertionError):
            poll(self._finished, self.size.deadline, "every task to finish", every=0.25)

    def _wait_runs_ended(self) -> None:
        with contextlib.suppress(AssertionError):
            poll(lambda: not self._open_runs(), 30, "every run to end")

    def _check_nodes(self) -> None:
        """Survivors must still run (never restarted) and be registered."""
        assert self.fleet is not None and self.client is not None
        for node in self.fleet.survivors():
            proc = self.fleet.procs[node]
            if not proc.is_alive():
                self.report.problems.append(
                    f"consumer {node} died (exit {proc.exitcode}):\n{self.fleet.log_tail(node)}")
        for e in self.ledger.events():
            if e["e"] == "crash":
                self.report.problems.append(f"consumer {e['n']} crashed: {e['err']}")
        try:
            live = set(self.client.nodes())
        except MetaforaError as exc:
            self.report.problems.append(f"cannot list nodes after the faults: {exc}")
            return
        for node in self.fleet.survivors():
            if node not in live:
                self.report.problems.append(f"consumer {node} is not registered after the faults")

    def _check_lost(self, runs: list[Run]) -> None:
        assert self.client is not None
        try:
            infos = {i.id: i for i in self.client.tasks()}
        except MetaforaError as exc:
            self.report.problems.append(f"cannot list tasks: {exc}")
            return
        finished_by = {r.task for r in runs if r.why == "done"}
        finished_by |= {r.task for r in runs if r.why == "stopped" and r.task.startswith("sentinel-")}
        for task_id, want in self.expected.items():
            info = infos.get(task_id)
            if info is None:
                self.report.lost.append(f"{task_id}: gone from the store")
            elif info.state not in _FINISH_STATES:
                self.report.lost.append(f"{task_id}: still {info.state.value} (owner {info.owner})")
            elif want == "done" and info.state is not TaskState.DONE:
                self.report.lost.append(f"{task_id}: {info.state.value} ({info.error})")
            elif want == "done" and task_id not in finished_by:
                self.report.lost.append(f"{task_id}: done in the store, but no run finished it")
        for run in runs:
            if run.end is None and run.node not in self.faults.killed:
                self.report.problems.append(f"{run.task}: run of token {run.token} on {run.node} "
                                            "never ended")

    def _scenario_checks(self, runs: list[Run]) -> None:
        if self.scenario == "zombie":
            self._check_zombies(runs)
        elif self.scenario == "network_cut":
            self._check_cuts(runs)
        elif self.scenario == "malformed":
            self._check_malformed(runs)
        elif self.scenario == "sigkill":
            moved = sum(1 for r in runs if r.node in self.faults.killed and r.end is None)
            self.report.notes.append(f"{moved} runs cut by SIGKILL, all re-run elsewhere")

    def _check_zombies(self, runs: list[Run]) -> None:
        """Count what the zombies did after SIGCONT (their stale writes are judged by analyze)."""
        frozen_runs = superseded = refused = fenced = late = 0
        for node, windows in self.faults.frozen.items():
            for stopped, resumed in windows:
                for run in runs:
                    if run.node != node or run.start > stopped or (run.end or _INF) < stopped:
                        continue
                    frozen_runs += 1
                    superseded += any(o.task == run.task and o.token > run.token for o in runs)
                    late += sum(1 for m0, _ in run.writes if m0 >= resumed)
                    if run.refused:
                        refused += 1
                    elif run.why == "stopped":
                        fenced += 1
        if frozen_runs == 0:
            self.report.problems.append("no run was frozen: the zombie scenario proved nothing")
        self.report.notes.append(
            f"{frozen_runs} frozen runs, {superseded} re-claimed elsewhere; after SIGCONT "
            f"{refused} had a write refused, {fenced} self-fenced, {late} writes accepted")

    def _check_cuts(self, runs: list[Run]) -> None:
        active = fenced = 0
        for begin, end in self.faults.cuts:
            for run in runs:
                if run.start >= begin or (run.end is not None and run.end <= begin):
                    continue
                if run.node in self.faults.killed:
                    continue
                active += 1
                if run.end is not None and run.end < end:
                    fenced += 1
                else:
                    self.report.problems.append(
                        f"{run.task}: run of token {run.token} on {run.node} still ran when the "
                        "store came back (no self-fencing)")
        self.report.notes.append(f"{active} runs active at the cut, {fenced} stopped before the "
                                 "store came back")

    def _check_malformed(self, runs: list[Run]) -> None:
        assert self.fleet is not None and self.client is not None
        per_node = getattr(self, "_bad_per_node", 0)
        for node in self.fleet.survivors():
            try:
                text = self.fleet.log_path(node).read_text(errors="replace")
            except OSError:
                text = ""
            logged = text.count("malformed command")
            if logged < per_node:
                self.report.problems.append(f"{node} logged {logged} of {per_node} malformed commands")
        ran = {r.task for r in runs}
        for task_id in INVALID_IDS:
            if task_id in ran:
                self.report.problems.append(f"a task with the invalid id {task_id[:20]!r} ran")
        outcome = []
        infos = {i.id: i for i in self.client.tasks()}
        for task_id in MALFORMED_PROPS:
            info = infos.get(task_id)
            outcome.append(f"{task_id}: {info.state.value if info else 'absent'}"
                           + (f" ({info.error[:60]})" if info and info.error else ""))
        self.report.notes.append(f"{per_node} bad commands per node dropped and logged; "
                                 f"{len(INVALID_IDS)} invalid ids skipped; " + ", ".join(outcome))
