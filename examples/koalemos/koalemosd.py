"""koalemosd: a consumer daemon whose tasks are shell commands.

Each task's props hold ``{"args": [...]}``; the command runs as a child process in its own
process group. Exit code 0 marks the task done; non-zero fails it with the tail of stderr.
``stop()`` (balancing, ``metafora stop``, shutdown) sends SIGTERM, then SIGKILL after
``--grace`` seconds, and releases the task. SIGTERM/SIGINT to koalemosd shut it down
gracefully: claims are released at once, so another daemon picks them up without waiting
for the lease to expire.

    .venv/bin/python examples/koalemos/koalemosd.py --url sqlite:///metafora.db

The same handler runs under the ``metafora worker`` command too, with no main of one's own
(``KOALEMOS_GRACE`` sets ``--grace``; the worker's own options set the rest):

    cd examples/koalemos && metafora --url sqlite:///metafora.db worker koalemosd:shell

Errors and exit codes are the ``metafora`` command's: 2 usage (bad URL, node id, option or
``--http`` address, the HTTP port taken), 3 store unreachable, 1 refused (the node id is
live elsewhere); one ``Error: ...`` line, never a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from typing import Any

import click

from metafora import Consumer, Handler, Task, open_coordinator
from metafora.cli.tool import MetaforaCommand, url_option
from metafora.core.logs import LEVELS, configure

STDERR_TAIL = 2000  # characters of stderr kept in a failed task's error


class CommandFailed(Exception):
    """The command exited with a non-zero code."""


class ShellHandler(Handler):
    """Runs ``task.props["args"]`` as a child process."""

    def __init__(self, task: Task, grace: float) -> None:
        self.task = task
        self.grace = grace
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = threading.Event()

    def run(self) -> bool:
        args = self.task.props.get("args")
        if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
            raise CommandFailed('props must be {"args": ["command", "arg", ...]}')
        with tempfile.TemporaryFile() as err:
            with self._lock:
                if self._stopped.is_set():
                    return False
                self._proc = subprocess.Popen(
                    args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    start_new_session=True,  # its own group, so stop() reaches its children too
                )
            code = self._proc.wait()
            if self._stopped.is_set():
                return False
            if code == 0:
                return True
            err.seek(0)
            tail = err.read().decode(errors="replace")[-STDERR_TAIL:].strip()
            raise CommandFailed(f"exit code {code}" + (f": {tail}" if tail else ""))

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._signal(proc, signal.SIGTERM)
        timer = threading.Timer(self.grace, self._signal, args=(proc, signal.SIGKILL))
        timer.daemon = True
        timer.start()

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass


def shell(task: Task) -> ShellHandler:
    """The HandlerFunc for ``metafora worker koalemosd:shell`` (grace from ``KOALEMOS_GRACE``)."""
    return ShellHandler(task, float(os.environ.get("KOALEMOS_GRACE", "10")))


@click.command(cls=MetaforaCommand)
@url_option
@click.option("--node", default=None, help="Node id (default: hostname-<random>).")
@click.option("--max-tasks", type=click.IntRange(min=1), default=None, help="Concurrent tasks.")
@click.option("--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when a task is stopped.")
@click.option("--lease-ttl", type=click.FloatRange(min=1), default=None, help="Lease TTL (s).")
@click.option("--http", "http_addr", default=None, help="Serve /info, /metrics on HOST:PORT.")
@click.option("--start-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds to wait for a store that cannot be reached at start.")
@click.option("--log-level", type=click.Choice(LEVELS), default="info", show_default=True)
@click.option("--log-json", is_flag=True, help="Log JSON lines.")
def main(url: str, node: str | None, max_tasks: int | None, grace: float, lease_ttl: float | None,
         http_addr: str | None, start_timeout: float, log_level: str, log_json: bool) -> None:
    """Run shell-command tasks from the store until SIGTERM or Ctrl-C."""
    configure(log_level, json_lines=log_json)
    options: dict[str, Any] = {} if lease_ttl is None else {"lease_ttl": lease_ttl}
    coord = open_coordinator(url, node_id=node, **options)
    try:
        consumer = Consumer(coord, lambda task: ShellHandler(task, grace), max_tasks=max_tasks,
                            http_addr=http_addr, shutdown_timeout=grace + 5,
                            start_timeout=start_timeout)
    except BaseException:
        coord.close()  # a bad --http or option: leave nothing registered behind
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: consumer.shutdown())
    click.echo(f"koalemosd {consumer.node_id} on {coord.name}", err=True)
    consumer.run()


if __name__ == "__main__":
    main()
