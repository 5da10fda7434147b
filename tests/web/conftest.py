"""Fixtures of the dashboard tests: a served dashboard and a headless system Chromium."""

from __future__ import annotations

import asyncio
import http.client
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode

import pytest

pytest.importorskip("starlette", reason="the dashboard needs the extra metafora-cluster[web]")

from metafora import Task, open_client
from metafora.web.app import create_app
from metafora.web.server import WebServer

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def _chromium() -> str | None:
    explicit = os.environ.get("METAFORA_CHROMIUM")
    if explicit:
        return explicit
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _missing(reason: str) -> None:
    """Skip locally; in CI a missing browser is a failure."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the browser tests must run)")
    pytest.skip(reason)


def http_call(port: int, method: str, path: str, data: dict[str, str] | None = None,
              headers: dict[str, str] | None = None, cookies: dict[str, str] | None = None,
              timeout: float = 30) -> tuple[int, str, dict[str, str]]:
    """One request to ``127.0.0.1:port`` (a form body for ``data``, a Cookie header for
    ``cookies``): its status, text and headers (names in lower case)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = dict(headers or {})
    if cookies:
        sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
    body = None
    if data is not None:
        body = urlencode(data)
        sent["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        conn.request(method, path, body=body, headers=sent)
        raw = conn.getresponse()
        got = {k.lower(): v for k, v in raw.getheaders()}
        return raw.status, raw.read().decode(), got
    finally:
        conn.close()


def insert_tasks(url: str, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` (``id``, ``state``, optional ``error`` and ``finished_at``) straight into a
    SQLite store's table, as a bulk load faster than submitting them one by one."""
    from sqlalchemy import text

    stamp = "2026-11-23 10:00:00.000"
    with open_client(url) as client:
        client.submit_task(Task("seed"))  # the schema exists
        with client._db.write() as conn:  # type: ignore[attr-defined]
            conn.execute(text(
                "INSERT INTO metafora_tasks (namespace, id, props, state, error, created_at,"
                " updated_at, finished_at) VALUES ('metafora', :id, '{}', :state, :error, :stamp,"
                " :stamp, :finished_at)"),
                [{"error": None, "finished_at": None, "stamp": stamp, **row} for row in rows])


class Served:
    """A dashboard running on a free loopback port."""

    def __init__(self, url: str, token: str | None, **options: Any) -> None:
        self.app = create_app(url, token=token, refresh=0.5, **options)
        self.server = WebServer(self.app, "127.0.0.1", 0)

    @property
    def base(self) -> str:
        return self.server.base_url

    def __enter__(self) -> Served:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.app.state.dashboard.close()


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(url, token=None)`` starts a dashboard; all are stopped at the end."""
    started: list[Served] = []

    def start(url: str, token: str | None = None, **options: Any) -> Served:
        served = Served(url, token, **options).__enter__()
        started.append(served)
        return served

    yield start
    for served in reversed(started):
        served.__exit__()


class _Chromium:
    """The session's browser and the event loop Playwright's sync API runs it on."""

    def __init__(self, browser: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        self.browser = browser
        self.loop = loop

    @contextmanager
    def driving(self) -> Iterator[None]:
        """Mark Playwright's loop as running while the block drives the browser, and as not
        running after it. The sync API leaves its loop marked as running on this thread after
        every call; left so, every later ``asyncio.run`` in this process fails ("cannot be
        called from a running event loop"), whichever test it is in (issue 53)."""
        asyncio._set_running_loop(self.loop)
        try:
            yield
        finally:
            asyncio._set_running_loop(None)


@pytest.fixture(scope="session")
def chromium() -> Iterator[_Chromium]:
    """Headless Chromium from the system (Debian's package), driven by Playwright; between
    the tests that drive it, no event loop is left marked as running."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install 'metafora-cluster[browser]')")
    path = _chromium()
    if path is None:
        _missing("no system Chromium (apt-get install -y chromium)")
    with sync_playwright() as pw:
        held = _Chromium(None, asyncio._get_running_loop())
        try:
            with held.driving():
                held.browser = pw.chromium.launch(
                    executable_path=path, headless=True,
                    args=["--no-sandbox", "--disable-dev-shm-usage"])
            yield held
        finally:
            asyncio._set_running_loop(held.loop)  # the exit below runs on Playwright's loop
            if held.browser is not None:
                held.browser.close()


@pytest.fixture
def browser(chromium: _Chromium) -> Iterator[Any]:
    """The session's headless Chromium, for one test (Playwright's loop is marked as running
    during the test only)."""
    with chromium.driving():
        yield chromium.browser


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh 1280x800 page; dialogs (the actions' confirmations) are accepted."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.on("dialog", lambda dialog: dialog.accept())
    try:
        yield page
    finally:
        context.close()
