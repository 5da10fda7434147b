"""The dashboard's charts page over real HTTP and in headless Chromium, on SQLite: with data
and without, a hostile node id escaped, reads capped, no CSP violation."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.contracts.coordinator import Coordinator, CoordinatorContext
from metafora.web.charts import CHART_READ, LABEL_CHARS
from tests.web.conftest import http_call, insert_tasks

HOSTILE = '<img src=x onerror=alert(1)>&"node'


class _Quiet(CoordinatorContext):
    def lost(self, task: Task) -> None:
        return


@contextmanager
def _busy(url: str) -> Iterator[str]:
    """A store with a node of a hostile id holding one task, two done, one failed, and
    pending tasks waiting for each reason."""
    node: Coordinator = open_coordinator(url, node_id=HOSTILE)
    node.init(_Quiet())
    later = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    with open_client(url) as client:
        for name in ("run-1", "run-2", "run-3", "run-4"):
            client.submit_task(Task(name))
        held = [node.claim(Task(name)) for name in ("run-1", "run-2", "run-3", "run-4")]
        assert all(t is not None for t in held)
        node.done(held[0])  # type: ignore[arg-type]
        node.done(held[1])  # type: ignore[arg-type]
        node.fail(held[2], "boom")  # type: ignore[arg-type]
        client.submit_task(Task("gpu-job", selector={"gpu": "yes"}))
        client.submit_task(Task("tomorrow", {"launch_at": later}))
        client.submit_task(Task("ready-1"))
        client.submit_task(Task("ready-2"))
    try:
        yield url
    finally:
        node.close()


@pytest.fixture
def busy(sqlite_url: str) -> Iterator[str]:
    """:func:`_busy` on SQLite."""
    with _busy(sqlite_url) as url:
        yield url


@pytest.fixture(params=["sqlite_url", "postgres_url", "etcd_url"])
def busy_store(request: pytest.FixtureRequest) -> Iterator[str]:
    """:func:`_busy` on each store that has a task page of its own (or the default one)."""
    with _busy(request.getfixturevalue(request.param)) as url:
        yield url


def _get(web: Any, path: str) -> tuple[int, str, dict[str, str]]:
    return http_call(web.server.port, "GET", path)


def test_charts_with_data(busy_store: str, serve: Any) -> None:
    web = serve(busy_store)
    status, page, headers = _get(web, "/charts")
    assert status == 200 and "default-src 'self'" in headers["content-security-policy"]
    for name in ("throughput", "nodes", "pending"):
        assert f'id="chart-{name}"' in page and f'id="chart-{name}-empty"' not in page
    assert page.count('class="bar claims"') == 1  # four claims, all in this minute
    assert page.count('class="bar done"') == 1 and page.count('class="bar failed"') == 1
    # etcd forgets a claim's time when the task finishes; SQL keeps the latest one
    claims = 1 if busy_store.startswith("etcd") else 4
    assert re.search(rf"<title>[^<]*: {claims} claims</title>", page)
    assert page.count('class="bar node"') == 1 and page.count('class="share"') == 1
    for key, n in (("no-node", 1), ("launch-ahead", 1), ("claimable", 2)):
        assert re.search(rf'class="bar {key}"[^>]*/><text class="value"[^>]*>{n}</text>', page), key
    # the hostile node id is text, never markup
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;&amp;&#34;node" in page
    assert "style=" not in page and re.search(r"<[^>]*\son[a-z]+=", page) is None
    assert "Read 1 of 1 claimed, 2 of 2 done and 1 of 1 failed" in page
    live = _get(web, "/charts?partial=1")[1]
    assert live.lstrip().startswith('<div class="charts">') and "<html" not in live


def test_charts_without_data(sqlite_url: str, serve: Any) -> None:
    with open_client(sqlite_url) as client:
        client.task_counts()  # the schema exists
    web = serve(sqlite_url)
    status, page, _ = _get(web, "/charts")
    assert status == 200 and "<svg" not in page
    assert 'id="chart-throughput-empty"' in page
    assert "No claims and no finished tasks in the last hour" in page
    assert 'id="chart-nodes-empty"' in page and "No live nodes." in page
    assert 'id="chart-pending-empty"' in page and "No pending tasks." in page
    assert 'href="/charts"' in _get(web, "/nodes")[1]  # in the navigation


def test_charts_read_at_most_the_cap(tmp_path: Path, serve: Any) -> None:
    url = f"sqlite:///{tmp_path / 'big.db'}"
    total = CHART_READ * 3
    insert_tasks(url, [{"id": f"job-{i:06d}", "state": "done" if i % 2 else "pending",
                        "finished_at": "2026-11-23 10:00:00.000"} for i in range(total)])
    web = serve(url)
    status, page, _ = _get(web, "/charts")  # the captions say how much was read: the cap
    assert status == 200
    assert f"0 of 0 claimed, {CHART_READ} of {total // 2} done" in page
    assert f"Read {CHART_READ} of {total // 2 + 1} pending tasks" in page
    assert page.count('class="capped"') == 2  # the throughput and the pending captions


# -- in a browser ---------------------------------------------------------------------------------


def _charts_in_browser(page: Any, base: str) -> list[str]:
    """Open /charts, wait for one live refresh; the console's CSP complaints."""
    from playwright.sync_api import expect

    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    page.goto(f"{base}/charts")
    expect(page.locator("#live")).to_have_attribute("data-updated", re.compile(r"\d+"), timeout=30_000)
    return [m for m in console if "Content Security Policy" in m]


def test_charts_render_in_a_browser(busy: str, serve: Any, page: Any) -> None:
    pytest.importorskip("playwright")
    from playwright.sync_api import expect

    web = serve(busy)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    assert _charts_in_browser(page, web.base) == []
    for name in ("throughput", "nodes", "pending"):
        expect(page.locator(f"svg#chart-{name}")).to_be_visible()
    expect(page.locator("#chart-throughput rect.bar")).to_have_count(3)
    expect(page.locator("#chart-nodes rect.bar")).to_have_count(1)
    expect(page.locator("#chart-nodes line.share")).to_have_count(1)
    # bars: no node matches, launch time ahead, group at its limit, held, claimable
    expect(page.locator("#chart-pending rect.bar")).to_have_count(5)
    expect(page.locator("#chart-nodes text.label")).to_have_text(HOSTILE[: LABEL_CHARS - 1] + "…")
    # the bars are drawn by the stylesheet's fill (no inline style), so they are not black
    fill = page.locator("#chart-throughput rect.bar.done").evaluate("e => getComputedStyle(e).fill")
    assert fill not in ("rgb(0, 0, 0)", "none"), fill
    # Measured in the page in one step, on the svg in the document at that moment: the live
    # refresh swaps the charts in every few seconds, and an element the locator resolved just
    # before it was swapped out measured (0, 0) (detached) or bounding_box() returned None.
    width, height = page.evaluate(
        "() => { const r = document.querySelector('svg#chart-nodes').getBoundingClientRect();"
        " return [r.width, r.height]; }")
    assert width > 100 and height > 10, (width, height)
    assert dialogs == []  # the hostile id's onerror=alert(1) never ran


def test_empty_charts_render_in_a_browser(sqlite_url: str, serve: Any, page: Any) -> None:
    pytest.importorskip("playwright")
    from playwright.sync_api import expect

    with open_client(sqlite_url) as client:
        client.task_counts()
    web = serve(sqlite_url)
    assert _charts_in_browser(page, web.base) == []
    expect(page.locator("svg.chart")).to_have_count(0)
    for name in ("throughput", "nodes", "pending"):
        expect(page.locator(f"#chart-{name}-empty")).to_be_visible()
    expect(page.locator("#chart-pending-empty")).to_have_text("No pending tasks.")
