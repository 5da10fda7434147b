"""The ledger outside the store, and the judge that reads it after a scenario.

Every consumer process appends JSON lines to one :class:`Ledger`: each run's start and end
and each state write the store ACCEPTED or REFUSED, with the claim's token and the
system-wide monotonic time before and after the call (``CLOCK_MONOTONIC`` is shared by the
processes of one machine, so times from different processes compare). The campaign keeps
its own :class:`FaultLog` (kills, freezes, store cuts). :func:`analyze` then finds:

- **stale writes accepted**: an accepted write of token T that began after a run of the same
  task with a token T' > T had started (so after the store handed out T'). The store must
  refuse it. This is the primary proof of fencing, and it judges what a zombie did after
  SIGCONT. It also covers "a write of T accepted after a write of T' > T": that write of T'
  began after its run had started.
- **overlaps**: two runs of one task whose valid periods intersect. A run is valid from its
  start until the earliest of its end, its node's SIGKILL, its node's SIGSTOP (a frozen
  handler does nothing; what it does after SIGCONT is judged by its writes) and the end of
  its first refused write (the store said the claim was gone by then).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FaultLog", "Ledger", "Report", "Run", "analyze", "runs_of", "stalls"]

_INF = float("inf")


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
    claimed: float | None = None  # when the consumer made the handler (right after the claim)
    stopped: float | None = None  # when the consumer first called the handler's stop()

    def valid_until(self, faults: FaultLog) -> float:
        """The end of the period in which this run may have acted under a valid token.

        A node frozen between the claim and the handler's start counts too: its handler
        then starts after SIGCONT under a token that may long be stale (judged by writes).
        """
        ends = [self.end if self.end is not None else _INF]
        killed = faults.killed.get(self.node)
        if killed is not None and killed >= self.start:
            ends.append(killed)
        since = self.start if self.claimed is None else min(self.claimed, self.start)
        for stopped, _ in faults.frozen.get(self.node, []):
            if stopped >= since:
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
                "lost": len(self.lost), "seconds": self.seconds,
                "control": self.scenario.endswith("(unfenced control)"),
                "notes": "; ".join(self.notes)}

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
    made: dict[tuple[str, str, int], float] = {}
    anomalies: list[str] = []
    for e in events:
        if e["e"] not in ("made", "start", "stop", "end", "write", "refused", "unavailable"):
            continue
        key = (e["k"], e["n"], int(e["tok"]))
        if e["e"] == "made":
            made[key] = float(e["m"])
            continue
        if e["e"] == "start":
            if key in runs:
                anomalies.append(f"run {key} started twice")
            runs[key] = Run(key[0], key[1], key[2], float(e["m"]), claimed=made.get(key))
            continue
        run = runs.get(key)
        if run is None:
            # The consumer may stop a handler it has made before its run() begins (its claim was
            # lost or the node shut down meanwhile): the run never starts, which is no anomaly.
            if e["e"] != "stop":
                anomalies.append(f"{e['e']} of {key} without a start")
            continue
        if e["e"] == "stop":
            run.stopped = float(e["m"]) if run.stopped is None else run.stopped
        elif e["e"] == "end":
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


def stalls(runs: Sequence[Run], submitted: Mapping[str, float], faults: FaultLog,
           threshold: float) -> list[str]:
    """Periods longer than ``threshold`` s in which no handler ran although work waited.

    Work waited during a gap if a run that started after it belongs to a task submitted
    before it and not yet done. Time the store was cut off does not count. This catches a
    cluster that recovers only at its safety-net poll (a lost wake-up).
    """
    spans = sorted((r.start, _effective_end(r, faults)) for r in runs)
    gaps: list[tuple[float, float]] = []
    reach = -_INF
    for start, end in spans:
        if reach != -_INF and start > reach:
            gaps.append((reach, start))
        reach = max(reach, end)
    done_at: dict[str, float] = {}
    for r in runs:
        if r.why == "done" and r.end is not None:
            done_at[r.task] = min(done_at.get(r.task, _INF), r.end)
    out = []
    for g0, g1 in gaps:
        cut = sum(max(0.0, min(g1, c1) - max(g0, c0)) for c0, c1 in faults.cuts)
        if g1 - g0 - cut <= threshold:
            continue
        waiting = sorted({r.task for r in runs if r.start >= g1
                          and submitted.get(r.task, _INF) <= g0 and done_at.get(r.task, _INF) > g0})
        if waiting:
            out.append(f"stall: no handler ran for {g1 - g0 - cut:.1f}s although "
                       f"{', '.join(waiting[:5])} waited")
    return out


def _effective_end(run: Run, faults: FaultLog) -> float:
    if run.end is not None:
        return run.end
    killed = faults.killed.get(run.node)
    return killed if killed is not None else _INF
