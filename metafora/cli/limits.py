"""Limit commands: ``metafora limit set|list|delete``."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from metafora.cli._common import cell, console, print_json, store_client
from metafora.core.limits import GroupUsage

__all__ = ["limit"]


def _as_dict(usage: GroupUsage) -> dict[str, Any]:
    lim = usage.limit
    return {"group": lim.group, "max": lim.max,
            "rate": None if lim.rate is None else str(lim.rate),
            "running": usage.running, "recent": usage.recent, "full": usage.full()}


@click.group()
def limit() -> None:
    """Cluster-wide limits per task group (Task.group, submit --group): at most N running at
    once and/or at most N claims per window, across every node."""


@limit.command("set")
@click.argument("group")
@click.option("--max", "max_", type=int, metavar="N",
              help="At most N tasks of GROUP running at once across the cluster (N >= 1).")
@click.option("--rate", metavar="N/WINDOW",
              help="At most N claims of GROUP's tasks per WINDOW: 100/1m, 5/1s, 1000/1h.")
@click.pass_context
def set_(ctx: click.Context, group: str, max_: int | None, rate: str | None) -> None:
    """Set (or replace) the limit of GROUP: --max, --rate or both."""
    if max_ is None and rate is None:
        raise click.UsageError("give --max N, --rate N/WINDOW or both", ctx)
    with store_client(ctx) as client:
        done = client.set_limit(group, max=max_, rate=rate)
    click.echo(f"limit of group {done.group}: {done.describe()}")


@limit.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """List the limits with what their groups use now."""
    with store_client(ctx) as client:
        usage = [u for _, u in sorted(client.group_usage().items())]
    if as_json:
        print_json([_as_dict(u) for u in usage])
        return
    out = console()
    if not usage:
        out.print("no limits")
        return
    table = Table()
    for name in ("group", "max", "running", "rate", "in window", "state"):
        table.add_column(name, justify="right" if name in ("max", "running", "in window") else "left")
    for u in usage:
        lim = u.limit
        full = u.full()
        table.add_row(cell(lim.group, exact=True), "-" if lim.max is None else str(lim.max),
                      str(u.running), "-" if lim.rate is None else str(lim.rate),
                      "-" if lim.rate is None else str(u.recent),
                      cell("full" if full else "open", "yellow" if full else "green"))
    out.print(table)


@limit.command("delete")
@click.argument("group")
@click.pass_context
def delete(ctx: click.Context, group: str) -> None:
    """Remove the limit of GROUP (its waiting tasks become claimable)."""
    with store_client(ctx) as client:
        client.delete_limit(group)
    click.echo(f"deleted the limit of group {group}")
