"""Node commands: nodes, freeze, unfreeze, balance, stop."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from metafora.cli._common import cell, console, print_json, store_client
from metafora.cli.top import frozen_text
from metafora.contracts.client import NodeInfo
from metafora.core import commands
from metafora.core.commands import Command
from metafora.core.errors import InvalidTaskState, NodeNotFound
from metafora.core.task import TaskState, label_text
from metafora.surfaces.connect import validate_node_id

__all__ = ["balance", "drain", "freeze", "nodes", "stop", "top", "unfreeze"]


def _node_dict(info: NodeInfo) -> dict[str, Any]:
    def iso(dt: datetime | None) -> str | None:
        return None if dt is None else dt.isoformat()

    return {"node": info.id, "tasks": info.tasks, "frozen": bool(info.frozen), "host": info.host,
            "pid": info.pid, "started": iso(info.started), "heartbeat": iso(info.heartbeat),
            "labels": dict(info.labels), "weight": info.weight}


def _age(now: datetime, then: datetime | None) -> str:
    if then is None:
        return "-"
    seconds = max(0.0, (now - then).total_seconds())
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def nodes(ctx: click.Context, as_json: bool) -> None:
    """List live nodes: tasks held, weight, frozen, labels, host, pid, last heartbeat (where the
    store keeps them). ``metafora nodes drain ID`` hands a stopped node's held tasks off."""
    if ctx.invoked_subcommand is not None:
        return
    with store_client(ctx) as client:
        infos = sorted(client.node_infos(), key=lambda n: n.id)
    if as_json:
        print_json([_node_dict(info) for info in infos])
        return
    out = console()
    if not infos:
        out.print("no live nodes")
        return
    total = sum(info.tasks for info in infos)
    table = Table(caption=f"{len(infos)} node{'s' if len(infos) != 1 else ''}, {total} claimed "
                  f"task{'s' if total != 1 else ''}", caption_justify="left")
    table.add_column("node", overflow="fold")
    table.add_column("tasks", justify="right")
    table.add_column("weight", justify="right")
    table.add_column("frozen")
    table.add_column("labels", overflow="fold")
    table.add_column("host", overflow="fold")
    table.add_column("pid", justify="right")
    table.add_column("heartbeat")
    now = datetime.now(UTC)
    for info in infos:
        frozen = frozen_text(info.frozen)
        table.add_row(cell(info.id, exact=True), str(info.tasks), f"{info.weight:g}",
                      Text(frozen, style="bold blue" if info.frozen else ""),
                      cell(label_text(info.labels) or "-"), cell(info.host or "-"),
                      "-" if info.pid is None else str(info.pid),
                      _age(now, info.heartbeat))
    out.print(table)


@nodes.command()
@click.argument("node", metavar="ID")
@click.pass_context
def drain(ctx: click.Context, node: str) -> None:
    """Hand the tasks held for node ID to every node now (a scale-down).

    A node with a stable id (--node-id, METAFORA_NODE_ID) that stops gracefully holds its
    tasks for that id for its --sticky-for, so a restart takes them back; when it is not
    coming back, this ends the wait at once. See docs/deploys.md.
    """
    validate_node_id(node)
    with store_client(ctx) as client:
        count = client.drain_node(node)
        live = node in client.nodes()
    click.echo(f"handed {count} task{'s' if count != 1 else ''} held for node {node} to every node")
    if live:
        click.echo(f"node {node} is live: a graceful stop holds its tasks again (stop it with "
                   "leaving, or --sticky-for 0, for a scale-down)", err=True)


def _send(ctx: click.Context, node: str | None, everyone: bool, make: Callable[[], Command],
          verb: str) -> None:
    """Send the command built by ``make`` to ``node``, or to every live node with ``--all``."""
    if (node is None) == (not everyone):
        raise click.UsageError("give a NODE or --all (exactly one of them)", ctx)
    command = make()  # validated client-side before the store is touched
    if node is not None:
        validate_node_id(node)
        with store_client(ctx) as client:
            client.submit_command(node, command)
        click.echo(f"sent {command.name} to node {node}")
        return
    with store_client(ctx) as client:
        targets = client.nodes()
        sent = 0
        for target in targets:
            try:
                client.submit_command(target, command)
            except NodeNotFound:  # it went away between listing and sending
                click.echo(f"node {target} is gone; skipped", err=True)
                continue
            sent += 1
    if not targets:
        click.echo(f"no live nodes; nothing to {verb}", err=True)
        return
    click.echo(f"sent {command.name} to {sent} node{'s' if sent != 1 else ''}")


_NODE = click.argument("node", metavar="[NODE]", required=False)
_ALL = click.option("--all", "everyone", is_flag=True, help="Every live node.")


@click.command()
@_NODE
@_ALL
@click.pass_context
def freeze(ctx: click.Context, node: str | None, everyone: bool) -> None:
    """Stop NODE (or --all) from claiming new tasks; running tasks keep running."""
    _send(ctx, node, everyone, commands.freeze, "freeze")


@click.command()
@_NODE
@_ALL
@click.pass_context
def unfreeze(ctx: click.Context, node: str | None, everyone: bool) -> None:
    """Let a frozen NODE (or --all) claim tasks again."""
    _send(ctx, node, everyone, commands.unfreeze, "unfreeze")


@click.command()
@_NODE
@_ALL
@click.pass_context
def balance(ctx: click.Context, node: str | None, everyone: bool) -> None:
    """Ask NODE (or --all) to run its balancer now (it may release tasks to others)."""
    _send(ctx, node, everyone, commands.balance, "balance")


@click.command()
@click.argument("node", metavar="NODE")
@click.argument("task_id", metavar="TASK")
@click.pass_context
def stop(ctx: click.Context, node: str, task_id: str) -> None:
    """Ask NODE to stop TASK and release it (another node may then claim it)."""
    command = commands.stop_task(task_id)  # InvalidCommand for a bad task id: exit 2
    validate_node_id(node)
    with store_client(ctx) as client:
        if node not in client.nodes():  # before the task: "not running there" would mislead
            raise NodeNotFound(f"no live node {node!r}")
        info = client.get_task(task_id)  # TaskNotFound: exit 1
        if info.state is not TaskState.CLAIMED or info.owner != node:
            where = f"claimed by {info.owner}" if info.state is TaskState.CLAIMED else info.state.value
            raise InvalidTaskState(f"task {task_id!r} is not running on node {node!r} (it is {where})")
        client.submit_command(node, command)
    click.echo(f"asked node {node} to stop task {task_id}")


@click.command()
@click.option("--interval", type=click.FloatRange(0.1, 60.0), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--frames", type=click.IntRange(1), default=None, hidden=True,
              help="Stop after this many refreshes (for scripts and tests).")
@click.pass_context
def top(ctx: click.Context, interval: float, frames: int | None) -> None:
    """A live view of the cluster: nodes, tasks by state, claims and releases per second,
    and the groups at their limit with how many pending tasks wait on each.

    Press q or Ctrl-C to quit.
    """
    from metafora.cli.top import run_top

    with store_client(ctx) as client:
        run_top(client, interval=interval, console=console(), frames=frames)
