"""Schedule commands: ``metafora schedule add|list|delete|pause|resume``."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from metafora.cli._common import cell, console, format_time, print_json, store_client
from metafora.core.errors import InvalidProps
from metafora.core.jsontext import load_value
from metafora.core.schedule_model import MISSED_POLICIES, Schedule

__all__ = ["schedule"]


def _props(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    loaded = load_value(text, "--props", InvalidProps)  # the API's bounded reader (deep JSON: exit 2)
    if not isinstance(loaded, dict):
        raise InvalidProps(f"--props must be a JSON object, not a JSON {type(loaded).__name__}")
    return loaded


def _as_dict(s: Schedule) -> dict[str, Any]:
    return {"name": s.name, "every": s.every, "cron": s.cron, "props": dict(s.props),
            "missed": s.missed, "paused": s.paused, "cursor": s.cursor.isoformat(),
            "next": None if s.paused else s.next_tick(s.cursor).isoformat()}


@click.group()
def schedule() -> None:
    """Periodic tasks: any live node makes each tick one task NAME@<tick time, UTC>."""


@schedule.command("add")
@click.argument("name")
@click.option("--every", metavar="DURATION", help="Period: 30s, 5m, 1h, 1d (at least 1s).")
@click.option("--cron", metavar="EXPR", help='A cron expression in UTC, e.g. "*/5 * * * *".')
@click.option("--props", "props_json", metavar="JSON", help="Props of every task, a JSON object.")
@click.option("--missed", type=click.Choice(MISSED_POLICIES), default="skip", show_default=True,
              help="Ticks missed while no node was up: none, one task, or each (at most 100).")
@click.pass_context
def add(ctx: click.Context, name: str, every: str | None, cron: str | None, props_json: str | None,
        missed: str) -> None:
    """Add schedule NAME (exactly one of --every and --cron)."""
    if (every is None) == (cron is None):
        raise click.UsageError("give exactly one of --every DURATION and --cron EXPR", ctx)
    props = _props(props_json)
    with store_client(ctx) as client:
        added = client.add_schedule(name, every=every, cron=cron, props=props, missed=missed)
    click.echo(f"added schedule {added.name} ({added.spec}); first tick "
               f"{format_time(added.next_tick(added.cursor))}")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """List schedules: when they tick, their next tick, paused or not."""
    with store_client(ctx) as client:
        found = client.schedules()
    if as_json:
        print_json([_as_dict(s) for s in found])
        return
    out = console()
    if not found:
        out.print("no schedules")
        return
    table = Table()
    table.add_column("name", overflow="fold")
    table.add_column("when")
    table.add_column("missed")
    table.add_column("next tick")
    table.add_column("props", overflow="fold")
    for s in found:
        nxt = "paused" if s.paused else format_time(s.next_tick(s.cursor))
        table.add_row(cell(s.name, exact=True), cell(s.spec), s.missed, nxt,
                      cell(json.dumps(dict(s.props), sort_keys=True)))
    out.print(table)


@schedule.command("delete")
@click.argument("name")
@click.pass_context
def delete(ctx: click.Context, name: str) -> None:
    """Delete schedule NAME (tasks it made stay)."""
    with store_client(ctx) as client:
        client.delete_schedule(name)
    click.echo(f"deleted schedule {name}")


@schedule.command("pause")
@click.argument("name")
@click.pass_context
def pause(ctx: click.Context, name: str) -> None:
    """Pause schedule NAME: no tasks until resumed (ticks meanwhile are not made later)."""
    with store_client(ctx) as client:
        client.pause_schedule(name)
    click.echo(f"paused schedule {name}")


@schedule.command("resume")
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """Resume schedule NAME from its first tick after now."""
    with store_client(ctx) as client:
        client.resume_schedule(name)
    click.echo(f"resumed schedule {name}")
