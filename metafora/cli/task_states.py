"""Commands to stateful tasks (:mod:`metafora.statemachine`): pause, resume, kill, sleep, state.

These go to a *task* (its state machine reacts when it runs, or when it is next claimed),
unlike freeze/balance/stop, which go to a node. A task no state machine has run (it has no
state) is refused with exit 1 unless ``--queue`` says the command should wait for one.
"""

from __future__ import annotations

import click
from rich.text import Text

from metafora.cli._common import cell, console, field_table, print_json, store_client
from metafora.cli.tasks import parse_when
from metafora.core.errors import InvalidTaskState
from metafora.core.task import TaskState, validate_task_id

__all__ = ["kill", "pause", "resume", "sleep", "state"]


def _send(ctx: click.Context, verb: str, task_id: str, queue: bool, until: str | None = None) -> None:
    from metafora.statemachine import command_message, get_state, send_task_command

    message = command_message(verb, until)  # validated before the store is touched
    validate_task_id(task_id)
    with store_client(ctx) as client:
        # A state machine stores its task's state as soon as it runs it; without one, nothing
        # would ever read the command. (TaskNotFound for a missing task, and a finished task
        # is refused by send_task_command: exit 1 either way.)
        unfinished = client.get_task(task_id).state in (TaskState.PENDING, TaskState.CLAIMED)
        if unfinished and not queue and get_state(client, task_id) is None:
            raise InvalidTaskState(
                f"task {task_id!r} is not run by a state machine (it has no state), so nothing "
                f"would read {verb}; give --queue to leave it for a state machine that claims it later"
            )
        send_task_command(client, task_id, message)
    click.echo(f"sent {verb} to task {task_id}")


_TASK = click.argument("task_id", metavar="TASK")
_QUEUE = click.option(
    "--queue", is_flag=True,
    help="Also when no state machine has run TASK yet: the command waits for one to claim it.")


@click.command()
@_TASK
@_QUEUE
@click.pass_context
def pause(ctx: click.Context, task_id: str, queue: bool) -> None:
    """Pause stateful TASK: its handler waits, keeping its claim, until resumed."""
    _send(ctx, "pause", task_id, queue)


@click.command()
@_TASK
@_QUEUE
@click.pass_context
def resume(ctx: click.Context, task_id: str, queue: bool) -> None:
    """Resume a paused or sleeping stateful TASK (it becomes runnable)."""
    _send(ctx, "resume", task_id, queue)


@click.command()
@_TASK
@_QUEUE
@click.pass_context
def kill(ctx: click.Context, task_id: str, queue: bool) -> None:
    """Kill stateful TASK: it stops and never runs again (state 'killed')."""
    _send(ctx, "kill", task_id, queue)


@click.command()
@_TASK
@click.option("--until", "until", required=True, metavar="TIME",
              help="Wake-up time: ISO-8601 (naive = UTC), 'now' or '+DURATION' (+30s, +2h).")
@_QUEUE
@click.pass_context
def sleep(ctx: click.Context, task_id: str, until: str, queue: bool) -> None:
    """Put stateful TASK to sleep until TIME: it keeps its claim and wakes then (or on resume)."""
    _send(ctx, "sleep", task_id, queue, parse_when(until, "--until"))


@click.command()
@_TASK
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of a table.")
@click.pass_context
def state(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show the state machine's state of TASK: state, wake-up time, recent errors, cursor."""
    from metafora.statemachine import get_state

    validate_task_id(task_id)
    with store_client(ctx) as client:
        found = get_state(client, task_id)
    if as_json:
        print_json(None if found is None else found.to_dict())
        return
    if found is None:
        click.echo(f"task {task_id} has no state yet (no state machine has run it)")
        return
    table = field_table()
    table.add_row("task", cell(task_id, exact=True))
    table.add_row("state", Text(found.code.value))
    table.add_row("until", "-" if found.until is None else found.until.isoformat())
    table.add_row("cursor", cell(found.cursor if found.cursor is not None else "-"))
    for record in found.errors:
        table.add_row("error", cell(f"{record.time.isoformat()}  {record.text}", "red"))
    console().print(table)
