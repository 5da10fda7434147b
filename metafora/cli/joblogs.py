"""``metafora joblogs``: the job logs of a SQL store (see :mod:`metafora.coordinators.sql.joblog`,
found through the stores' registry)."""

from __future__ import annotations

import click
from rich.table import Table

from metafora.cli._common import cell, console, format_time, print_json, settings

__all__ = ["joblogs"]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def joblogs(ctx: click.Context, as_json: bool) -> None:
    """List the job logs (SQLJobLog) of the store's namespace, by name: jobs, head index and when
    each was created and last appended to. The store must be SQL (SQLite or PostgreSQL)."""
    from metafora.contracts.backends import implementation

    job_logs = implementation("sql", "job_logs")  # the SQL store keeps the job logs
    logs = job_logs(settings(ctx).url)
    if as_json:
        print_json([{"name": i.name, "size": i.size, "head": i.head,
                     "created_at": i.created_at.isoformat() if i.created_at else None,
                     "updated_at": i.updated_at.isoformat() if i.updated_at else None} for i in logs])
        return
    out = console()
    if not logs:
        out.print("no job logs")
        return
    table = Table()
    table.add_column("name", overflow="fold")
    table.add_column("jobs", justify="right")
    table.add_column("head", justify="right")
    table.add_column("created")
    table.add_column("last append")
    for info in logs:
        table.add_row(cell(info.name, exact=True), str(info.size), str(info.head),
                      format_time(info.created_at), format_time(info.updated_at))
    out.print(table)
