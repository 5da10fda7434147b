"""``metafora web``: a dashboard of the cluster served from the store (extra ``metafora-cluster[web]``).

It needs no consumer: it opens an operator client on the store URL and shows nodes, tasks
(paged in the store), one task's detail (state machine, gate progress), charts (throughput
over the last hour, tasks per node against the fair share, pending tasks by why they wait:
:mod:`metafora.web.charts`) and, when started
with a token, actions (freeze, stop, retry ...). Without a token it is read-only, and it
refuses a non-loopback bind without a token (see ``docs/security.md``).
"""

from __future__ import annotations

from collections.abc import Iterable

from metafora.web.server import (
    ENV_TOKEN,
    WebServer,
    display_url,
    is_loopback,
    parse_bind,
)

__all__ = ["ENV_TOKEN", "WebServer", "create_app", "display_url", "is_loopback", "parse_bind"]


def create_app(url: str, *, token: str | None = None, items_url: str | None = None,
               refresh: float = 2.0, allowed_hosts: Iterable[str] | None = None) -> object:
    """The dashboard's ASGI application for the store ``url`` (see :mod:`metafora.web.app`)."""
    from metafora.web.app import create_app as _create

    return _create(url, token=token, items_url=items_url, refresh=refresh, allowed_hosts=allowed_hosts)
