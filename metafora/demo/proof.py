"""The proof of a demo run: every task ran to completion exactly once, no runs overlapped."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from metafora.core.task import TaskState
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
    # Tasks whose run on the killed node had ended (done) but whose outcome the kill cut off
    # before it was stored: they ran again elsewhere (a handler's end is durable once stored).
    redone: list[tuple[LedgerRun, LedgerRun]] = field(default_factory=list)


def verify(
    task_ids: Sequence[str],
    runs: Sequence[LedgerRun],
    states: dict[str, TaskState],
    killed_node: str | None = None,
    kill_time: float | None = None,
    unstored: Sequence[str] = (),
) -> Verdict:
    """Check that every task ran to completion exactly once, with no overlapping runs.

    A run without an end is allowed only on ``killed_node`` and only if it started before
    ``kill_time`` (a ``time.time()``): the kill cut it off there. No two runs of a task may
    overlap, and each claim of a task must carry a higher fencing token than the one before.

    ``unstored``: tasks the store still showed claimed by ``killed_node`` right after the
    kill. Such a task whose run there had ended (done) before the kill had no outcome stored
    yet: the kill fell between its handler's end and that write, and it ran to completion
    once more elsewhere (at-least-once for that moment, see docs/handlers.md). It is listed
    in ``redone``, not counted as a problem; a second completion any other way is one.
    """
    grouped = runs_by_task(runs)
    problems: list[str] = []
    interrupted: list[LedgerRun] = []
    moves: list[tuple[LedgerRun, LedgerRun]] = []
    redone: list[tuple[LedgerRun, LedgerRun]] = []
    finished_once = 0
    for task_id in task_ids:
        task_runs = grouped.get(task_id, [])
        finished = [r for r in task_runs if r.outcome == "done"]
        if len(finished) == 1:
            finished_once += 1
        elif _redone(finished, task_id, unstored, killed_node, kill_time):
            finished_once += 1
            redone.append((finished[0], finished[1]))
        else:
            problems.append(f"task {task_id} finished {len(finished)} times")
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
    return Verdict(not problems, problems, finished_once, interrupted, failover, moves, redone)


def _redone(finished: list[LedgerRun], task_id: str, unstored: Sequence[str],
            killed_node: str | None, kill_time: float | None) -> bool:
    """Whether two completions of ``task_id`` are a run whose outcome the kill cut off (it
    ended on the killed node before the kill, the store still had it claimed there) and
    the run that took it over after the kill."""
    if len(finished) != 2 or task_id not in unstored or kill_time is None:
        return False
    first, second = finished
    return (first.node == killed_node and first.end is not None and first.end <= kill_time
            and second.node != killed_node and second.start >= kill_time)


