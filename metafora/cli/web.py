"""``metafora web``: serve the dashboard (needs the extra ``metafora-cluster[web]``)."""

from __future__ import annotations

import click

from metafora.cli._common import CliError, ExitCode, settings
from metafora.errors import ConfigError

__all__ = ["web"]


@click.command()
@click.option("--bind", default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="Address to listen on; a non-loopback address needs --token.")
@click.option("--token", default=None, metavar="T", envvar="METAFORA_WEB_TOKEN", show_envvar=True,
              help="Allow actions to whoever sends T (login form, or header 'Authorization: Bearer T'). "
                   "Without it the dashboard is read-only.")
@click.option("--items-url", default=None, metavar="URL",
              help="The SQL store of the gates' items, when it is not --url.")
@click.option("--refresh", type=click.FloatRange(0.5, 2.0), default=2.0, show_default=True,
              help="Seconds between live updates of a page.")
@click.pass_context
def web(ctx: click.Context, bind: str, token: str | None, items_url: str | None, refresh: float) -> None:
    """Serve a dashboard of the cluster from the store: nodes, tasks, actions.

    Read-only unless started with a token; listens on loopback unless told otherwise.
    """
    from metafora.web.server import is_loopback, parse_bind

    host, port = parse_bind(bind)
    if not is_loopback(host) and not token:
        raise ConfigError(f"refusing to serve on {host} (not loopback) without --token: anyone who can "
                          "reach it would see the cluster; give --token or bind 127.0.0.1")
    try:
        from metafora.web.app import create_app
        from metafora.web.server import WebServer
    except ImportError as exc:
        raise CliError.make(f"the dashboard needs its extra: pip install 'metafora-cluster[web]' ({exc})",
                            ExitCode.USAGE) from None
    app = create_app(settings(ctx).url, token=token, items_url=items_url, refresh=refresh)
    server = WebServer(app, host, port)
    mode = "actions allowed with the token" if token else "read-only"
    click.echo(f"metafora web on http://{host}:{port}/ ({mode}); Ctrl-C stops it", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        pass
    finally:
        app.state.dashboard.close()
    click.echo("metafora web stopped", err=True)
