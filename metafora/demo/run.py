"""The demo's parent process: start the nodes, watch, kill the busiest, verify."""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from metafora.contracts.client import Client
from metafora.core.config import parse_store_url
from metafora.core.task import Task, TaskInfo, TaskState
from metafora.demo.config import FINISHED, POLL_SECONDS, DemoConfig, DemoError, demo_url, lease_ttl_of
from metafora.demo.proof import Verdict, verify
from metafora.surfaces.connect import ENV_URL, open_client
from metafora.testing import FileLedger

log = logging.getLogger(__name__)


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
        self.lease_ttl = lease_ttl_of(self.url, config.lease_ttl)
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
        done = sum(counts[s] for s in FINISHED)
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
        done = sum(counts[s] for s in FINISHED)
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
            finished = sum(1 for i in infos if i.state in FINISHED)
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
            self._wait(POLL_SECONDS)

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
        # Ctrl-C interrupts the demo even when it was started with SIGINT ignored (a parent
        # that ignores it passes that on, and Python then raises no KeyboardInterrupt): its
        # nodes, which set their own handler, would stop while the demo waited on.
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous_int)
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
        verdict = verify(self.task_ids, runs, states, killed, self.kill_wall, self.victim_tasks)
        total = len(self.task_ids)
        rows: list[tuple[str, Text | str]] = []
        done = sum(1 for s in states.values() if s is TaskState.DONE)
        rows.append(("tasks", f"{total} submitted, {done} done, {len(runs)} handler runs in all"))
        if verdict.ok:
            rows.append(("exactly once", Text(
                f"[ok] every task ran exactly once to completion ({verdict.finished_once}/{total}); "
                "no two runs of a task overlapped; every claim had a higher fencing token", style="green")))
            for first, again in verdict.redone:
                rows.append(("ran again", Text(
                    f"{first.task}: its run on {first.node} ended just before the SIGKILL, before its "
                    f"outcome was stored, so it ran once more on {again.node} (token {again.token}): "
                    "a handler's end counts once its outcome is written (docs/handlers.md)",
                    style="yellow")))
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

