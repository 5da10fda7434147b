"""The demo's worker process: one consumer whose handler writes every run to the ledger."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

import click

from metafora.consumer import Consumer
from metafora.contracts.handler import simple_handler
from metafora.core.errors import CoordinatorUnavailable, MetaforaError
from metafora.core.task import Task
from metafora.surfaces.connect import ENV_URL, default_url, open_coordinator
from metafora.testing import FileLedger

log = logging.getLogger(__name__)


def _work(ledger: FileLedger, node: str) -> Callable[[Task, threading.Event], bool]:
    def work(task: Task, stop: threading.Event) -> bool:
        seconds = float(task.props.get("seconds", 1.0))
        ledger.start(task, node)
        if stop.wait(seconds):  # asked to stop (balance, stop command, shutdown): release it
            ledger.end(task, node, "release")
            return False
        ledger.end(task, node, "done")
        return True

    return work


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def _worker_cli() -> None:
    """Internal entry points of ``metafora demo`` (not a public interface)."""


@_worker_cli.command("worker")
@click.option("--url", envvar=ENV_URL, default=None, help="The store (default: $METAFORA_URL).")
@click.option("--node", required=True, help="This node's id.")
@click.option("--ledger", "ledger_path", required=True, type=click.Path(dir_okay=False))
@click.option("--max-tasks", type=click.IntRange(1), default=4, show_default=True)
@click.option("--parent", type=int, default=None, help="Shut down when this process is gone.")
@click.option("--log-level", default="info", show_default=True)
def _worker(url: str | None, node: str, ledger_path: str, max_tasks: int, parent: int | None,
            log_level: str) -> None:
    """Run one demo consumer until SIGTERM/SIGINT (graceful) or the parent goes away."""
    from metafora.core.logs import configure

    configure(log_level)
    ledger = FileLedger(ledger_path)
    try:
        coordinator = open_coordinator(url or default_url(), node_id=node)
        consumer = Consumer(coordinator, simple_handler(_work(ledger, node)), max_tasks=max_tasks,
                            shutdown_timeout=5.0)
    except MetaforaError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(3 if isinstance(exc, CoordinatorUnavailable) else 2)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("node %s: signal %d, shutting down", node, signum)
        consumer.shutdown()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    finished = threading.Event()
    if parent is not None:
        threading.Thread(target=_watch_parent, args=(parent, consumer, finished),
                         name="demo-parent-watch", daemon=True).start()
    try:
        consumer.run()
    except MetaforaError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(3 if isinstance(exc, CoordinatorUnavailable) else 1)
    finally:
        finished.set()


def _watch_parent(parent: int, consumer: Consumer, finished: threading.Event) -> None:
    """Shut the consumer down if the demo's parent process dies (no orphaned workers)."""
    while not finished.wait(0.5):
        if os.getppid() != parent:
            log.warning("the demo process %d is gone; shutting down", parent)
            consumer.shutdown()
            return


def worker_main(argv: Sequence[str] | None = None) -> None:
    """``python -m metafora.demo worker --node N --ledger PATH`` (the URL from $METAFORA_URL)."""
    _worker_cli.main(args=list(argv) if argv is not None else None, prog_name="python -m metafora.demo")


