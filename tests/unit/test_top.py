"""``metafora top`` renders the right counts (through rich's capture)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from rich.console import Console

from metafora import Task, simple_handler
from metafora.cli.top import Snapshot, rates, render, run_top, take_snapshot
from metafora.core import commands
from metafora.core.limits import GroupUsage, Limit, Rate
from metafora.core.task import TaskInfo, TaskState
from metafora.testing import LocalCluster, wait_for


def test_top_frame_shows_nodes_states_and_rates() -> None:
    gate = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        if task.id.startswith("hold"):
            gate.wait(30)
        return True

    with LocalCluster() as cluster:
        cluster.add(simple_handler(work), "alpha")
        b = cluster.add(simple_handler(work), "beta")
        first = take_snapshot(cluster.client)
        for i in range(4):
            cluster.client.submit_task(Task(f"quick{i}"))
        for i in range(2):
            cluster.client.submit_task(Task(f"hold{i}"))
        wait_for(lambda: len(cluster.client.tasks("done")) == 4
                 and len(cluster.client.tasks("claimed")) == 2, what="tasks settled")
        cluster.client.submit_command("beta", commands.freeze())
        wait_for(lambda: b.frozen, what="beta frozen")
        wait_for(lambda: any(n.frozen for n in cluster.client.node_infos()), what="frozen published")
        second = take_snapshot(cluster.client)
        claims, _ = rates(first, second)
        assert claims > 0

        console = Console(record=True, width=120, force_terminal=False)
        console.print(render(cluster.client.name, first, second))
        text = console.export_text()
        assert "alpha" in text and "beta" in text
        lines = text.splitlines()
        header = next(i for i, line in enumerate(lines) if "pending" in line and "claimed" in line)
        cells = [c.strip() for c in lines[header + 2].split("│")[1:6]]
        assert cells == ["0", "2", "4", "0", "0"]  # pending, claimed, done, failed, expired
        assert "yes" in text  # beta is frozen

        console2 = Console(record=True, width=120, force_terminal=False)
        run_top(cluster.client, interval=0.01, console=console2, frames=2)
        assert "metafora top" in console2.export_text()
        gate.set()


HOSTILE_GROUP = '[bold red]<img src=x>&"g'


def _text(frame: object) -> str:
    console = Console(record=True, width=140, force_terminal=False)
    console.print(frame)
    return console.export_text()


def test_top_shows_the_groups_at_their_limit_and_who_waits() -> None:
    gate = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        gate.wait(30)
        return True

    with LocalCluster() as cluster:
        client = cluster.client
        client.set_limit(HOSTILE_GROUP, max=1)
        client.set_limit("roomy", max=10)
        cluster.add(simple_handler(work), "alpha")
        client.submit_tasks([Task(f"t{i}", group=HOSTILE_GROUP) for i in range(3)])
        client.submit_task(Task("gpu", group=HOSTILE_GROUP, selector={"gpu": "yes"}))
        wait_for(lambda: len(client.tasks("claimed")) == 1, what="one task of the group claimed")
        snap = take_snapshot(client)
        assert snap.usage[HOSTILE_GROUP].running == 1
        text = _text(render(client.name, None, snap))
        gate.set()
    lines = text.splitlines()
    assert any(line.strip() == "waiting" for line in lines)
    row = next(line for line in lines if "at its limit" in line)
    cells = [c.strip() for c in row.split("│")[1:4]]
    # the group's name shown as typed (no markup read in it); the task no node matches
    # counts under that reason, as `metafora tasks` says, not here
    assert cells == [HOSTILE_GROUP, "at its limit (1/1)", "2"]
    assert "roomy" not in text  # a group with room is not listed
    assert "pending with no matching node 1" in text


def test_top_rate_limit_reason_and_nothing_when_no_group_is_full() -> None:
    now = datetime.now(UTC)
    tasks = {f"p{i}": TaskInfo(f"p{i}", {}, TaskState.PENDING, group="api:github") for i in range(3)}
    full = GroupUsage(Limit("api:github", rate=Rate(100, 60)), recent=100)
    text = _text(render("memory://", None, Snapshot(0.0, now, [], tasks, {"api:github": full})))
    row = next(line for line in text.splitlines() if "api:github" in line)
    assert [c.strip() for c in row.split("│")[1:4]] == [
        "api:github", "at its rate limit (100/100 per 1m)", "3"]
    room = GroupUsage(Limit("api:github", rate=Rate(100, 60)), recent=99)
    text = _text(render("memory://", None, Snapshot(0.0, now, [], tasks, {"api:github": room})))
    assert "waiting" not in text and "api:github" not in text


def test_top_reads_no_limits_without_grouped_pending_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalCluster() as cluster:
        client = cluster.client
        client.set_limit("g", max=1)
        reads: list[int] = []
        real = client.group_usage

        def counted() -> dict[str, GroupUsage]:
            reads.append(1)
            return real()

        monkeypatch.setattr(client, "group_usage", counted)
        client.submit_task(Task("plain"))
        assert take_snapshot(client).usage == {} and reads == []
        client.submit_task(Task("grouped", group="g"))
        assert set(take_snapshot(client).usage) == {"g"} and reads == [1]
