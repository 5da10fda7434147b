"""Issue 25 against ``metafora web`` running as its own process on SQLite, over real HTTP.

One test per finding of the dashboard: long requests cost little (1), actions hit the task
shown (2), login is throttled, short tokens are refused off loopback and the token can come
from a file (5), sessions end at logout (6), other Hosts are refused (7), every response
carries the security headers and the pages hold no inline script or style (8). Units of
:mod:`metafora.web.security` close the file.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from metafora import Task, open_client
from metafora.core.errors import (
    ConfigError,
    CoordinatorUnavailable,
    InvalidTaskId,
    InvalidTaskState,
    MetaforaError,
    StoreError,
    TaskNotFound,
)
from metafora.testing import wait_for
from metafora.web.security import (
    LoginThrottle,
    Sessions,
    allowed_hosts,
    check_token,
    host_allowed,
    host_name,
    status_for,
)
from tests.web.conftest import http_call

TOKEN = "a-long-enough-token-for-tests"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env.update(extra)
    return env


class Reply:
    def __init__(self, status: int, text: str, headers: dict[str, str]) -> None:
        self.status, self.text, self.headers = status, text, headers


class Web:
    """``python -m metafora web`` in a subprocess, and a small HTTP client with a cookie jar."""

    def __init__(self, url: str, tmp: Path, *args: str, token: str | None = TOKEN,
                 token_file: bool = False, bind: str = "127.0.0.1") -> None:
        self.port = _free_port()
        self.cookies: dict[str, str] = {}
        env = _env()
        extra = list(args)
        if token is not None and token_file:
            path = tmp / "token"
            path.write_text(token + "\n", encoding="utf-8")
            extra += ["--token-file", str(path)]
        elif token is not None:
            env["METAFORA_WEB_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metafora", "--url", url, "web", "--bind", f"{bind}:{self.port}",
             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(self._up, 60, "metafora web to answer")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.proc.communicate()
        try:
            return self.request("GET", "/healthz").status == 200
        except OSError:
            return False

    def request(self, method: str, path: str, data: dict[str, str] | None = None,
                headers: dict[str, str] | None = None, jar: dict[str, str] | None = None,
                timeout: float = 30) -> Reply:
        cookies = self.cookies if jar is None else jar
        status, text, got = http_call(self.port, method, path, data, headers, cookies, timeout)
        if "set-cookie" in got and jar is None:
            name, _, rest = got["set-cookie"].partition("=")
            self.cookies[name] = rest.split(";", 1)[0]
        return Reply(status, text, got)

    def login(self) -> str:
        """Log in with the token; the CSRF value of the new session."""
        assert self.request("POST", "/login", {"token": TOKEN}).status == 303
        found = re.search(r'name="csrf" value="([0-9a-f]+)"', self.request("GET", "/nodes").text)
        assert found, "no CSRF field after logging in"
        return found.group(1)

    def stop(self) -> str:
        """Interrupt the server; its stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
        return str(err)


@pytest.fixture
def web(sqlite_url: str, tmp_path: Path) -> Iterator[Any]:
    """``web(*args, token=TOKEN, token_file=False)`` starts ``metafora web`` on the SQLite store
    (the token in its environment, or in a file); all are stopped at the end."""
    started: list[Web] = []

    def start(*args: str, token: str | None = TOKEN, token_file: bool = False,
              bind: str = "127.0.0.1") -> Web:
        server = Web(sqlite_url, tmp_path, *args, token=token, token_file=token_file, bind=bind)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# -- 1: one request cannot cost seconds of CPU --------------------------------------------------


def test_a_long_message_and_long_props_render_whole(sqlite_url: str, web: Any) -> None:
    letters = "m" * 65_000
    with open_client(sqlite_url) as client:
        client.submit_task(Task("long-props", {"text": letters}))
    server = web(token=None)
    # Before the fix each of these took 6-25 s of CPU (a quadratic URL pattern over the page);
    # now a few ms (benchmarks/security.py). The 10 s socket timeout is a liveness bound only.
    page = server.request("GET", "/nodes?" + urlencode({"msg": "m" * 60_000}), timeout=10)
    assert page.status == 200 and 'id="msg"' not in page.text  # issue 34: only fixed codes show
    props = server.request("GET", "/task?id=long-props", timeout=10)
    assert props.status == 200 and letters in props.text
    assert server.request("GET", "/healthz").status == 200


# -- 2: actions hit the task shown ----------------------------------------------------------------


def test_the_page_of_a_task_acts_on_that_task(sqlite_url: str, web: Any) -> None:
    decoy, victim = "x://***@b", "x://victim@b"
    with open_client(sqlite_url) as client:
        client.submit_task(Task(decoy))
        client.submit_task(Task(victim, {"note": "see postgresql://app:SECRET@db/prod"}))
    server = web()
    csrf = server.login()
    page = server.request("GET", "/task?" + urlencode({"id": victim})).text
    assert decoy not in page, "the page of x://victim@b names the other task"
    assert f"<title>Task {victim} · metafora</title>" in page
    ids = set(re.findall(r'name="id" value="([^"]*)"', page))
    assert ids == {victim}
    assert "SECRET" not in page and "app:***@db" in page  # text is still masked
    gone = server.request("POST", "/act", {"target": "task", "verb": "delete", "id": victim,
                                           "csrf": csrf})
    assert gone.status == 303
    with open_client(sqlite_url) as client:
        assert [t.id for t in client.tasks()] == [decoy]


# -- 5: throttled login, no weak token off loopback, the token off the command line -------------


def test_login_is_throttled_per_client(web: Any) -> None:
    server = web()
    act = {"target": "task", "verb": "retry", "id": "nope"}
    statuses = [server.request("POST", "/login", {"token": f"wrong-{i}"}).status for i in range(3)]
    # a wrong header token (a script's way in) counts the same
    statuses += [server.request("POST", "/act", act, headers={"Authorization": f"Bearer wrong-{i}"}).status
                 for i in range(2)]
    assert statuses == [403] * 5
    slowed = server.request("POST", "/login", {"token": "wrong-again"})
    assert slowed.status == 429 and int(slowed.headers["retry-after"]) >= 1
    # while the client waits, even the right token is not tried, by either way
    assert server.request("POST", "/login", {"token": TOKEN}).status == 429
    assert server.request("POST", "/act", act, headers={"X-Metafora-Token": TOKEN}).status == 429


def test_the_token_file_keeps_the_token_out_of_ps(web: Any) -> None:
    server = web(token_file=True)
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
    assert TOKEN not in cmdline and "--token-file" in cmdline
    server.login()


def test_a_short_token_is_refused_off_loopback(sqlite_url: str, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "metafora", "--url", sqlite_url, "web"]
    short = subprocess.run([*base, "--bind", "0.0.0.0:0", "--token", "a"], env=_env(),
                           capture_output=True, text=True, timeout=60, check=False)
    assert short.returncode == 2 and "at least 16" in short.stderr, short.stderr
    (tmp_path / "two").write_text("a\nb\n", encoding="utf-8")
    both = subprocess.run([*base, "--token", TOKEN, "--token-file", str(tmp_path / "two")],
                          env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert both.returncode == 2 and "not both" in both.stderr, both.stderr
    assert "Traceback" not in short.stderr + both.stderr


# -- 6: sessions end --------------------------------------------------------------------------------


def test_each_login_is_a_new_session_and_logout_ends_it(web: Any) -> None:
    server = web()
    csrf = server.login()
    first = dict(server.cookies)
    server.cookies.clear()
    server.login()
    assert server.cookies != first, "two logins got the same session cookie"
    act = {"target": "task", "verb": "retry", "id": "nope", "csrf": csrf}
    assert server.request("POST", "/act", act, jar=first).status == 404  # the session works
    assert server.request("POST", "/logout", {"csrf": csrf}, jar=first).status == 303
    after = server.request("POST", "/act", act, jar=first)
    assert after.status == 403 and "log in" in after.text
    assert 'name="csrf"' not in server.request("GET", "/nodes", jar=first).text


# -- 7: DNS rebinding --------------------------------------------------------------------------------


def test_other_hosts_are_refused(web: Any) -> None:
    server = web("--allow-host", "dash.example")
    assert server.request("GET", "/nodes", headers={"Host": "evil.example"}).status == 421
    assert server.request("GET", "/nodes", headers={"Host": "evil.example:80"}).status == 421
    for good in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "dash.example"):
        assert server.request("GET", "/nodes", headers={"Host": good}).status == 200, good
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
        raw.sendall(b"GET /nodes HTTP/1.0\r\n\r\n")  # no Host at all
        assert raw.recv(64).startswith(b"HTTP/1.1 400")


def test_a_wildcard_bind_answers_addresses_and_its_own_names_but_no_other_name(web: Any) -> None:
    # Bound to every interface (the test only connects through loopback). Without --allow-host
    # it still starts: loopback names, this machine's names and IP addresses are answered
    # (a rebinding attack needs a DNS name), any other name is refused.
    server = web(bind="0.0.0.0")
    for good in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "10.1.2.3", "[::1]:80",
                 socket.gethostname()):
        assert server.request("GET", "/nodes", headers={"Host": good}).status == 200, good
    assert server.request("GET", "/nodes", headers={"Host": "evil.example"}).status == 421
    assert server.request("GET", "/nodes", headers={"Host": "evil.example:80"}).status == 421


def test_an_idle_connection_is_closed(sqlite_url: str) -> None:
    from metafora.web.app import create_app
    from metafora.web.server import WebServer

    app = create_app(sqlite_url)
    server = WebServer(app, "127.0.0.1", 0, idle_timeout=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as idle:
            idle.sendall(b"GET /nodes HTTP/1.1\r\n")  # a head never finished
            assert idle.recv(1024) == b""  # closed by the server, long before the 30 s timeout
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as silent:
            assert silent.recv(1024) == b""  # nothing sent at all
    finally:
        server.stop()
        app.state.dashboard.close()


# -- 8: headers, and nothing inline for the CSP to forbid -----------------------------------------


def test_every_response_carries_the_security_headers(web: Any) -> None:
    server = web()
    for method, path in (("GET", "/nodes"), ("GET", "/tasks?partial=1"), ("GET", "/task?id=nope"),
                         ("GET", "/static/app.js"), ("GET", "/static/style.css"), ("GET", "/static/x"),
                         ("GET", "/healthz"), ("POST", "/login"), ("GET", "/nowhere")):
        reply = server.request(method, path, {} if method == "POST" else None)
        csp = reply.headers.get("content-security-policy", "")
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, (path, reply.headers)
        assert reply.headers.get("x-content-type-options") == "nosniff", path
    refused = server.request("GET", "/nodes", headers={"Host": "evil.example"})
    assert refused.headers.get("x-content-type-options") == "nosniff"


def test_pages_hold_no_inline_script_or_style(sqlite_url: str, web: Any) -> None:
    with open_client(sqlite_url) as client:
        client.submit_task(Task("t1"))
    server = web()
    server.login()
    for path in ("/nodes", "/tasks", "/charts", "/task?id=t1", "/task?id=nope", "/login"):
        page = server.request("GET", path).text
        assert not re.search(r"<script(?![^>]*\bsrc=)", page), path
        assert "style=" not in page and "<style" not in page and "javascript:" not in page, path
        assert re.search(r"\son[a-z]+=", page) is None, path


# -- 9: an id stored before bidi controls were refused cannot read as another -------------------


def test_a_bidi_id_is_shown_escaped(sqlite_url: str, web: Any) -> None:
    spoof = "invoice\u202etxt.exe"
    with open_client(sqlite_url) as client:
        client.submit_task(Task("seed"))
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as db:  # as an older version stored it
        db.execute("INSERT INTO metafora_tasks (namespace, id, props, state, created_at, updated_at)"
                   " VALUES ('metafora', ?, '{}', 'failed', '2026-11-23 10:00:00.000',"
                   " '2026-11-23 10:00:00.000')", (spoof,))
    server = web()
    listed = server.request("GET", "/tasks").text
    shown = re.sub(r"<[^>]*>", "", listed)  # the text a reader sees, without tags and attributes
    assert "\u202e" not in shown and "invoice\\u202etxt.exe" in shown
    assert f'data-task="{spoof}"' in listed  # data stays exact
    refused = server.request("GET", "/task?" + urlencode({"id": spoof}))
    assert refused.status == 400 and "bidi" in refused.text
    assert "\u202e" not in re.sub(r"<[^>]*>", "", refused.text)


# -- units ----------------------------------------------------------------------------------------


def test_sessions_expire_when_idle_and_end_at_logout() -> None:
    now = [0.0]
    sessions = Sessions(idle=60, limit=2, clock=lambda: now[0])
    sid, csrf = sessions.start()
    other, _ = sessions.start()
    assert sid != other and len(sid) >= 32 and sessions.get(sid) is not None
    now[0] = 59.0
    assert sessions.get(sid) is not None and sessions.get(sid).csrf == csrf  # type: ignore[union-attr]
    now[0] = 200.0
    assert sessions.get(sid) is None  # idle for longer than 60 s
    third, _ = sessions.start()
    sessions.end(third)
    assert sessions.get(third) is None and sessions.get("") is None


def test_login_throttle_doubles_its_wait() -> None:
    now = [0.0]
    throttle = LoginThrottle(free=2, first_wait=1.0, max_wait=8.0, clock=lambda: now[0])
    throttle.failed("a")
    assert throttle.wait("a") == 0.0  # a free try
    throttle.failed("a")
    assert throttle.wait("a") == 1.0
    throttle.failed("a")
    assert throttle.wait("a") == 2.0 and throttle.wait("b") == 0.0
    now[0] = 2.0
    assert throttle.wait("a") == 0.0  # waited long enough: one more try
    for _ in range(10):
        throttle.failed("a")
    assert throttle.wait("a") == 8.0
    throttle.succeeded("a")
    assert throttle.wait("a") == 0.0


def test_hosts_and_tokens() -> None:
    assert host_name("[::1]:8080") == "::1" and host_name("Example.COM:80") == "example.com"
    assert host_name("::1") == "::1"
    assert allowed_hosts("127.0.0.1", True) >= {"localhost", "127.0.0.1", "::1"}
    wildcard = allowed_hosts("0.0.0.0", False)
    assert {"localhost", "127.0.0.1", socket.gethostname().lower()} <= wildcard
    assert "0.0.0.0" not in wildcard and "evil.example" not in wildcard
    assert allowed_hosts("10.0.0.5", False, ["Dash.example"]) == {"dash.example", "10.0.0.5"}
    assert host_allowed("192.0.2.7", frozenset()) and host_allowed("::1", frozenset())
    assert not host_allowed("evil.example", wildcard)
    check_token(None, "0.0.0.0", False)
    check_token("x" * 16, "127.0.0.1", True)
    with pytest.raises(ConfigError, match="at least 16"):
        check_token("short", "0.0.0.0", False)
    with pytest.raises(ConfigError, match="at least 16"):  # issue 34: on loopback too
        check_token("short", "127.0.0.1", True)


def test_exception_status_table() -> None:
    assert status_for(TaskNotFound("x")) == 404
    assert status_for(CoordinatorUnavailable("x")) == 503
    assert status_for(InvalidTaskState("x")) == 409
    assert status_for(StoreError("x")) == 409
    assert status_for(InvalidTaskId("x")) == 400
    assert status_for(MetaforaError("x")) == 400
    assert status_for(RuntimeError("x")) == 500


def test_the_pages_run_under_their_csp_in_a_browser(sqlite_url: str, serve: Any, page: Any) -> None:
    pytest.importorskip("playwright")
    from playwright.sync_api import expect

    with open_client(sqlite_url) as client:
        client.submit_task(Task("csp-task", {"url": "postgresql://app:SECRET@db/prod"}))
    web = serve(sqlite_url, token=TOKEN)
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    page.goto(f"{web.base}/login")
    page.fill("#token", TOKEN)
    page.click("#login-go")
    expect(page.locator("#msg")).to_have_text("logged in")
    page.goto(f"{web.base}/task?id=csp-task")
    expect(page.locator("#props")).to_contain_text("app:***@db")
    # the live part refreshes through the page's script (allowed by default-src 'self')
    expect(page.locator("#live")).to_have_attribute("data-updated", re.compile(r"\d+"), timeout=30_000)
    page.goto(f"{web.base}/tasks")
    page.goto(f"{web.base}/task?id=nope")
    page.click("a[data-back]")  # the script's history.back(), not a javascript: link
    expect(page).to_have_url(f"{web.base}/tasks")
    assert [m for m in console if "Content Security Policy" in m] == []
