"""The demo's pure parts: its proof (``verify``), its URL, its options, its rendering.

The demo itself (processes, SIGKILL, SQLite) runs end to end in
``tests/acceptance/test_cli_subprocess.py``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from rich.console import Console

from metafora.core.errors import ConfigError
from metafora.core.task import Task, TaskInfo, TaskState
from metafora.demo import Demo, DemoConfig, demo_url, run_demo, runs_by_task, verify
from metafora.demo.worker import _work
from metafora.testing import FileLedger, LedgerRun

DONE = TaskState.DONE


def run(task: str, node: str, token: int, start: float, end: float | None,
        outcome: str | None = "done") -> LedgerRun:
    return LedgerRun(task, node, token, start, end, outcome if end is not None else None)


def test_verify_clean_run() -> None:
    runs = [run("a", "n1", 1, 0.0, 1.0), run("b", "n2", 2, 0.5, 1.5)]
    verdict = verify(["a", "b"], runs, {"a": DONE, "b": DONE})
    assert verdict.ok, verdict.problems
    assert verdict.finished_once == 2
    assert verdict.interrupted == []
    assert verdict.failover is None


def test_verify_failover_after_a_kill() -> None:
    runs = [
        run("a", "n1", 1, 0.0, None),  # cut off by the kill at t=2
        run("a", "n2", 5, 4.5, 6.0),
        run("b", "n1", 2, 0.5, 1.5),  # finished before the kill
        run("c", "n1", 3, 1.0, None),
        run("c", "n3", 6, 5.25, 6.5),
    ]
    states = {"a": DONE, "b": DONE, "c": DONE}
    verdict = verify(["a", "b", "c"], runs, states, killed_node="n1", kill_time=2.0)
    assert verdict.ok, verdict.problems
    assert [r.task for r in verdict.interrupted] == ["a", "c"]
    assert verdict.failover == pytest.approx(3.25)
    assert [(cut.task, nxt.node) for cut, nxt in verdict.moves] == [("a", "n2"), ("c", "n3")]


def test_verify_names_a_run_whose_outcome_the_kill_cut_off() -> None:
    """A run that ended on the killed node just before the kill, while the store still had
    the task claimed there (its outcome not yet written), ran again elsewhere: listed as
    redone, not a problem. The same two runs without that store reading, a first run that
    ended after the kill, or one on another node are double runs."""
    runs = [run("a", "n1", 1, 0.0, 1.99), run("a", "n2", 5, 4.5, 6.0)]
    verdict = verify(["a"], runs, {"a": DONE}, killed_node="n1", kill_time=2.0, unstored=["a"])
    assert verdict.ok, verdict.problems
    assert verdict.finished_once == 1
    assert [(first.node, again.node) for first, again in verdict.redone] == [("n1", "n2")]
    for bad in (
        verify(["a"], runs, {"a": DONE}, killed_node="n1", kill_time=2.0),  # stored, then redone
        verify(["a"], runs, {"a": DONE}, killed_node="n2", kill_time=2.0, unstored=["a"]),
        verify(["a"], [run("a", "n1", 1, 0.0, 2.5), run("a", "n2", 5, 4.5, 6.0)], {"a": DONE},
               killed_node="n1", kill_time=2.0, unstored=["a"]),
    ):
        assert not bad.ok and "task a finished 2 times" in bad.problems and bad.redone == []


def test_verify_catches_a_double_run() -> None:
    runs = [run("a", "n1", 1, 0.0, 1.0), run("a", "n2", 2, 2.0, 3.0)]
    verdict = verify(["a"], runs, {"a": DONE})
    assert not verdict.ok
    assert "task a finished 2 times" in verdict.problems


def test_verify_catches_a_missing_task() -> None:
    verdict = verify(["a", "b"], [run("a", "n1", 1, 0.0, 1.0)], {"a": DONE, "b": TaskState.PENDING})
    assert not verdict.ok
    assert "task b finished 0 times" in verdict.problems
    assert "task b is pending in the store" in verdict.problems


def test_verify_catches_overlap() -> None:
    runs = [run("a", "n1", 1, 0.0, 2.0, "release"), run("a", "n2", 2, 1.0, 3.0)]
    verdict = verify(["a"], runs, {"a": DONE})
    assert not verdict.ok
    assert any("overlapped" in p for p in verdict.problems)


def test_verify_catches_a_run_that_outlived_the_kill() -> None:
    # the killed node's run must not overlap its successor: the successor started before the kill
    runs = [run("a", "n1", 1, 0.0, None), run("a", "n2", 2, 1.0, 3.0)]
    verdict = verify(["a"], runs, {"a": DONE}, killed_node="n1", kill_time=2.0)
    assert any("overlapped" in p for p in verdict.problems)


def test_verify_catches_an_unfinished_run_on_a_live_node() -> None:
    runs = [run("a", "n2", 1, 0.0, None), run("a", "n3", 2, 1.0, 2.0)]
    verdict = verify(["a"], runs, {"a": DONE}, killed_node="n1", kill_time=5.0)
    assert any("never ended" in p for p in verdict.problems)


def test_verify_catches_stale_tokens() -> None:
    runs = [run("a", "n1", 5, 0.0, 1.0, "release"), run("a", "n2", 4, 2.0, 3.0)]
    verdict = verify(["a"], runs, {"a": DONE})
    assert any("token 4 came after token 5" in p for p in verdict.problems)


def test_runs_by_task_orders_by_start() -> None:
    grouped = runs_by_task([run("a", "n2", 2, 5.0, 6.0), run("a", "n1", 1, 1.0, 2.0)])
    assert [r.token for r in grouped["a"]] == [1, 2]


def test_the_demo_handler_writes_the_ledger(tmp_path: Path) -> None:
    import threading

    ledger = FileLedger(tmp_path / "ledger.jsonl")
    work = _work(ledger, "n1")
    assert work(Task("a", {"seconds": 0.01}, token=3), threading.Event()) is True
    stop = threading.Event()
    stop.set()
    assert work(Task("b", {"seconds": 30}, token=4), stop) is False
    runs = {r.task: r for r in ledger.runs()}
    assert (runs["a"].node, runs["a"].token, runs["a"].outcome) == ("n1", 3, "done")
    assert runs["b"].outcome == "release"


def test_demo_url_default_is_a_fresh_sqlite_file(tmp_path: Path) -> None:
    url = demo_url(None, tmp_path, 2.5)
    assert url.startswith(f"sqlite:///{tmp_path}/demo.db?")  # sqlite:////abs/path.db
    assert url.startswith("sqlite:////")
    assert parse_qs(urlsplit(url).query) == {"lease_ttl": ["2.5"]}


def test_demo_url_given_gets_its_own_namespace_and_ttl(tmp_path: Path) -> None:
    url = demo_url("postgresql://u:pw@h/db", tmp_path, 3)
    query = parse_qs(urlsplit(url).query)
    assert query["lease_ttl"] == ["3"]
    assert query["namespace"][0].startswith("demo-")
    kept = demo_url("sqlite:///x.db?namespace=mine&lease_ttl=5", tmp_path, 3)
    assert kept == "sqlite:///x.db?namespace=mine&lease_ttl=5"


def test_demo_url_uses_whole_seconds_on_etcd(tmp_path: Path) -> None:
    url = demo_url("etcd://127.0.0.1:2379/ns", tmp_path, 2.5)
    assert parse_qs(urlsplit(url).query)["lease_ttl"] == ["3"]


def test_demo_url_refuses_memory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="separate processes"):
        demo_url("memory://x", tmp_path, 2.5)


@pytest.mark.parametrize("kwargs", [{"nodes": 1}, {"tasks": 0}, {"lease_ttl": 0.5},
                                    {"min_seconds": 3.0, "max_seconds": 2.0}])
def test_demo_config_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        DemoConfig(**kwargs)  # type: ignore[arg-type]


def test_demo_config_spreads_the_work() -> None:
    assert DemoConfig().max_tasks == 4  # 30 tasks, 3 nodes: every node runs several waves
    assert DemoConfig(nodes=2, tasks=2).max_tasks == 1


def test_demo_refuses_a_memory_store_before_making_files(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(ConfigError):
        run_demo(DemoConfig(url="memory://x"), Console(file=io.StringIO()))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    """A Demo with two finished node processes: enough to render its table and its summary."""
    import subprocess
    import sys

    from metafora.demo.run import _Node

    out = Console(file=io.StringIO(), width=200, force_terminal=False, soft_wrap=False)
    shown = Demo(DemoConfig(nodes=2, tasks=30), out, tmp_path)
    for name in ("node1", "node2"):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait(30)
        proc.pid = 4194304  # the widest pid Linux hands out, whatever this one was
        shown.nodes.append(_Node(name, proc, tmp_path / f"{name}.log"))
    yield shown


def test_summary_is_not_padded_when_not_a_terminal(demo: Demo) -> None:
    """Issue 18: a rich table padded every summary line to 144 columns in a pipe."""
    infos = [TaskInfo(t, {}, TaskState.DONE) for t in demo.task_ids]
    demo._summary(infos, 7.5)
    assert isinstance(demo.out.file, io.StringIO)
    lines = demo.out.file.getvalue().splitlines()
    assert lines[0] == "Summary"
    assert all(line == line.rstrip() for line in lines), lines
    assert any(line.startswith("tasks         30 submitted, 30 done") for line in lines), lines


def test_live_table_fits_80_columns(demo: Demo) -> None:
    """Issue 18: the live table's minimum width was 81 columns, so rich cropped its right edge."""
    from collections import Counter

    from metafora.demo.run import _View

    infos = [TaskInfo(t, {}, TaskState.CLAIMED, owner="node1" if i % 2 else "node2")
             for i, t in enumerate(demo.task_ids)]
    view = _View(3.0, infos, Counter({"node1": 0, "node2": 0}), {demo.task_ids[0]: "node3"})
    demo.nodes[1].killed_at, demo.nodes[1].gone = 1.0, True  # the widest status: "killed, lease expired"
    narrow = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    narrow.print(demo._render(view))
    lines = narrow.file.getvalue().splitlines()  # type: ignore[attr-defined]
    table = [line for line in lines if line.startswith(("┏", "┃", "│", "└"))]
    assert table and all(len(line) <= 80 and line.rstrip().endswith(("┓", "┃", "│", "┘")) for line in table)
