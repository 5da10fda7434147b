"""The campaign's judge on hand-written ledgers: it must catch what it claims to catch.

Fast, no store: each test writes the records consumer processes would have written and
checks the verdict of :func:`tests.faults.ledger.analyze`.
"""

from __future__ import annotations

from typing import Any

from tests.faults.ledger import FaultLog, Report, analyze, runs_of, stalls


def _run(node: str, token: int, start: float, end: float | None,
         writes: tuple[float, ...] = (), refused: tuple[float, ...] = (),
         task: str = "t1", made: float | None = None) -> list[dict[str, Any]]:
    """Records of one run: made, start, accepted writes (0.01 s each), refused writes, end."""
    base = {"n": node, "k": task, "tok": token}
    out = [{"e": "made", "m": start if made is None else made, **base},
           {"e": "start", "m": start, **base}]
    out += [{"e": "write", "m": w, "m0": w, "m1": w + 0.01, "i": i, **base}
            for i, w in enumerate(writes)]
    out += [{"e": "refused", "m": r, "m0": r, "m1": r + 0.01, "i": 0, **base} for r in refused]
    if end is not None:
        out.append({"e": "end", "m": end, "why": "done", **base})
    return out


def _judge(events: list[dict[str, Any]], faults: FaultLog | None = None) -> Report:
    report = Report("test", "test")
    analyze(report, events, faults or FaultLog())
    return report


def test_a_clean_hand_over_is_accepted() -> None:
    report = _judge(_run("a", 10, 1.0, 2.0, writes=(1.1, 1.5)) + _run("b", 20, 2.5, 3.0, (2.6,)))
    assert report.ok and report.runs == 2 and report.writes == 3


def test_two_runs_at_once_are_an_overlap() -> None:
    report = _judge(_run("a", 10, 1.0, 3.0) + _run("b", 20, 2.0, 4.0))
    assert len(report.overlaps) == 1 and not report.stale


def test_a_write_accepted_after_a_newer_claim_started_is_stale() -> None:
    # a was SIGSTOPped at 1.5; b took over at 5.0; a resumed and its write at 6.0 went through.
    faults = FaultLog(frozen={"a": [(1.5, 5.5)]})
    events = _run("a", 10, 1.0, 6.5, writes=(1.2, 6.0)) + _run("b", 20, 5.0, 7.0, writes=(5.1,))
    report = _judge(events, faults)
    assert not report.overlaps  # a was frozen: its run ended, as far as overlap goes, at 1.5
    assert len(report.stale) == 1 and "token 10" in report.stale[0]


def test_a_zombie_whose_writes_are_refused_is_fine() -> None:
    faults = FaultLog(frozen={"a": [(1.5, 5.5)]})
    events = _run("a", 10, 1.0, 6.1, writes=(1.2,), refused=(6.0,)) + _run("b", 20, 5.0, 7.0, (5.1,))
    assert _judge(events, faults).ok


def test_a_killed_run_ends_at_the_kill() -> None:
    faults = FaultLog(killed={"a": 1.5})
    events = _run("a", 10, 1.0, None, writes=(1.2,)) + _run("b", 20, 4.5, 5.0)
    assert _judge(events, faults).ok
    # Without the kill, the run never ended: the next one overlaps it.
    assert _judge(events).overlaps


def test_a_refused_write_ends_the_valid_period() -> None:
    events = _run("a", 10, 1.0, 4.2, refused=(4.0,)) + _run("b", 20, 4.1, 5.0)
    assert _judge(events).ok  # a's claim was gone by 4.01 (refused), b started at 4.1
    events = _run("a", 10, 1.0, 4.2, refused=(4.0,)) + _run("b", 20, 3.9, 5.0)
    assert _judge(events).overlaps  # b started before a's refusal proved a invalid


def test_one_token_handed_to_two_nodes_is_an_overlap() -> None:
    report = _judge(_run("a", 10, 1.0, 2.0) + _run("b", 10, 3.0, 4.0))
    assert report.overlaps and "handed to a and b" in report.overlaps[0]


def test_records_without_a_start_are_problems() -> None:
    events = [e for e in _run("a", 10, 1.0, 2.0) if e["e"] != "start"]  # no start record
    report = _judge(events)
    assert report.problems and not report.ok


def test_tasks_are_judged_separately() -> None:
    events = _run("a", 10, 1.0, 3.0, task="t1") + _run("b", 20, 2.0, 4.0, task="t2")
    assert _judge(events).ok


def test_a_handler_started_after_sigcont_under_a_stale_claim_is_judged_by_its_writes() -> None:
    # a claimed at 1.0, froze at 1.1 before its handler started; b took over at 5.0; a's
    # handler started at 6.0 (after SIGCONT), saw it was stopped and ended without writing.
    faults = FaultLog(frozen={"a": [(1.1, 5.9)]})
    events = _run("b", 20, 5.0, 7.0, writes=(5.1,)) + _run("a", 10, 6.0, 6.01, made=1.0)
    assert _judge(events, faults).ok
    # Had it written, that write would be stale.
    events = _run("b", 20, 5.0, 7.0, writes=(5.1,)) + _run("a", 10, 6.0, 6.2, (6.1,), made=1.0)
    assert _judge(events, faults).stale


def test_an_idle_cluster_with_work_waiting_is_a_stall() -> None:
    runs, _ = runs_of(_run("a", 10, 1.0, 2.0, task="t1") + _run("a", 20, 20.0, 21.0, task="t2"))
    found = stalls(list(runs.values()), {"t1": 0.5, "t2": 0.5}, FaultLog(), threshold=10.0)
    assert len(found) == 1 and "t2" in found[0]
    # t2 submitted only at 19.5: the cluster had nothing to do.
    assert not stalls(list(runs.values()), {"t1": 0.5, "t2": 19.5}, FaultLog(), threshold=10.0)
    # The store was cut off for most of the gap: not a stall either.
    cut = FaultLog(cuts=[(2.5, 15.0)])
    assert not stalls(list(runs.values()), {"t1": 0.5, "t2": 0.5}, cut, threshold=10.0)


def test_a_handler_stopped_before_its_run_began_is_no_anomaly() -> None:
    base = {"n": "a", "k": "t1", "tok": 10}
    made_then_stopped = [{"e": "made", "m": 1.0, **base}, {"e": "stop", "m": 1.1, **base}]
    report = _judge(made_then_stopped + _run("b", 20, 2.0, 3.0))
    assert report.ok, report.problems
    orphan_end = [{"e": "end", "m": 1.2, "why": "done", **base}]
    assert not _judge(orphan_end).ok  # an end without a start still is one
