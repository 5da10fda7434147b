"""``metafora web``: serve the dashboard (needs the extra ``metafora-cluster[web]``)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import click

from metafora.cli._common import CliError, ExitCode, settings
from metafora.core.errors import ConfigError

__all__ = ["web"]


def _read_token(token: str | None, token_file: Path | None) -> str | None:
    """The token from ``--token`` or ``--token-file`` (one of them), or None (read-only)."""
    if token_file is None:
        return token or None
    if token:
        raise ConfigError("give the token once: --token (METAFORA_WEB_TOKEN) or --token-file, not both")
    try:
        text = token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --token-file {str(token_file)!r}: {exc}") from None
    if not text or "\n" in text:
        raise ConfigError(f"--token-file {str(token_file)!r} must hold the token on one line")
    _warn_if_shared(token_file)
    return text


def _warn_if_shared(path: Path) -> None:
    """Warn (stderr) when the token file may be read by its group or by other users."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return
    if mode & 0o077:
        click.echo(f"warning: --token-file {str(path)!r} can be read or changed by other users "
                   f"(mode {mode:04o}): whoever reads it can act on the cluster; chmod 600 {str(path)!r}",
                   err=True)


@click.command()
@click.option("--bind", default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="Address to listen on; a non-loopback address needs --token (and --allow-host for the "
                   "DNS names clients use).")
@click.option("--token", default=None, metavar="T", envvar="METAFORA_WEB_TOKEN", show_envvar=True,
              help="Allow actions to whoever sends T (login form, or header 'Authorization: Bearer T'). "
                   "Without it the dashboard is read-only. Prefer --token-file: a command line is "
                   "visible to every user of the machine (ps).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="PATH", envvar="METAFORA_WEB_TOKEN_FILE", show_envvar=True,
              help="Read the token from this file (one line).")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="A DNS name clients reach the dashboard by (the Host header); requests naming "
                   "another host are refused (DNS rebinding). Loopback names, this machine's names and "
                   "IP addresses are always allowed. Repeatable.")
@click.option("--trusted-proxy", "trusted_proxies", multiple=True, metavar="ADDR",
              help="The address of a reverse proxy whose X-Forwarded-For and X-Forwarded-Proto are "
                   "believed (the client's address for the login throttle, https for the cookie). "
                   "Repeatable. Without it these headers are ignored, from loopback too.")
@click.option("--request-timeout", type=click.FloatRange(1.0, 600.0), default=30.0, show_default=True,
              metavar="SECONDS", help="How long a request's body may take to arrive (then 408).")
@click.option("--items-url", default=None, metavar="URL",
              help="The SQL store of the gates' items, when it is not --url.")
@click.option("--refresh", type=click.FloatRange(0.5, 2.0), default=2.0, show_default=True,
              help="Seconds between live updates of a page.")
@click.pass_context
def web(ctx: click.Context, bind: str, token: str | None, token_file: Path | None,
        allow_hosts: tuple[str, ...], trusted_proxies: tuple[str, ...], request_timeout: float,
        items_url: str | None, refresh: float) -> None:
    """Serve a dashboard of the cluster from the store: nodes, tasks, actions.

    Read-only unless started with a token; listens on loopback unless told otherwise.
    """
    from metafora.core.hosts import allowed_hosts
    from metafora.web.security import check_token
    from metafora.web.server import is_loopback, parse_bind

    host, port = parse_bind(bind)
    token = _read_token(token, token_file)
    loopback = is_loopback(host)
    if not loopback and not token:
        raise ConfigError(f"refusing to serve on {host} (not loopback) without --token: anyone who can "
                          "reach it would see the cluster; give --token or bind 127.0.0.1")
    check_token(token, host, loopback)
    for proxy in trusted_proxies:
        try:
            ipaddress.ip_network(proxy.strip(), strict=False)
        except ValueError:
            raise ConfigError(f"--trusted-proxy must be an IP address or network (10.0.0.5, "
                              f"10.0.0.0/24), got {proxy!r}") from None
    hosts = allowed_hosts(host, loopback, allow_hosts)
    try:
        from metafora.web.app import create_app
        from metafora.web.server import WebServer
    except ImportError as exc:
        raise CliError.make(f"the dashboard needs its extra: pip install 'metafora-cluster[web]' ({exc})",
                            ExitCode.USAGE) from None
    app = create_app(settings(ctx).url, token=token, items_url=items_url, refresh=refresh,
                     allowed_hosts=hosts, request_timeout=request_timeout)
    server = WebServer(app, host, port, trusted_proxies=trusted_proxies)
    mode = "actions allowed with the token" if token else "read-only"
    click.echo(f"metafora web on http://{host}:{port}/ ({mode}); Ctrl-C stops it", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        pass
    finally:
        app.state.dashboard.close()
    click.echo("metafora web stopped", err=True)
