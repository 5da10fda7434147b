"""koalemosctl: submit a command line as a koalemos task.

    .venv/bin/python examples/koalemos/koalemosctl.py sleep 3
    .venv/bin/python examples/koalemos/koalemosctl.py --id backup --wait -- tar czf /tmp/b.tgz /etc

Errors and exit codes are the ``metafora`` command's: 0 ok (with ``--wait``: the task is
done), 1 refused (the id is taken, the task failed or did not finish in time), 2 usage (bad
id, URL or option), 3 store unreachable; one ``Error: ...`` line, never a traceback.
"""

from __future__ import annotations

import threading
import time
import uuid

import click

from metafora import Task, TaskState, open_client
from metafora.cli.tool import MetaforaCommand, url_option
from metafora.core.task import validate_task_id


@click.command(cls=MetaforaCommand, context_settings={"ignore_unknown_options": True})
@url_option
@click.option("--id", "task_id", default=None, help="Task id (default: koalemos-<random>).")
@click.option("--wait", "wait_s", type=float, default=None, is_flag=False, flag_value=3600.0,
              help="Wait (up to N seconds) until the task is done or failed.")
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED)
def main(url: str, task_id: str | None, wait_s: float | None, args: tuple[str, ...]) -> None:
    """Submit ARGS (a command and its arguments) as a task; print its id."""
    # An explicit id is checked as given: `--id ""` is an error, never a random id.
    chosen = validate_task_id(task_id) if task_id is not None else f"koalemos-{uuid.uuid4().hex[:8]}"
    task = Task(chosen, {"args": list(args)})
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
