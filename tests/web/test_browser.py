"""The dashboard in a real browser (headless system Chromium through Playwright), on SQLite
with real consumers in threads: freeze really stops claiming, stop moves a task, a
token-less dashboard refuses actions."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from metafora import Task, TaskState, simple_handler
from metafora.testing import LocalCluster, wait_for

pytest.importorskip("playwright")
from playwright.sync_api import expect

TOKEN = "browser-test-token"
SHOTS = os.environ.get("METAFORA_WEB_SCREENSHOTS")  # a directory: save the main pages there


def _shot(page: Any, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / name))


def _hold(task: Task, stop: threading.Event) -> bool:
    stop.wait(120)
    return False  # stopped: release


def _stays(predicate: Any, seconds: float) -> bool:
    """Whether ``predicate`` holds on every check for ``seconds`` (a bounded observation)."""
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while time.monotonic() < deadline:
        if not predicate():
            return False
        pause.wait(0.1)
    return True


def test_freeze_stop_unfreeze_through_the_browser(tmp_path: Path, serve: Any, page: Any) -> None:
    url = f"sqlite:///{tmp_path / 'web.db'}"
    with LocalCluster(url) as cluster:
        client = cluster.client
        node_a = cluster.add(simple_handler(_hold), "node-a")
        client.submit_task(Task("report-2026-11", {"month": "2026-11", "rows": 120000}))
        cluster.wait_for_state("report-2026-11", TaskState.CLAIMED, timeout=30)
        web = serve(url, token=TOKEN)

        # log in with the token
        page.goto(f"{web.base}/nodes")
        expect(page.locator("#login")).to_be_visible()
        expect(page.locator('tr[data-node="node-a"] button[data-action="freeze"]')).to_be_disabled()
        page.click("#login")
        page.fill("#token", TOKEN)
        page.click("#login-go")
        expect(page.locator("#msg")).to_have_text("logged in")
        row = page.locator('tr[data-node="node-a"]')
        expect(row.locator(".status")).to_have_text("active")

        # freeze -> the page shows frozen -> the node really stops claiming
        row.locator('button[data-action="freeze"]').click()
        expect(page.locator("#msg")).to_have_text("sent freeze to node node-a")
        expect(row.locator(".status")).to_have_text("frozen", timeout=30_000)
        assert node_a.frozen
        client.submit_task(Task("late-task"))
        assert _stays(lambda: client.get_task("late-task").state is TaskState.PENDING, 3.0), \
            "a frozen node claimed a new task"
        _shot(page, "web-nodes.png")

        # a second node takes the waiting task; stopping report-2026-11 moves it there
        cluster.add(simple_handler(_hold), "node-b")
        cluster.wait_for_state("late-task", TaskState.CLAIMED, timeout=30)
        page.goto(f"{web.base}/tasks")
        task_row = page.locator('tr[data-task="report-2026-11"]')
        expect(task_row.locator(".owner")).to_have_text("node-a")
        task_row.locator('button[data-action="stop"]').click()
        expect(page.locator("#msg")).to_have_text("asked the node running task report-2026-11 to stop it")
        expect(task_row.locator(".owner")).to_have_text("node-b", timeout=30_000)
        assert client.get_task("report-2026-11").owner == "node-b"
        _shot(page, "web-tasks.png")

        # the task's page, then unfreeze node-a from the nodes page
        page.click('a:text("report-2026-11")')
        expect(page.locator("#task-state")).to_have_text("claimed")
        expect(page.locator("#props")).to_contain_text('"rows": 120000')
        _shot(page, "web-task.png")
        page.goto(f"{web.base}/nodes")
        page.locator('tr[data-node="node-a"] button[data-action="unfreeze"]').click()
        expect(page.locator('tr[data-node="node-a"] .status')).to_have_text("active", timeout=30_000)
        wait_for(lambda: not node_a.frozen, 30, "node-a to unfreeze")
        assert not cluster.errors
        assert url.split("///")[1] in page.content()  # the store is named (it has no password)


def test_a_token_less_dashboard_refuses_actions(tmp_path: Path, serve: Any, page: Any) -> None:
    url = f"sqlite:///{tmp_path / 'ro.db'}"
    with LocalCluster(url) as cluster:
        node = cluster.add(simple_handler(_hold), "node-ro")
        web = serve(url)
        page.goto(f"{web.base}/nodes")
        expect(page.locator("#mode")).to_have_text("read-only")
        button = page.locator('tr[data-node="node-ro"] button[data-action="freeze"]')
        expect(button).to_be_disabled()
        # a forged post (as a script or another site would send it) is refused too
        response = page.request.post(f"{web.base}/act",
                                     form={"target": "node", "verb": "freeze", "id": "node-ro"})
        assert response.status == 403
        assert "read-only" in response.text()
        # and a made-up login cookie does not help
        page.context.add_cookies([{"name": "metafora_session", "value": "x", "url": web.base}])
        response = page.request.post(f"{web.base}/act",
                                     form={"target": "node", "verb": "freeze", "id": "node-ro"})
        assert response.status == 403
        assert _stays(lambda: not node.frozen, 1.0)
