"""The dashboard's charts: data read from the store within a cap, drawn as inline SVG.

Nothing here writes to the store, and the store keeps no history of events: each chart is
derived from the tasks' current fields, and its caption says how.

- **Throughput** (last hour, per minute): *claims* are the ``claimed_at`` times the store still
  holds -- each running task's, and on SQL and memory:// each finished task's latest claim (etcd
  drops it at the finish); a task claimed twice counts once, a released task has none. *Done*
  and *failed* are finished tasks by their ``finished_at``.
- **Tasks per node**: each live node's held tasks, and its fair share marked -- the total
  held spread over the live nodes in proportion to their ``weight`` (1.0 without one).
- **Pending by reason**: why each pending task waits, the first of :data:`PENDING_REASONS`
  that holds, else *claimable*.

Reads are capped (:data:`CHART_READ` tasks per state, read in id order with the client's
``task_page``) and the captions say when a cap cut a chart short. The SVG uses classes
(styled by ``/static/style.css``) and presentation attributes only, no ``style=``: the
pages run under a CSP without inline style. Every id drawn as text goes through
:func:`shown_id`, the ``|id_text`` filter's escaping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from markupsafe import Markup, escape

from metafora.contracts.client import Client, NodeInfo
from metafora.core.holds import is_held
from metafora.core.limits import GroupUsage, waiting_reason
from metafora.core.masking import escape_controls
from metafora.core.task import TaskInfo, TaskState, matches
from metafora.features.waiting import read_usage

__all__ = [
    "CHART_READ",
    "LABEL_CHARS",
    "PENDING_REASONS",
    "Charts",
    "NodeBar",
    "PendingReason",
    "Throughput",
    "WaitContext",
    "node_bars",
    "nodes_svg",
    "pending_reasons",
    "pending_svg",
    "read_charts",
    "shown_id",
    "throughput",
    "throughput_svg",
]

CHART_READ = 1000
"""Tasks read per state for one refresh of the charts (claimed, done, failed, pending)."""
MAX_NODE_BARS = 40
"""Nodes drawn in the tasks-per-node chart (the first by id); the caption names the rest."""
WINDOW_MINUTES = 60
LABEL_CHARS = 24
"""Characters of a node id drawn as a label (the whole id is in the row's tooltip)."""


def shown_id(value: str, limit: int | None = None) -> Markup:
    """An id as SVG text: control and bidi characters escaped (as ``|id_text`` does), cut to
    ``limit`` characters with an ellipsis, then HTML-escaped."""
    text = escape_controls(value)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return escape(text)


# --- data ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    """Per-minute counts over the window ending at ``end`` (oldest minute first)."""

    end: datetime
    claims: list[int]
    done: list[int]
    failed: list[int]

    @property
    def empty(self) -> bool:
        """Whether nothing happened in the window (as far as the read tasks tell)."""
        return not any(self.claims) and not any(self.done) and not any(self.failed)


def throughput(tasks: Iterable[TaskInfo], now: datetime, minutes: int = WINDOW_MINUTES) -> Throughput:
    """Claims, done and failed per minute over the ``minutes`` before ``now``."""
    series: dict[str, list[int]] = {k: [0] * minutes for k in ("claims", "done", "failed")}
    start = now - timedelta(minutes=minutes)

    def count(name: str, when: datetime | None) -> None:
        if when is not None and start < when <= now:
            index = min(minutes - 1, int((when - start).total_seconds() // 60))
            series[name][index] += 1

    for info in tasks:
        count("claims", info.claimed_at)
        if info.state is TaskState.DONE:
            count("done", info.finished_at)
        elif info.state is TaskState.FAILED:
            count("failed", info.finished_at)
    return Throughput(now, series["claims"], series["done"], series["failed"])


@dataclass(frozen=True)
class NodeBar:
    """One live node in the tasks-per-node chart."""

    id: str
    tasks: int
    share: float
    """The node's fair share: total held x its weight / the live nodes' total weight."""
    weight: float = 1.0
    frozen: bool = False


def node_bars(infos: Sequence[NodeInfo]) -> list[NodeBar]:
    """Each live node's held tasks and fair share, sorted by id."""
    weights = [max(0.0, float(getattr(info, "weight", 1.0) or 0.0)) for info in infos]
    total = sum(info.tasks for info in infos)
    weight_sum = sum(weights)
    bars = []
    for info, weight in zip(infos, weights, strict=True):
        share = total * weight / weight_sum if weight_sum > 0 else total / len(infos)
        bars.append(NodeBar(info.id, info.tasks, share, weight, bool(info.frozen)))
    return sorted(bars, key=lambda bar: bar.id)


@dataclass(frozen=True)
class WaitContext:
    """What the pending reasons look at: the time and the live nodes' labels."""

    now: datetime
    node_labels: Sequence[Mapping[str, str]]
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Room for what later reasons need (e.g. the groups' limits), filled by :func:`read_charts`."""


@dataclass(frozen=True)
class PendingReason:
    """One reason a pending task waits: a key (a CSS class), a label, and its test."""

    key: str
    label: str
    holds: Callable[[TaskInfo, WaitContext], bool]


def _no_node_matches(info: TaskInfo, ctx: WaitContext) -> bool:
    return not any(matches(info.selector, labels) for labels in ctx.node_labels)


def _launch_ahead(info: TaskInfo, ctx: WaitContext) -> bool:
    try:
        launch = info.task().launch_at
    except ValueError:  # a malformed prop: not this chart's business to report
        return False
    return launch is not None and launch > ctx.now


def _group_full(info: TaskInfo, ctx: WaitContext) -> bool:
    usage: dict[str, GroupUsage] = ctx.extra.get("group_usage") or {}
    return waiting_reason(info.group, usage) is not None


PENDING_REASONS: list[PendingReason] = [
    PendingReason("no-node", "no live node matches", _no_node_matches),
    PendingReason("launch-ahead", "launch time ahead", _launch_ahead),
    PendingReason("group-full", "group at its limit", _group_full),
    # Released by a node that stopped with a stable id, waiting for it (metafora.core.holds).
    PendingReason("held", "held for a stopped node", lambda info, ctx: is_held(info, ctx.now)),
    # Extension point: another reason is inserted here (before "claimable", which is what
    # is left); its data goes in WaitContext.extra.
]
CLAIMABLE = PendingReason("claimable", "claimable", lambda info, ctx: True)


def pending_reasons(tasks: Iterable[TaskInfo], ctx: WaitContext,
                    reasons: Sequence[PendingReason] | None = None) -> list[tuple[PendingReason, int]]:
    """How many of the pending ``tasks`` wait for each reason (the first that holds), in
    the reasons' order, ``claimable`` last."""
    order = [*(PENDING_REASONS if reasons is None else reasons), CLAIMABLE]
    counts = dict.fromkeys(range(len(order)), 0)
    for info in tasks:
        if info.state is not TaskState.PENDING:
            continue
        counts[next(i for i, r in enumerate(order) if r.holds(info, ctx))] += 1
    return [(reason, counts[i]) for i, reason in enumerate(order)]


@dataclass(frozen=True)
class Charts:
    """Everything the charts page draws, and what the caps left out."""

    throughput: Throughput
    nodes: list[NodeBar]
    pending: list[tuple[PendingReason, int]]
    read: dict[TaskState, int]
    """Tasks read per state (at most :data:`CHART_READ`)."""
    counts: dict[TaskState, int]
    """Tasks per state in the store (the client's counts)."""

    def capped(self, *states: TaskState) -> bool:
        """Whether the cap left tasks of any of ``states`` unread."""
        return any(self.read.get(s, 0) < self.counts.get(s, 0) for s in states)


def _read(client: Client, state: TaskState, cap: int) -> list[TaskInfo]:
    return client.task_page(state=state, limit=cap) if cap > 0 else []


def read_charts(client: Client, now: datetime, counts: Mapping[TaskState, int],
                cap: int = CHART_READ) -> Charts:
    """Read what the charts need: at most ``cap`` tasks per state, the nodes, the counts."""
    read: dict[TaskState, list[TaskInfo]] = {}
    for state in (TaskState.CLAIMED, TaskState.DONE, TaskState.FAILED, TaskState.PENDING):
        # A state the counts say is empty is not read at all.
        read[state] = _read(client, state, cap) if counts.get(state, 0) else []
    infos = client.node_infos()
    extra: dict[str, Any] = {}
    if any(info.group is not None for info in read[TaskState.PENDING]):
        # the groups' limits are read only when a pending task has a group
        extra["group_usage"] = read_usage(client)
    ctx = WaitContext(now, [dict(getattr(i, "labels", None) or {}) for i in infos], extra)
    finished = [*read[TaskState.CLAIMED], *read[TaskState.DONE], *read[TaskState.FAILED]]
    got = {s: len(tasks) for s, tasks in read.items()}
    # The counts and the pages are separate reads: a caption never says "read 5 of 3".
    total = {s: max(counts.get(s, 0), got.get(s, 0)) for s in TaskState}
    return Charts(throughput(finished, now), node_bars(infos),
                  pending_reasons(read[TaskState.PENDING], ctx), got, total)


# --- SVG ----------------------------------------------------------------------------------


def _ceiling(value: float) -> int:
    """A round axis maximum at or above ``value`` (1, 2, 5 x 10^n)."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if step * m >= value:
                return step * m
        step *= 10


def _svg(name: str, width: int, height: int, label: str, body: list[str]) -> Markup:
    return Markup(
        f'<svg class="chart" id="chart-{name}" viewBox="0 0 {width} {height}" width="100%"'
        f' role="img" aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">'
        + "".join(body) + "</svg>")


def _empty(name: str, text: str) -> Markup:
    return Markup(f'<p class="hint chart-empty" id="chart-{name}-empty">{escape(text)}</p>')


def throughput_svg(data: Throughput) -> Markup:
    """Grouped bars per minute (claims, done, failed); an empty state when nothing happened."""
    if data.empty:
        return _empty("throughput", "No claims and no finished tasks in the last hour.")
    minutes = len(data.claims)
    left, top, width, height = 40, 10, 1080, 200
    top_value = _ceiling(max(*data.claims, *data.done, *data.failed))
    slot = width / minutes
    bar = slot / 4
    body = [f'<line class="axis" x1="{left}" y1="{top + height}" x2="{left + width}" y2="{top + height}"/>']
    for tick in (0, top_value // 2, top_value) if top_value > 1 else (0, top_value):
        y = top + height - height * tick / top_value
        body.append(f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{left + width}" y2="{y:.1f}"/>'
                    f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick}</text>')
    for m in range(0, minutes + 1, 10):
        x = left + m * slot
        ago = minutes - m
        body.append(f'<text class="tick" x="{x:.1f}" y="{top + height + 16}" text-anchor="middle">'
                    f'{"now" if ago == 0 else f"-{ago}m"}</text>')
    for offset, (name, values) in enumerate((("claims", data.claims), ("done", data.done),
                                             ("failed", data.failed))):
        for m, value in enumerate(values):
            if value:
                h = height * value / top_value
                x = left + m * slot + bar * (offset + 0.5)
                since = data.end - timedelta(minutes=minutes - m)
                until = since + timedelta(minutes=1)
                body.append(f'<rect class="bar {name}" x="{x:.1f}" y="{top + height - h:.1f}"'
                            f' width="{bar:.1f}" height="{h:.1f}"><title>{since:%H:%M:%S}'
                            f' to {until:%H:%M:%S} UTC: {value} {name}</title></rect>')
    return _svg("throughput", left + width + 24, top + height + 24,
                "claims, done and failed per minute over the last hour", body)


def nodes_svg(bars: Sequence[NodeBar], limit: int = MAX_NODE_BARS) -> Markup:
    """A bar per node (held tasks) with its fair share marked; an empty state without nodes."""
    if not bars:
        return _empty("nodes", "No live nodes.")
    shown = list(bars)[:limit]
    left, row, width = 210, 24, 500
    top_value = _ceiling(max(*(b.tasks for b in shown), *(b.share for b in shown), 1))
    body = []
    for i, b in enumerate(shown):
        y = 6 + i * row
        w = width * b.tasks / top_value
        mark = left + width * b.share / top_value
        name = shown_id(b.id)
        frozen = " frozen" if b.frozen else ""
        body.append(
            f'<g class="node-row{frozen}"><title>{name}: {b.tasks} tasks, fair share {b.share:.1f}'
            f' (weight {b.weight:g}){", frozen" if b.frozen else ""}</title>'
            f'<text class="label" x="{left - 8}" y="{y + 15}" text-anchor="end">'
            f'{shown_id(b.id, LABEL_CHARS)}</text>'
            f'<rect class="bar node{frozen}" x="{left}" y="{y + 3}" width="{w:.1f}" height="{row - 8}"/>'
            f'<text class="value" x="{left + w + 4:.1f}" y="{y + 15}">{b.tasks}</text>'
            f'<line class="share" x1="{mark:.1f}" y1="{y}" x2="{mark:.1f}" y2="{y + row - 2}"/></g>')
    return _svg("nodes", left + width + 40, 12 + len(shown) * row,
                "tasks per node with each node's fair share", body)


def pending_svg(pending: Sequence[tuple[PendingReason, int]]) -> Markup:
    """A bar per reason a pending task waits; an empty state when none waits."""
    if not any(n for _, n in pending):
        return _empty("pending", "No pending tasks.")
    left, row, width = 170, 26, 520
    top_value = _ceiling(max(n for _, n in pending))
    body = []
    for i, (reason, n) in enumerate(pending):
        y = 6 + i * row
        w = width * n / top_value
        key = escape(reason.key)
        body.append(
            f'<g class="reason-row"><title>{escape(reason.label)}: {n}</title>'
            f'<text class="label" x="{left - 8}" y="{y + 16}" text-anchor="end">{escape(reason.label)}</text>'
            f'<rect class="bar {key}" x="{left}" y="{y + 3}" width="{w:.1f}" height="{row - 8}"/>'
            f'<text class="value" x="{left + w + 4:.1f}" y="{y + 16}">{n}</text></g>')
    return _svg("pending", left + width + 60, 12 + len(pending) * row, "pending tasks by reason", body)
