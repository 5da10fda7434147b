"""The dashboard's Starlette application: pages, fragments for live updates, actions.

Every page is rendered from the store on request (sync endpoints run in Starlette's thread
pool). ``?partial=1`` returns only the live part of a page, which the page's script fetches
every ``refresh`` seconds. Actions are POSTed forms: they need the token (a header
``Authorization: Bearer T`` / ``X-Metafora-Token: T``, or the login cookie together with the
form's CSRF field); without a configured token every action is refused.

Masking is applied to text where it is shown, never to identifiers carried as data: every
``{{ expression }}`` of a template is masked (the environment's ``finalize``) unless it is
marked ``|ident`` -- task and node ids, form values, links (``|id_text`` shows an id as text,
its control and bidi characters escaped) -- so the page of task
``x://victim@b`` acts on that task, not on ``x://***@b``. Sessions, login throttling, the
Host check and the headers live in :mod:`metafora.web.security`.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from metafora.consumer.cluster_metrics import backlog_line, read_backlog
from metafora.contracts.client import Client, NodeInfo
from metafora.contracts.coordinator import MAX_ERROR_BYTES
from metafora.core import commands
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError, InvalidTaskState, MetaforaError, TaskNotFound
from metafora.core.hosts import LOOPBACK_NAMES
from metafora.core.masking import cut_text, escape_controls, one_line, scrub
from metafora.core.task import TaskState, validate_task_id
from metafora.features.waiting import pending_reasons
from metafora.surfaces.connect import open_client
from metafora.web import charts as chart
from metafora.web.security import (
    MAX_BODY,
    MIN_TOKEN_LENGTH,
    REQUEST_TIMEOUT,
    HostCheck,
    LoginThrottle,
    RequestLimits,
    Session,
    Sessions,
    status_for,
)
from metafora.web.server import display_url

__all__ = ["Dashboard", "Ident", "create_app"]

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SESSION_COOKIE = "metafora_session"
_PAGE_SIZES = (25, 50, 100, 200)
_SQL_SCHEMES = ("sqlite", "postgresql", "postgres", "postgresql+psycopg")
_ITEM_STATUSES = ("available", "complete", "failed")
_CHARTS_EVERY = 5.0  # seconds: the charts read up to 4 x CHART_READ tasks, so not every refresh
NODE_VERBS = ("freeze", "unfreeze", "balance")
TASK_VERBS = ("stop", "delete", "retry", "pause", "resume", "kill", "retry-items")
MESSAGES: dict[str, str] = {
    "logged-in": "logged in",
    "logged-out": "logged out",
    "freeze": "sent freeze to node {id}",
    "unfreeze": "sent unfreeze to node {id}",
    "balance": "sent balance to node {id}",
    "deleted": "deleted task {id}",
    "retry": "task {id} is pending again",
    "stop": "asked the node running task {id} to stop it",
    "pause": "sent pause to task {id}",
    "resume": "sent resume to task {id}",
    "kill": "sent kill to task {id}",
    "retry-items": "the failed items of {id} are pending again",
}
"""What a page may say after an action: ``?msg=CODE`` picks one of these fixed texts (any
other code shows nothing), ``msg_id`` the id it names, shown as an id. A link cannot make
the dashboard say anything else in its own voice."""
_MSG_ID_SHOWN = 40  # characters of msg_id shown (a link's text must not say much)


def _age(now: datetime, then: datetime | None) -> str:
    if then is None:
        return "-"
    seconds = max(0.0, (now - then).total_seconds())
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _time(dt: datetime | None) -> str:
    return "-" if dt is None else dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


class Ident(str):
    """Text a page carries as data (an id, a form value, a link): shown exactly, never masked."""

    __slots__ = ()


def _id_text(value: str) -> Ident:
    """An id shown as text: exact, but a bidi or control character written as an escape (an id
    stored before they were refused must not read as another); forms and links keep it raw."""
    return Ident(escape_controls(value))


def _client(request: Request) -> str:
    return request.client.host if request.client is not None else "?"


class Dashboard:
    """The dashboard's state: one operator client, the token's derived secrets, templates."""

    def __init__(self, url: str, *, token: str | None = None, items_url: str | None = None,
                 refresh: float = 2.0, client: Client | None = None) -> None:
        self.url = url
        self.store = display_url(url)
        self.client = client if client is not None else open_client(url)
        scheme = parse_store_url(items_url or url).scheme
        self.items_url = (items_url or url) if scheme in _SQL_SCHEMES else None
        self._items: Any = None
        self._items_lock = threading.Lock()
        self._counts: tuple[float, dict[TaskState, int]] | None = None
        self._counts_lock = threading.Lock()
        self._charts: tuple[float, chart.Charts] | None = None
        self._charts_lock = threading.Lock()
        self.charts_every = max(refresh, _CHARTS_EVERY)
        self.token = token or None
        if self.token is not None and len(self.token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"the dashboard's token must be at least {MIN_TOKEN_LENGTH} characters "
                              f"long, got {len(self.token)}")
        self.sessions = Sessions()  # held here: they end at logout, when idle, at a restart
        self.throttle = LoginThrottle()
        self.refresh_ms = int(refresh * 1000)
        self.env = Environment(loader=FileSystemLoader(_HERE / "templates"),
                               autoescape=select_autoescape(default=True), finalize=self._shown)
        self.env.filters["ident"] = Ident
        self.env.filters["id_text"] = _id_text
        # A list shows one short line of an error, masked once (printed as title and cell).
        self.env.filters["short"] = lambda text: Ident(scrub(one_line(text), self.url))
        # A task's page shows as much of its error as a store keeps now (rows written by an
        # older version may hold megabytes).
        self.env.filters["stored_error"] = lambda text: cut_text(text, MAX_ERROR_BYTES)
        self.env.globals.update(age=_age, time=_time, store=self.store, states=list(TaskState),
                                refresh_ms=self.refresh_ms, item_statuses=_ITEM_STATUSES)

    def _shown(self, value: Any) -> Any:
        """Every expression a template prints: text is masked, ids and rendered HTML are not."""
        if isinstance(value, str) and not isinstance(value, (Ident, Markup)):
            return scrub(value, self.url)
        return value

    # --- access -------------------------------------------------------------------------

    def _header_token(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return request.headers.get("x-metafora-token")

    def session(self, request: Request) -> Session | None:
        """The live login session of the request's cookie, or None."""
        if self.token is None:
            return None
        return self.sessions.get(request.cookies.get(_SESSION_COOKIE, ""))

    def logged_in(self, request: Request) -> bool:
        """Whether the request carries the token (header) or a live session's cookie."""
        if self.token is None:
            return False
        sent = self._header_token(request)
        if sent is not None:
            return self.try_token(request, sent)
        return self.session(request) is not None

    def try_token(self, request: Request, sent: str) -> bool:
        """Whether ``sent`` is the token. Every way of sending one (login form, header) counts
        toward the client's throttle, and nothing is compared while the client must wait."""
        tried: bool | None = getattr(request.state, "token_ok", None)
        if tried is not None:  # once per request: rendering the refusal must not count twice
            return tried
        client = _client(request)
        ok = False
        if self.token is not None and self.throttle.wait(client) <= 0:
            ok = hmac.compare_digest(sent.encode(), self.token.encode())
            (self.throttle.succeeded if ok else self.throttle.failed)(client)
        request.state.token_ok = ok
        return ok

    def slow_down(self, request: Request) -> HTMLResponse | None:
        """A 429 page with Retry-After when the client must wait after failed tokens, else None."""
        wait = self.throttle.wait(_client(request))
        if wait <= 0:
            return None
        page = self.error(request, 429, f"too many wrong tokens: try again in {wait:.0f}s")
        page.headers["Retry-After"] = str(max(1, round(wait + 0.5)))
        return page

    def may_act(self, request: Request, form: dict[str, str]) -> str | None:
        """None if the action may go ahead, else why not (for a 403 page)."""
        if self.token is None:
            return "this dashboard is read-only: start it with --token (or METAFORA_WEB_TOKEN) to act"
        sent = self._header_token(request)
        if sent is not None:  # a custom header: browsers send none cross-site, so no CSRF risk
            return None if self.try_token(request, sent) else "wrong token"
        session = self.session(request)
        if session is None:
            return "log in with the dashboard's token first"
        if not hmac.compare_digest(form.get("csrf", "").encode(), session.csrf.encode()):
            return "the form's CSRF token is missing or stale: reload the page and try again"
        return None

    # --- rendering ----------------------------------------------------------------------

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        """Render template ``name`` (its live part only with ``?partial=1``)."""
        partial = request.query_params.get("partial") == "1"
        session = self.session(request)
        context.update(request=request, read_only=self.token is None, can_act=self.logged_in(request),
                       csrf=Ident(session.csrf if session is not None else ""),
                       msg=_message(request.query_params.get("msg", ""),
                                    request.query_params.get("msg_id", "")),
                       here=Ident(str(request.url.path)
                                  + (f"?{request.url.query}" if request.url.query else "")),
                       now=datetime.now(UTC))
        template = self.env.get_template(name.replace(".html", "_live.html") if partial else name)
        # No masking of the whole page here: text is masked per expression (finalize).
        return HTMLResponse(template.render(**context), status_code=status,
                            headers={"Cache-Control": "no-store"})

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        """A page saying what went wrong (never a traceback, never the password)."""
        heading = {403: "Refused", 404: "Not found", 429: "Slow down"}.get(status, "Error")
        return self.render(request, "error.html", status=status, message=scrub(message, self.url),
                           title=heading, heading=heading)

    # --- data ---------------------------------------------------------------------------

    def item_store(self) -> Any:
        """The gates' item store (SQL), opened on first use; None when the store is not SQL."""
        if self.items_url is None:
            return None
        with self._items_lock:
            if self._items is None:
                from metafora.gates import ItemStore

                self._items = ItemStore(self.items_url)
            return self._items

    def task_counts(self) -> dict[TaskState, int]:
        """Tasks per state, counted at most once per refresh interval (shared by every viewer)."""
        with self._counts_lock:
            now = time.monotonic()
            if self._counts is None or now - self._counts[0] >= self.refresh_ms / 1000:
                self._counts = (now, self.client.task_counts())
            return self._counts[1]

    def backlog(self) -> str:
        """The backlog, capacity and retention in one line (as ``metafora top`` shows it),
        read at most once per refresh interval (shared by every viewer)."""
        with self._counts_lock:
            now = time.monotonic()
            found = getattr(self, "_backlog", None)
            if found is None or now - found[0] >= self.refresh_ms / 1000:
                found = self._backlog = (now, backlog_line(*read_backlog(self.client)))
            return str(found[1])

    def charts(self) -> chart.Charts:
        """The charts' data, read at most once per ``charts_every`` seconds (shared by every
        viewer), each state's read capped at :data:`~metafora.web.charts.CHART_READ` tasks."""
        with self._charts_lock:
            now = time.monotonic()
            if self._charts is None or now - self._charts[0] >= self.charts_every:
                # Counted afresh (not the shared counts of up to a refresh ago): the
                # captions set what was read against these.
                self._charts = (now, chart.read_charts(self.client, datetime.now(UTC),
                                                       self.client.task_counts()))
            return self._charts[1]

    def close(self) -> None:
        """Close the client and the item store."""
        self.client.close()
        if self._items is not None:
            self._items.close()


def _message(code: str, ident: str) -> dict[str, str] | None:
    """The fixed message of ``code`` (:data:`MESSAGES`) as text before and after its id, or None."""
    text = MESSAGES.get(code)
    if text is None:
        return None
    before, _, after = text.partition("{id}")
    if "{id}" not in text:
        return {"before": before, "id": "", "after": after}
    try:
        validate_task_id(ident)  # an id the action could have named (node ids share the rule)
    except MetaforaError:
        return None
    shown = ident if len(ident) <= _MSG_ID_SHOWN else ident[:_MSG_ID_SHOWN - 1] + "…"
    return {"before": before, "id": shown, "after": after}


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (no multipart parser needed)."""
    body = (await request.body())[:65536].decode("utf-8", "replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _back(form: dict[str, str], fallback: str, msg: str, ident: str = "") -> RedirectResponse:
    target = form.get("next", "") or fallback
    if not target.startswith("/") or target.startswith(("//", "/\\")) or any(c < " " for c in target):
        target = fallback
    path, _, query = target.partition("?")
    params = [(k, v) for k, v in parse_qs(query).items() if k not in ("msg", "msg_id", "partial")]
    flat = [(k, x) for k, vs in params for x in vs] + [("msg", msg)] + ([("msg_id", ident)] if ident else [])
    return RedirectResponse(f"{path}?{urlencode(flat)}", status_code=303)


def _node_row(info: NodeInfo, now: datetime) -> dict[str, Any]:
    labels = getattr(info, "labels", None) or {}
    return {"id": info.id, "tasks": info.tasks, "frozen": info.frozen, "host": info.host,
            "pid": info.pid, "heartbeat": _age(now, info.heartbeat), "started": _time(info.started),
            "labels": ", ".join(f"{k}={v}" for k, v in sorted(dict(labels).items())),
            "weight": f"{getattr(info, 'weight', 1.0):g}"}


def create_app(url: str, *, token: str | None = None, items_url: str | None = None,
               refresh: float = 2.0, client: Client | None = None,
               allowed_hosts: Iterable[str] | None = None, max_body: int = MAX_BODY,
               request_timeout: float = REQUEST_TIMEOUT) -> Starlette:
    """The dashboard for the store ``url``; actions only with ``token``.

    ``allowed_hosts`` are the names a request's Host may carry (default: the loopback
    names); see :func:`metafora.web.security.allowed_hosts`. A request body over
    ``max_body`` bytes gets 413, one not received within ``request_timeout`` seconds 408
    (:class:`~metafora.web.security.RequestLimits`).
    """
    dash = Dashboard(url, token=token, items_url=items_url, refresh=refresh, client=client)

    def guarded(page: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def run(request: Request) -> Response:
            try:
                return page(request)
            except MetaforaError as exc:
                log.warning("dashboard: %s", scrub(str(exc), url))
                return dash.error(request, status_for(exc), f"{type(exc).__name__}: {exc}")
        return run

    def index(request: Request) -> Response:
        return RedirectResponse("/nodes", status_code=307)

    def nodes_page(request: Request) -> Response:
        now = datetime.now(UTC)
        rows = [_node_row(i, now) for i in sorted(dash.client.node_infos(), key=lambda n: n.id)]
        counts = dash.task_counts()
        return dash.render(request, "nodes.html", nodes=rows, counts=counts, title="Nodes",
                           backlog=dash.backlog())

    def tasks_page(request: Request) -> Response:
        return _tasks_view(dash, request)

    def task_page(request: Request) -> Response:
        return _task_view(dash, request)

    async def act(request: Request) -> Response:
        return await _act(dash, request)

    def charts_page(request: Request) -> Response:
        data = dash.charts()
        return dash.render(request, "charts.html", charts=data, S=TaskState, cap=chart.CHART_READ,
                           max_nodes=chart.MAX_NODE_BARS, ttl_ms=int(dash.charts_every * 1000),
                           throughput_svg=chart.throughput_svg(data.throughput),
                           nodes_svg=chart.nodes_svg(data.nodes),
                           pending_svg=chart.pending_svg(data.pending), title="Charts")

    def streams_page(request: Request) -> Response:
        return _streams_view(dash, request)

    def health(request: Request) -> Response:
        return JSONResponse({"store": dash.store, "read_only": dash.token is None})

    routes = [
        Route("/", index),
        Route("/nodes", guarded(nodes_page)),
        Route("/tasks", guarded(tasks_page)),
        Route("/charts", guarded(charts_page)),
        Route("/task", guarded(task_page)),
        Route("/streams", guarded(streams_page)),
        Route("/act", act, methods=["POST"]),
        *_auth_routes(dash),
        Route("/healthz", health),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    hosts = frozenset(h.lower().strip("[]") for h in (LOOPBACK_NAMES if allowed_hosts is None
                                                      else allowed_hosts))
    app = _App(hosts, RequestLimits, {"max_body": max_body, "timeout": request_timeout}, routes=routes)
    app.state.dashboard = dash
    return app


class _App(Starlette):
    """Starlette with the Host check and the security headers outside everything else, so
    that even its own error responses carry the headers."""

    def __init__(self, hosts: frozenset[str], limits: Any, limit_options: dict[str, Any],
                 **options: Any) -> None:
        self._hosts, self._limits, self._limit_options = hosts, limits, limit_options
        super().__init__(**options)

    def build_middleware_stack(self) -> Any:
        """The usual stack inside :class:`~metafora.web.security.RequestLimits` inside
        :class:`~metafora.web.security.HostCheck`."""
        inner = self._limits(super().build_middleware_stack(), **self._limit_options)
        return HostCheck(inner, self._hosts)


def _auth_routes(dash: Dashboard) -> list[Route]:
    """``/login`` (a form, throttled per client address) and ``/logout`` (ends the session)."""

    def login_page(request: Request) -> Response:
        return dash.render(request, "login.html", title="Log in", failed=False)

    async def login(request: Request) -> Response:
        form = await _form(request)
        if dash.token is None:
            return dash.error(request, 403, "this dashboard is read-only: there is no token to log in with")
        slow = dash.slow_down(request)
        if slow is not None:
            return slow
        if not dash.try_token(request, form.get("token", "")):
            return dash.render(request, "login.html", status=403, title="Log in", failed=True)
        sid, _ = dash.sessions.start()
        response = _back(form, "/nodes", "logged-in")
        response.set_cookie(_SESSION_COOKIE, sid, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path="/")
        return response

    async def logout(request: Request) -> Response:
        form = await _form(request)
        session = dash.session(request)
        if session is not None:
            if not hmac.compare_digest(form.get("csrf", "").encode(), session.csrf.encode()):
                return dash.error(request, 403, "the form's CSRF token is missing or stale")
            dash.sessions.end(request.cookies.get(_SESSION_COOKIE, ""))
        response = RedirectResponse("/nodes?msg=logged-out", status_code=303)
        response.delete_cookie(_SESSION_COOKIE, path="/")
        return response

    return [Route("/login", login_page, methods=["GET"]), Route("/login", login, methods=["POST"]),
            Route("/logout", logout, methods=["POST"])]


def _task_action(dash: Dashboard, verb: str, task_id: str) -> str:
    """Carry out a task action; the code of the message to show (:data:`MESSAGES`). Raises
    MetaforaError on refusal."""
    client = dash.client
    if verb == "delete":
        client.delete_task(task_id)
        return "deleted"
    if verb == "retry":
        client.retry_task(task_id)
        return "retry"
    if verb == "stop":
        info = client.get_task(task_id)
        if info.state is not TaskState.CLAIMED or info.owner is None:
            raise InvalidTaskState(f"task {task_id!r} is {info.state.value}, not running on a node")
        client.submit_command(info.owner, commands.stop_task(task_id))
        return "stop"
    if verb == "retry-items":
        store = dash.item_store()
        if store is None:
            raise InvalidTaskState("items live in SQL: start the dashboard with --items-url")
        from metafora.gates import retry_partition

        retry_partition(store, task_id, client)
        return "retry-items"
    from metafora.statemachine import command_message, send_task_command

    send_task_command(client, task_id, command_message(verb))
    return verb


def _tasks_view(dash: Dashboard, request: Request) -> Response:
    """``/tasks``: a page of tasks, filtered by state, owner and id prefix."""
    q = request.query_params
    state = q.get("state") or None
    if state is not None and state not in {s.value for s in TaskState}:
        return dash.error(request, 400, f"unknown state {state!r}")
    owner = q.get("owner") or None
    prefix = q.get("prefix", "")
    after = q.get("after") or None
    try:
        limit = int(q.get("limit") or 50)
    except ValueError:
        limit = 50
    limit = min(max(limit, 1), max(_PAGE_SIZES))
    # The list shows no props and one line of each error: the store reads neither whole.
    page = dash.client.task_page(state=state, owner=owner, prefix=prefix, after=after, limit=limit + 1,
                                 props=False)
    more = len(page) > limit
    page = page[:limit]
    base = {k: v for k, v in {"state": state, "owner": owner, "prefix": prefix,
                              "limit": str(limit)}.items() if v}
    next_url = Ident(f"/tasks?{urlencode({**base, 'after': page[-1].id})}") if more and page else None
    first_url = Ident(f"/tasks?{urlencode(base)}") if after else None
    # Why each pending task of the page waits (the CLI's text); read only when one needs it.
    reasons = pending_reasons(dash.client, page)
    return dash.render(request, "tasks.html", tasks=page, reasons=reasons, counts=dash.task_counts(),
                       state=state or "", owner=owner or "", prefix=prefix, limit=limit,
                       next_url=next_url, first_url=first_url, title="Tasks")


def _streams_view(dash: Dashboard, request: Request) -> Response:
    """``/streams``: a page of streams (metafora.streams) with their progress and lag."""
    from metafora.streams.ops import stream_rows

    q = request.query_params
    after = q.get("after") or None
    if after is not None:
        validate_task_id(after)
    limit = 50
    # Tasks are read without props; one state read per task of the page.
    rows = stream_rows(dash.client, after=after, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    next_url = Ident(f"/streams?{urlencode({'after': rows[-1].id})}") if more and rows else None
    first_url = Ident("/streams") if after else None
    return dash.render(request, "streams.html", streams=rows, next_url=next_url,
                       first_url=first_url, title="Streams")


def _task_view(dash: Dashboard, request: Request) -> Response:
    """``/task?id=``: one task, its props, its state machine and its gated items."""
    task_id = request.query_params.get("id", "")
    try:
        validate_task_id(task_id)
        info = dash.client.get_task(task_id)
    except TaskNotFound:
        return dash.error(request, 404, f"no task {task_id!r}")
    except MetaforaError as exc:
        return dash.error(request, status_for(exc), str(exc))
    from metafora.statemachine import get_state

    state = get_state(dash.client, task_id)
    gates = None
    store = dash.item_store()
    if store is not None:
        found = store.info(task_id)
        if found.exists:
            gates = found
    props = json.dumps(dict(info.props), indent=2, sort_keys=True, default=str)
    if len(props) > 65536:
        props = props[:65536] + "\n... (cut)"
    reason = pending_reasons(dash.client, [info]).get(info.id)
    return dash.render(request, "task.html", task=info, props=props, sm=state, gates=gates,
                       reason=reason, title=_id_text(f"Task {task_id}"))


async def _act(dash: Dashboard, request: Request) -> Response:
    """``POST /act``: a node or task action, with the token (a session and its CSRF value)."""
    form = await _form(request)
    slow = dash.slow_down(request) if dash._header_token(request) is not None else None
    if slow is not None:
        return slow
    refused = dash.may_act(request, form)
    if refused is not None:
        return dash.error(request, 403, refused)
    target, verb, ident = form.get("target", ""), form.get("verb", ""), form.get("id", "")
    from starlette.concurrency import run_in_threadpool

    try:
        validate_task_id(ident)
        if target == "node" and verb in NODE_VERBS:
            command = {"freeze": commands.freeze, "unfreeze": commands.unfreeze,
                       "balance": commands.balance}[verb]()
            await run_in_threadpool(dash.client.submit_command, ident, command)
            return _back(form, "/nodes", verb, ident)
        if target == "task" and verb in TASK_VERBS:
            done = await run_in_threadpool(_task_action, dash, verb, ident)
            return _back(form, "/tasks", done, ident)
    except MetaforaError as exc:
        return dash.error(request, status_for(exc), str(exc))
    return dash.error(request, 400, f"unknown action {verb!r} on {target!r}")
