"""The ``metafora`` command: submit and inspect tasks, steer nodes, run the demo.

``metafora [--url URL] [--log-level LEVEL] COMMAND ...``; the store URL comes from
``--url``, else ``$METAFORA_URL``, else the embedded SQLite default ``sqlite:///metafora.db``.

Exit codes (:class:`ExitCode`): 0 ok, 1 not found or refused, 2 usage (bad arguments, URL,
id, props or command), 3 store unreachable, 4 (``metafora worker``) the consumer died after it
started, 70 an unexpected internal error. Errors are one
``Error: <message>`` line on stderr, never a traceback, and never show the store password.
"""

from __future__ import annotations

import logging
import platform
import sys
from typing import Any

import click

import metafora
from metafora.cli import (
    demo_cmd,
    gates_worker,
    items,
    joblogs,
    limits,
    migrate,
    nodes,
    retention,
    schedules,
    streams,
    task_states,
    tasks,
    web,
    worker,
)
from metafora.cli._common import (
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ExitCode,
    Settings,
)
from metafora.cli.tool import invoke_translated, url_option
from metafora.core.logs import LEVELS, configure

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "ExitCode",
    "cli",
    "main",
]

ENV_LOG_LEVEL = "METAFORA_LOG_LEVEL"
ENV_LOG_JSON = "METAFORA_LOG_JSON"
#: The name to install from the package index (the import package and the command are ``metafora``).
DISTRIBUTION = "metafora-cluster"


class MetaforaGroup(click.Group):
    """The root group: translates errors into ``Error: ...`` and named exit codes."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the sub-command; turn every metafora error into a CliError (no traceback)."""
        return invoke_translated(lambda: super(MetaforaGroup, self).invoke(ctx), ctx)


def _configure_logging(level: str, json_lines: bool) -> None:
    """Log to stderr at ``level`` unless the host program (or pytest) configured logging."""
    if logging.getLogger().handlers:
        return
    configure(level, json_lines=json_lines, stream=sys.stderr)


@click.group(cls=MetaforaGroup, context_settings={"help_option_names": ["-h", "--help"]})
@url_option
@click.option("--log-level", type=click.Choice(LEVELS, case_sensitive=False), default="warning",
              show_default=True, envvar=ENV_LOG_LEVEL, show_envvar=True, help="Log verbosity (stderr).")
@click.option("--log-json", is_flag=True, envvar=ENV_LOG_JSON, show_envvar=True,
              help="Log one JSON object per line (with node, task, token, action fields).")
@click.version_option(metafora.__version__, "--version", prog_name="metafora",
                      message=f"%(prog)s %(version)s (distribution {DISTRIBUTION}, "
                              f"Python {platform.python_version()})")
@click.pass_context
def cli(ctx: click.Context, url: str, log_level: str, log_json: bool) -> None:
    """Run long-running tasks across a masterless cluster: operate it from here.

    \b
    Exit codes: 0 ok, 1 not found or refused, 2 usage error,
                3 store unreachable, 4 a worker's consumer died,
                70 internal error.
    """
    source = ctx.get_parameter_source("url")
    from_command_line = source is click.core.ParameterSource.COMMANDLINE
    ctx.obj = Settings(url, from_command_line, log_level.lower())
    _configure_logging(log_level, log_json)


for _command in (
    tasks.submit, tasks.delete, tasks.retry, tasks.tasks, tasks.show, tasks.purge,
    nodes.nodes, nodes.freeze, nodes.unfreeze, nodes.balance, nodes.stop, nodes.top,
    task_states.pause, task_states.resume, task_states.kill, task_states.sleep, task_states.state,
    items.items, items.gate, items.partition,
    schedules.schedule,
    limits.limit,
    retention.retention,
    streams.streams, streams.stream, joblogs.joblogs,
    demo_cmd.demo,
    web.web,
    worker.worker,
    migrate.migrate,
    gates_worker.gates,
):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``metafora`` console script and of ``python -m metafora``."""
    cli.main(args=argv, prog_name="metafora")
