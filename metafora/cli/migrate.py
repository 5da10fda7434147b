"""``metafora migrate --url URL``: apply a SQL store's schema migrations (the release step).

A store whose URL says ``migrate=false`` never creates or alters its tables; this command
applies them: the coordinator's tables, the state machine's command table, the gated
partitions' item tables and the job logs' tables. It exits 0 when the schema is up to date,
whether it changed it or not (a second run changes nothing), and refuses stores that have no
schema (etcd, memory).
"""

from __future__ import annotations

import click

from metafora.cli._common import settings
from metafora.cli.tool import check_url
from metafora.contracts.backends import backend_of
from metafora.core.config import parse_store_url
from metafora.core.masking import mask_url

__all__ = ["migrate"]


@click.command()
@click.option("--url", "store_url", metavar="URL", callback=check_url,
              help="The SQL store to migrate (default: the store of metafora --url / $METAFORA_URL).")
@click.pass_context
def migrate(ctx: click.Context, store_url: str | None) -> None:
    """Apply the schema migrations of a SQL store (for stores run with migrate=false)."""
    url = store_url or settings(ctx).url
    parsed = parse_store_url(url)
    for applied in backend_of(parsed).migrate(parsed):
        state = (f"version {applied.before} -> {applied.after}" if applied.changed
                 else f"at version {applied.after}, up to date")
        click.echo(f"{mask_url(url, brief=True)}: {applied.schema} schema {state}")
