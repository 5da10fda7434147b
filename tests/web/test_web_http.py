"""The dashboard over real HTTP on loopback (on real stores): access rules, CSRF, no password
in any page, the CLI's bind checks, and speed with 100,000 tasks."""

from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from click.testing import CliRunner

from metafora import Task, open_client
from metafora.cli import cli
from metafora.core.errors import ConfigError
from metafora.web.app import create_app
from metafora.web.server import WebServer, display_url, is_loopback, parse_bind
from tests.web.conftest import http_call, insert_tasks

TOKEN = "t0ken-for-tests-16"


class Response:
    def __init__(self, status_code: int, text: str, headers: dict[str, str]) -> None:
        self.status_code, self.text, self.headers = status_code, text, headers


class TestClient:
    """A tiny HTTP client on a served app: keeps one cookie jar, never follows redirects."""

    __test__ = False

    def __init__(self, app: Any, follow_redirects: bool = True) -> None:
        self.server = WebServer(app, "127.0.0.1", 0)
        self.follow = follow_redirects
        self.cookies: dict[str, str] = {}

    def __enter__(self) -> TestClient:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def request(self, method: str, path: str, data: dict[str, str] | None = None,
                headers: dict[str, str] | None = None, params: dict[str, str] | None = None,
                cookies: dict[str, str] | None = None) -> Response:
        if params:
            path = f"{path}?{urlencode(params)}"
        jar = self.cookies if cookies is None else cookies
        status, text, got = http_call(self.server.port, method, path, data, headers, jar)
        if "set-cookie" in got:
            name, _, rest = got["set-cookie"].partition("=")
            self.cookies[name] = rest.split(";", 1)[0]
        if self.follow and status in (303, 307) and "location" in got:
            return self.request("GET", got["location"])
        return Response(status, text, got)

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw: Any) -> Response:
        return self.request("POST", path, **kw)



def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert found, "no CSRF field in the page"
    return found.group(1)


@pytest.fixture
def store(sqlite_url: str) -> str:
    with open_client(sqlite_url) as client:
        client.submit_task(Task("alpha", {"k": 1}))
        client.submit_task(Task("beta"))
    return sqlite_url


def test_read_only_without_token(store: str) -> None:
    app = create_app(store)
    with TestClient(app) as http:
        page = http.get("/nodes")
        assert page.status_code == 200 and "read-only" in page.text
        refused = http.post("/act", data={"target": "task", "verb": "delete", "id": "alpha"})
        assert refused.status_code == 403 and "read-only" in refused.text
        assert http.post("/login", data={"token": ""}).status_code == 403
    app.state.dashboard.close()
    with open_client(store) as client:
        assert client.get_task("alpha").id == "alpha"


def test_login_cookie_needs_the_csrf_field(store: str) -> None:
    app = create_app(store, token=TOKEN)
    with TestClient(app, follow_redirects=False) as http:
        assert http.post("/login", data={"token": "wrong"}).status_code == 403
        logged = http.post("/login", data={"token": TOKEN, "next": "/tasks"})
        assert logged.status_code == 303 and logged.headers["location"].startswith("/tasks?")
        cookie = logged.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and TOKEN not in cookie
        # the cookie alone (what a cross-site form would carry) is not enough
        forged = http.post("/act", data={"target": "task", "verb": "delete", "id": "alpha"})
        assert forged.status_code == 403 and "CSRF" in forged.text
        csrf = _csrf(http.get("/tasks").text)
        ok = http.post("/act", data={"target": "task", "verb": "delete", "id": "alpha", "csrf": csrf,
                                     "next": "//evil.example/"})
        assert ok.status_code == 303 and ok.headers["location"].startswith("/tasks?msg=deleted")
        for evil in ("/\\evil.example/", "https://evil.example/"):
            moved = http.post("/act", data={"target": "task", "verb": "retry", "id": "nope", "next": evil},
                              headers={"X-Metafora-Token": TOKEN})
            assert moved.status_code == 404  # refused before any redirect
        again = http.post("/login", data={"token": TOKEN, "next": "/\\evil.example"})
        assert again.headers["location"].startswith("/nodes?")
        # header token (scripts): no CSRF field needed; a wrong one is refused
        assert http.post("/act", data={"target": "task", "verb": "retry", "id": "beta"},
                         headers={"Authorization": "Bearer nope"}, cookies={}).status_code == 403
        wrong_state = http.post("/act", data={"target": "task", "verb": "retry", "id": "beta"},
                                headers={"X-Metafora-Token": TOKEN})
        assert wrong_state.status_code == 409 and "pending" in wrong_state.text
        missing = http.post("/act", data={"target": "node", "verb": "freeze", "id": "ghost"},
                            headers={"X-Metafora-Token": TOKEN})
        assert missing.status_code == 404 and "Traceback" not in missing.text
        bad = http.post("/act", data={"target": "node", "verb": "explode", "id": "x"},
                        headers={"X-Metafora-Token": TOKEN})
        assert bad.status_code == 400
    app.state.dashboard.close()
    with open_client(store) as client:
        assert [t.id for t in client.tasks()] == ["beta"]


def test_no_password_in_any_page(postgres_url: str) -> None:
    scheme, rest = postgres_url.split("://", 1)
    user, at, host_part = rest.rpartition("@")
    user = user.split(":", 1)[0] if at else "postgres"
    secret_url = f"{scheme}://{user}:Hunter2Secret@{host_part}"
    with open_client(secret_url) as client:
        client.submit_task(Task("visible", {"a": 1}))
    app = create_app(secret_url, token=TOKEN)
    with TestClient(app) as http:
        for path in ("/nodes", "/tasks", "/tasks?partial=1", "/charts", "/task?id=visible",
                     "/task?id=missing", "/tasks?state=bogus", "/login", "/healthz"):
            body = http.get(path).text
            assert "Hunter2Secret" not in body, path
            assert f"{user}:" not in body and f"{user}@" not in body, path
        assert display_url(secret_url) in http.get("/nodes").text
    app.state.dashboard.close()


def test_detail_and_filters(store: str) -> None:
    app = create_app(store)
    with TestClient(app) as http:
        detail = http.get("/task", params={"id": "alpha"})
        assert detail.status_code == 200 and "&#34;k&#34;: 1" in detail.text
        assert "No state yet" in detail.text and "No items stored" in detail.text
        listed = http.get("/tasks", params={"prefix": "al"}).text
        assert 'data-task="alpha"' in listed and 'data-task="beta"' not in listed
        partial = http.get("/tasks", params={"partial": "1"}).text
        assert "<html" not in partial and 'data-task="beta"' in partial
        assert http.get("/task", params={"id": "nope"}).status_code == 404
        assert http.get("/tasks", params={"state": "bogus"}).status_code == 400
    app.state.dashboard.close()


def test_bind_rules() -> None:
    assert parse_bind("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_bind("[::1]:9") == ("::1", 9)
    assert parse_bind(":7000") == ("127.0.0.1", 7000)
    for bad in ("nonsense", "host:99999", "host:"):
        with pytest.raises(ConfigError, match=r"bind|range"):
            parse_bind(bad)
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_cli_refuses_a_public_bind_without_token(sqlite_url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["--url", sqlite_url, "web", "--bind", "0.0.0.0:8080"], env={})
    assert result.exit_code == 2
    assert "refusing to serve on 0.0.0.0" in result.output and "Traceback" not in result.output
    result = runner.invoke(cli, ["--url", sqlite_url, "web", "--bind", "wat"], env={})
    assert result.exit_code == 2 and "HOST:PORT" in result.output


@pytest.mark.timing
def test_fast_with_100000_tasks(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'big.db'}"
    insert_tasks(url, [{"id": f"job-{i:06d}", "state": "failed" if i % 10 == 0 else "pending",
                        "error": "boom" if i % 10 == 0 else None} for i in range(100_000)])
    app = create_app(url)
    with TestClient(app) as http:
        http.get("/tasks")  # warm up (templates compiled, schema checked)
        timings = {}
        for path in ("/tasks", "/tasks?state=failed&limit=200", "/tasks?prefix=job-0999",
                     "/tasks?after=job-050000", "/tasks?state=pending&after=job-099000&partial=1",
                     "/nodes"):
            best = float("inf")
            for _ in range(3):  # the best of three: a shared CI machine has noisy neighbours
                start = time.perf_counter()
                response = http.get(path)
                best = min(best, time.perf_counter() - start)
                assert response.status_code == 200
            timings[path] = best
        page = http.get("/tasks?state=failed&limit=200").text
        assert page.count("data-task=") == 200 and 'id="next"' in page
        assert "100000" in http.get("/nodes").text.replace(",", "")
    app.state.dashboard.close()
    print("page render times with 100,000 tasks:", {k: f"{v * 1000:.0f} ms" for k, v in timings.items()})
    assert max(timings.values()) < 1.0, timings


def test_task_detail_with_state_machine_and_gates(sqlite_url: str) -> None:
    from metafora import open_coordinator
    from metafora.contracts.coordinator import CoordinatorContext
    from metafora.gates import ItemStore, NewItem
    from metafora.statemachine import State, StateCode, state_store_for

    class Ctx(CoordinatorContext):
        def lost(self, task: Task) -> None:
            return

    with open_client(sqlite_url) as client:
        client.submit_task(Task("part-1"))
        with open_coordinator(sqlite_url, node_id="writer") as coord:
            coord.init(Ctx())
            claimed = coord.claim(Task("part-1"))
            assert claimed is not None
            states = state_store_for(client)
            try:  # a state is written under the claim (fenced by its token)
                states.store(claimed, State(code=StateCode.PAUSED, cursor="row-42"))
            finally:
                states.close()
    items = ItemStore(sqlite_url)
    try:
        items.add("part-1", [NewItem(0, b"a"), NewItem(0, b"b"), NewItem(1, b"c")])
    finally:
        items.close()
    app = create_app(sqlite_url, token=TOKEN)
    with TestClient(app, follow_redirects=False) as http:
        page = http.get("/task", params={"id": "part-1"}).text
        assert 'id="sm"' in page and "paused" in page and "row-42" in page
        gates = page[page.index('id="gates"'):]
        assert re.search(r"<td>0 ◀ current</td><td class=\"num\">2</td>", gates), gates[:600]
        for verb in ("pause", "resume", "kill"):
            assert f'data-action="{verb}"' in page
        sent = http.post("/act", data={"target": "task", "verb": "pause", "id": "part-1"},
                         headers={"X-Metafora-Token": TOKEN})
        assert sent.status_code == 303 and "msg=pause&msg_id=part-1" in sent.headers["location"]
        retried = http.post("/act", data={"target": "task", "verb": "retry-items", "id": "part-1"},
                            headers={"X-Metafora-Token": TOKEN})
        assert retried.status_code == 303 and "msg=retry-items" in retried.headers["location"]
    app.state.dashboard.close()


def test_metafora_web_command_serves_until_interrupted(sqlite_url: str) -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys

    from metafora.testing import wait_for

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "METAFORA_WEB_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "metafora", "--url", sqlite_url, "web",
                             "--bind", f"127.0.0.1:{port}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def health() -> str | None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/healthz")
                return conn.getresponse().read().decode()
            except OSError:
                assert proc.poll() is None, proc.communicate()
                return None

        body = wait_for(health, 60, "metafora web to answer")
        assert json.loads(body)["read_only"] is True
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "read-only" in err and "stopped" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_node_list_shows_labels_and_weight(store: str) -> None:
    from metafora import open_coordinator
    from metafora.testing import RecordingContext

    coord = open_coordinator(store, node_id="gpu-node")
    coord.init(RecordingContext(labels={"gpu": "1", "zone": "eu"}, weight=2.5))
    app = create_app(store)
    try:
        with TestClient(app) as http:
            page = http.get("/nodes")
            assert page.status_code == 200 and "gpu=1, zone=eu" in page.text
            assert '<th class="num">weight</th>' in page.text
            assert '<td class="num">2.5</td>' in page.text
    finally:
        app.state.dashboard.close()
        coord.close()
