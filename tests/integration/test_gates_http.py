"""HTTPProcessor against a real HTTP server on 127.0.0.1 (http.server): the wire format,
4xx = non-retryable, 5xx / timeouts = retryable, malformed answers, headers, and the gate
handler running partitions through it on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from metafora import Consumer, Task, TaskState, gates, open_coordinator
from metafora.core.errors import ConfigError
from metafora.gates import (
    HTTPProcessor,
    Item,
    ItemStatus,
    ItemStore,
    NewItem,
    PermanentError,
    ProcessingError,
)
from metafora.statemachine import ErrorPolicy
from metafora.testing import LocalCluster

pytestmark = pytest.mark.integration


@dataclass
class Service:
    """A tiny classification service with misbehaving routes."""

    url: str
    calls: Counter[str] = field(default_factory=Counter)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    in_flight: Counter[str] = field(default_factory=Counter)
    most_in_flight: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def service() -> Iterator[Service]:
    svc = Service("")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        _partition = ""

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _answer(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            with svc.lock:  # done before the client can see the answer and send the next
                svc.in_flight[self._partition] -= 1
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            item = json.loads(self.rfile.read(length))
            route = self.path.strip("/")
            with svc.lock:
                svc.calls[f"{route}:{item['id']}"] += 1
                count = svc.calls[f"{route}:{item['id']}"]
                svc.bodies.append(item)
                svc.headers.append(dict(self.headers))
                self._partition = part = item["partition"]
                svc.in_flight[part] += 1
                svc.most_in_flight[part] = max(svc.most_in_flight[part], svc.in_flight[part])
            self._route(route, item, count)

        def _route(self, route: str, item: dict[str, Any], count: int) -> None:
            if route == "classify":
                svc.release.wait(0.01)  # a little work, so requests overlap
                text = item["data"] or ""
                answer = {"gate": item["gate"], "done": True, "data": {"label": text.upper()}}
                if text == "bad":
                    self._answer(422, b"cannot classify 'bad'", "text/plain")
                    return
                if text == "flaky" and count < 3:
                    self._answer(503, b"overloaded", "text/plain")
                    return
                if text == "fan":
                    answer = {"gate": item["gate"], "done": True,
                              "spawn": [{"gate": item["gate"] + 1, "data": "child"},
                                        {"gate": item["gate"] + 2, "data_base64": "AP8="}]}
                self._answer(200, json.dumps(answer).encode())
            elif route.startswith("status/"):
                self._answer(int(route.split("/")[1]), b"nope", "text/plain")
            elif route == "slow":
                svc.release.wait(10)
                self._answer(200, b'{"done": true}')
            elif route == "garbage":
                self._answer(200, b"<html>not json</html>", "text/html")
            elif route == "no-done":
                self._answer(200, b'{"gate": 0}')
            else:
                self._answer(200, json.dumps({"done": False, "gate": 7,
                                              "data": self.headers.get("Authorization")}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    svc.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield svc
    finally:
        svc.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def _item(data: bytes = b"hello", gate: int = 0) -> Item:
    return Item("p", 42, gate, ItemStatus.AVAILABLE, data, attempts=1)


def test_the_wire_format_both_ways(service: Service) -> None:
    answer = HTTPProcessor(f"{service.url}/classify").process(_item(b"hello"))
    assert (answer.gate, answer.done, answer.data) == (0, True, b'{"label":"HELLO"}')
    assert service.bodies[-1] == {"partition": "p", "id": 42, "gate": 0, "attempts": 1,
                                  "data": "hello", "data_base64": "aGVsbG8="}
    binary = HTTPProcessor(f"{service.url}/classify").process(_item(b"\xff"))
    assert binary.done and service.bodies[-1]["data"] is None
    fan = HTTPProcessor(f"{service.url}/classify").process(_item(b"fan", gate=3))
    assert fan.spawn == (NewItem(4, b"child"), NewItem(5, b"\x00\xff"))
    echoed = HTTPProcessor(f"{service.url}/echo", headers={"Authorization": "Bearer t0k"}).process(_item())
    assert (echoed.gate, echoed.done, echoed.data) == (7, False, b"Bearer t0k")
    assert service.headers[-1]["Content-Type"] == "application/json"


def test_4xx_is_permanent_and_5xx_timeouts_and_connection_errors_are_retryable(service: Service) -> None:
    for status in (400, 404, 422):
        with pytest.raises(PermanentError, match=f"HTTP {status}"):
            HTTPProcessor(f"{service.url}/status/{status}").process(_item())
    for status in (500, 502, 503, 429, 408):
        with pytest.raises(ProcessingError, match=f"HTTP {status}") as info:
            HTTPProcessor(f"{service.url}/status/{status}").process(_item())
        assert info.value.retryable
    with pytest.raises(ProcessingError, match=r"no answer within 0\.2s") as slow:
        HTTPProcessor(f"{service.url}/slow", timeout=0.2).process(_item())
    assert slow.value.retryable
    with pytest.raises(PermanentError, match="not JSON"):
        HTTPProcessor(f"{service.url}/garbage").process(_item())
    with pytest.raises(PermanentError, match="'done'"):
        HTTPProcessor(f"{service.url}/no-done").process(_item())
    service.release.set()
    closed = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = closed.server_address[1]
    closed.server_close()  # nothing listens there any more
    with pytest.raises(ProcessingError) as refused:
        HTTPProcessor(f"http://127.0.0.1:{port}/x", timeout=2).process(_item())
    assert refused.value.retryable


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        HTTPProcessor("ftp://example.com/x")
    with pytest.raises(ConfigError):
        HTTPProcessor("http://127.0.0.1/x", timeout=0)
    with pytest.raises(ConfigError):
        HTTPProcessor("http://127.0.0.1/x", headers={"X": 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigError):
        HTTPProcessor("http://127.0.0.1/x", concurrency=0)


def test_partitions_through_http_4xx_fails_the_item_5xx_is_retried(sql_url: str, service: Service) -> None:
    items = ItemStore(sql_url)
    try:
        ok = items.add("ok", [NewItem(0, f"resume-{n}") for n in range(20)]
                       + [NewItem(0, b"flaky"), NewItem(1, b"rank")])
        (bad,) = items.add("bad", [NewItem(0, b"bad")])
        processor = HTTPProcessor(f"{service.url}/classify", timeout=5, concurrency=4)
        with LocalCluster(sql_url) as cluster:
            coord = open_coordinator(sql_url, node_id="n1")
            policy = ErrorPolicy(max_errors=3, base_delay=0.05, max_delay=0.1)
            handler = gates.handler_func(processor, coord, items, retry_delay=0.01,
                                         error_handler=gates.gate_error_handler(items, policy))
            assert handler.options.concurrency == 4  # the processor's bound
            cluster.start(Consumer(coord, handler))
            cluster.client.submit_task(Task("ok"))
            cluster.client.submit_task(Task("bad"))
            cluster.wait_for_state("ok", TaskState.DONE, timeout=60)
            cluster.wait_for_state("bad", TaskState.FAILED, timeout=60)
        flaky = items.get("ok", ok[20])
        assert (flaky.status, flaky.attempts, flaky.data) == (ItemStatus.COMPLETE, 3, b'{"label":"FLAKY"}')
        assert service.calls[f"classify:{ok[20]}"] == 3  # 503, 503, 200 within one round
        failed = items.get("bad", bad)
        assert (failed.status, failed.permanent, failed.attempts) == (ItemStatus.FAILED, True, 1)
        assert "HTTP 422" in (failed.error or "") and "cannot classify 'bad'" in (failed.error or "")
        assert service.calls[f"classify:{bad}"] == 1  # never retried
        assert 1 < service.most_in_flight["ok"] <= 4  # concurrent, and bounded per partition
    finally:
        items.close()
