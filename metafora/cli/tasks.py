"""Task commands: submit, delete, retry, tasks, show, purge."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import IO, Any

import click
from rich.table import Table
from rich.text import Text

from metafora.cli._common import (
    CliError,
    Duration,
    ExitCode,
    cell,
    console,
    field_table,
    format_time,
    print_json,
    scrub,
    store_client,
)
from metafora.cli.tool import items_url_option
from metafora.contracts.coordinator import MAX_ERROR_BYTES
from metafora.core.durations import parse_duration
from metafora.core.errors import InvalidProps, InvalidTaskId
from metafora.core.jsontext import load_value
from metafora.core.masking import MAX_MASKED, cut_text, one_line
from metafora.core.submitting import IF_EXISTS, IfExists
from metafora.core.task import (
    MAX_PRIORITY,
    MAX_PROPS_BYTES,
    MAX_PROPS_TEXT,
    MIN_PRIORITY,
    Task,
    TaskInfo,
    TaskState,
    label_text,
    parse_time,
    validate_labels,
    validate_schedule,
    validate_task_id,
)
from metafora.features.waiting import pending_reasons

__all__ = [
    "delete",
    "parse_prop",
    "parse_select",
    "parse_when",
    "purge",
    "read_task_lines",
    "retry",
    "show",
    "submit",
    "tasks",
]

_STATE_STYLE = {
    TaskState.PENDING: "yellow",
    TaskState.CLAIMED: "cyan",
    TaskState.DONE: "green",
    TaskState.FAILED: "bold red",
    TaskState.EXPIRED: "dim",
}


class _NotJson(InvalidProps):
    """A ``--prop`` value that is not JSON: taken as text."""


def parse_prop(pair: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value): the value is JSON if it parses as JSON, else the text.

    ``n=3`` gives 3, ``ok=true`` gives True, ``tags=["a"]`` a list, ``name=bob`` the string
    ``"bob"``; quote a JSON string to keep digits as text (``zip='"01234"'``).
    """
    key, sep, raw = pair.partition("=")
    if not sep or not key.strip():
        raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="'--prop'")
    try:
        # The API's bounded reader: JSON nested too deep is a usage error, not a crash.
        value: Any = load_value(raw, f"--prop {key}", _NotJson, constants=False, deep=InvalidProps)
    except _NotJson:
        value = raw
    return key, value


def parse_select(pairs: tuple[str, ...] | list[str], option: str = "--select") -> dict[str, str]:
    """``("gpu=1", "zone=eu")`` -> a validated selector (or labels); a clear error otherwise."""
    selector: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidProps(f"{option} {pair!r} is not KEY=VALUE (e.g. {option} gpu=1)")
        if key in selector and selector[key] != value:
            raise InvalidProps(f"{option} gives {key!r} twice ({selector[key]!r} and {value!r})")
        selector[key] = value
    return validate_labels(selector, option)


_TIME_FORMS = "an ISO-8601 time (naive = UTC, e.g. 2030-01-01T12:00:00Z), 'now' or '+DURATION' (+30s, +2h)"
"""Every form :func:`parse_when` accepts, for help texts and errors."""


def parse_when(text: str, option: str) -> str:
    """An ISO-8601 time, ``now``, or ``+DURATION`` from now, as an ISO-8601 UTC string.

    Raises InvalidProps naming every accepted form.
    """
    stripped = text.strip()
    if stripped.lower() == "now":
        return datetime.now(UTC).isoformat()
    if stripped.startswith("+"):
        try:
            delta = timedelta(seconds=parse_duration(stripped[1:]))
        except ValueError as exc:
            raise InvalidProps(f"{option}: {exc}; expected {_TIME_FORMS}") from None
        return (datetime.now(UTC) + delta).isoformat()
    try:
        return parse_time(stripped, option).isoformat()
    except InvalidProps:
        raise InvalidProps(f"{option}: {text!r} is not a time; expected {_TIME_FORMS}") from None


def _task_props(pairs: tuple[str, ...], props_json: str | None, launch_at: str | None,
                expires_at: str | None) -> dict[str, Any]:
    props: dict[str, Any] = {}
    if props_json is not None:
        _text_bound(props_json, "--props")
        loaded = load_value(props_json, "--props", InvalidProps, constants=False)
        if not isinstance(loaded, dict):
            raise InvalidProps(f"--props must be a JSON object, not a JSON {type(loaded).__name__}")
        props.update(loaded)
    for pair in pairs:
        key, value = parse_prop(pair)
        props[key] = value
    if launch_at is not None:
        props["launch_at"] = parse_when(launch_at, "--launch-at")
    if expires_at is not None:
        props["expires_at"] = parse_when(expires_at, "--expires-at")
    return props


def _text_bound(text: str, what: str) -> None:
    """Refuse JSON text longer than :data:`~metafora.core.task.MAX_PROPS_TEXT` before decoding it."""
    if len(text) > MAX_PROPS_TEXT:
        raise InvalidProps(f"{what}: {len(text)} characters of JSON; props may take at most "
                           f"{MAX_PROPS_BYTES} bytes as JSON (text: {MAX_PROPS_TEXT} characters)")


_LINE_KEYS = frozenset({"id", "props", "selector", "priority", "prefer", "spread", "group"})


def read_task_lines(stream: IO[str]) -> list[Task]:
    """Tasks from JSON lines ``{"id": ..., "props": {...}, "selector": {...}, "priority": N,
    "prefer": {...}, "spread": "...", "group": "..."}`` (only ``id`` is required; blank lines
    skipped).

    Every line is checked; an error names the line number and keeps its type (a bad id is
    InvalidTaskId, anything else InvalidProps).
    """
    tasks = []
    for number, line in enumerate(stream, 1):
        if line.strip():
            tasks.append(_task_line(line, number))
    return tasks


def _task_line(line: str, number: int) -> Task:
    _text_bound(line, f"--from-file line {number}")
    # The API's bounded reader; a line's props are one level below it (top=0).
    item = load_value(line, f"--from-file line {number}", InvalidProps, top=0, constants=False)
    if not isinstance(item, dict):
        raise InvalidProps(f"--from-file line {number}: must be a JSON object like "
                           '{"id": "t1", "props": {}}')
    unknown = sorted(set(item) - _LINE_KEYS)
    if unknown or "id" not in item:
        what = f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown else "no 'id'"
        raise InvalidProps(f"--from-file line {number}: {what} (a line holds 'id' and optionally "
                           "'props', 'selector', 'priority', 'prefer', 'spread', 'group')")
    try:
        task = Task(item["id"], item.get("props") or {}, selector=item.get("selector") or {},
                    priority=item.get("priority", 0), prefer=item.get("prefer") or {},
                    spread=item.get("spread"), group=item.get("group"))
        return validate_schedule(task, datetime.now(UTC))
    except (InvalidTaskId, InvalidProps) as exc:
        raise type(exc)(f"--from-file line {number}: {exc}") from None


@click.command()
@click.argument("task_id", metavar="ID", required=False)
@click.option("--prop", "pairs", multiple=True, metavar="KEY=VALUE",
              help="A prop; VALUE is parsed as JSON if it is JSON, else kept as text. Repeatable.")
@click.option("--props", "props_json", metavar="JSON", help="All props as one JSON object (--prop wins).")
@click.option("--launch-at", metavar="TIME",
              help="Not claimable before TIME: ISO-8601 (naive = UTC), 'now' or '+DURATION' (+30s, +2h).")
@click.option("--expires-at", metavar="TIME",
              help="Not claimed after TIME (the task moves to 'expired'); same forms as --launch-at. "
                   "Must be in the future and after --launch-at.")
@click.option("--select", "select", multiple=True, metavar="KEY=VALUE",
              help="Placement: only a node whose labels include KEY=VALUE may claim the task. "
                   "Repeatable (every pair must match).")
@click.option("--priority", type=int, default=None, metavar="N",
              help=f"Higher is claimed first among claimable tasks (default 0; {MIN_PRIORITY:,} "
                   f"to {MAX_PRIORITY:,}). Never stops a running task.")
@click.option("--prefer", "prefer", multiple=True, metavar="KEY=VALUE",
              help="Soft placement: nodes without these labels hold back briefly while a node "
                   "with them is live. Repeatable.")
@click.option("--spread", metavar="GROUP",
              help="Anti-affinity: tasks of one GROUP go to distinct nodes where possible.")
@click.option("--group", metavar="GROUP",
              help="Limit group: while GROUP is at its limit (metafora limit set), no node "
                   "claims the task.")
@click.option("--from-file", "from_file", type=click.File("r", encoding="utf-8"), metavar="FILE|-",
              help='Submit many tasks instead: JSON lines {"id": ..., "props": {...}, '
                   '"selector": {...}, "priority": N} ("-": stdin), in batches, all-or-nothing '
                   "per batch.")
@click.option("--if-exists", "if_exists", type=click.Choice(IF_EXISTS), default="error",
              show_default=True,
              help="An existing id: error (exit 1), ignore (leave it), or replace (a pending "
                   "task takes the new props, priority, times, selector and group; a claimed "
                   "or finished one is left).")
@click.pass_context
def submit(ctx: click.Context, task_id: str | None, pairs: tuple[str, ...], props_json: str | None,
           launch_at: str | None, expires_at: str | None, select: tuple[str, ...],
           priority: int | None, prefer: tuple[str, ...], spread: str | None,
           group: str | None, from_file: IO[str] | None, if_exists: IfExists = "error") -> None:
    """Submit a new task ID (pending until a consumer claims it), or many with --from-file."""
    if from_file is not None:
        if (task_id is not None or pairs or props_json or launch_at or expires_at or select
                or priority is not None or prefer or spread is not None or group is not None):
            raise click.UsageError("--from-file takes no ID, --prop, --props, --launch-at, "
                                   "--expires-at, --select, --priority, --prefer, --spread or "
                                   "--group (put them in the file's lines)")
        tasks = read_task_lines(from_file)
        with store_client(ctx) as client:
            added = client.submit_tasks(tasks, if_exists=if_exists)
        if if_exists == "error":
            click.echo(f"submitted {len(tasks)} task(s)")
        else:
            click.echo(f"submitted {added} task(s), left {len(tasks) - added} existing")
        return
    if task_id is None:
        raise click.UsageError("give a task ID, or --from-file FILE|-")
    if priority is not None and not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidProps(f"--priority {priority} is out of range [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    task = Task(task_id, _task_props(pairs, props_json, launch_at, expires_at),
                selector=parse_select(select), priority=priority or 0,
                prefer=parse_select(prefer, "--prefer"), spread=spread, group=group)
    validate_schedule(task, datetime.now(UTC))  # refused before the store is touched
    with store_client(ctx) as client:
        added = client.submit_task(task, if_exists=if_exists)
    if not added:
        click.echo(f"task {task.id} exists: left as it was")
    elif if_exists == "replace":
        click.echo(f"submitted task {task.id} (added, or replaced while pending)")
    else:
        click.echo(f"submitted task {task.id}")


@click.command()
@click.argument("task_id", metavar="ID")
@click.pass_context
def delete(ctx: click.Context, task_id: str) -> None:
    """Delete task ID in any state (a running task is stopped on its node)."""
    validate_task_id(task_id)
    with store_client(ctx) as client:
        client.delete_task(task_id)
    click.echo(f"deleted task {task_id}")


@click.command()
@click.argument("task_id", metavar="ID")
@click.option("--reset-state", is_flag=True,
              help="Also re-run a stateful task that ended failed or killed: its state "
                   "becomes runnable again, its errors cleared.")
@click.option("--keep-cursor", is_flag=True,
              help="With --reset-state: keep the cursor of its last checkpoint (resume there).")
@click.pass_context
def retry(ctx: click.Context, task_id: str, reset_state: bool, keep_cursor: bool) -> None:
    """Make a failed or expired task ID pending again (its error is cleared).

    A stateful task whose stored state is terminal would end at once: it is refused with
    the reason unless --reset-state is given.
    """
    from metafora.statemachine.retry import check_retry_options, retry_advice

    validate_task_id(task_id)
    check_retry_options(reset_state, keep_cursor)
    with store_client(ctx) as client:
        if not reset_state and (advice := retry_advice(client, task_id)) is not None:
            raise CliError.make(advice, ExitCode.REFUSED)
        client.retry_task(task_id, reset_state=reset_state, keep_cursor=keep_cursor)
    done = "" if not reset_state else " with a runnable state" + (
        " (cursor kept)" if keep_cursor else "")
    click.echo(f"task {task_id} is pending again{done}")


def _state_cell(state: TaskState) -> Text:
    return Text(state.value, style=_STATE_STYLE.get(state, ""))


def _error_cell(error: str | None) -> Text:
    if not error:
        return Text("")
    return cell(one_line(error), "red", overflow="ellipsis", no_wrap=True)


def _json_info(info: TaskInfo) -> dict[str, Any]:
    """``info.to_dict()`` with its error masked (an error stored before masking existed)."""
    shown = info.to_dict()
    if shown.get("error"):
        shown["error"] = scrub(cut_text(shown["error"], MAX_ERROR_BYTES))
    return shown


def _summary(infos: list[TaskInfo]) -> str:
    counts = Counter(info.state for info in infos)
    parts = [f"{counts[state]} {state.value}" for state in TaskState if counts[state]]
    noun = "task" if len(infos) == 1 else "tasks"
    return f"{len(infos)} {noun}" + (f": {', '.join(parts)}" if parts else "")


@click.command()
@click.option("--state", type=click.Choice([s.value for s in TaskState], case_sensitive=False),
              help="Only tasks in this state.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def tasks(ctx: click.Context, state: str | None, as_json: bool) -> None:
    """List tasks (ordered by id): state, owner node, fencing token, claim time, error.

    A pending task that no live node can run (its selector matches no node's labels) says
    why; tasks with a priority or a selector show them.
    """
    wanted = None if state is None else TaskState(state.lower())
    with store_client(ctx) as client:
        infos = client.tasks(wanted)
        reasons = pending_reasons(client, infos)
    if as_json:
        print_json([{**_json_info(info), "reason": reasons.get(info.id)} for info in infos])
        return
    out = console()
    if not infos:
        out.print(f"no {wanted.value} tasks" if wanted else "no tasks")
        return
    table = Table(caption=_summary(infos), caption_justify="left")
    table.add_column("id", overflow="fold")
    table.add_column("state")
    table.add_column("owner", overflow="fold")
    table.add_column("token", justify="right")
    table.add_column("claimed_at")
    placed = any(info.selector or info.priority for info in infos)
    if placed:
        table.add_column("priority", justify="right")
        table.add_column("selector", overflow="fold")
    table.add_column("error", max_width=60)
    for info in infos:
        cells: list[Text | str] = [
            cell(info.id, exact=True), _state_cell(info.state), cell(info.owner or "-", exact=True),
            str(info.token), format_time(info.claimed_at)]
        if placed:
            cells += [str(info.priority), cell(label_text(info.selector) or "-")]
        reason = reasons.get(info.id)
        cells.append(cell(reason, "yellow") if reason else _error_cell(info.error))
        table.add_row(*cells)
    out.print(table)


@click.command()
@click.argument("task_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of a table.")
@click.pass_context
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show everything the store knows about task ID."""
    validate_task_id(task_id)
    with store_client(ctx) as client:
        info = client.get_task(task_id)
        reason = pending_reasons(client, [info]).get(info.id)
    if as_json:
        print_json({**_json_info(info), "reason": reason})
        return
    table = field_table()
    rows: list[tuple[str, Text | str]] = [
        ("id", cell(info.id, exact=True)),
        ("state", _state_cell(info.state)),
        ("owner", cell(info.owner or "-", exact=True)),
        ("token", str(info.token)),
        ("attempts", str(info.attempts)),
        ("priority", str(info.priority)),
        ("selector", cell(label_text(info.selector) or "-")),
        ("prefer", cell(label_text(info.prefer) or "-")),
        ("spread", cell(info.spread or "-")),
        ("group", cell(info.group or "-")),
        ("created_at", format_time(info.created_at)),
        ("claimed_at", format_time(info.claimed_at)),
        ("finished_at", format_time(info.finished_at)),
        ("error", cell(cut_text(info.error or "-", MAX_ERROR_BYTES), "red" if info.error else "")),
        *([("waiting", cell(reason, "yellow"))] if reason else []),
        ("props", cell(cut_text(json.dumps(dict(info.props), sort_keys=True, ensure_ascii=False),
                                MAX_MASKED))),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console().print(table)


@click.command()
@click.option("--older-than", type=Duration(), default="0", show_default=True, metavar="SECONDS",
              help="Only tasks finished longer ago than this (seconds, or with a unit: 90m, 7d).")
@items_url_option
@click.pass_context
def purge(ctx: click.Context, older_than: timedelta, items_url: str | None) -> None:
    """Delete done, failed and expired tasks (their history) finished before the cut-off,
    and the gate items of those that were partitions (with --items-url when the items live
    in a database of their own, as with an etcd coordinator)."""
    with store_client(ctx) as client, ExitStack() as stack:
        if items_url:
            from metafora.cli.items import item_store  # the gates load only when items are asked for

            items = stack.enter_context(item_store(ctx, items_url))
            client.prune_also(items.delete_partitions)
        count = client.purge(older_than)
    click.echo(f"purged {count} task{'' if count == 1 else 's'}")
