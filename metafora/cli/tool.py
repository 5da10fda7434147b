"""What a command-line tool built on metafora needs to behave like the ``metafora`` command.

:class:`MetaforaCommand` (a ``click.Command`` class) turns every error into one
``Error: <message>`` line on stderr and the ``metafora`` command's exit codes (0 ok, 1 not
found or refused, 2 usage, 3 store unreachable, 70 internal), never a traceback and never the
store password; :func:`url_option` is the ``--url`` option read the same way (``--url``, else
``$METAFORA_URL``, else ``sqlite:///metafora.db``; an empty ``--url`` is refused). The
koalemos examples (``examples/koalemos``) are written with them::

    @click.command(cls=MetaforaCommand)
    @url_option
    def main(url: str) -> None:
        ...
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click

from metafora.cli._common import CliError, ExitCode, Settings, exit_code_for, scrub
from metafora.core.errors import MetaforaError
from metafora.surfaces.connect import DEFAULT_URL, ENV_URL

__all__ = ["ENV_ITEMS_URL", "MetaforaCommand", "check_url", "cli_error", "invoke_translated",
           "items_url_option", "url_option"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

_URL_HELP = ("The store: sqlite:///PATH.db, postgresql://user:pass@host/db, etcd://host:2379/NS, "
            "memory://NAME (in-process only).")


def _describe(exc: BaseException) -> str:
    """An error's message, or its class docstring when it was raised without one."""
    text = str(exc).strip()
    if text:
        return text
    doc = (type(exc).__doc__ or "").strip()
    return doc.splitlines()[0] if doc else type(exc).__name__


def _url(ctx: click.Context) -> str | None:
    """The store URL the command was given (to scrub its password from messages)."""
    obj = ctx.find_object(Settings)
    if obj is not None:
        return obj.url
    current: click.Context | None = ctx
    while current is not None:  # a stand-alone command keeps it in its own parameters
        value = current.params.get("url")
        if isinstance(value, str):
            return value
        current = current.parent
    return None


def cli_error(ctx: click.Context, exc: Exception) -> CliError:
    """The one-line error and exit code the ``metafora`` command shows for ``exc``."""
    url = _url(ctx)
    if isinstance(exc, MetaforaError):
        return CliError.make(scrub(_describe(exc), url), exit_code_for(exc))
    log.debug("unexpected error", exc_info=exc)
    return CliError.make(
        scrub(f"unexpected {type(exc).__name__}: {_describe(exc)} "
              "(rerun with --log-level debug to see the traceback)", url),
        ExitCode.INTERNAL,
    )


def invoke_translated(invoke: Callable[[], Any], ctx: click.Context) -> Any:
    """Call ``invoke()``; raise what it raises as the ``metafora`` command's errors."""
    try:
        return invoke()
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # `... | head`: click handles it quietly
            raise
        raise cli_error(ctx, exc) from exc
    except Exception as exc:
        raise cli_error(ctx, exc) from exc


class MetaforaCommand(click.Command):
    """A click command whose errors look like the ``metafora`` command's (no traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; turn every error into ``Error: ...`` and a named exit code."""
        return invoke_translated(lambda: super(MetaforaCommand, self).invoke(ctx), ctx)


def check_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: refuse an empty or blank URL option (it never means the default)."""
    if value is not None and not value.strip():
        name = param.opts[0] if param.opts else "--url"
        raise click.BadParameter(f"must not be empty: give a store URL, or leave {name} out for its default",
                                 ctx, param, param_hint=f"'{name}'")
    return value


def url_option(fn: _F) -> _F:
    """``--url URL``: else ``$METAFORA_URL``, else ``sqlite:///metafora.db``; never empty."""
    option = click.option("--url", metavar="URL", default=DEFAULT_URL, show_default=True, envvar=ENV_URL,
                          show_envvar=True, callback=check_url, help=_URL_HELP)
    return option(fn)


ENV_ITEMS_URL = "METAFORA_ITEMS_URL"

items_url_option = click.option(  # the commands that reach the items (also `purge`)
    "--items-url", metavar="URL", envvar=ENV_ITEMS_URL, show_envvar=True, callback=check_url,
    help="The SQL store holding the items, when it is not --url (e.g. with an etcd coordinator).",
)
"""``--items-url URL``: here, not in :mod:`metafora.cli.items`, so that ``purge`` carries it
without importing the gates (they load with the first command that reaches an item)."""
