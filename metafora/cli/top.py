"""``metafora top``: a live terminal view of a cluster (nodes, tasks by state, claim rates,
the groups at their limit and how many pending tasks wait on each)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from metafora.consumer.cluster_metrics import ClusterSnapshot, backlog_line, read_backlog
from metafora.contracts.client import Client, NodeInfo
from metafora.core.holds import held_by_node
from metafora.core.limits import GroupUsage
from metafora.core.masking import escape_controls, for_terminal
from metafora.core.retention import Retention
from metafora.core.task import TaskInfo, TaskState, label_text, placement_reason
from metafora.features.waiting import read_usage, waiting_groups

__all__ = ["Snapshot", "frozen_text", "render", "run_top", "take_snapshot"]


@dataclass(frozen=True)
class Snapshot:
    """The cluster at one moment, as one client read it."""

    at: float
    now: datetime
    nodes: list[NodeInfo]
    tasks: dict[str, TaskInfo] = field(repr=False)
    usage: dict[str, GroupUsage] = field(default_factory=dict)
    """The limited groups' usage, read only when a pending task has a group."""
    cluster: ClusterSnapshot | None = None
    """The backlog and capacity as the nodes' ``/metrics`` show them (None: not read)."""
    retention: Retention | None = None
    """The namespace's retention policy (None: the store keeps none)."""

    def by_state(self) -> dict[TaskState, int]:
        """How many tasks are in each state."""
        counts = dict.fromkeys(TaskState, 0)
        for info in self.tasks.values():
            counts[info.state] += 1
        return counts

    def unplaceable(self) -> int:
        """How many pending tasks no live node can run (their selector matches no labels)."""
        labels = [n.labels for n in self.nodes]
        return sum(1 for info in self.tasks.values()
                   if info.state is TaskState.PENDING and info.selector
                   and placement_reason(info.selector, labels) is not None)

    def waiting(self) -> list[tuple[GroupUsage, int]]:
        """Each group at its limit, with how many pending tasks wait on it (by group name)."""
        return waiting_groups(self.tasks.values(), self.usage, [n.labels for n in self.nodes])


def take_snapshot(client: Client) -> Snapshot:
    """Read nodes and tasks from the store, and the groups' usage when a pending task has a
    group (no more reads otherwise)."""
    nodes = client.node_infos()
    tasks = {t.id: t for t in client.tasks()}
    grouped = any(t.state is TaskState.PENDING and t.group is not None for t in tasks.values())
    usage = read_usage(client) if grouped else {}
    cluster, retention = read_backlog(client)
    return Snapshot(time.monotonic(), datetime.now(UTC), nodes, tasks, usage, cluster, retention)


def rates(prev: Snapshot | None, cur: Snapshot) -> tuple[float, float]:
    """(claims/s, releases/s) between two snapshots.

    Claims: increments of each task's ``attempts``. Releases: tasks that were claimed (or were
    claimed meanwhile) and are pending again.
    """
    if prev is None or cur.at <= prev.at:
        return 0.0, 0.0
    claims = releases = 0
    for task_id, info in cur.tasks.items():
        old = prev.tasks.get(task_id)
        before = old.attempts if old else 0
        claims += max(0, info.attempts - before)
        if info.state is TaskState.PENDING and old is not None and (
            old.state is TaskState.CLAIMED or info.attempts > before
        ):
            releases += 1
    span = cur.at - prev.at
    return claims / span, releases / span


def _age(now: datetime, then: datetime | None) -> str:
    if then is None:
        return "-"
    seconds = max(0.0, (now - then).total_seconds())
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def frozen_text(frozen: bool | None) -> str:
    """``yes`` or ``no``; a node that never reported (None) was never frozen: nodes start unfrozen."""
    return "yes" if frozen else "no"


def render(store: str, prev: Snapshot | None, cur: Snapshot, *, live: bool = True) -> RenderableType:
    """One frame of the view (``live=False``: a one-off snapshot, without the key hint)."""
    nodes = Table(title="nodes", expand=False)
    labelled = any(n.labels for n in cur.nodes)
    for col in ("node", "host", "tasks", "frozen", "heartbeat age") + (("labels",) if labelled else ()):
        nodes.add_column(col, justify="right" if col == "tasks" else "left")
    for n in cur.nodes:
        # Text, not str: rich would read "[...]" in a stored name as markup; escaped and masked
        # like every table of the CLI.
        row: list[RenderableType] = [Text(escape_controls(n.id)), Text(for_terminal(n.host or "-")),
                                     str(n.tasks), frozen_text(n.frozen), _age(cur.now, n.heartbeat)]
        nodes.add_row(*row, *((Text(for_terminal(label_text(n.labels) or "-")),) if labelled else ()))
    states = Table(title="tasks", expand=False)
    counts = cur.by_state()
    for state in TaskState:
        states.add_column(state.value, justify="right")
    states.add_row(*(str(counts[s]) for s in TaskState))
    claims, releases = rates(prev, cur)
    hint = " — press q to quit" if live else ""
    header = Text(f"metafora top — {store} — {cur.now:%H:%M:%S} UTC{hint}", style="bold")
    footer = Text(f"claims/s {claims:.1f}   releases/s {releases:.1f}   nodes {len(cur.nodes)}")
    for node, (count, until) in held_by_node(cur.tasks.values(), cur.now).items():
        footer.append(f"   held for {escape_controls(node)} {count} until {until:%H:%M:%S}",
                      style="blue")
    stuck = cur.unplaceable()
    if stuck:
        footer.append(f"   pending with no matching node {stuck}", style="yellow")
    waiting = _waiting_table(cur)
    line = backlog_line(cur.cluster, cur.retention)
    if line:
        footer.append("\n" + line)
    return Group(header, nodes, states, *((waiting,) if waiting is not None else ()), footer)


def _waiting_table(cur: Snapshot) -> Table | None:
    """The groups at their limit and their waiting pending tasks; None when no group is full."""
    full = cur.waiting()
    if not full:
        return None
    table = Table(title="waiting", expand=False)
    table.add_column("group")
    table.add_column("reason")
    table.add_column("pending", justify="right")
    for usage, count in full:
        # Text, not str: a group name is stored text (see the nodes table).
        table.add_row(Text(for_terminal(usage.limit.group)),
                      Text(usage.condition() or "", style="yellow"), str(count))
    return table


@contextlib.contextmanager
def _keys(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` when 'q' is pressed (only when stdin is a terminal)."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read() -> None:
        while not stop.is_set():
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready and os.read(fd, 1) in (b"q", b"Q"):
                stop.set()

    reader = threading.Thread(target=read, name="metafora-top-keys", daemon=True)
    reader.start()
    try:
        yield
    finally:
        stop.set()
        reader.join(1)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _stop_on_sigterm(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` on SIGTERM, so the live view ends through its exit path (cursor shown again).

    The default action would kill the process with the terminal's cursor still hidden. Only
    the main thread may set signal handlers; elsewhere the default stays.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_top(client: Client, *, interval: float = 1.0, console: Console | None = None,
            frames: int | None = None) -> None:
    """Show the live view until 'q', Ctrl-C, SIGTERM or ``frames`` refreshes.

    When ``console`` is not a terminal (a pipe, a file) it prints one snapshot and returns.
    """
    console = console or Console()
    if not console.is_terminal:
        console.print(render(client.name, None, take_snapshot(client), live=False))
        return
    stop = threading.Event()
    prev: Snapshot | None = None
    shown = 0
    try:
        with _keys(stop), _stop_on_sigterm(stop), \
                Live(console=console, auto_refresh=False, transient=False) as live:
            while not stop.is_set():
                cur = take_snapshot(client)
                live.update(render(client.name, prev, cur), refresh=True)
                prev, shown = cur, shown + 1
                if frames is not None and shown >= frames:
                    break
                stop.wait(interval)
    except KeyboardInterrupt:
        pass
