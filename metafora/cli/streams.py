"""Stream commands: ``metafora streams`` and ``metafora stream show|check|retry ID``
(see :mod:`metafora.streams`)."""

from __future__ import annotations

import click
from rich.table import Table
from rich.text import Text

from metafora.cli._common import cell, console, field_table, print_json, store_client
from metafora.core.task import validate_task_id

__all__ = ["stream", "streams"]

_ID = click.argument("task_id", metavar="ID")


def _number(value: int | None) -> str:
    return "-" if value is None else str(value)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def streams(ctx: click.Context, as_json: bool) -> None:
    """List streams (tasks run by a stream handler), ordered by id: owner, processed index,
    head, lag and the job a stream is failing on. Head and lag are as the owner last wrote them."""
    from metafora.streams.ops import stream_rows

    with store_client(ctx) as client:
        rows = stream_rows(client)
    if as_json:
        print_json([row.to_dict() for row in rows])
        return
    out = console()
    if not rows:
        out.print("no streams")
        return
    table = Table()
    table.add_column("id", overflow="fold")
    table.add_column("owner", overflow="fold")
    table.add_column("state")
    table.add_column("processed", justify="right")
    table.add_column("head", justify="right")
    table.add_column("lag", justify="right")
    table.add_column("failing", max_width=60)
    for row in rows:
        info = row.info
        failing: Text | str = "-"
        if info.failing is not None:
            failing = cell(f"#{info.failing.index} ({info.failing.attempts}x): {info.failing.error}",
                           "red")
        table.add_row(cell(row.id, exact=True), cell(row.owner or "-", exact=True),
                      Text(row.state), str(info.processed), _number(info.head),
                      _number(info.lag), failing)
    out.print(table)


@click.group()
def stream() -> None:
    """Look at one stream, wake it, or resume it after a failing job."""


@stream.command("show")
@_ID
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of a table.")
@click.pass_context
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show stream ID: processed index, head, lag, jobs in flight, the job it is failing on."""
    from metafora.streams.ops import info_dict, stream_info, stream_state

    validate_task_id(task_id)
    with store_client(ctx) as client:
        task = client.get_task(task_id)
        info = stream_info(client, task_id)
        state = stream_state(client, task_id)
    code = "new" if state is None else state.code.value
    if as_json:
        print_json({"id": task_id, "owner": task.owner, "task_state": task.state.value,
                    "state": code, **info_dict(info)})
        return
    table = field_table()
    table.add_row("stream", cell(task_id, exact=True))
    table.add_row("owner", cell(task.owner or "-", exact=True))
    table.add_row("state", Text(f"{code} (task {task.state.value})"))
    table.add_row("processed", str(info.processed))
    table.add_row("head", _number(info.head))
    table.add_row("lag", _number(info.lag))
    table.add_row("in flight", str(info.in_flight))
    if info.failing is not None:
        table.add_row("failing", cell(f"job {info.failing.index} after {info.failing.attempts} "
                                      f"attempts: {info.failing.error}", "red"))
    console().print(table)


@stream.command("check")
@_ID
@click.pass_context
def check(ctx: click.Context, task_id: str) -> None:
    """Wake stream ID: its owner re-reads the source's head at once (pushed to it)."""
    validate_task_id(task_id)
    with store_client(ctx) as client:
        sent = client.check_stream(task_id)
    click.echo(f"checked {task_id}" if sent
               else f"stream {task_id} is paused or finished; nothing sent")


@stream.command("retry")
@_ID
@click.pass_context
def retry(ctx: click.Context, task_id: str) -> None:
    """Resume stream ID, paused on a failing job: the job gets fresh attempts."""
    validate_task_id(task_id)
    with store_client(ctx) as client:
        client.retry_stream(task_id)
    click.echo(f"retrying {task_id}")
