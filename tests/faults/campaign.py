"""One scenario of the fault campaign: a fleet of consumer processes, load, faults, verdict.

:class:`Campaign` starts consumer processes (:mod:`tests.faults.worker`) on one store
(:mod:`tests.faults.stores`), submits tasks, injects the scenario's faults under load,
submits one task pinned to each surviving consumer (each must work again, without a
restart), waits with deadlines for every task to finish and every run to end, stops every
process by pid, and judges the ledger (:mod:`tests.faults.ledger`):

- ``sigkill``: SIGKILL random busy consumers; start replacements.
- ``zombie``: SIGSTOP a busy consumer past its lease TTL until its tasks run elsewhere,
  then SIGCONT: its handlers must self-fence or have their writes refused.
- ``store_restart``: PostgreSQL killed and restarted; an etcd follower, then the leader,
  stopped and restarted (the cluster keeps its quorum).
- ``network_cut``: the store unreachable for longer than the TTL (PostgreSQL stopped; etcd
  without quorum), then back: every running handler must have been told to stop (the
  owner self-fences) before it comes back.
- ``malformed``: raw malformed commands to every consumer (followed by a valid one, which
  must still be obeyed) and raw tasks with malformed props or invalid ids.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metafora import Task, open_client
from metafora.contracts.client import Client
from metafora.core.commands import stop_task
from metafora.core.errors import MetaforaError, TaskExists
from metafora.core.task import TaskState
from tests.faults.ledger import FaultLog, Ledger, Report, Run, analyze, runs_of, stalls
from tests.faults.stores import INVALID_IDS, MALFORMED_PROPS, Store
from tests.faults.waiting import hold, poll
from tests.faults.worker import WorkerSpec, worker_main

__all__ = ["Campaign", "Fleet", "Size"]

_INF = float("inf")
_UP_DEADLINE = 90.0  # seconds for a spawned consumer to import, register and report
_STOP_DEADLINE = 20.0  # seconds for a consumer to shut down after SIGTERM
_FINISH_STATES = (TaskState.DONE, TaskState.FAILED)
_HANDLER_LAG = 10.0  # seconds a handler may take to return after stop() (a store call)
_MALFORMED_GRACE = 20.0  # seconds more for malformed tasks (SQL full scans run every 5 s)


class Fleet:
    """Consumer processes on one store, signalled by pid; always stopped in ``stop_all``."""

    def __init__(self, url: str, workdir: Path, ledger: Ledger, faults: FaultLog,
                 client: Client, max_tasks: int, write_every: float, broken: str = "") -> None:
        self.url = url
        self.workdir = workdir
        self.ledger = ledger
        self.faults = faults
        self.client = client
        self._max_tasks = max_tasks
        self._every = write_every
        self._broken = broken
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
                              self._max_tasks, self._every, self._broken)
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
                 seed: int | None = None, *, broken: str = "") -> None:
        """``broken``: a negative control's broken consumer (tests/faults/worker.py's module
        doc: ``unfenced``, ``no_self_fence``, ``lose``, ``quiet_malformed``, ``fragile``,
        ``no_takeover``); the checker it targets must then report a problem."""
        if scenario not in self.SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}")
        self.store = store
        self.scenario = scenario
        self.size = size
        self.workdir = workdir
        self.seed = seed if seed is not None else random.randrange(2**32)
        self.rng = random.Random(self.seed)  # the seed is in the report: a run can be replayed
        self.namespace = "f" + uuid.uuid4().hex[:10]
        self.url = store.url(self.namespace, size.lease_ttl)
        self.ledger = Ledger(workdir / "ledger.jsonl")
        self.faults = FaultLog()
        self.broken = broken
        self.report = Report(store.kind, scenario + (f" ({broken} control)" if broken else ""))
        self.report.notes.append(f"seed {self.seed}")
        self.expected: dict[str, str] = {}  # task id -> "done" | "failed" | "finished"
        self.submitted: dict[str, float] = {}  # task id -> when it was first submitted
        self._next_task = 0
        self.client: Client | None = None
        self.fleet: Fleet | None = None

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> Report:
        """Run the scenario end to end; every process is stopped before this returns."""
        began = time.monotonic()
        self.client = open_client(self.url)
        self.fleet = Fleet(self.url, self.workdir, self.ledger, self.faults, self.client,
                           self.size.max_tasks, self.size.write_every, self.broken)
        try:
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
            self.report.problems.extend(
                stalls(runs, self.submitted, self.faults, 2 * self.size.lease_ttl + 4.0))
            self._check_lost(runs)
            self._scenario_checks(runs)
            self.report.faults = len(self.faults.injected)
            self.report.tasks = len(self.expected)
        finally:
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
        self.submitted.setdefault(task.id, time.monotonic())

        def submit() -> bool:
            try:
                client.submit_task(task)
            except TaskExists:
                pass  # an earlier attempt went through before its answer was lost
            return True

        poll(submit, 60, f"submitting {task.id}")

    def _batch(self) -> int:
        """Tasks to submit before each fault."""
        return max(1, (self.size.tasks // 2) // max(1, self.size.faults))

    def _open_runs(self) -> dict[str, list[Run]]:
        """Runs started and not ended, per node (from the ledger)."""
        runs, _ = runs_of(self.ledger.events())
        out: dict[str, list[Run]] = {}
        for run in runs.values():
            if run.end is None and run.node not in self.faults.killed:
                out.setdefault(run.node, []).append(run)
        return out

    def _done_count(self) -> int:
        return sum(1 for e in self.ledger.events() if e["e"] == "end" and e["why"] == "done")

    def _load(self) -> None:
        """Submit a batch and wait until the fleet runs several tasks: faults hit under load."""
        self._submit(self._batch())
        want = min(2 * len(self.fleet.alive()) if self.fleet else 2, self._batch())
        poll(lambda: sum(len(v) for v in self._open_runs().values()) >= want, 60,
             f"{want} tasks running")

    def _wait_progress(self, mark: int, count: int = 2, timeout: float = 60.0) -> None:
        """After a fault: wait until ``count`` more runs than ``mark`` finished (work goes on).

        Progress can only show while work remains: on a slow machine the whole load may have
        finished elsewhere while the fault lasted (a zombie frozen until its tasks moved), and
        waiting for more "done" then timed out although nothing had stalled. So the fleet is
        given ``count`` fresh tasks whenever fewer than that are still unfinished.
        """
        if self._unfinished() < count:
            self._submit(count)
        poll(lambda: self._done_count() >= mark + count, timeout,
             f"{count} more tasks to finish after the fault")

    def _unfinished(self) -> int:
        """Submitted tasks that have not ended done yet."""
        done = {e["k"] for e in self.ledger.events() if e["e"] == "end" and e["why"] == "done"}
        return sum(1 for task_id, want in self.expected.items() if want == "done" and task_id not in done)

    def _wait_busy(self) -> str:
        """Wait until a live node runs a task; returns one such node (at random)."""
        assert self.fleet is not None
        fleet = self.fleet

        def busy() -> str | None:
            open_runs = self._open_runs()
            loaded = [n for n in fleet.alive() if open_runs.get(n)]
            return self.rng.choice(loaded) if loaded else None

        node = poll(busy, 60, "a node running tasks")
        assert node is not None
        return node

    # -- scenarios ------------------------------------------------------------------------

    def _scenario_sigkill(self) -> None:
        """SIGKILL a random busy consumer, start a replacement; repeated."""
        assert self.fleet is not None
        self._submit(self.size.tasks // 2)
        for _ in range(self.size.faults):
            self._load()
            victim = self._wait_busy()
            mark = self._done_count()
            self.fleet.kill(victim)
            self.fleet.start(1)
            self._wait_progress(mark)

    def _scenario_zombie(self) -> None:
        """SIGSTOP a busy consumer past its lease until its tasks run elsewhere, then SIGCONT."""
        assert self.fleet is not None
        self._submit(self.size.tasks // 2)
        ttl = self.size.lease_ttl
        for _ in range(self.size.faults):
            self._load()
            victim = self._wait_busy()
            frozen = {(r.task, r.token) for r in self._open_runs().get(victim, [])}
            stopped = self.fleet.freeze(victim)
            self.faults.add("sigstop", victim)
            hold(ttl + 1.0)
            # Keep it frozen until one of its tasks runs under a newer token (a true zombie).
            try:
                poll(functools.partial(self._taken_over, frozen), 3 * ttl + 10,
                     "a frozen task to move")
            except AssertionError:
                self.report.problems.append(
                    f"no task of the frozen {victim} was taken over within {3 * ttl + 10} s: "
                    "no zombie was made")
            mark = self._done_count()
            resumed = self.fleet.thaw(victim)
            self.faults.frozen.setdefault(victim, []).append((stopped, resumed))
            poll(functools.partial(self._old_runs_ended, victim, frozen), 30,
                 f"the zombie {victim}'s old runs to end")
            self._wait_progress(mark)

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
            self._load()
            mark = self._done_count()
            done = self.store.restart(index)
            self.faults.add("store_restart", done)
            if index < 2:
                self.report.notes.append(done)
            self._wait_progress(mark)

    def _scenario_network_cut(self) -> None:
        """Take the store away for longer than the lease TTL, then bring it back."""
        self._submit(self.size.tasks // 2)
        for _ in range(max(1, self.size.faults // 2)):
            self._load()
            mark = self._done_count()
            begin, end = self.store.cut(self.size.lease_ttl + 2.0)
            self.faults.cuts.append((begin, end))
            self.faults.add("network_cut", self.store.kind)
            self._wait_progress(mark)

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
        self._load()
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

    def _finished(self, wanted: Sequence[str]) -> bool:
        assert self.client is not None
        states = {i.id: i.state for i in self.client.tasks()}
        return all(states.get(t) in _FINISH_STATES for t in wanted)

    def _survivor_died(self) -> bool:
        """Whether a consumer the campaign never killed has exited: the survivor check fails
        the scenario, and its pinned recovery task and open runs would only be waited out."""
        assert self.fleet is not None
        return any(not self.fleet.procs[n].is_alive() for n in self.fleet.survivors())

    def _wait_finished(self) -> None:
        """Wait for the real tasks, then (briefly) for the malformed ones; verdicts come later."""
        real = [t for t, want in self.expected.items() if want == "done"]
        with contextlib.suppress(AssertionError):
            poll(lambda: self._finished(real) or self._survivor_died(), self.size.deadline,
                 "every task to finish", every=0.25)
        with contextlib.suppress(AssertionError):
            poll(lambda: self._finished(list(self.expected)) or self._survivor_died(),
                 _MALFORMED_GRACE, "the malformed tasks to finish", every=0.25)

    def _wait_runs_ended(self) -> None:
        with contextlib.suppress(AssertionError):
            poll(lambda: not self._open_runs() or self._survivor_died(), 30, "every run to end")

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
                    since = run.start if run.claimed is None else min(run.claimed, run.start)
                    if run.node != node or since > stopped or (run.end or _INF) < stopped:
                        continue
                    frozen_runs += 1
                    superseded += any(o.task == run.task and o.token > run.token and o.node != node
                                      for o in runs)
                    late += sum(1 for m0, _ in run.writes if m0 >= resumed)
                    if run.refused:
                        refused += 1
                    elif run.why == "stopped":
                        fenced += 1
        if frozen_runs == 0:
            self.report.problems.append("no run was frozen: the zombie scenario proved nothing")
        elif superseded == 0:
            self.report.problems.append("no frozen run was re-claimed elsewhere: no takeover was "
                                        "seen, so no zombie was made")
        self.report.notes.append(
            f"{frozen_runs} frozen runs, {superseded} re-claimed elsewhere; after SIGCONT "
            f"{refused} had a write refused, {fenced} self-fenced, {late} writes accepted")

    def _check_cuts(self, runs: list[Run]) -> None:
        """Every run active at a cut ended, or was told to stop (self-fencing), before the
        store came back.

        A handler inside a store call when the store vanished returns when that call gives
        up (etcd: the request timeout); that lag is reported. Whether it acted on a stale
        claim meanwhile is judged by the overlap and stale-write checks.
        """
        active = before = 0
        lag = 0.0
        for begin, end in self.faults.cuts:
            for run in runs:
                if run.start >= begin or (run.end is not None and run.end <= begin):
                    continue
                if run.node in self.faults.killed:
                    continue
                active += 1
                ended = run.end is not None and run.end < end
                before += ended
                if run.stopped is None:
                    if not ended:
                        self.report.problems.append(
                            f"{run.task}: run of token {run.token} on {run.node} was not "
                            "stopped while the store was cut off (no self-fencing)")
                    continue  # it finished its work as the cut began
                if run.stopped >= end and not ended:
                    self.report.problems.append(
                        f"{run.task}: run of token {run.token} on {run.node} was told to stop "
                        "only after the store came back (no self-fencing)")
                    continue
                lag = max(lag, (run.end if run.end is not None else _INF) - run.stopped)
        if active == 0:
            self.report.problems.append("no run was active at the cut: it proved nothing")
        if lag > _HANDLER_LAG:
            self.report.problems.append(f"a handler took {lag:.1f}s to return after stop()")
        self.report.notes.append(
            f"{active} runs active at the cut, each ended or told to stop while it lasted; "
            f"{before} had returned before the store came back; slowest return after stop(): "
            f"{lag:.2f}s")

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
