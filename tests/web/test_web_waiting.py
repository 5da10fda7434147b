"""The dashboard says why a pending task waits (docs/limits.md), in the CLI's words: on the
task list and on the task's own page, over real HTTP on each SQL store; a hostile group name
is text, never markup."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from markupsafe import escape

from metafora import Task, open_client, open_coordinator
from metafora.contracts.coordinator import Coordinator, CoordinatorContext
from metafora.features.waiting import pending_reasons
from tests.web.conftest import http_call

HOSTILE = '<img src=x onerror=alert(1)>&"tenant'


class _Quiet(CoordinatorContext):
    def lost(self, task: Task) -> None:
        return


@pytest.fixture
def waiting(sql_url: str) -> Iterator[str]:
    """A store where group HOSTILE is at its limit (1/1, ``full-0`` claimed, ``full-1`` and
    ``full-2`` waiting), group ``api:github`` at its rate limit, a task no node matches and
    a claimable one."""
    node: Coordinator = open_coordinator(sql_url, node_id="n1")
    node.init(_Quiet())
    with open_client(sql_url) as client:
        client.set_limit(HOSTILE, max=1)
        client.set_limit("api:github", rate="1/1h")
        client.submit_tasks([*(Task(f"full-{i}", group=HOSTILE) for i in range(3)),
                             Task("rate-0", group="api:github"), Task("rate-1", group="api:github"),
                             Task("gpu-job", selector={"gpu": "yes"}, group=HOSTILE), Task("free")])
        assert node.claim(Task("full-0", group=HOSTILE)) is not None
        assert node.claim(Task("rate-0", group="api:github")) is not None
        assert node.claim(Task("full-1", group=HOSTILE)) is None  # the store refuses: 1/1
    try:
        yield sql_url
    finally:
        node.close()


def _get(web: Any, path: str) -> str:
    status, page, _ = http_call(web.server.port, "GET", path)
    assert status == 200, page
    return page


def _row(page: str, task_id: str) -> str:
    start = page.index(f'<tr data-task="{task_id}">')
    return page[start:page.index("</tr>", start)]


def test_task_list_and_task_page_say_why_a_pending_task_waits(waiting: str, serve: Any) -> None:
    web = serve(waiting)
    full = f"waiting: group {escape(HOSTILE)} at its limit (1/1)"
    rate = "waiting: group api:github at its rate limit (1/1 per 1h)"
    for path in ("/tasks", "/tasks?state=pending", "/tasks?partial=1"):
        page = _get(web, path)
        assert "<img" not in page  # the group's name is text, escaped
        for task_id in ("full-1", "full-2"):
            assert f'<td class="waiting" title="{full}">{full}</td>' in _row(page, task_id)
        assert rate in _row(page, "rate-1")
        # the placement reason comes first, as in `metafora tasks`
        assert "no live node matches gpu=yes" in _row(page, "gpu-job")
        assert "waiting" not in _row(page, "free")
        if "state=pending" not in path:
            assert "waiting" not in _row(page, "full-0")  # running: no reason
    task = _get(web, "/task?" + urlencode({"id": "full-1"}))
    assert f'<dd class="waiting" id="task-waiting">{full}</dd>' in task
    assert f'<dd class="mono" id="task-group">{escape(HOSTILE)}</dd>' in task and "<img" not in task
    assert rate in _get(web, "/task?id=rate-1&partial=1")
    for plain in ("full-0", "free"):
        assert 'id="task-waiting"' not in _get(web, f"/task?id={plain}")


def test_the_dashboard_shows_what_the_cli_says(waiting: str, serve: Any) -> None:
    web = serve(waiting)
    page = _get(web, "/tasks")
    with open_client(waiting) as client:
        reasons = pending_reasons(client, client.tasks())
    assert set(reasons) == {"full-1", "full-2", "rate-1", "gpu-job"}
    for task_id, reason in reasons.items():
        assert str(escape(reason)) in _row(page, task_id)


def test_no_reason_once_the_limit_is_gone(waiting: str, serve: Any) -> None:
    with open_client(waiting) as client:
        client.delete_limit(HOSTILE)
    page = _get(serve(waiting), "/tasks")
    assert 'class="waiting"' not in _row(page, "full-1")
    assert "at its rate limit" in _row(page, "rate-1")
