"""Retention and the cluster's view as an operator meets them: a consumer prunes on its own
(counted on /metrics), the cluster gauges are read in the background (not per scrape) and
match the store, ``metafora retention`` and ``metafora top`` show them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from metafora import Task, TaskState, simple_handler
from metafora.cli import cli
from metafora.cli.top import render, take_snapshot
from metafora.testing import LocalCluster, wait_for
from tests.unit.test_http import get


def _samples(addr: str) -> dict[tuple[str, str], float]:
    status, body = get(addr, "/metrics")
    assert status == 200
    return {(s.name, s.labels.get("namespace") or s.labels.get("node") or ""): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_a_consumer_prunes_and_shows_the_cluster(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    release = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        if not task.id.startswith("quick"):
            release.wait(30)
        return True

    with LocalCluster(url) as cluster:
        c = cluster.client
        c.set_retention(done="1s")
        consumer = cluster.add(simple_handler(work), "web", http_addr="127.0.0.1:0",
                               max_tasks=3, prune_every=0.3)
        consumer._cluster.every = 0.2
        addr = wait_for(lambda: consumer.http_address, what="http server")
        c.submit_tasks([Task(f"quick{n}") for n in range(20)])
        wait_for(lambda: not c.tasks(), what="quick tasks pruned", timeout=30)
        c.submit_tasks([Task(f"hold{n}") for n in range(3)] + [Task(f"wait{n}") for n in range(4)])
        wait_for(lambda: len(c.tasks("claimed")) == 3, what="holds claimed")

        def gauges() -> tuple[float, ...] | None:
            s = _samples(addr)
            got = tuple(s.get((f"metafora_cluster_{n}", c.namespace_label()), -1.0)
                        for n in ("pending_tasks", "held_tasks", "capacity", "nodes"))
            return got if got == (4.0, 3.0, 3.0, 1.0) else None

        wait_for(gauges, what="cluster gauges match the store", timeout=20)
        counts = c.task_counts()
        assert (counts[TaskState.PENDING], counts[TaskState.CLAIMED]) == (4, 3)
        assert _samples(addr)[("metafora_pruned_tasks_total", "web")] == 20
        # Scrapes do not read the store: the background reads follow the clock, not them.
        consumer._cluster.every = 3600
        reads = consumer._cluster.reads
        for _ in range(20):
            _samples(addr)
        assert consumer._cluster.reads <= reads + 1

        frame = render(url, None, take_snapshot(c), live=False)
        from rich.console import Console
        out = Console(width=200, record=True)
        out.print(frame)
        text = out.export_text()
        assert "backlog 4 pending, 3 held / capacity 3 on 1 node" in text
        assert "retention done 1s, failed 30d, killed 30d" in text
        release.set()


def test_retention_cli(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    runner = CliRunner()
    shown = runner.invoke(cli, ["--url", url, "retention", "show"])
    assert shown.exit_code == 0 and "done 7d, failed 30d, killed 30d" in shown.output
    done = runner.invoke(cli, ["--url", url, "retention", "set", "--done", "12h", "--killed", "never"])
    assert done.exit_code == 0 and "done 12h, failed 30d, killed never" in done.output
    js = runner.invoke(cli, ["--url", url, "retention", "show", "--json"])
    assert '"killed": null' in js.output and '"done": 43200' in js.output
    bad = runner.invoke(cli, ["--url", url, "retention", "set", "--failed", "1 week"])
    assert bad.exit_code != 0 and "never" in bad.output
    none = runner.invoke(cli, ["--url", url, "retention", "set"])
    assert none.exit_code == 2


def test_dashboard_shows_backlog_and_retention(tmp_path: Path) -> None:
    from metafora import open_client
    from metafora.web.app import create_app
    from tests.web.test_web_http import TestClient

    url = f"sqlite:///{tmp_path / 'd.db'}"
    with open_client(url) as client:
        client.submit_tasks([Task("a"), Task("b")])
        client.set_retention(failed="2d")
    app = create_app(url)
    try:
        with TestClient(app) as http:
            page = http.get("/nodes").text
        assert "backlog 2 pending, 0 held / capacity 0 on 0 nodes" in page
        assert "retention done 7d, failed 2d, killed 30d" in page
    finally:
        app.state.dashboard.close()


def test_purge_on_etcd_takes_the_items_of_items_url(metafora_store_url: Any) -> None:
    """`metafora purge --items-url` deletes a purged partition's items in their SQL database."""
    from metafora import open_client, open_coordinator
    from metafora.gates import ItemStore, NewItem
    from metafora.testing import RecordingContext

    url, items_url = metafora_store_url("etcd"), metafora_store_url("sqlite")
    with open_client(url) as client, ItemStore(items_url) as items:
        client.submit_tasks([Task("job-old"), Task("job-live")])
        items.add("job-old", [NewItem(gate=0, data=b"x")] * 3)
        items.add("job-live", [NewItem(gate=0, data=b"y")] * 2)
        coord = open_coordinator(url, node_id="n1")
        try:
            coord.init(RecordingContext())
            claimed = coord.claim(Task("job-old"))
            assert claimed is not None
            coord.done(claimed)
        finally:
            coord.close()
        out = CliRunner().invoke(cli, ["--url", url, "purge", "--items-url", items_url])
        assert out.exit_code == 0 and "purged 1 task" in out.output, out.output
        assert items.list("job-old") == []
        assert len(items.list("job-live")) == 2
        assert [t.id for t in client.tasks()] == ["job-live"]
