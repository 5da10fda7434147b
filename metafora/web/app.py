"""The dashboard's Starlette application: pages, fragments for live updates, actions.

Every page is rendered from the store on request (sync endpoints run in Starlette's thread
pool). ``?partial=1`` returns only the live part of a page, which the page's script fetches
every ``refresh`` seconds. Actions are POSTed forms: they need the token (a header
``Authorization: Bearer T`` / ``X-Metafora-Token: T``, or the login cookie together with the
form's CSRF field); without a configured token every action is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from metafora import commands
from metafora.config import parse_store_url
from metafora.connect import open_client
from metafora.coordinator import Client, NodeInfo
from metafora.errors import InvalidTaskState, MetaforaError, NodeNotFound, TaskNotFound
from metafora.masking import scrub
from metafora.task import TaskState, validate_task_id
from metafora.web.server import display_url

__all__ = ["Dashboard", "create_app"]

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SESSION_COOKIE = "metafora_session"
_PAGE_SIZES = (25, 50, 100, 200)
_SQL_SCHEMES = ("sqlite", "postgresql", "postgres", "postgresql+psycopg")
_ITEM_STATUSES = ("available", "complete", "failed")
NODE_VERBS = ("freeze", "unfreeze", "balance")
TASK_VERBS = ("stop", "delete", "retry", "pause", "resume", "kill", "retry-items")


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
        self.token = token or None
        key = secrets.token_bytes(32)  # sessions end when the server restarts
        secret = (token or "").encode()
        self.session = hmac.new(key, b"session:" + secret, hashlib.sha256).hexdigest()
        self.csrf = hmac.new(key, b"csrf:" + secret, hashlib.sha256).hexdigest()
        self.refresh_ms = int(refresh * 1000)
        self.env = Environment(loader=FileSystemLoader(_HERE / "templates"),
                               autoescape=select_autoescape(default=True))
        self.env.globals.update(age=_age, time=_time, store=self.store, states=list(TaskState),
                                refresh_ms=self.refresh_ms, item_statuses=_ITEM_STATUSES)

    # --- access -------------------------------------------------------------------------

    def _header_token(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return request.headers.get("x-metafora-token")

    def logged_in(self, request: Request) -> bool:
        """Whether the request carries the token (header) or the login cookie."""
        if self.token is None:
            return False
        sent = self._header_token(request)
        if sent is not None:
            return hmac.compare_digest(sent.encode(), self.token.encode())
        cookie = request.cookies.get(_SESSION_COOKIE, "")
        return hmac.compare_digest(cookie.encode(), self.session.encode())

    def may_act(self, request: Request, form: dict[str, str]) -> str | None:
        """None if the action may go ahead, else why not (for a 403 page)."""
        if self.token is None:
            return "this dashboard is read-only: start it with --token (or METAFORA_WEB_TOKEN) to act"
        sent = self._header_token(request)
        if sent is not None:  # a custom header: browsers send none cross-site, so no CSRF risk
            ok = hmac.compare_digest(sent.encode(), self.token.encode())
            return None if ok else "wrong token"
        if not self.logged_in(request):
            return "log in with the dashboard's token first"
        if not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            return "the form's CSRF token is missing or stale: reload the page and try again"
        return None

    # --- rendering ----------------------------------------------------------------------

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        """Render template ``name`` (its live part only with ``?partial=1``)."""
        partial = request.query_params.get("partial") == "1"
        can_act = self.logged_in(request)
        context.update(request=request, read_only=self.token is None, can_act=can_act,
                       csrf=self.csrf if can_act else "", msg=request.query_params.get("msg", ""),
                       here=str(request.url.path) + (f"?{request.url.query}" if request.url.query else ""),
                       now=datetime.now(UTC))
        template = self.env.get_template(name.replace(".html", "_live.html") if partial else name)
        html = template.render(**context)
        return HTMLResponse(scrub(html, self.url), status_code=status,
                            headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                                     "Referrer-Policy": "same-origin"})

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        """A page saying what went wrong (never a traceback, never the password)."""
        heading = "Refused" if status == 403 else "Not found" if status == 404 else "Error"
        return self.render(request, "error.html", status=status, message=scrub(message, self.url),
                           title=heading, heading=heading)

    # --- data ---------------------------------------------------------------------------

    def item_store(self) -> Any:
        """The gates' item store (SQL), opened on first use; None when the store is not SQL."""
        if self.items_url is None:
            return None
        with self._items_lock:
            if self._items is None:
                from metafora.statemachine.gates import ItemStore

                self._items = ItemStore(self.items_url)
            return self._items

    def task_counts(self) -> dict[TaskState, int]:
        """Tasks per state, counted at most once per refresh interval (shared by every viewer)."""
        with self._counts_lock:
            now = time.monotonic()
            if self._counts is None or now - self._counts[0] >= self.refresh_ms / 1000:
                self._counts = (now, self.client.task_counts())
            return self._counts[1]

    def close(self) -> None:
        """Close the client and the item store."""
        self.client.close()
        if self._items is not None:
            self._items.close()


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (no multipart parser needed)."""
    body = (await request.body())[:65536].decode("utf-8", "replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _back(form: dict[str, str], fallback: str, msg: str) -> RedirectResponse:
    target = form.get("next", "") or fallback
    if not target.startswith("/") or target.startswith(("//", "/\\")) or any(c < " " for c in target):
        target = fallback
    path, _, query = target.partition("?")
    params = [(k, v) for k, v in parse_qs(query).items() if k not in ("msg", "partial")]
    flat = [(k, x) for k, vs in params for x in vs] + [("msg", msg)]
    return RedirectResponse(f"{path}?{urlencode(flat)}", status_code=303)


def _node_row(info: NodeInfo, now: datetime) -> dict[str, Any]:
    labels = getattr(info, "labels", None) or {}
    return {"id": info.id, "tasks": info.tasks, "frozen": info.frozen, "host": info.host,
            "pid": info.pid, "heartbeat": _age(now, info.heartbeat), "started": _time(info.started),
            "labels": ", ".join(f"{k}={v}" for k, v in sorted(dict(labels).items()))}


def create_app(url: str, *, token: str | None = None, items_url: str | None = None,
               refresh: float = 2.0, client: Client | None = None) -> Starlette:
    """The dashboard for the store ``url``; actions only with ``token``."""
    dash = Dashboard(url, token=token, items_url=items_url, refresh=refresh, client=client)

    def guarded(page: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def run(request: Request) -> Response:
            try:
                return page(request)
            except MetaforaError as exc:
                log.warning("dashboard: %s", scrub(str(exc), url))
                return dash.error(request, 503 if "unavailable" in type(exc).__name__.lower() else 400,
                                  f"{type(exc).__name__}: {exc}")
        return run

    def index(request: Request) -> Response:
        return RedirectResponse("/nodes", status_code=307)

    def nodes_page(request: Request) -> Response:
        now = datetime.now(UTC)
        rows = [_node_row(i, now) for i in sorted(dash.client.node_infos(), key=lambda n: n.id)]
        counts = dash.task_counts()
        return dash.render(request, "nodes.html", nodes=rows, counts=counts, title="Nodes")

    def tasks_page(request: Request) -> Response:
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
        page = dash.client.task_page(state=state, owner=owner, prefix=prefix, after=after, limit=limit + 1)
        more = len(page) > limit
        page = page[:limit]
        base = {k: v for k, v in {"state": state, "owner": owner, "prefix": prefix,
                                  "limit": str(limit)}.items() if v}
        next_url = f"/tasks?{urlencode({**base, 'after': page[-1].id})}" if more and page else None
        first_url = f"/tasks?{urlencode(base)}" if after else None
        return dash.render(request, "tasks.html", tasks=page, counts=dash.task_counts(),
                           state=state or "", owner=owner or "", prefix=prefix, limit=limit,
                           next_url=next_url, first_url=first_url, title="Tasks")

    def task_page(request: Request) -> Response:
        task_id = request.query_params.get("id", "")
        try:
            validate_task_id(task_id)
            info = dash.client.get_task(task_id)
        except TaskNotFound:
            return dash.error(request, 404, f"no task {task_id!r}")
        except MetaforaError as exc:
            return dash.error(request, 400, str(exc))
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
        return dash.render(request, "task.html", task=info, props=props, sm=state, gates=gates,
                           title=f"Task {task_id}")

    async def act(request: Request) -> Response:
        form = await _form(request)
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
                return _back(form, "/nodes", f"sent {verb} to node {ident}")
            if target == "task" and verb in TASK_VERBS:
                done = await run_in_threadpool(_task_action, dash, verb, ident)
                return _back(form, "/tasks", done)
        except (TaskNotFound, NodeNotFound) as exc:
            return dash.error(request, 404, str(exc))
        except MetaforaError as exc:
            return dash.error(request, 409, str(exc))
        return dash.error(request, 400, f"unknown action {verb!r} on {target!r}")

    def login_page(request: Request) -> Response:
        return dash.render(request, "login.html", title="Log in", failed=False)

    async def login(request: Request) -> Response:
        form = await _form(request)
        if dash.token is None:
            return dash.error(request, 403, "this dashboard is read-only: there is no token to log in with")
        if not hmac.compare_digest(form.get("token", "").encode(), dash.token.encode()):
            return dash.render(request, "login.html", status=403, title="Log in", failed=True)
        response = _back(form, "/nodes", "logged in")
        response.set_cookie(_SESSION_COOKIE, dash.session, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path="/")
        return response

    async def logout(request: Request) -> Response:
        form = await _form(request)
        if dash.token is not None and not hmac.compare_digest(form.get("csrf", "").encode(),
                                                              dash.csrf.encode()):
            return dash.error(request, 403, "the form's CSRF token is missing or stale")
        response = RedirectResponse("/nodes?msg=logged+out", status_code=303)
        response.delete_cookie(_SESSION_COOKIE, path="/")
        return response

    def health(request: Request) -> Response:
        return JSONResponse({"store": dash.store, "read_only": dash.token is None})

    routes = [
        Route("/", index),
        Route("/nodes", guarded(nodes_page)),
        Route("/tasks", guarded(tasks_page)),
        Route("/task", guarded(task_page)),
        Route("/act", act, methods=["POST"]),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", health),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.dashboard = dash
    return app


def _task_action(dash: Dashboard, verb: str, task_id: str) -> str:
    """Carry out a task action; the message to show. Raises MetaforaError on refusal."""
    client = dash.client
    if verb == "delete":
        client.delete_task(task_id)
        return f"deleted task {task_id}"
    if verb == "retry":
        client.retry_task(task_id)
        return f"task {task_id} is pending again"
    if verb == "stop":
        info = client.get_task(task_id)
        if info.state is not TaskState.CLAIMED or info.owner is None:
            raise InvalidTaskState(f"task {task_id!r} is {info.state.value}, not running on a node")
        client.submit_command(info.owner, commands.stop_task(task_id))
        return f"asked node {info.owner} to stop task {task_id}"
    if verb == "retry-items":
        store = dash.item_store()
        if store is None:
            raise InvalidTaskState("items live in SQL: start the dashboard with --items-url")
        from metafora.statemachine.gates import retry_partition

        count = retry_partition(store, task_id, client)
        return f"{count} failed item{'s' if count != 1 else ''} of {task_id} made pending again"
    from metafora.statemachine import command_message, send_task_command

    send_task_command(client, task_id, command_message(verb))
    return f"sent {verb} to task {task_id}"

