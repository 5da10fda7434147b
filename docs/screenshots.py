"""Make the dashboard screenshots of the docs (docs/web-*.png, 1280x800).

Run: ``.venv/bin/python docs/screenshots.py`` (needs metafora-cluster[web,browser] and a system
Chromium). It builds a small SQLite cluster in a temporary directory, serves the dashboard
on a free loopback port and photographs the nodes, tasks, task and charts pages.

The charts page is photographed last, after the script writes an hour of finished tasks straight
into the demo database (claim and finish times spread over the hour): the cluster itself only
runs for a few seconds, and the picture should show what an hour looks like.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from playwright.sync_api import sync_playwright

from metafora import Task, TaskState, open_coordinator, simple_handler
from metafora.contracts.client import Client
from metafora.contracts.coordinator import CoordinatorContext
from metafora.core import commands
from metafora.gates import ItemStore, NewItem
from metafora.statemachine import State, StateCode, state_store_for
from metafora.testing import LocalCluster, wait_for
from metafora.web.app import create_app
from metafora.web.server import WebServer

OUT = Path(__file__).parent


class _Quiet(CoordinatorContext):
    def lost(self, task: Task) -> None:
        return


def _an_hour_of_history(client: Client) -> None:
    """Finished tasks with claim and finish times over the last hour (demo data for the
    throughput chart), a task no node can run and one that launches tomorrow."""
    from sqlalchemy import text

    rng = random.Random(29)
    now = datetime.now(UTC)
    rows = []
    for i in range(900):
        ago = timedelta(minutes=60 * rng.random() ** 0.8)
        finished = now - ago
        rows.append({"id": f"resize-{i:05d}", "state": "failed" if rng.random() < 0.04 else "done",
                     "claimed": _sql_time(finished - timedelta(seconds=rng.uniform(2, 50))),
                     "finished": _sql_time(finished)})
    with client._db.write() as conn:  # type: ignore[attr-defined]
        conn.execute(text(
            "INSERT INTO metafora_tasks (namespace, id, props, state, claimed_at, finished_at,"
            " created_at, updated_at) VALUES ('metafora', :id, '{}', :state, :claimed, :finished,"
            " :claimed, :finished)"), rows)
    client.submit_task(Task("train-gpu", {"epochs": 40}, selector={"gpu": "a100"}))
    tomorrow = (now + timedelta(days=1)).replace(hour=2, minute=0, second=0, microsecond=0)
    client.submit_task(Task("nightly-backup", {"launch_at": tomorrow.isoformat()}))


def _sql_time(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def main() -> None:
    def work(task: Task, stop: threading.Event) -> bool:
        if task.props.get("fail"):
            raise RuntimeError(f"upstream answered 503 for {task.props.get('month')}")
        if task.props.get("quick"):
            return True
        stop.wait(600)
        return False

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/cluster.db"
        with LocalCluster(url) as cluster:
            client = cluster.client
            # a stateful partition held by a node of its own, with a cursor and items at two gates
            partition = open_coordinator(url, node_id="worker-d")
            partition.init(_Quiet())
            client.submit_task(Task("ingest-eu", {"region": "eu-west", "batch": 500}))
            claimed = partition.claim(Task("ingest-eu"))
            assert claimed is not None
            states = state_store_for(client)
            states.store(claimed, State(code=StateCode.RUNNABLE, cursor="s3://bucket/eu/part-0042"))
            states.close()
            items = ItemStore(url)
            items.add("ingest-eu", [NewItem(0, f"row {i}".encode()) for i in range(37)]
                      + [NewItem(1, f"summary {i}".encode()) for i in range(5)])
            for i in range(12):
                client.submit_task(Task(f"thumbnail-{i:04d}", {"quick": True, "size": 256}))
            nodes = [cluster.add(simple_handler(work), f"worker-{n}", max_tasks=3) for n in "abc"]
            wait_for(lambda: client.task_counts()[TaskState.DONE] == 12, 60, "quick tasks")
            for month in ("2026-08", "2026-09"):
                client.submit_task(Task(f"report-{month}", {"month": month, "fail": True}))
            for month in ("2026-10", "2026-11"):
                client.submit_task(Task(f"report-{month}", {"month": month, "rows": 120000,
                                                            "format": "parquet"}))
            for i in range(5):
                client.submit_task(Task(f"import-shard-{i:02d}", {"shard": i, "source": "s3://bucket/x"}))
            wait_for(lambda: client.task_counts()[TaskState.FAILED] == 2, 60, "failures")
            wait_for(lambda: client.task_counts()[TaskState.CLAIMED] == 8, 60, "claims")
            client.submit_command("worker-c", commands.freeze())
            wait_for(lambda: nodes[2].frozen, 30, "freeze")
            for i in range(3):
                client.submit_task(Task(f"reindex-{i:02d}", {"index": f"products-{i}"}))
            app = create_app(url, token="demo", refresh=2.0)
            chromium = shutil.which("chromium") or "chromium"
            with WebServer(app, "127.0.0.1", 0) as server, sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(f"{server.base_url}/login")
                page.fill("#token", "demo")
                page.click("#login-go")
                page.goto(f"{server.base_url}/nodes")
                page.wait_for_selector('tr[data-node="worker-c"] .badge.frozen')
                page.screenshot(path=str(OUT / "web-nodes.png"))
                page.goto(f"{server.base_url}/tasks?limit=25")
                page.screenshot(path=str(OUT / "web-tasks.png"))
                page.goto(f"{server.base_url}/task?id=ingest-eu")
                page.screenshot(path=str(OUT / "web-task.png"))
                _an_hour_of_history(client)
                page.goto(f"{server.base_url}/charts")
                page.wait_for_selector("svg#chart-throughput")
                page.screenshot(path=str(OUT / "web-charts.png"), full_page=True)
                browser.close()
            app.state.dashboard.close()
            items.close()
            partition.close()


if __name__ == "__main__":
    main()
