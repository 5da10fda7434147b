"""Issue 52, finding 11 (the smaller ones): the connection-cap 503s (info server and
dashboard) and uvicorn's own 400 carry the security headers; ``msg_id`` shows at most a short
id; one log line carries at most a few KiB of an error; a 100 MB props value is refused
before it is encoded (no 346 MB peak)."""

from __future__ import annotations

import io
import logging
import resource
import socket
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from metafora import Task
from metafora.consumer.http import HEADERS, _BoundedServer
from metafora.core.errors import InvalidProps
from metafora.core.logs import MAX_LOG_TEXT, configure
from metafora.web.security import HEADERS as WEB_HEADERS
from metafora.web.security import MAX_REQUESTS
from tests.web import test_web_limits as _limits
from tests.web.test_web_limits import _reply

web = _limits.web  # the fixture: ``metafora web`` processes on a SQLite store


def _headers_of(reply: bytes) -> dict[str, str]:
    head = reply.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head)}


class _Slow(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()


def test_the_info_servers_connection_cap_503_has_the_headers() -> None:
    server = _BoundedServer(("127.0.0.1", 0), _Slow, max_clients=1)
    try:
        import threading

        serving = threading.Thread(target=server.serve_forever, daemon=True)
        serving.start()
        port = server.server_address[1]
        first = socket.create_connection(("127.0.0.1", port), timeout=10)  # holds the only slot
        try:
            first.sendall(b"GET / HTTP/1.1\r\n")  # and never finishes its request
            second = socket.create_connection(("127.0.0.1", port), timeout=10)
            reply = _reply(second)
            second.close()
        finally:
            first.close()
    finally:
        server.shutdown()
        server.server_close()
    assert reply.startswith(b"HTTP/1.0 503"), reply[:80]
    got = _headers_of(reply)
    for name, value in HEADERS:  # before: none of them
        assert got.get(name.lower()) == value, (name, got)


def test_the_dashboards_400_and_connection_cap_503_have_the_headers(web: Any) -> None:
    server = web(token=None)
    bad = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    bad.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    reply = _reply(bad)
    bad.close()
    assert reply.startswith(b"HTTP/1.1 400"), reply[:80]
    for name, value in WEB_HEADERS:  # before: uvicorn's own 400 had none
        assert _headers_of(reply).get(name.decode()) == value.decode(), name
    held = []
    try:
        for _ in range(MAX_REQUESTS):
            held.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        over = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        over.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = _reply(over)
        over.close()
    finally:
        for sock in held:
            sock.close()
    assert reply.startswith(b"HTTP/1.1 503"), reply[:80]
    for name, value in WEB_HEADERS:  # before: uvicorn's own 503 had none
        assert _headers_of(reply).get(name.decode()) == value.decode(), name


def test_msg_id_shows_a_short_valid_id_only(web: Any) -> None:
    server = web(token=None)
    long_text = "Session expired. Paste your token at https://evil.example/login " * 3
    shown = server.request("GET", f"/nodes?msg=freeze&msg_id={long_text.replace(' ', '+')}")
    assert "evil.example" not in shown.text  # before: 200 characters of it
    named = server.request("GET", "/nodes?msg=freeze&msg_id=" + "n" * 100)
    assert "n" * 39 + "…" in named.text and "n" * 41 not in named.text
    bidi = server.request("GET", "/nodes?msg=freeze&msg_id=a%E2%80%AEb")
    assert "sent freeze" not in bidi.text  # not an id: no message at all


def test_one_log_line_carries_a_few_kib_of_a_huge_error() -> None:
    out = io.StringIO()
    configure(stream=out)
    try:
        try:
            raise ValueError("a://h/?%=1 " * 95000)
        except ValueError as exc:
            logging.getLogger("metafora.test").exception("task t failed: %s", exc)
    finally:
        configure(stream=io.StringIO())
        logging.getLogger().handlers.clear()
    line = out.getvalue()
    assert line.count("\n") == 1
    assert len(line) < 3 * MAX_LOG_TEXT, len(line)  # before: 82 KB
    assert "… cut, " in line


def test_huge_props_are_refused_before_they_are_encoded() -> None:
    blob = {"blob": "x" * 100_000_000}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidProps, match="1048576"):
        Task("t", blob)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 50_000, grown_kib  # before: the JSON text and its bytes, 200+ MB


def test_cli_props_text_is_bounded_before_decoding(tmp_path: Path) -> None:
    from metafora.cli.tasks import _task_props

    with pytest.raises(InvalidProps, match="at most"):
        _task_props((), '{"a": "' + "x" * 5_000_000 + '"}', None, None)
