"""Serving the dashboard: bind address checks, the store's display name, a threaded server."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

from metafora.core.errors import ConfigError
from metafora.core.hosts import is_loopback
from metafora.core.masking import mask_url
from metafora.web.security import LISTEN_BACKLOG

__all__ = ["ENV_TOKEN", "ENV_TOKEN_FILE", "IDLE_TIMEOUT", "WebServer", "display_url", "is_loopback",
           "parse_bind"]

log = logging.getLogger(__name__)

ENV_TOKEN = "METAFORA_WEB_TOKEN"
"""Environment variable read for ``metafora web --token``."""
ENV_TOKEN_FILE = "METAFORA_WEB_TOKEN_FILE"
"""Environment variable read for ``metafora web --token-file``."""
IDLE_TIMEOUT = 10.0
"""Seconds a connection may stay open without sending a whole request head (before its
first request or after a response) before the server closes it."""


def parse_bind(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (loopback) into (host, port); ConfigError if bad."""
    value = text.strip()
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConfigError(f"--bind must be HOST:PORT (e.g. 127.0.0.1:8080), got {text!r}")
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"port {port} in --bind is out of range (0-65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", port


def display_url(url: str) -> str:
    """The store as a page may show it: scheme, hosts and database/path only (no user,
    password or query options) -- the one masking function's brief form."""
    return mask_url(url, brief=True)


class WebServer:
    """The dashboard served by uvicorn in a background thread (for ``metafora web`` and tests).

    ``start()`` binds first, so an address in use is a clear ConfigError; ``port`` is the bound
    port (``bind`` may ask for port 0). ``stop()`` asks uvicorn to finish and joins the thread.
    A connection idle for ``idle_timeout`` seconds is closed. ``X-Forwarded-For`` and
    ``X-Forwarded-Proto`` are believed only from the addresses in ``trusted_proxies``
    (``--trusted-proxy``; none by default, loopback included: any local process could
    forge them to escape the login throttle).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 8080,
                 idle_timeout: float = IDLE_TIMEOUT, trusted_proxies: Iterable[str] = ()) -> None:
        self._app = app
        self._trusted = [str(addr).strip() for addr in trusted_proxies if str(addr).strip()]
        self._host = host
        self._port = port
        self._idle = idle_timeout
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._sock is None:
            return self._port
        return int(self._sock.getsockname()[1])

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {self._host}:{self._port}: {exc.strerror or exc}") from None
        sock.listen(LISTEN_BACKLOG)
        return sock

    def _config(self) -> Any:
        import uvicorn

        from metafora.web.security import MAX_REQUESTS, idle_closing_protocol

        return uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off",
                              http=idle_closing_protocol(self._idle),
                              timeout_keep_alive=max(1, round(self._idle)),
                              proxy_headers=bool(self._trusted),
                              forwarded_allow_ips=self._trusted or [],
                              limit_concurrency=MAX_REQUESTS, backlog=LISTEN_BACKLOG)

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C)."""
        import uvicorn

        self._sock = self._bind()
        self._server = uvicorn.Server(self._config())
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._sock.close()

    def start(self, timeout: float = 30.0) -> Self:
        """Serve in a background thread; returns once the server accepts connections."""
        import uvicorn

        self._sock = self._bind()
        self._server = uvicorn.Server(self._config())
        sock = self._sock
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="metafora-web", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the web server did not start within {timeout:.0f}s")
            pause.wait(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the server to finish and wait for its thread. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
