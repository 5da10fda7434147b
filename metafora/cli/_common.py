"""Pieces every CLI command shares: exit codes, error translation, the store handle, output.

Every error metafora raises on purpose (:class:`~metafora.core.errors.MetaforaError`) is turned
into one ``Error: <message>`` line on stderr and a named exit code; nothing a user can do
wrong prints a traceback. Messages never show the store password.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import IO, Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from metafora.contracts.client import Client
from metafora.core.durations import parse_duration
from metafora.core.errors import (
    ConfigError,
    CoordinatorUnavailable,
    InvalidCommand,
    InvalidProps,
    InvalidTaskId,
    MetaforaError,
)
from metafora.core.masking import escape_controls, escape_json, for_terminal, scrub
from metafora.surfaces.connect import open_client

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "CliError",
    "Duration",
    "ExitCode",
    "Settings",
    "cell",
    "console",
    "exit_code_for",
    "field_table",
    "format_time",
    "print_json",
    "scrub",
    "settings",
    "store_client",
]

log = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    """The exit status of the ``metafora`` command."""

    OK = 0
    """The command did what it was asked."""
    REFUSED = 1
    """Not found or refused: no such task or node, the id is taken, the task is in the wrong state."""
    USAGE = 2
    """Bad usage: unknown option, bad URL or store option, invalid task id, props or command."""
    UNAVAILABLE = 3
    """The store cannot be reached (retrying later may work)."""
    CONSUMER_DIED = 4
    """``metafora worker``: the consumer stopped on its own after it started (one of its loops
    crashed: a handler that broke the event loop, a balancer, the store gone for good)."""
    INTERNAL = 70
    """An unexpected error: a bug in metafora or a store driver (sysexits' EX_SOFTWARE)."""


EXIT_OK = ExitCode.OK
EXIT_REFUSED = ExitCode.REFUSED
EXIT_USAGE = ExitCode.USAGE
EXIT_UNAVAILABLE = ExitCode.UNAVAILABLE
EXIT_INTERNAL = ExitCode.INTERNAL

_USAGE_ERRORS: tuple[type[MetaforaError], ...] = (ConfigError, InvalidTaskId, InvalidProps, InvalidCommand)


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code for an error raised while running a command.

    Metafora's errors that are also ``ValueError`` (a bad URL, option, id, props, command or
    state-machine message) are usage errors.
    """
    if isinstance(exc, CoordinatorUnavailable):
        return ExitCode.UNAVAILABLE
    if isinstance(exc, _USAGE_ERRORS) or (isinstance(exc, MetaforaError) and isinstance(exc, ValueError)):
        return ExitCode.USAGE
    if isinstance(exc, MetaforaError):
        # TaskNotFound, TaskExists, NodeNotFound, NodeExists, InvalidTaskState, ClaimLost,
        # StoreError, CoordinatorClosed: the store said no.
        return ExitCode.REFUSED
    return ExitCode.INTERNAL


class CliError(click.ClickException):
    """An error shown as ``Error: <message>`` on stderr, exiting with :attr:`exit_code`.

    Build one with :meth:`make`, which picks the subclass for the exit code.
    """

    exit_code = int(ExitCode.REFUSED)

    @staticmethod
    def make(message: str, code: ExitCode) -> CliError:
        """A CliError exiting with ``code``."""
        return _ERROR_CLASSES[code](message)


class _UsageFailure(CliError):
    exit_code = int(ExitCode.USAGE)


class _Unavailable(CliError):
    exit_code = int(ExitCode.UNAVAILABLE)


class _Died(CliError):
    exit_code = int(ExitCode.CONSUMER_DIED)


class _Internal(CliError):
    exit_code = int(ExitCode.INTERNAL)


_ERROR_CLASSES: dict[ExitCode, type[CliError]] = {
    ExitCode.OK: CliError,  # never raised; keeps the table total
    ExitCode.REFUSED: CliError,
    ExitCode.USAGE: _UsageFailure,
    ExitCode.UNAVAILABLE: _Unavailable,
    ExitCode.CONSUMER_DIED: _Died,
    ExitCode.INTERNAL: _Internal,
}


@dataclass
class Settings:
    """What the root command parsed, handed to sub-commands through the click context."""

    url: str
    url_from_command_line: bool
    log_level: str


def settings(ctx: click.Context) -> Settings:
    """The root command's settings (``metafora --url ... COMMAND``)."""
    obj = ctx.find_object(Settings)
    if obj is None:  # a sub-command invoked on its own (tests, embedding)
        from metafora.surfaces.connect import default_url

        obj = Settings(default_url(), False, "warning")
        ctx.obj = obj
    return obj


@contextmanager
def store_client(ctx: click.Context) -> Iterator[Client]:
    """An operator client on the store the user named, closed afterwards."""
    url = settings(ctx).url
    client = open_client(url)
    try:
        yield client
    finally:
        try:
            client.close()
        except Exception as exc:  # closing must not hide the command's own outcome
            log.debug("closing the client failed: %s", scrub(str(exc), url))


def console(err: bool = False) -> Console:
    """A rich console on the current stdout (or stderr): wide and plain when not a terminal."""
    probe = Console(stderr=err)
    if probe.is_terminal:
        return Console(stderr=err, highlight=False)
    return Console(stderr=err, highlight=False, width=200, no_color=True, soft_wrap=False)


def cell(text: str, style: str = "", *, exact: bool = False, **options: Any) -> Text:
    """Untrusted text (an error, props, labels, an id) as a table cell.

    Control and bidi characters are shown escaped (``\\x1b``, ``\\u202e``), so stored text
    cannot drive the terminal or read as something else; the text is masked too unless it
    is ``exact`` -- an id, shown as it is so that it can be typed back.
    """
    return Text(escape_controls(text) if exact else for_terminal(text), style=style, **options)


def field_table() -> Table:
    """An empty two-column table of one object's fields (``show``): bold names, values
    folded, no header and no box; add a row per field."""
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    return table


def print_json(data: Any, out: IO[str] | None = None) -> None:
    """Print ``data`` as indented JSON on stdout (one document, machine-readable): readable
    letters as they are, control, C1, bidi and other invisible characters as JSON escapes
    (:func:`~metafora.core.masking.escape_json`), so stored text cannot drive the terminal."""
    click.echo(escape_json(json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False)), file=out)


def format_time(dt: datetime | None) -> str:
    """A compact UTC time for tables (``2030-01-01 12:00:03Z``), or ``-``."""
    if dt is None:
        return "-"
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


class Duration(click.ParamType):  # type: ignore[type-arg]
    """A click parameter: a non-negative duration, plain seconds or with a unit."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        """Parse the option's text into a timedelta, failing as a usage error."""
        if isinstance(value, timedelta):
            return value
        try:
            return timedelta(seconds=parse_duration(str(value)))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
