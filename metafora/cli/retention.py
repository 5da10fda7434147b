"""Retention commands: ``metafora retention set|show`` (see :mod:`metafora.core.retention`)."""

from __future__ import annotations

from datetime import timedelta

import click

from metafora.cli._common import print_json, store_client
from metafora.core.retention import UNCHANGED, _Unchanged, parse_keep

__all__ = ["retention"]

_KEEP_HELP = "Keep {} tasks this long after they finished: 30s, 12h, 7d, or 'never'."


@click.group()
def retention() -> None:
    """How long finished tasks are kept before a node prunes them (no leader: one node per
    interval, whichever wins the store's turn). Pending, claimed and sleeping tasks are never
    pruned. Default: done 7d, failed 30d, killed 30d."""


@retention.command("set")
@click.option("--done", metavar="DURATION|never", help=_KEEP_HELP.format("done"))
@click.option("--failed", metavar="DURATION|never",
              help=_KEEP_HELP.format("failed and expired (and state-machine failed)"))
@click.option("--killed", metavar="DURATION|never",
              help=_KEEP_HELP.format("killed (state machine)"))
@click.pass_context
def set_(ctx: click.Context, done: str | None, failed: str | None, killed: str | None) -> None:
    """Set the retention of the namespace; a kind not given keeps its value."""
    if done is None and failed is None and killed is None:
        raise click.UsageError("give --done, --failed, --killed or several", ctx)
    def keep(value: str | None, name: str) -> timedelta | _Unchanged | None:
        return UNCHANGED if value is None else parse_keep(value, f"--{name}")

    args = keep(done, "done"), keep(failed, "failed"), keep(killed, "killed")
    with store_client(ctx) as client:
        policy = client.set_retention(*args)
    click.echo(f"retention: {policy.describe()}")


@retention.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (seconds, null for never).")
@click.pass_context
def show(ctx: click.Context, as_json: bool) -> None:
    """Show the retention of the namespace."""
    with store_client(ctx) as client:
        policy = client.retention()
    if as_json:
        print_json(policy.to_json())
    else:
        click.echo(f"retention: {policy.describe()}")
