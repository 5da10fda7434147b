"""``metafora worker MODULE:NAME``: run a consumer on the store until SIGTERM or Ctrl-C.

The operator's way to start a node, as ``celery worker`` or ``procrastinate worker`` are: the
handler comes from ``MODULE:NAME`` (recognised by the rules of :mod:`metafora.cli._load`), the
Consumer's options from the command line or ``METAFORA_WORKER_*`` variables. The first SIGTERM
or SIGINT shuts the consumer down gracefully (running handlers are stopped and their tasks
released at once, the node deregistered) and exits 0; a second one exits at once. See
``docs/deploy.md`` for systemd and Kubernetes recipes built on this behaviour.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click

from metafora import Consumer
from metafora.balancers import CpuReporter, DumbBalancer, FairBalancer, ResourceBalancer, SleepBalancer
from metafora.cli._common import CliError, Duration, ExitCode, scrub, settings
from metafora.cli._load import Kind, Target, import_object, load_balancer, load_target
from metafora.cli.tasks import parse_select
from metafora.consumer.options import ConsumerOptions, option_docs, option_fields
from metafora.contracts.balancer import Balancer
from metafora.core.masking import mask_url
from metafora.surfaces.connect import open_coordinator

__all__ = ["BALANCERS", "ENV_PREFIX", "consumer_options", "flag_of", "worker"]

ENV_PREFIX = "METAFORA_WORKER_"


def _resource() -> Balancer:
    return ResourceBalancer(CpuReporter(), claim_limit=80, release_limit=95)


#: ``--balancer`` names: what each builds (anything else must be ``MODULE:NAME``).
BALANCERS: Mapping[str, Callable[[], Balancer]] = {
    "fair": FairBalancer,
    "resource": _resource,
    "sleep": SleepBalancer,
    "dumb": DumbBalancer,
}

_HELP = """Run a node: claim tasks from the store and run them with MODULE:NAME.

\b
MODULE:NAME (or $METAFORA_WORKER_TARGET) is imported (from PYTHONPATH
and the installed packages, then the current directory, last and for
that import only) and recognised as one of:
  handler       a Handler or AsyncHandler subclass, built as NAME(task)
  step          a stateful step (task, cmds) -> Message, sync or async,
                run by the state machine: its second parameter is
                annotated Commands/AsyncCommands, or is named cmds
  function      a plain function (task, stop) -> bool, sync or async,
                wrapped with simple_handler: its second parameter is
                annotated threading.Event/asyncio.Event, or named stop
  handler-func  a callable taking only the task, returning a Handler
                (a metafora.messages.Router is one: --list-types)
Anything else is refused naming what was found; --kind says which kind
it is instead of the rules.

\b
SIGTERM or SIGINT stops claiming, stops the handlers, releases their
tasks and exits 0 (with --node-id or METAFORA_NODE_ID and --sticky-for,
held for that id for the window: a restart under it takes them back, see
docs/deploys.md; metafora nodes drain ID hands them off at once); a
second signal exits at once (130 after SIGINT, 143 after SIGTERM: the
claims then wait for their lease).

\b
Exit codes: 0 stopped by a signal, 1 refused (the node id is live
elsewhere), 2 usage (bad MODULE:NAME, import error, bad option or URL),
3 store unreachable at start (after --start-timeout), 4 the consumer
died after it started (a loop crashed: handler, balancer or store),
70 internal error, 130/143 a second signal.
"""


def _option(*decls: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option read from ``$METAFORA_WORKER_<NAME>`` too, shown in --help."""
    env = ENV_PREFIX + decls[0].lstrip("-").replace("-", "_").upper()
    return click.option(*decls, envvar=env, show_envvar=True, **kwargs)


def make_balancer(name: str) -> Balancer:
    """The balancer ``--balancer`` names: a bundled one, or ``MODULE:NAME``."""
    make = BALANCERS.get(name.strip().lower())
    if make is not None:
        return make()
    if ":" not in name:
        raise CliError.make(f"--balancer must be one of {', '.join(BALANCERS)} or MODULE:NAME, got {name!r}",
                            ExitCode.USAGE)
    return load_balancer(name)


class _Signals:
    """First SIGTERM/SIGINT: graceful shutdown. Second: exit at once with 128 + signal."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer
        self.received: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: the handler may interrupt a write to the same stream.
        if self.received is not None:
            os.write(2, f"metafora worker: second {name}, exiting at once (its claims wait for "
                        "their lease)\n".encode())
            os._exit(128 + signum)
        self.received = signum
        os.write(2, f"metafora worker: {name}, shutting down gracefully (again to exit at once)\n".encode())
        self._consumer.shutdown()

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGTERM and SIGINT while the block runs (only the main thread may)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _list_types(spec: str) -> None:
    """``--list-types``: the message types of the Router ``spec`` names, as JSON Schemas."""
    from metafora.messages import Router  # only this option needs it

    router = import_object(spec)
    if not isinstance(router, Router):
        raise CliError.make(f"--list-types needs a metafora.messages.Router; {spec!r} is a "
                            f"{type(router).__name__}", ExitCode.USAGE)
    click.echo(json.dumps(router.schemas(), indent=2, sort_keys=True))


def _run(consumer: Consumer, target: Target, url: str) -> None:
    """Run until a signal; a consumer that dies after starting exits 4."""
    flavour = f"{target.kind.value}{', async' if target.is_async else ''}"
    store = mask_url(url, brief=True)
    click.echo(f"metafora worker {consumer.node_id} on {store}: running {target.spec} ({flavour}); "
               "SIGTERM or Ctrl-C stops it", err=True)
    signals = _Signals(consumer)
    with signals.installed():
        try:
            consumer.run()
        except Exception as exc:
            if consumer.info().get("started") is None:
                raise  # never registered: unreachable (3), refused (1) or a usage error (2)
            message = f"the consumer {consumer.node_id} stopped: {type(exc).__name__}: {exc}"
            raise CliError.make(scrub(message, url), ExitCode.CONSUMER_DIED) from exc
    click.echo(f"metafora worker {consumer.node_id} stopped", err=True)


# How the worker spells an option where its flag is not the option's name.
_FLAG_NAMES = {"http_addr": "--http"}
# The operator's wording of a flag's help where it says more than the option's first sentence.
_FLAG_HELP = {
    "labels": "A placement label of this node (repeat it; the variable holds them space-separated).",
    "weight": "This node's share of the work relative to the others (a positive number).",
    "max_tasks": "At most this many tasks at once.",
    "sticky_for": "With a node id: how long a graceful stop holds this node's tasks for its id, so a "
                  "restart under it takes them back (e.g. 10s; 0, the default, releases at once; at "
                  "most 1h).",
    "http_addr": "Serve /info, /metrics, /healthz and /readyz on this address.",
    "shutdown_timeout": "On SIGTERM, how long handlers may take to return before they are abandoned.",
    "handoff_timeout": "How long a handler asked to give its task up (balance, metafora stop) may take.",
    "start_timeout": "How long to wait for a store that cannot be reached at start (then exit 3).",
    "prune_every": "How often this node tries to take the namespace's prune turn (metafora retention).",
}


def flag_of(name: str) -> str:
    """The worker's flag for the Consumer option ``name`` (``--balance-every``)."""
    return _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence as plain text (``x`` as x, :func:`a.b` as b)."""
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"\1", " ".join(doc.split())).replace("``", "")
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _option_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """One flag per Consumer option (:class:`ConsumerOptions`'s fields, in their order), typed by
    the option's kind, shown with its default; unset flags leave the option at its default."""
    docs = option_docs()
    for field in reversed(option_fields()):
        kind, default = field.metadata["kind"], field.default
        # The dataclass's default, shown (a flag not given passes it back unchanged).
        kwargs: dict[str, Any] = {"default": default, "show_default": default is not None,
                                  "help": _FLAG_HELP.get(field.name) or _first_sentence(docs[field.name])}
        if kind == "labels":
            kwargs.update(multiple=True, metavar="KEY=VALUE", default=(), show_default=False)
        elif kind == "seconds":
            kwargs.update(type=Duration(), default=f"{default:g}s")
        elif kind == "count":
            kwargs.update(type=int)
        elif kind == "number":
            kwargs.update(type=float)
        else:
            kwargs.update(metavar="HOST:PORT")
        command = _option(flag_of(field.name), field.name, **kwargs)(command)
    return command


def consumer_options(values: Mapping[str, Any]) -> ConsumerOptions:
    """The options the flags gave (``None``: not given), each checked once and a refusal
    naming its flag (a ConfigError: a usage error, exit 2)."""
    given = {name: value for name, value in values.items() if value not in (None, ())}
    if "labels" in given:
        given["labels"] = parse_select(given["labels"], flag_of("labels"))
    return ConsumerOptions.parse(given, flag_of)


@click.command(help=_HELP)
@click.argument("target_spec", metavar="MODULE:NAME", envvar=ENV_PREFIX + "TARGET")
@_option("--kind", type=click.Choice([k.value for k in Kind]), default=None,
         help="What MODULE:NAME is, instead of recognising it.")
@_option("--balancer", default="fair", show_default=True, metavar="fair|resource|sleep|dumb|MODULE:NAME",
         help="How the node claims and gives back work: resource is CPU-based (claims below 80%, "
              "releases above 95%); MODULE:NAME is a Balancer, or a class or factory called with "
              "no arguments.")
@_option("--node-id", default=None, metavar="ID",
         help="This node's id, stable across restarts (METAFORA_NODE_ID is read too; default: "
              "hostname-<random>).")
@_option_flags
@click.option("--list-types", is_flag=True, default=False,
              help="MODULE:NAME is a metafora.messages.Router: print the JSON Schema of each "
                   "message type it handles (a JSON object by type name) and exit; the store is "
                   "not touched.")
@click.pass_context
def worker(ctx: click.Context, /, target_spec: str, kind: str | None, balancer: str, node_id: str | None,
           list_types: bool, **values: Any) -> None:
    """Run a node with MODULE:NAME until SIGTERM or SIGINT (the help text is ``_HELP``)."""
    if list_types:
        _list_types(target_spec)
        return
    # Everything that can be refused is checked before the store is touched.
    options = consumer_options(values)
    target = load_target(target_spec, Kind(kind) if kind is not None else None)
    chosen = make_balancer(balancer)
    url = settings(ctx).url
    coordinator = open_coordinator(url, node_id=node_id)
    try:
        consumer = Consumer(coordinator, target.handler_func(coordinator), chosen, options=options)
    except BaseException:
        coordinator.close()  # leave nothing open behind
        raise
    _run(consumer, target, url)
