"""``metafora demo``: a masterless cluster on one machine, a crash, and the proof nothing was lost.

The demo starts ``--nodes`` consumer *processes* (``python -m metafora.demo worker``) on one
store (by default a fresh SQLite file in a temporary directory: no server needed), submits
``--tasks`` tasks whose handler works for a second or two, and shows a live table of the nodes
and the tasks they run. Half-way it SIGKILLs the busiest node: its claims stay put until its
lease runs out (``lease_ttl``, 2.5 s here), then the other nodes claim them and run them
again. At the end it reads the **ledger** -- every handler appends ``start`` / ``end`` /
``stop`` lines with its node and fencing token to one file -- and proves that every task ran
to completion exactly once, that no two runs of a task overlapped, and how long failover took.

Everything goes through the public API (``open_client``, ``open_coordinator``, ``Consumer``),
so the demo runs on any store the processes can share (``--url postgresql://...``; the demo
then works in a namespace of its own).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from urllib.parse import urlencode
from uuid import uuid4

import click
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from metafora.config import parse_store_url
from metafora.connect import ENV_URL, default_url, open_client, open_coordinator
from metafora.consumer import Consumer
from metafora.coordinator import Client
from metafora.errors import ConfigError, CoordinatorUnavailable, MetaforaError
from metafora.handler import simple_handler
from metafora.task import Task, TaskInfo, TaskState
from metafora.testing import FileLedger, LedgerRun

__all__ = [
    "DemoConfig",
    "DemoError",
    "Verdict",
    "demo_url",
    "run_demo",
    "runs_by_task",
    "verify",
    "worker_main",
]

log = logging.getLogger(__name__)

_FINISHED = (TaskState.DONE, TaskState.FAILED, TaskState.EXPIRED)
_POLL = 0.25  # seconds between looks at the store (the live table refreshes at this pace)


class DemoError(MetaforaError):
    """The demo could not run or did not finish (the message says why)."""


@dataclass(frozen=True)
class DemoConfig:
    """What ``metafora demo`` runs: its options, validated."""

    nodes: int = 3
    tasks: int = 30
    url: str | None = None
    lease_ttl: float = 2.5
    min_seconds: float = 1.0
    max_seconds: float = 2.0
    time_limit: float = 55.0
    keep: bool = False
    live: bool | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= 32:
            raise ConfigError(f"the demo needs 2 to 32 nodes (one is killed), got {self.nodes}")
        if not 1 <= self.tasks <= 2000:
            raise ConfigError(f"the demo runs 1 to 2000 tasks, got {self.tasks}")
        if not 1.0 <= self.lease_ttl <= 30.0:
            raise ConfigError(f"the demo's lease_ttl must be 1 to 30 seconds, got {self.lease_ttl}")
        if not 0 < self.min_seconds <= self.max_seconds:
            raise ConfigError("task durations must satisfy 0 < min_seconds <= max_seconds")

    @property
    def max_tasks(self) -> int:
        """Tasks one node runs at once: low enough that all nodes share the work in waves."""
        return max(1, math.ceil(self.tasks / (self.nodes * 2.5)))


# -- the proof ---------------------------------------------------------------------------


def runs_by_task(runs: Sequence[LedgerRun]) -> dict[str, list[LedgerRun]]:
    """The ledger's runs grouped per task, in start order."""
    grouped: dict[str, list[LedgerRun]] = {}
    for run in sorted(runs, key=lambda r: (r.start, r.token)):
        grouped.setdefault(run.task, []).append(run)
    return grouped


@dataclass
class Verdict:
    """What the ledger and the store prove about a demo run."""

    ok: bool
    problems: list[str]
    finished_once: int
    interrupted: list[LedgerRun]  # runs the SIGKILL cut off
    failover: float | None  # seconds from SIGKILL until the last cut-off task ran again
    moves: list[tuple[LedgerRun, LedgerRun]] = field(default_factory=list)  # (cut off, next run)


def verify(
    task_ids: Sequence[str],
    runs: Sequence[LedgerRun],
    states: dict[str, TaskState],
    killed_node: str | None = None,
    kill_time: float | None = None,
) -> Verdict:
    """Check that every task ran to completion exactly once, with no overlapping runs.

    A run without an end is allowed only on ``killed_node`` and only if it started before
    ``kill_time`` (a ``time.time()``): the kill cut it off there. No two runs of a task may
    overlap, and each claim of a task must carry a higher fencing token than the one before.
    """
    grouped = runs_by_task(runs)
    problems: list[str] = []
    interrupted: list[LedgerRun] = []
    moves: list[tuple[LedgerRun, LedgerRun]] = []
    finished_once = 0
    for task_id in task_ids:
        task_runs = grouped.get(task_id, [])
        done = sum(1 for r in task_runs if r.outcome == "done")
        if done == 1:
            finished_once += 1
        else:
            problems.append(f"task {task_id} finished {done} times")
        state = states.get(task_id)
        if state is not TaskState.DONE:
            problems.append(f"task {task_id} is {state.value if state else 'missing'} in the store")
        for prev, nxt in itertools.pairwise(task_runs):
            if nxt.token <= prev.token:
                problems.append(f"task {task_id}: token {nxt.token} came after token {prev.token}")
        ends: list[float] = []
        for i, run in enumerate(task_runs):
            end = run.end
            if end is None:
                if kill_time is not None and run.node == killed_node and run.start <= kill_time:
                    end = kill_time  # the SIGKILL cut it off
                    interrupted.append(run)
                    if i + 1 < len(task_runs):
                        moves.append((run, task_runs[i + 1]))
                else:
                    problems.append(f"task {task_id}: the run on {run.node} (token {run.token}) never ended")
                    end = float("inf")
            ends.append(end)
        for i, run in enumerate(task_runs):
            for later in task_runs[i + 1:]:
                if later.start < ends[i]:
                    problems.append(f"task {task_id}: runs overlapped (token {run.token} on {run.node}, "
                                    f"token {later.token} on {later.node})")
    failover = None
    if kill_time is not None and moves:
        failover = max(nxt.start - kill_time for _, nxt in moves)
    return Verdict(not problems, problems, finished_once, interrupted, failover, moves)


# -- the URL ------------------------------------------------------------------------------


def demo_url(url: str | None, workdir: Path, lease_ttl: float) -> str:
    """The store URL the demo uses: a fresh SQLite file in ``workdir`` unless ``url`` is given.

    A given URL gets the demo's ``lease_ttl`` (whole seconds on etcd, whose leases count in
    seconds) and a namespace of its own (``demo-<hex>``) unless it sets them, so the demo
    never mixes with a real cluster's tasks.
    """
    if url is None:
        return f"sqlite:///{workdir / 'demo.db'}?" + urlencode({"lease_ttl": lease_ttl})
    parsed = parse_store_url(url)
    if parsed.scheme == "memory":
        raise ConfigError(
            "the demo runs its nodes as separate processes; a memory:// store lives in one process "
            "(use sqlite:///PATH.db, or leave --url out for a temporary one)"
        )
    extra: dict[str, str] = {}
    if "lease_ttl" not in parsed.query:
        whole = parsed.scheme in ("etcd", "etcds")
        extra["lease_ttl"] = f"{math.ceil(lease_ttl) if whole else lease_ttl:g}"
    if "namespace" not in parsed.query:
        extra["namespace"] = f"demo-{uuid4().hex[:8]}"
    if not extra:
        return url
    return url + ("&" if "?" in url else "?") + urlencode(extra)


def _lease_ttl_of(url: str, default: float) -> float:
    """The lease TTL the demo's store will use (the URL's, when it sets one)."""
    try:
        return float(parse_store_url(url).query.get("lease_ttl", default))
    except ValueError:
        return default  # the store itself will refuse the URL, with a clearer message


# -- the worker process -------------------------------------------------------------------


def _work(ledger: FileLedger, node: str) -> Callable[[Task, threading.Event], bool]:
    def work(task: Task, stop: threading.Event) -> bool:
        seconds = float(task.props.get("seconds", 1.0))
        ledger.start(task, node)
        if stop.wait(seconds):  # asked to stop (balance, stop command, shutdown): release it
            ledger.end(task, node, "release")
            return False
        ledger.end(task, node, "done")
        return True

    return work


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def _worker_cli() -> None:
    """Internal entry points of ``metafora demo`` (not a public interface)."""


@_worker_cli.command("worker")
@click.option("--url", envvar=ENV_URL, default=None, help="The store (default: $METAFORA_URL).")
@click.option("--node", required=True, help="This node's id.")
@click.option("--ledger", "ledger_path", required=True, type=click.Path(dir_okay=False))
@click.option("--max-tasks", type=click.IntRange(1), default=4, show_default=True)
@click.option("--parent", type=int, default=None, help="Shut down when this process is gone.")
@click.option("--log-level", default="info", show_default=True)
def _worker(url: str | None, node: str, ledger_path: str, max_tasks: int, parent: int | None,
            log_level: str) -> None:
    """Run one demo consumer until SIGTERM/SIGINT (graceful) or the parent goes away."""
    from metafora.logs import configure

    configure(log_level)
    ledger = FileLedger(ledger_path)
    try:
        coordinator = open_coordinator(url or default_url(), node_id=node)
        consumer = Consumer(coordinator, simple_handler(_work(ledger, node)), max_tasks=max_tasks,
                            shutdown_timeout=5.0)
    except MetaforaError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(3 if isinstance(exc, CoordinatorUnavailable) else 2)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("node %s: signal %d, shutting down", node, signum)
        consumer.shutdown()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    finished = threading.Event()
    if parent is not None:
        threading.Thread(target=_watch_parent, args=(parent, consumer, finished),
                         name="demo-parent-watch", daemon=True).start()
    try:
        consumer.run()
    except MetaforaError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(3 if isinstance(exc, CoordinatorUnavailable) else 1)
    finally:
        finished.set()


def _watch_parent(parent: int, consumer: Consumer, finished: threading.Event) -> None:
    """Shut the consumer down if the demo's parent process dies (no orphaned workers)."""
    while not finished.wait(0.5):
        if os.getppid() != parent:
            log.warning("the demo process %d is gone; shutting down", parent)
            consumer.shutdown()
            return


def worker_main(argv: Sequence[str] | None = None) -> None:
    """``python -m metafora.demo worker --node N --ledger PATH`` (the URL from $METAFORA_URL)."""
    _worker_cli.main(args=list(argv) if argv is not None else None, prog_name="python -m metafora.demo")


# -- the parent: start, watch, kill, verify ------------------------------------------------


@dataclass
class _Node:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    killed_at: float | None = None  # monotonic
    gone: bool = False  # its registration left the store (lease expired)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


@dataclass
class _View:
    """What the monitor knows at one instant (rendered as a table or a progress line)."""

    elapsed: float
    infos: list[TaskInfo]
    done_by: Counter[str]
    moved: dict[str, str]  # task id -> node it was taken from


class _Terminated(Exception):
    """SIGTERM reached the demo process."""


class Demo:
    """One run of the demo. :meth:`run` returns the exit code (0: proved, 1: not)."""

    def __init__(self, config: DemoConfig, out: Console, workdir: Path) -> None:
        self.cfg = config
        self.out = out
        self.workdir = workdir  # the demo's own directory: run() removes it unless asked to keep it
        self.url = demo_url(config.url, workdir, config.lease_ttl)
        self.lease_ttl = _lease_ttl_of(self.url, config.lease_ttl)
        self.name = parse_store_url(self.url).redacted()
        self.ledger = FileLedger(self.workdir / "ledger.jsonl")
        self.nodes: list[_Node] = []
        self.task_ids = [f"demo-{i:0{len(str(config.tasks))}d}" for i in range(1, config.tasks + 1)]
        self.events: list[str] = []
        self.started = time.monotonic()
        self.killed: _Node | None = None
        self.kill_wall: float | None = None
        self.victim_tasks: list[str] = []
        self.moved: dict[str, str] = {}
        self.live: Live | None = None
        self.plain = not (config.live if config.live is not None else out.is_terminal)
        self._last_line = ""
        self._last_line_at = 0.0
        self._stop = threading.Event()
        self.verdict: Verdict | None = None
        self._last_view: _View | None = None

    # -- output --

    def note(self, text: str) -> None:
        """An event: a line in plain mode, the newest entry of the event list when live."""
        stamp = f"{time.monotonic() - self.started:5.1f}s"
        self.events.append(f"{stamp}  {text}")
        if self.plain:
            self.out.print(Text(f"{stamp}  {text}"))
        elif self.live is not None and self._last_view is not None:
            self.live.update(self._render(self._last_view))

    def _render(self, view: _View) -> RenderableType:
        running: dict[str, list[str]] = {}
        counts: Counter[TaskState] = Counter()
        for info in view.infos:
            counts[info.state] += 1
            if info.state is TaskState.CLAIMED and info.owner:
                running.setdefault(info.owner, []).append(info.id)
        table = Table(title=f"metafora demo on {self.name}", title_justify="left", expand=False)
        table.add_column("node")
        table.add_column("pid", justify="right")
        table.add_column("status")
        # No wider minimum: the whole table must fit an 80-column terminal (rich crops, not wraps).
        table.add_column("running tasks (←: moved from)", overflow="fold", min_width=16)
        table.add_column("done", justify="right")
        for node in self.nodes:
            if node.killed_at is not None:
                lease = "lease expired" if node.gone else "lease held"
                status = Text(f"killed, {lease}", style="bold red")
            elif node.proc.poll() is not None:
                status = Text(f"exited {node.proc.returncode}", style="red")
            else:
                status = Text("running", style="green")
            cell = Text()
            for task_id in sorted(running.get(node.name, [])):
                if cell:
                    cell.append(" ")
                if task_id in view.moved:
                    cell.append(f"{task_id}←{view.moved[task_id]}", style="bold yellow")
                elif node.killed_at is not None:
                    cell.append(task_id, style="strike dim")
                else:
                    cell.append(task_id)
            table.add_row(node.name, str(node.proc.pid), status, cell, str(view.done_by[node.name]))
        total = len(self.task_ids)
        done = sum(counts[s] for s in _FINISHED)
        progress = Text(
            f"{view.elapsed:5.1f}s  done {done}/{total}  running {counts[TaskState.CLAIMED]}  "
            f"pending {counts[TaskState.PENDING]}"
            + (f"  failed {counts[TaskState.FAILED]}" if counts[TaskState.FAILED] else ""),
            style="bold",
        )
        recent = Text("\n".join(self.events[-6:]), style="dim")
        return Group(table, progress, recent)

    def _plain_progress(self, view: _View) -> None:
        counts = Counter(info.state for info in view.infos)
        per_node = Counter(i.owner for i in view.infos if i.state is TaskState.CLAIMED and i.owner)
        nodes = ", ".join(f"{n.name} {per_node[n.name]}" for n in self.nodes)
        done = sum(counts[s] for s in _FINISHED)
        line = (f"done {done}/{len(self.task_ids)}  running {counts[TaskState.CLAIMED]} ({nodes})  "
                f"pending {counts[TaskState.PENDING]}")
        now = time.monotonic()
        if line != self._last_line and now - self._last_line_at >= 1.0:
            self._last_line, self._last_line_at = line, now
            self.out.print(Text(f"{view.elapsed:5.1f}s  {line}"))

    def show(self, view: _View) -> None:
        """Refresh the live table, or print a progress line when something changed."""
        self._last_view = view
        if self.live is not None:
            self.live.update(self._render(view))
        elif self.plain:
            self._plain_progress(view)

    # -- steps --

    def _spawn(self, name: str) -> _Node:
        log_path = self.workdir / f"{name}.log"
        env = dict(os.environ)
        env[ENV_URL] = self.url  # through the environment: a password never shows in `ps`
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, "-m", "metafora.demo", "worker", "--node", name,
               "--ledger", self.ledger.path, "--max-tasks", str(self.cfg.max_tasks),
               "--parent", str(os.getpid())]
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT, env=env, close_fds=True)
        return _Node(name, proc, log_path)

    def _check_workers(self) -> None:
        for node in self.nodes:
            if node.killed_at is None and node.proc.poll() is not None:
                tail = node.log_tail()
                raise DemoError(f"node {node.name} exited with code {node.proc.returncode}"
                                + (f"; its log ends with:\n{tail}" if tail else ""))

    def _wait(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise _Terminated()

    def _deadline_check(self, what: str) -> None:
        if time.monotonic() - self.started > self.cfg.time_limit:
            raise DemoError(f"the demo did not finish within {self.cfg.time_limit:g}s ({what})")

    def _wait_for_nodes(self, client: Client) -> None:
        names = {n.name for n in self.nodes}
        while True:
            self._check_workers()
            live = set(client.nodes())
            if names <= live:
                return
            self._deadline_check(f"waiting for nodes to register; live: {sorted(live) or 'none'}")
            self._wait(0.05)

    def _submit(self, client: Client) -> None:
        rng = random.Random(self.cfg.seed)
        for task_id in self.task_ids:
            seconds = round(rng.uniform(self.cfg.min_seconds, self.cfg.max_seconds), 2)
            client.submit_task(Task(task_id, {"seconds": seconds}))

    def _kill(self, infos: list[TaskInfo]) -> None:
        held = Counter(i.owner for i in infos if i.state is TaskState.CLAIMED and i.owner)
        candidates = [n for n in self.nodes if n.killed_at is None and held[n.name] > 0]
        if not candidates:
            return
        victim = max(candidates, key=lambda n: (held[n.name], n.name))
        self.kill_wall = time.time()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        victim.killed_at = time.monotonic()
        self.killed = victim
        self.victim_tasks = []  # read back from the store: the dead node can change nothing now

    def _observe(self, client: Client) -> _View:
        infos = client.tasks()
        runs = self.ledger.runs()  # a few hundred short lines: cheap to re-read at 4 Hz
        done_by = Counter(r.node for r in runs if r.outcome == "done")
        killed = self.killed
        if killed is not None and self.kill_wall is not None:
            for run in runs:
                if (run.task in self.victim_tasks and run.node != killed.name
                        and run.task not in self.moved and run.start >= self.kill_wall):
                    self.moved[run.task] = killed.name
                    self.note(f"{run.task} moved {killed.name} → {run.node} "
                              f"{run.start - self.kill_wall:.1f}s after the kill (token {run.token})")
        return _View(time.monotonic() - self.started, infos, done_by, dict(self.moved))

    def _monitor(self, client: Client) -> list[TaskInfo]:
        half = math.ceil(len(self.task_ids) / 2)
        while True:
            self._check_workers()
            view = self._observe(client)
            infos = view.infos
            finished = sum(1 for i in infos if i.state in _FINISHED)
            if self.killed is None and finished >= half and finished < len(infos):
                self._kill(infos)
                if self.killed is not None:
                    victim = self.killed
                    self.victim_tasks = sorted(
                        i.id for i in client.tasks(TaskState.CLAIMED) if i.owner == victim.name)
                    self.note(f"half-way: SIGKILL {victim.name} (pid {victim.proc.pid}) holding "
                              f"{len(self.victim_tasks)} task(s): {', '.join(self.victim_tasks) or '-'}")
                    self.note(f"its claims stay until its lease expires (lease_ttl {self.lease_ttl:g}s)")
                    view = self._observe(client)
            if self.killed is not None and not self.killed.gone and self.killed.name not in client.nodes():
                self.killed.gone = True
                self.note(f"{self.killed.name}'s lease expired: it left the cluster")
            self.show(view)
            if infos and finished == len(self.task_ids):
                return infos
            self._deadline_check(f"{finished}/{len(self.task_ids)} tasks finished")
            self._wait(_POLL)

    def _shutdown(self) -> None:
        """SIGTERM every worker still alive (graceful), SIGKILL what lingers, reap all."""
        alive = [n for n in self.nodes if n.proc.poll() is None]
        for node in alive:
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for node in alive:
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("node %s (pid %d) did not stop; killing it", node.name, node.proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    node.proc.kill()
                node.proc.wait(timeout=10)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_term(signum: int, frame: FrameType | None) -> None:
            self._stop.set()

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def run(self) -> int:
        """Run the demo end to end; the exit code is 0 when the ledger proves the guarantees."""
        keep = True  # a demo that errs keeps its store, ledger and logs for a look
        try:
            with self._signals(), open_client(self.url) as client:
                client.tasks()  # reach the store (and create its schema) before starting nodes
                self.out.print(Text(f"metafora demo: {self.cfg.nodes} nodes, {self.cfg.tasks} tasks, "
                                    f"lease_ttl {self.lease_ttl:g}s, store {self.name}", style="bold"))
                with self._live():
                    for i in range(1, self.cfg.nodes + 1):
                        self.nodes.append(self._spawn(f"node{i}"))
                    self.note("started " + ", ".join(f"{n.name} (pid {n.proc.pid})" for n in self.nodes))
                    self._wait_for_nodes(client)
                    self.note(f"all {len(self.nodes)} nodes registered; "
                              f"submitting {len(self.task_ids)} tasks")
                    self._submit(client)
                    infos = self._monitor(client)
                    self.note(f"all {len(self.task_ids)} tasks finished; stopping the nodes")
                self._shutdown()
                ok = self._summary(infos, time.monotonic() - self.started)
                keep = not ok
                return 0 if ok else 1
        except (KeyboardInterrupt, _Terminated):
            keep = False
            self.out.print(Text("interrupted: stopping the demo's nodes", style="bold red"))
            return 130
        finally:
            self._shutdown()
            if keep or self.cfg.keep:
                self.out.print(Text(f"the demo's files (store, ledger, node logs) are in {self.workdir}",
                                    style="dim"))
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)

    @contextlib.contextmanager
    def _live(self) -> Iterator[None]:
        if self.plain:
            yield
            return
        with Live(console=self.out, refresh_per_second=4, transient=False) as live:
            self.live = live
            try:
                yield
            finally:
                self.live = None

    def _summary(self, infos: list[TaskInfo], elapsed: float) -> bool:
        states = {i.id: i.state for i in infos}
        runs = self.ledger.runs()
        killed = self.killed.name if self.killed else None
        verdict = verify(self.task_ids, runs, states, killed, self.kill_wall)
        total = len(self.task_ids)
        rows: list[tuple[str, Text | str]] = []
        done = sum(1 for s in states.values() if s is TaskState.DONE)
        rows.append(("tasks", f"{total} submitted, {done} done, {len(runs)} handler runs in all"))
        if verdict.ok:
            rows.append(("exactly once", Text(
                f"[ok] every task ran exactly once to completion ({verdict.finished_once}/{total}); "
                "no two runs of a task overlapped; every claim had a higher fencing token", style="green")))
        else:
            rows.append(("exactly once", Text(
                f"[FAILED] {verdict.finished_once}/{total} tasks finished exactly once; "
                f"{len(verdict.problems)} problem(s) below", style="bold red")))
        if self.killed is None:
            rows.append(("failover", "no node was killed (the tasks finished before one held any)"))
        else:
            cut = ", ".join(r.task for r in verdict.interrupted) or "-"
            rows.append(("killed", f"{self.killed.name} by SIGKILL, cutting off {len(verdict.interrupted)} "
                         f"run(s): {cut}"))
            if verdict.failover is not None:
                rows.append(("failover", f"{verdict.failover:.1f}s from SIGKILL until the last of its tasks "
                             f"ran again on another node (lease_ttl {self.lease_ttl:g}s)"))
            else:
                rows.append(("failover", "none needed: it held no unfinished task"))
        done_by = Counter(r.node for r in runs if r.outcome == "done")
        rows.append(("done by", ", ".join(f"{n.name} {done_by[n.name]}" for n in self.nodes)))
        rows.append(("total", f"{elapsed:.1f}s"))
        self._print_summary(rows)
        for problem in verdict.problems[:20]:
            self.out.print(Text(f"problem: {problem}", style="bold red"))
        self.verdict = verdict
        return verdict.ok


    def _print_summary(self, rows: list[tuple[str, Text | str]]) -> None:
        """A table on a terminal; plain lines elsewhere (a table pads every row to its widest)."""
        if self.out.is_terminal:
            table = Table(title="Summary", title_justify="left", show_header=False, box=None,
                          padding=(0, 2, 0, 0))
            table.add_column(style="bold")
            table.add_column()
            for label, value in rows:
                table.add_row(label, value)
            self.out.print(table)
            return
        width = max(len(label) for label, _ in rows)
        self.out.print("Summary")
        for label, value in rows:
            self.out.print(Text(f"{label:<{width}}  ").append(value), soft_wrap=True)


def run_demo(config: DemoConfig, out: Console | None = None) -> int:
    """Run the demo in a fresh temporary directory; 0 when every task provably ran exactly once."""
    if config.url is not None:
        demo_url(config.url, Path(), config.lease_ttl)  # a bad URL fails before any file is made
    workdir = Path(tempfile.mkdtemp(prefix="metafora-demo-"))
    try:
        demo = Demo(config, out or Console(), workdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return demo.run()


if __name__ == "__main__":
    worker_main()
