"""The dashboard's defences: sessions, login throttling, the Host check, headers, statuses.

Threat model (see ``docs/security.md``): anyone who can reach the port may read the
dashboard when it is served without a token, and nobody without the token may act. These
pieces keep that true against a browser on another site (DNS rebinding: the Host check;
framing and injected script: the headers), against guessing (throttled login, a minimum
token length off loopback) and against a stolen cookie outliving its session (server-side
sessions with an idle expiry, ended by logout).

Everything here is plain data and small objects with an injectable clock; the ASGI
middleware is the only part that touches requests.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from metafora.core.errors import (
    ClaimLost,
    ConfigError,
    CoordinatorClosed,
    CoordinatorUnavailable,
    InvalidTaskState,
    MetaforaError,
    NodeExists,
    NodeNotFound,
    RequestTooLarge,
    ScheduleExists,
    ScheduleNotFound,
    StoreError,
    TaskExists,
    TaskNotFound,
)
from metafora.core.hosts import allowed_hosts, host_allowed, host_name

__all__ = [
    "HEADERS",
    "LISTEN_BACKLOG",
    "MAX_BODY",
    "MAX_REQUESTS",
    "MIN_TOKEN_LENGTH",
    "REQUEST_TIMEOUT",
    "SESSION_LIFETIME_SECONDS",
    "HostCheck",
    "LoginThrottle",
    "RequestLimits",
    "Session",
    "Sessions",
    "allowed_hosts",
    "check_token",
    "host_allowed",
    "status_for",
]

MIN_TOKEN_LENGTH = 16
"""The shortest token accepted, on every address (loopback too: any local user, and anything
that can make a request through a local proxy, may try it)."""

SESSION_IDLE_SECONDS = 30 * 60.0
"""A session unused this long is gone (the next request must log in again)."""
SESSION_LIFETIME_SECONDS = 12 * 3600.0
"""A session is gone this long after its login, however often it is used (an open tab
refreshes itself: without this it would never end)."""
MAX_BODY = 64 * 1024
"""The largest request body the dashboard reads (bytes): a longer one gets ``413`` at once,
and no more of it is read (the forms are small)."""
REQUEST_TIMEOUT = 30.0
"""Seconds a request's body may take to arrive, from its head: a slower one gets ``408`` and
its connection is closed (a body sent one byte at a time must not hold a connection)."""
MAX_REQUESTS = 256
"""Connections and requests the dashboard holds at once; more get ``503`` at once (uvicorn's
``limit_concurrency``), so slow clients cannot take every file descriptor."""
LISTEN_BACKLOG = 2048
"""Connections the kernel queues before they are accepted (capped by ``somaxconn``)."""
MAX_SESSIONS = 1000
"""Sessions kept at most; the least recently used one goes first (bounds the memory a
stream of logins can take)."""

HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy",
     b"default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)
"""Sent with every response of the dashboard and the info server (pages, ``/static``, errors)."""

STATUS_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (TaskNotFound, 404),
    (NodeNotFound, 404),
    (ScheduleNotFound, 404),
    (CoordinatorUnavailable, 503),
    (CoordinatorClosed, 503),
    (RequestTooLarge, 413),
    (InvalidTaskState, 409),
    (TaskExists, 409),
    (NodeExists, 409),
    (ScheduleExists, 409),
    (ClaimLost, 409),
    (StoreError, 409),
    (MetaforaError, 400),  # ConfigError, InvalidTaskId, InvalidProps, InvalidCommand: bad input
)
"""Exception -> HTTP status, the first ``isinstance`` match wins: a missing thing is 404, a
store out of reach 503, a refusal by the store 409, bad input 400."""


def status_for(exc: BaseException, default: int = 500) -> int:
    """The HTTP status for ``exc`` by :data:`STATUS_TABLE` (``default`` when none matches)."""
    for kind, status in STATUS_TABLE:
        if isinstance(exc, kind):
            return status
    return default


def check_token(token: str | None, host: str, loopback: bool) -> None:
    """Refuse a token too short to resist guessing (ConfigError), on every address: on
    loopback too, where every local user and every local proxy may try it."""
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        where = "" if loopback else " (not loopback)"
        raise ConfigError(f"refusing to serve on {host}{where} with a token of {len(token)} "
                          f"characters: use at least {MIN_TOKEN_LENGTH} (e.g. python -c "
                          "'import secrets; print(secrets.token_urlsafe(24))')")


# --- sessions -------------------------------------------------------------------------------


@dataclass
class Session:
    """One login: its CSRF value, when it was last used and when it began (monotonic seconds)."""

    csrf: str
    used: float
    started: float = 0.0


class Sessions:
    """Server-side sessions: a random id per login, an idle expiry, an absolute lifetime,
    ended by :meth:`end`."""

    def __init__(self, idle: float = SESSION_IDLE_SECONDS, limit: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic,
                 lifetime: float = SESSION_LIFETIME_SECONDS) -> None:
        self._idle, self._limit, self._clock, self._lifetime = idle, limit, clock, lifetime
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def start(self) -> tuple[str, str]:
        """A new session: (its id for the cookie, its CSRF value for the forms)."""
        sid, csrf = secrets.token_urlsafe(32), secrets.token_hex(32)
        with self._lock:
            now = self._clock()
            self._by_id[sid] = Session(csrf, now, now)
            while len(self._by_id) > self._limit:
                self._by_id.popitem(last=False)
        return sid, csrf

    def get(self, sid: str) -> Session | None:
        """The live session of ``sid`` (its idle time restarts), or None (unknown, idle too
        long, or older than its lifetime)."""
        if not sid:
            return None
        now = self._clock()
        with self._lock:
            session = self._by_id.get(sid)
            if session is None:
                return None
            if now - session.used > self._idle or now - session.started > self._lifetime:
                del self._by_id[sid]
                return None
            session.used = now
            self._by_id.move_to_end(sid)
            return session

    def end(self, sid: str) -> None:
        """Forget ``sid`` (logout): its cookie and CSRF value no longer work."""
        with self._lock:
            self._by_id.pop(sid, None)


# --- login throttling -----------------------------------------------------------------------


class LoginThrottle:
    """Failed logins per client: ``free`` tries, then a wait that doubles with each failure.

    :meth:`wait` says how long a client must wait before its next try (0 when it may try
    now); a success forgets the client. Bounded: at most ``limit`` clients are remembered.
    """

    def __init__(self, free: int = 5, first_wait: float = 1.0, max_wait: float = 300.0,
                 limit: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._free, self._first, self._max, self._limit = free, first_wait, max_wait, limit
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def wait(self, client: str) -> float:
        """Seconds ``client`` must wait before trying again (0.0: it may try now)."""
        with self._lock:
            count, until = self._failures.get(client, (0, 0.0))
        return max(0.0, until - self._clock()) if count >= self._free else 0.0

    def failed(self, client: str) -> None:
        """Count a failed login of ``client``."""
        now = self._clock()
        with self._lock:
            count, _ = self._failures.pop(client, (0, 0.0))
            count += 1
            extra = count - self._free
            pause = 0.0 if extra < 0 else min(self._max, self._first * 2 ** min(extra, 30))
            self._failures[client] = (count, now + pause)
            while len(self._failures) > self._limit:
                self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures."""
        with self._lock:
            self._failures.pop(client, None)


# --- the Host check and the headers ---------------------------------------------------------
# (the Host rules themselves, shared with the info server, are in metafora.core.hosts)


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class HostCheck:
    """ASGI middleware: answers 421 to a Host not in ``hosts`` (400 without one), and adds
    :data:`HEADERS` to every response. ``hosts=None`` checks nothing but still adds them."""

    def __init__(self, app: App, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the request's Host, then run the app with the headers added."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.hosts is not None:
            raw = dict(scope.get("headers") or []).get(b"host")
            if raw is None:
                await _plain(send, 400, "a Host header is required\n")
                return
            if not host_allowed(host_name(raw.decode("latin-1")), self.hosts):
                # 421 Misdirected Request: a rebound DNS name must not read the dashboard.
                await _plain(send, 421, "this dashboard does not answer to that Host "
                                        "(start it with --allow-host NAME)\n")
                return

        async def with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


async def _plain(send: Send, status: int, text: str, close: bool = False) -> None:
    body = text.encode()
    extra = [(b"connection", b"close")] if close else []
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *extra, *HEADERS]})
    await send({"type": "http.response.body", "body": body})


class RequestLimits:
    """ASGI middleware bounding what one request may cost before the app sees it.

    - a body over ``max_body`` bytes gets ``413`` and no more of it is read: at once when its
      ``Content-Length`` says so, else when what arrived passes the limit;
    - a body that has not all arrived ``timeout`` seconds after the request began gets
      ``408`` (a slow body cannot hold a connection);
    - a client that goes away while its request is served ends it quietly (no traceback).

    Both refusals close the connection; the app then sees the client gone.
    """

    def __init__(self, app: App, max_body: int = MAX_BODY, timeout: float = REQUEST_TIMEOUT) -> None:
        self.app, self.max_body, self.timeout = app, max_body, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with a bounded, deadlined ``receive``."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
            await _plain(send, 413, f"request body over {self.max_body} bytes\n", close=True)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        seen = 0
        started = refused = body_done = False

        async def refuse(status: int, text: str) -> MutableMapping[str, Any]:
            nonlocal refused
            if not started and not refused:
                await _plain(send, status, text, close=True)
            refused = True
            return {"type": "http.disconnect"}  # what the app sees: the client is gone

        async def bounded() -> MutableMapping[str, Any]:
            nonlocal seen, body_done
            if refused:
                return {"type": "http.disconnect"}
            if body_done:  # the body is in: waiting for a disconnect has no deadline
                return await receive()
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                return await refuse(408, f"request body not received within {self.timeout:g}s\n")
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                return await refuse(413, f"request body over {self.max_body} bytes\n")
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def watched(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # answered already: whatever the app says now is not sent
            started = started or message["type"] == "http.response.start"
            await send(message)

        from starlette.requests import ClientDisconnect

        try:
            await self.app(scope, bounded, watched)
        except ClientDisconnect:
            # The client went away (or was refused above): the end of this request, not an
            # error to print a traceback of.
            return


# --- idle connections -----------------------------------------------------------------------


def _raw_response(status: int, text: str) -> bytes:
    """A whole plain-text response that closes the connection, with :data:`HEADERS`."""
    body = text.encode("utf-8", "replace")
    reason = {400: "Bad Request", 503: "Service Unavailable"}.get(status, "Error")
    head = [f"HTTP/1.1 {status} {reason}".encode(), b"content-type: text/plain; charset=utf-8",
            b"content-length: " + str(len(body)).encode(), b"connection: close",
            *(name + b": " + value for name, value in HEADERS)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def idle_closing_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol closing a connection that has not sent a whole request head
    within ``header_timeout`` seconds of opening or of its last response (uvicorn's own
    keep-alive timer starts only after a first response, and restarts on any byte)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleClosing(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _cap: int | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # The connection cap is answered here, with HEADERS: uvicorn's own 503 (its
            # limit_concurrency) bypasses the middleware and carried none of them.
            self._cap, self.limit_concurrency = self.limit_concurrency, None

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request that is not HTTP, with :data:`HEADERS` too."""
            self.transport.write(_raw_response(400, msg))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self._cap is not None and len(self.connections) > self._cap:
                transport.write(_raw_response(503, "too many connections; try again later\n"))
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                # A request is being served: the app's time is not idle time (its body has
                # a deadline of its own: RequestLimits).
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

    return IdleClosing
