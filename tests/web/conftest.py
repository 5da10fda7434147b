"""Fixtures of the dashboard tests: a served dashboard and a headless system Chromium."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the dashboard needs the extra metafora-cluster[web]")

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


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Chromium from the system (Debian's package), driven by Playwright."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install 'metafora-cluster[browser]')")
    path = _chromium()
    if path is None:
        _missing("no system Chromium (apt-get install -y chromium)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


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
