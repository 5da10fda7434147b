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
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from metafora.cluster_metrics import ClusterSnapshot
from metafora.errors import ConfigError
from metafora.masking import scrub
from metafora.metrics import ConsumerStats, HistogramSnapshot

__all__ = ["HEADERS", "InfoServer", "is_loopback", "parse_addr", "render_metrics"]

log = logging.getLogger(__name__)

HEADERS = (
    ("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
)
"""Headers of every response of the info server (it serves data only: nothing may load)."""
IDLE_TIMEOUT = 10.0
"""Seconds a connection may wait on a request before it is closed."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
                   cluster: ClusterSnapshot | None = None) -> bytes:
    """The consumer's metrics in Prometheus text format (``pruned``: finished tasks this node
    pruned; ``cluster``: the last read of :mod:`metafora.cluster_metrics`, if any)."""
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
            yield histogram("metafora_claim_latency_seconds", "Time of one claim round trip",
                            stats.claim_latency.snapshot())
            yield histogram("metafora_lease_renewal_latency_seconds",
                            "Time of one lease renewal", stats.renewal_latency.snapshot())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return bytes(generate_latest(registry))


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

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT  # an idle or slow connection is closed, not held forever

            def do_GET(self) -> None:
                outer._serve(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: %s", format % args)

        self._info, self._metrics, self._probes = info, metrics, probes
        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {addr}: {exc.strerror or exc}") from exc
        self._server.daemon_threads = True
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

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        try:
            if path == "/info":
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
