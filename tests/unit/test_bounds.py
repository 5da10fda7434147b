"""Issue 34's units: errors cut where they are made, masking capped, one-line log records,
invisible characters, the bounded JSON reader of the CLI, the info server's bounds."""

from __future__ import annotations

import io
import logging
import socket
import sys
import time
import unicodedata
import urllib.error
import urllib.request

import pytest

from metafora.consumer.http import InfoServer
from metafora.contracts.coordinator import MAX_ERROR_BYTES, error_text
from metafora.core.errors import InvalidProps, InvalidTaskId
from metafora.core.jsontext import load_value
from metafora.core.logs import JsonFormatter, PlainFormatter
from metafora.core.masking import (
    MAX_MASKED,
    cut_text,
    escape_controls,
    escape_line,
    invisible_char,
    one_line,
    scrub,
)
from metafora.core.task import validate_task_id

MIB = 1024 * 1024


@pytest.mark.timing  # linear, not quadratic: 1 s for MiBs
def test_error_text_keeps_the_type_and_the_first_kib() -> None:
    for message in ("a://h/?%=1 " * 95_000, "E" * MIB, "é" * MIB, "😀" * MIB):
        started = time.perf_counter()
        stored = error_text(ValueError(message))
        assert time.perf_counter() - started < 1.0
        assert len(stored.encode()) <= MAX_ERROR_BYTES + 16  # masking may lengthen a little
        assert stored.startswith("ValueError: ")
        assert stored.endswith(f"… cut, {len(message.encode())} bytes")
    assert error_text(ValueError("short")) == "ValueError: short"
    assert error_text("x" * 10_000).endswith("… cut, 10000 bytes")


def test_a_url_cut_in_its_middle_is_still_masked() -> None:
    for pad in range(MAX_ERROR_BYTES - 80, MAX_ERROR_BYTES):
        stored = error_text(ValueError("x" * pad + " postgresql://app:SECRETPASSWORD@db/prod"))
        assert "ECRET" not in stored and "SECR" not in stored, stored[-60:]


def test_cut_text_never_splits_a_character_and_is_a_fixed_point() -> None:
    assert cut_text("abc", 10) == "abc"
    cut = cut_text("é" * 100, 50)
    assert len(cut.encode()) <= 50 and cut.endswith("… cut, 200 bytes") and "\ufffd" not in cut
    assert cut_text(cut, 50) == cut


@pytest.mark.timing  # linear, not quadratic: 1 s for MiBs
def test_scrub_caps_each_value_and_stays_a_fixed_point() -> None:
    for unit in ("a://@ ", "E", "a://h/?%=1 ", "postgresql://a:SECRET@h/db "):
        text = unit * (MIB // len(unit))
        started = time.perf_counter()
        masked = scrub(text)
        assert time.perf_counter() - started < 1.0
        assert len(masked.encode()) <= MAX_MASKED and "SECRET" not in masked
        assert scrub(masked) == masked


def test_one_line() -> None:
    assert one_line("ValueError: x") == "ValueError: x"
    assert one_line("Traceback\n  line 2") == "Traceback…"
    long = one_line("E" * MIB)
    assert len(long) == 120 and long.endswith("…")
    assert one_line("") == ""


def test_the_invisible_list_covers_every_format_character() -> None:
    missing = [hex(c) for c in range(sys.maxunicode + 1)
               if unicodedata.category(chr(c)) == "Cf" and invisible_char(chr(c)) is None]
    assert missing == []
    for char in "\u200b\u2060\ufeff\u00ad\u034f\u180e\ufe0f\U000e0041\u2028":
        assert invisible_char(f"a{char}b") == char
        assert char not in escape_controls(f"a{char}b")
        with pytest.raises(InvalidTaskId):
            validate_task_id(f"task{char}1")
    assert invisible_char("tâche-漢字-😀") is None
    validate_task_id("tâche-漢字-😀")


def test_escape_line_writes_newlines_and_controls_as_escapes() -> None:
    assert escape_line("a\nb\r\x1b[2J\u202ec") == "a\\nb\\x0d\\x1b[2J\\u202ec"
    assert escape_line("\U000e0041") == "\\U000e0041"


def _record(message: str, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("metafora.consumer", logging.ERROR, __file__, 1, "%s", (message,), info)


def test_every_log_record_is_one_escaped_line() -> None:
    hostile = ("\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\ \x1b[2J \u202e "
               "\n2026-11-28 10:00:00,000 ERROR   metafora.consumer FAKE LOG LINE postgresql://a:SECRET@h/db")
    try:
        raise ValueError(hostile)
    except ValueError as exc:
        error = exc
    for formatter in (PlainFormatter(), JsonFormatter()):
        line = formatter.format(_record(hostile, error))
        assert "\n" not in line and "\x1b" not in line and "\u202e" not in line, line
        assert "SECRET" not in line and "FAKE LOG LINE" in line
    plain = PlainFormatter().format(_record(hostile, error))
    assert "Traceback (most recent call last):\\n" in plain and " | " in plain
    handler = logging.StreamHandler(out := io.StringIO())
    handler.setFormatter(PlainFormatter())
    handler.emit(_record(hostile, error))
    assert out.getvalue().count("\n") == 1


def test_the_cli_reads_json_with_the_bounded_reader() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidProps, match="nested deeper"):
        load_value(deep, "--props", InvalidProps)
    with pytest.raises(InvalidProps, match="not valid JSON"):
        load_value('{"x": NaN}', "--props", InvalidProps, constants=False)
    assert load_value('{"x": NaN}', "v", InvalidProps)["x"] != 0
    from metafora.cli.tasks import parse_prop

    assert parse_prop("name=bob") == ("name", "bob") and parse_prop("n=3") == ("n", 3)
    with pytest.raises(InvalidProps, match="nested deeper"):
        parse_prop("x=" + deep)


def _get(port: int, path: str, host: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_info_server_checks_host_and_bounds_its_clients() -> None:
    server = InfoServer("127.0.0.1:0", lambda: {"ok": True}, lambda: b"",
                        lambda: {"alive": True, "ready": True})
    server.start()
    try:
        port = int(server.address.rsplit(":", 1)[1])
        assert _get(port, "/info", "127.0.0.1") == 200
        assert _get(port, "/info", "localhost") == 200
        assert _get(port, "/info", "evil.example") == 421
        assert _get(port, "/info", "10.9.8.7") == 200  # an address: typed by whoever connected
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /info HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 99999\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.0 413")
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
        try:
            refused = 0
            for sock in held[32:]:
                sock.settimeout(5)
                try:
                    refused += sock.recv(100).startswith(b"HTTP/1.0 503")
                except TimeoutError:
                    pass
            assert refused == 8  # 32 served at once, the rest answered 503 at once
        finally:
            for sock in held:
                sock.close()
    finally:
        server.close()
