"""Opt-in HTTP endpoints of a consumer: ``/info`` (JSON), ``/metrics`` (Prometheus) and the
probes ``/healthz`` (alive) and ``/readyz`` (ready for work).

Started by ``Consumer(..., http_addr="127.0.0.1:PORT")``; binds to loopback unless told otherwise.
``/metrics`` needs prometheus_client (``pip install 'metafora-cluster[http]'``).

There is no authentication: ``/info`` lists the node's running task ids and their fencing
tokens. The probes answer 200 or 503 with a short JSON body naming what was checked
(:meth:`metafora.consumer.Consumer.probes`): ``/healthz`` stays 200 through a graceful
shutdown (the process is alive and handing off: do not kill it), ``/readyz`` turns 503 as soon
as the shutdown starts, before any claim is released. A non-loopback address is allowed (a
metrics scraper on another machine) but logged as a warning naming what it exposes. Every
response carries the dashboard's security headers (``nosniff``, a CSP that allows nothing,
no framing).

Bounds (``docs/security.md``): a request whose ``Host`` is a name other than this machine's
(loopback names, the bound address, its own names on a wildcard bind; any IP address) gets
421 -- a DNS-rebinding page cannot read ``/info``; a request must arrive whole within
:data:`REQUEST_TIMEOUT` seconds of its connection (a client sending a byte at a time is cut
off); at most :data:`MAX_CLIENTS` are served at once (more get 503); a request body (these
are GETs) over :data:`MAX_BODY` bytes gets 413 unread; the listen backlog is
:data:`LISTEN_BACKLOG`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from metafora.consumer.cluster_metrics import ClusterSnapshot
from metafora.core.errors import ConfigError
from metafora.core.hosts import allowed_hosts, host_allowed, host_name, is_loopback
from metafora.core.masking import scrub
from metafora.core.metrics import ConsumerStats, HistogramSnapshot

__all__ = ["HEADERS", "LISTEN_BACKLOG", "MAX_BODY", "MAX_CLIENTS", "REQUEST_TIMEOUT", "InfoServer",
           "is_loopback", "parse_addr", "render_metrics"]

log = logging.getLogger("metafora.http")  # its name before the move (users' log config names it)

HEADERS = (
    ("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
)
"""Headers of every response of the info server (it serves data only: nothing may load)."""
_REFUSAL = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n"
            + b"".join(f"{name}: {value}\r\n".encode() for name, value in HEADERS) + b"\r\n")
# The answer past the connection cap: written before any thread, with the headers too.
IDLE_TIMEOUT = 10.0
"""Seconds a connection may wait on a request before it is closed."""
REQUEST_TIMEOUT = 10.0
"""Seconds from a connection's opening to its response: a slower request is cut off."""
MAX_CLIENTS = 32
"""Connections served at once (a thread each); more are answered 503 and closed."""
MAX_BODY = 1024
"""The largest request body accepted (bytes; the endpoints are GETs): more gets 413 unread."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before they are accepted (capped by ``somaxconn``)."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (port 0 = any free port) -> (host, port); ConfigError naming the problem."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"http_addr must be HOST:PORT, got {addr!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"http_addr port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"http_addr port must be 0-65535, got {port}")
    return host.strip("[]"), port


def render_metrics(node: str, stats: ConsumerStats, running: int, *, pruned: int = 0,
                   cluster: ClusterSnapshot | None = None,
                   gauges: Mapping[str, tuple[str, float]] | None = None) -> bytes:
    """The consumer's metrics in Prometheus text format (``pruned``: finished tasks this node
    pruned; ``cluster``: the last read of :mod:`metafora.consumer.cluster_metrics`, if any; ``gauges``:
    name -> (doc, value) of node-level gauges its handler publishes, labelled ``node`` only)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def histogram(name: str, doc: str, snap: HistogramSnapshot) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["node"])
        buckets = [("+Inf" if b == float("inf") else repr(b), c) for b, c in snap.buckets]
        fam.add_metric([node], buckets, snap.total)
        return fam

    class _Collector:
        def collect(self) -> Iterator[Any]:
            docs = {
                "claims": "Tasks claimed by this node",
                "releases": "Tasks this node released",
                "done": "Tasks this node finished",
                "failed": "Tasks whose handler raised on this node",
                "lost": "Claims this node lost (lease lost, task deleted)",
                "races_lost": "Offers this node tried to claim that another node won",
            }
            for name, value in stats.counters().items():
                fam = CounterMetricFamily(f"metafora_{name}", docs[name], labels=["node"])
                fam.add_metric([node], value)
                yield fam
            gauge = GaugeMetricFamily("metafora_running_tasks", "Tasks running now", labels=["node"])
            gauge.add_metric([node], running)
            yield gauge
            fam = CounterMetricFamily("metafora_pruned_tasks",
                                      "Finished tasks this node pruned (retention)", labels=["node"])
            fam.add_metric([node], pruned)
            yield fam
            # ``loop`` takes the fixed names of the consumer's background loops, never user text.
            fam = CounterMetricFamily("metafora_loop_errors",
                                      "Errors of a background loop (logged and retried; the node "
                                      "keeps running)", labels=["node", "loop"])
            for loop, count in sorted(stats.loop_error_counts().items()):
                fam.add_metric([node, loop], count)
            yield fam
            if cluster is not None:
                for name, value, doc in (
                    ("pending_tasks", cluster.pending, "Tasks claimable now in the cluster"),
                    ("held_tasks", cluster.held, "Tasks held by the live nodes"),
                    ("capacity", cluster.capacity, "Sum of the live nodes' published capacities"),
                    ("nodes", cluster.nodes, "Live nodes"),
                ):
                    gauge = GaugeMetricFamily(f"metafora_cluster_{name}", doc, labels=["namespace"])
                    gauge.add_metric([cluster.namespace], value)
                    yield gauge
            for name, (doc, reading) in sorted((gauges or {}).items()):
                gauge = GaugeMetricFamily(name, doc, labels=["node"])
                gauge.add_metric([node], reading)
                yield gauge
            if stats.gates is not None:
                fam = CounterMetricFamily("metafora_gate_items",
                                          "Items of gated partitions processed here, by outcome",
                                          labels=["node", "outcome"])
                for outcome, value in stats.gates.items().items():
                    fam.add_metric([node, outcome.value], value)
                yield fam
                yield histogram("metafora_gate_item_seconds",
                                "Seconds an item of a gated partition took, first attempt to outcome",
                                stats.gates.item_seconds.snapshot())
            yield histogram("metafora_claim_latency_seconds", "Time of one claim round trip",
                            stats.claim_latency.snapshot())
            yield histogram("metafora_lease_renewal_latency_seconds",
                            "Time of one lease renewal", stats.renewal_latency.snapshot())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return bytes(generate_latest(registry))


class _BoundedServer(ThreadingHTTPServer):
    """A threaded server with a deadline per connection, a cap on connections and a large
    backlog. One reaper thread shuts down the sockets whose deadline passed (a socket timeout
    alone restarts with every byte received)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 deadline: float = REQUEST_TIMEOUT, max_clients: int = MAX_CLIENTS) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        # Set before the bind: a port in use makes TCPServer call server_close(), which uses them.
        self._deadline = deadline
        self._slots = threading.BoundedSemaphore(max_clients)
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float] = {}
        self._closing = threading.Event()
        super().__init__(addr, handler)
        self._reaper = threading.Thread(target=self._reap, name="metafora-http-reaper", daemon=True)
        self._reaper.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` in a thread of its own, or answer 503 when all slots are taken."""
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(_REFUSAL)
            self.shutdown_request(request)
            return
        with self._lock:
            self._open[request] = time.monotonic() + self._deadline
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection, then give its slot back."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._lock:
            if self._open.pop(request, None) is None:
                return
        self._slots.release()

    def _reap(self) -> None:
        while not self._closing.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [sock for sock, until in self._open.items() if until <= now]
            for sock in late:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends; it cleans up

    def server_close(self) -> None:
        """Stop the reaper and close the listening socket."""
        self._closing.set()
        super().server_close()


Probes = Callable[[], dict[str, Any]]
"""What the probes check: ``{"alive": bool, "ready": bool, ...details}`` (one call, no I/O)."""


class InfoServer:
    """A tiny threaded HTTP server over a consumer's state (``info``, ``metrics``, ``probes``)."""

    def __init__(
        self,
        addr: str,
        info: Callable[[], dict[str, Any]],
        metrics: Callable[[], bytes],
        probes: Probes,
    ) -> None:
        host, port = parse_addr(addr)
        outer = self
        self._hosts = allowed_hosts(host, is_loopback(host))

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT  # an idle or slow connection is closed, not held forever

            def do_GET(self) -> None:
                outer._serve(self)

            def handle(self) -> None:
                with contextlib.suppress(OSError):  # cut off at its deadline, or gone: no traceback
                    super().handle()

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: %s", format % args)

        self._info, self._metrics, self._probes = info, metrics, probes
        try:
            self._server = _BoundedServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {addr}: {exc.strerror or exc}") from exc
        if not is_loopback(host):
            log.warning("the info server listens on %s, beyond this machine, without authentication: "
                        "/info shows the node's task ids and fencing tokens, /metrics its counters; "
                        "bind 127.0.0.1 unless that is meant", self.address)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metafora-http",
                                        daemon=True)

    @property
    def address(self) -> str:
        """``host:port`` actually bound (useful with port 0)."""
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}" if isinstance(host, str) else f"{host.decode()}:{port}"

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _refusal(self, req: BaseHTTPRequestHandler) -> tuple[int, bytes] | None:
        """(status, body) when the request must not be answered, else None."""
        raw = req.headers.get("Host")
        if raw is None:
            return 400, b"a Host header is required\n"
        if not host_allowed(host_name(raw), self._hosts):
            return 421, b"this info server does not answer to that Host (DNS rebinding)\n"
        length = req.headers.get("Content-Length")
        if length is not None and (not length.strip().isdigit() or int(length) > MAX_BODY):
            return 413, f"request body over {MAX_BODY} bytes\n".encode()
        return None

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        refused = self._refusal(req)
        try:
            if refused is not None:
                status, body = refused
                ctype = "text/plain"
                req.close_connection = True
            elif path == "/info":
                body, ctype, status = json.dumps(self._info(), default=str).encode(), "application/json", 200
            elif path == "/metrics":
                body, ctype, status = self._metrics(), "text/plain; version=0.0.4; charset=utf-8", 200
            elif path in ("/healthz", "/readyz"):
                checks = self._probes()
                ok = bool(checks["alive" if path == "/healthz" else "ready"])
                body = json.dumps({"status": "ok" if ok else "unavailable", **checks}).encode() + b"\n"
                ctype, status = "application/json", 200 if ok else 503
            else:
                body = b"not found: try /info, /metrics, /healthz, /readyz\n"
                ctype, status = "text/plain", 404
        except ImportError:
            body = b"/metrics needs prometheus_client (pip install 'metafora-cluster[http]')\n"
            ctype, status = "text/plain", 501
        except Exception as exc:
            log.exception("http %s failed", path)
            body, ctype, status = f"error: {scrub(str(exc))}\n".encode(), "text/plain", 500
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        for name, value in HEADERS:
            req.send_header(name, value)
        req.end_headers()
        req.wfile.write(body)
