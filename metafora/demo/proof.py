"""The proof of a demo run: every task ran to completion exactly once, no runs overlapped."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from metafora.task import TaskState
from metafora.testing import LedgerRun


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


