"""``metafora top`` renders the right counts (through rich's capture)."""

from __future__ import annotations

import threading

from rich.console import Console

from metafora import Task, commands, simple_handler
from metafora.cli.top import rates, render, run_top, take_snapshot
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
