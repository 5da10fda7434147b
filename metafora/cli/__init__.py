"""The ``metafora`` command: submit and inspect tasks, steer nodes, run the demo.

``metafora [--url URL] [--log-level LEVEL] COMMAND ...``; the store URL comes from
``--url``, else ``$METAFORA_URL``, else the embedded SQLite default ``sqlite:///metafora.db``.

Exit codes (:class:`ExitCode`): 0 ok, 1 not found or refused, 2 usage (bad arguments, URL,
id, props or command), 3 store unreachable, 4 (``metafora worker``) the consumer died after it
started, 70 an unexpected internal error. Errors are one
``Error: <message>`` line on stderr, never a traceback, and never show the store password.
"""

from __future__ import annotations

import importlib
import logging
import platform
import sys
from typing import Any

import click

import metafora
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


# Each verb's module, loaded when the verb is asked for (``--help`` loads them all): a verb
# pays only for its own imports, not for the worker's, the gates', the dashboard's and the
# demo's (a tenth of a second of CPU on every start; the acceptance tests start the command
# hundreds of times, issue 51 wants a fast first second). Listed in the order of ``--help``.
COMMANDS: dict[str, str] = {
    **dict.fromkeys(("submit", "delete", "retry", "tasks", "show", "purge"), "tasks"),
    **dict.fromkeys(("nodes", "freeze", "unfreeze", "balance", "stop", "top"), "nodes"),
    **dict.fromkeys(("pause", "resume", "kill", "sleep", "state"), "task_states"),
    **dict.fromkeys(("items", "gate", "partition"), "items"),
    "schedule": "schedules",
    "limit": "limits",
    "retention": "retention",
    "streams": "streams",
    "stream": "streams",
    "joblogs": "joblogs",
    "demo": "demo_cmd",
    "web": "web",
    "worker": "worker",
    "migrate": "migrate",
    "gates": "gates_worker",
}


class MetaforaGroup(click.Group):
    """The root group: translates errors into ``Error: ...`` and named exit codes, and
    imports a verb's module only when the verb is asked for (:data:`COMMANDS`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every verb, in the order of :data:`COMMANDS` (then any added by hand)."""
        return [*COMMANDS, *(name for name in self.commands if name not in COMMANDS)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The verb ``cmd_name``, its module imported on first use."""
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module = importlib.import_module(f"metafora.cli.{COMMANDS[cmd_name]}")
            command = getattr(module, cmd_name)
            assert isinstance(command, click.Command) and command.name == cmd_name, cmd_name
            self.add_command(command)
        return self.commands.get(cmd_name)

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




def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``metafora`` console script and of ``python -m metafora``."""
    cli.main(args=argv, prog_name="metafora")
