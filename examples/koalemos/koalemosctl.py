"""koalemosctl: submit a command line as a koalemos task.

    python examples/koalemos/koalemosctl.py sleep 3
    python examples/koalemos/koalemosctl.py --id backup --wait -- tar czf /tmp/b.tgz /etc
"""

from __future__ import annotations

import threading
import time
import uuid

import click

from metafora import Task, TaskState, open_client
from metafora.connect import DEFAULT_URL, ENV_URL


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--url", envvar=ENV_URL, show_envvar=True, default=DEFAULT_URL, show_default=True,
              help="Store URL.")
@click.option("--id", "task_id", default=None, help="Task id (default: koalemos-<random>).")
@click.option("--wait", "wait_s", type=float, default=None, is_flag=False, flag_value=3600.0,
              help="Wait (up to N seconds) until the task is done or failed.")
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED)
def main(url: str, task_id: str | None, wait_s: float | None, args: tuple[str, ...]) -> None:
    """Submit ARGS (a command and its arguments) as a task; print its id."""
    task = Task(task_id or f"koalemos-{uuid.uuid4().hex[:8]}", {"args": list(args)})
    with open_client(url) as client:
        client.submit_task(task)
        click.echo(task.id)
        if wait_s is None:
            return
        deadline = time.monotonic() + wait_s
        pause = threading.Event()
        while time.monotonic() < deadline:
            info = client.get_task(task.id)
            if info.state in (TaskState.DONE, TaskState.FAILED, TaskState.EXPIRED):
                click.echo(info.state.value + (f": {info.error}" if info.error else ""))
                raise SystemExit(0 if info.state is TaskState.DONE else 1)
            pause.wait(0.05)
        raise click.ClickException(f"task {task.id} did not finish within {wait_s:g}s")


if __name__ == "__main__":
    main()
