"""Gated partitions from the command line: ``metafora items ...`` and ``metafora gate``.

``metafora items PARTITION [--gate G] [--status S] [--json]`` lists a partition's items
(``items list PARTITION`` is the same, for a partition named like a sub-command);
``metafora items add PARTITION --gate G --data @FILE|TEXT`` adds items;
``metafora items retry PARTITION`` makes failed items available and revives the task;
``metafora gate PARTITION N`` moves a partition's gate by hand (``manual_checkpoint``);
``metafora partition reopen PARTITION [--gate G --data ...]`` opens a completed partition again.

Items live in SQL: the store of ``--url`` when it is SQLite or PostgreSQL, else
``--items-url`` (``$METAFORA_ITEMS_URL``), e.g. with an etcd coordinator.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click
from rich.table import Table
from rich.text import Text

from metafora.cli._common import cell, console, format_time, print_json, settings, store_client
from metafora.cli.tool import ENV_ITEMS_URL, items_url_option
from metafora.core.errors import TaskExists, TaskNotFound
from metafora.core.task import Task, validate_task_id
from metafora.gates import (
    MAX_GATE,
    Item,
    ItemStatus,
    ItemStore,
    NewItem,
    PartitionInfo,
    reopen_partition,
    retry_partition,
)

__all__ = ["ENV_ITEMS_URL", "gate", "item_store", "items", "items_url_option", "partition"]

_STATUS_STYLE = {
    ItemStatus.AVAILABLE: "yellow",
    ItemStatus.COMPLETE: "green",
    ItemStatus.FAILED: "bold red",
}
_PREVIEW = 48  # characters of data shown in the table

@contextmanager
def item_store(ctx: click.Context, items_url: str | None) -> Iterator[ItemStore]:
    """The item store of ``--items-url`` (else ``--url``), closed on exit."""
    store = ItemStore(items_url or settings(ctx).url)
    try:
        yield store
    finally:
        store.close()


_ROUTED = "metafora.items.routed"  # ctx.meta key: `items PARTITION` was routed to `items list`


class _ItemsGroup(click.Group):
    """``items PARTITION ...`` runs ``items list PARTITION ...``; sub-command names win."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Route a first argument that is not a sub-command (or help) to ``list``."""
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["list", *args]
            ctx.meta[_ROUTED] = True
        return super().parse_args(ctx, args)


class _ListContext(click.Context):
    """Usage errors of a routed ``items PARTITION`` name the command the user typed."""

    @property
    def command_path(self) -> str:
        """``metafora items`` when the user left ``list`` out, else the usual path."""
        if self.parent is not None and self.meta.get(_ROUTED):
            return self.parent.command_path
        return super().command_path


class _ListCommand(click.Command):
    """`items list`, whose context knows when it was reached as `items PARTITION`."""

    context_class = _ListContext


@click.group(cls=_ItemsGroup)
def items() -> None:
    """Items of gated partitions: list them (metafora items PARTITION), add, retry.

    \b
    metafora items PARTITION [--gate G] [--status S] [--json]
    metafora items add PARTITION --gate G --data @FILE|TEXT [--data ...]
    metafora items retry PARTITION
    """


def _data_preview(item: Item) -> Text:
    try:
        shown = item.data.decode("utf-8")
    except UnicodeDecodeError:
        return Text(f"<{len(item.data)} bytes>", style="dim")
    shown = " ".join(shown.split())
    if len(shown) > _PREVIEW:
        shown = shown[: _PREVIEW - 3] + "..."
    return cell(shown)


def _caption(info: PartitionInfo, shown: int) -> str:
    parts = [f"{info.total(s)} {s.value}" for s in ItemStatus if info.total(s)]
    return (f"partition {info.partition}: gate {info.gate} ({info.status.value}), "
            f"{info.total()} item(s)" + (f": {', '.join(parts)}" if parts else "")
            + (f"; {shown} shown" if shown != info.total() else ""))


@items.command("list", cls=_ListCommand)
@click.argument("partition")
@click.option("--gate", type=click.IntRange(0, MAX_GATE), help="Only items at this gate.")
@click.option("--status", type=click.Choice([s.value for s in ItemStatus], case_sensitive=False),
              help="Only items in this status.")
@click.option("--limit", type=click.IntRange(1), help="Show at most this many items.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"partition": {...}, "items": [...]} as JSON instead of a table.')
@items_url_option
@click.pass_context
def list_items(ctx: click.Context, partition: str, gate: int | None, status: str | None,
               limit: int | None, as_json: bool, items_url: str | None) -> None:
    """List the items of PARTITION (ordered by id): gate, status, attempts, data, error."""
    validate_task_id(partition)
    wanted = None if status is None else ItemStatus(status.lower())
    with item_store(ctx, items_url) as store:
        info = store.info(partition)
        if not info.exists:  # not "gate 0 (open)": a typo must not look like an empty partition
            raise TaskNotFound(f"no partition {partition!r}: no items were ever added to it")
        found = store.list(partition, gate=gate, status=wanted, limit=limit)
    if as_json:
        print_json({"partition": info.to_dict(), "items": [i.to_dict() for i in found]})
        return
    out = console()
    if not found:
        out.print(f"partition {partition}: gate {info.gate} ({info.status.value}); no "
                  + ("matching items" if info.total() else "items"))
        return
    table = Table(caption=_caption(info, len(found)), caption_justify="left")
    table.add_column("id", justify="right")
    table.add_column("gate", justify="right")
    table.add_column("status")
    table.add_column("attempts", justify="right")
    table.add_column("data", max_width=_PREVIEW + 2, no_wrap=True)
    table.add_column("error", max_width=60, no_wrap=True, overflow="ellipsis")
    table.add_column("updated_at")
    for item in found:
        error = (item.error or "").strip().splitlines()
        table.add_row(
            str(item.id), str(item.gate),
            Text(item.status.value + (" (permanent)" if item.permanent and item.error else ""),
                 style=_STATUS_STYLE[item.status]),
            str(item.attempts), _data_preview(item),
            cell(error[0] if error else "", "red"), format_time(item.updated_at),
        )
    out.print(table)


def _read_data(value: str) -> bytes:
    """``@FILE`` (``@-``: standard input) reads bytes; anything else is the text itself."""
    if not value.startswith("@"):
        return value.encode("utf-8")
    path = value[1:]
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path!r}: {exc.strerror or exc}",
                                 param_hint="'--data'") from None


@items.command("add")
@click.argument("partition")
@click.option("--gate", type=click.IntRange(0, MAX_GATE), default=0, show_default=True,
              help="The gate of the new items.")
@click.option("--data", "datas", multiple=True, required=True, metavar="@FILE|TEXT",
              help="One item's data: @FILE reads a file (@- standard input), else the text. Repeatable.")
@click.option("--submit", is_flag=True,
              help="Also submit the partition's task if it does not exist yet (on --url).")
@items_url_option
@click.pass_context
def add_items(ctx: click.Context, partition: str, gate: int, datas: tuple[str, ...], submit: bool,
              items_url: str | None) -> None:
    """Add items to PARTITION, in one transaction (refused below the partition's gate)."""
    validate_task_id(partition)
    new = [NewItem(gate, _read_data(value)) for value in datas]
    with item_store(ctx, items_url) as store:
        ids = store.add(partition, new)
    span = str(ids[0]) if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
    click.echo(f"added {len(ids)} item(s) to partition {partition} at gate {gate} (id {span})")
    if submit:
        with store_client(ctx) as client:
            try:
                client.submit_task(Task(partition))
                click.echo(f"submitted task {partition}")
            except TaskExists:
                click.echo(f"task {partition} already exists")


@items.command("retry")
@click.argument("partition")
@items_url_option
@click.pass_context
def retry_items(ctx: click.Context, partition: str, items_url: str | None) -> None:
    """Make PARTITION's failed items available again and revive its task (pending again if
    it failed; resumed now if it is backing off)."""
    validate_task_id(partition)
    with item_store(ctx, items_url) as store, store_client(ctx) as client:
        count = retry_partition(store, partition, client)
        try:
            state: str | None = client.get_task(partition).state.value
        except TaskNotFound:
            state = None
    click.echo(f"{count} failed item(s) of partition {partition} made available again"
               + (f"; task is {state}" if state else "; no task with that id (submit it to run)"))


@click.command()
@click.argument("partition")
@click.argument("gate_number", metavar="N", type=click.IntRange(0, MAX_GATE))
@click.option("--force", is_flag=True,
              help="Move even if items below N are still available or failed (they are skipped).")
@items_url_option
@click.pass_context
def gate(ctx: click.Context, partition: str, gate_number: int, force: bool, items_url: str | None) -> None:
    """Move PARTITION's gate to N (partitions run with manual_checkpoint wait for this)."""
    validate_task_id(partition)
    with item_store(ctx, items_url) as store:
        old = store.set_gate(partition, gate_number, force=force)
    click.echo(f"partition {partition}: gate {old} -> {gate_number}")


@click.group()
def partition() -> None:
    """Gated partitions as a whole: reopen a completed one.

    \b
    metafora partition reopen PARTITION [--gate G --data @FILE|TEXT ...]
    """


@partition.command("reopen")
@click.argument("partition_id", metavar="PARTITION")
@click.option("--gate", type=click.IntRange(0, MAX_GATE), default=0, show_default=True,
              help="The gate of the items given with --data.")
@click.option("--data", "datas", multiple=True, metavar="@FILE|TEXT",
              help="An item to add in the same step: @FILE reads a file (@- standard input), "
                   "else the text. Repeatable.")
@items_url_option
@click.pass_context
def reopen(ctx: click.Context, partition_id: str, gate: int, datas: tuple[str, ...],
           items_url: str | None) -> None:
    """Open a completed PARTITION again and make its task pending: done items stay done,
    items added now or later (metafora items add) are processed."""
    validate_task_id(partition_id)
    new = [NewItem(gate, _read_data(value)) for value in datas]
    with item_store(ctx, items_url) as store, store_client(ctx) as client:
        at = reopen_partition(store, partition_id, client, new_items=new)
        state = client.get_task(partition_id).state.value
    added = f", {len(new)} item(s) added" if new else ""
    click.echo(f"partition {partition_id}: open at gate {at}{added}; task is {state}")
