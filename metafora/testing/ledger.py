"""A ledger of handler runs kept in a file outside the store, to prove exactly-once runs."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from metafora.core.task import Task

__all__ = ["FileLedger", "LedgerRun"]


@dataclass(frozen=True)
class LedgerRun:
    """One handler run recorded in a :class:`FileLedger` (``end`` None: never finished)."""

    task: str
    node: str
    token: int
    start: float
    end: float | None
    outcome: str | None


class FileLedger:
    """An append-only file, outside the store, where handlers record every start and end.

    Processes on one machine append JSON lines (``O_APPEND`` makes each small write atomic),
    so tests and benchmarks can prove exactly-once runs and no overlap, even across SIGKILL.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def _append(self, record: Mapping[str, object]) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def start(self, task: Task, node: str) -> None:
        """Record that ``node`` started ``task`` under ``task.token``."""
        self._append({"e": "start", "task": task.id, "node": node, "token": task.token,
                      "t": time.time()})

    def end(self, task: Task, node: str, outcome: str) -> None:
        """Record that the run ended (``done``, ``release``, ``fail``...)."""
        self._append({"e": "end", "task": task.id, "node": node, "token": task.token,
                      "t": time.time(), "outcome": outcome})

    def runs(self) -> list[LedgerRun]:
        """Every run, in start order."""
        if not os.path.exists(self.path):
            return []
        starts: dict[tuple[str, str, int], dict[str, object]] = {}
        ends: dict[tuple[str, str, int], dict[str, object]] = {}
        with open(self.path, encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    continue  # a write cut by SIGKILL
                rec = json.loads(line)
                key = (rec["task"], rec["node"], rec["token"])
                (starts if rec["e"] == "start" else ends)[key] = rec
        out = []
        for key, rec in starts.items():
            end = ends.get(key)
            out.append(LedgerRun(key[0], key[1], key[2], float(rec["t"]),  # type: ignore[arg-type]
                                 None if end is None else float(end["t"]),  # type: ignore[arg-type]
                                 None if end is None else str(end["outcome"])))
        return sorted(out, key=lambda r: r.start)

    def overlaps(self, died: Mapping[str, float] | None = None) -> list[tuple[LedgerRun, LedgerRun]]:
        """Pairs of runs of one task that overlapped in time.

        A run with no end counts as running until its node died (``died[node]``, a
        ``time.time()``) or forever.
        """
        died = died or {}
        by_task: dict[str, list[LedgerRun]] = {}
        for run in self.runs():
            by_task.setdefault(run.task, []).append(run)
        bad = []
        for runs in by_task.values():
            for i, a in enumerate(runs):
                a_end = a.end if a.end is not None else died.get(a.node, float("inf"))
                for b in runs[i + 1:]:
                    if b.start < a_end:
                        bad.append((a, b))
        return bad

    def completed(self, outcome: str = "done") -> dict[str, int]:
        """Task id -> how many runs ended with ``outcome``."""
        counts: dict[str, int] = {}
        for run in self.runs():
            if run.outcome == outcome:
                counts[run.task] = counts.get(run.task, 0) + 1
        return counts
