"""``metafora demo``: a cluster of consumer processes, a SIGKILL, and the proof (see :mod:`metafora.demo`)."""

from __future__ import annotations

import click

from metafora.cli._common import settings
from metafora.cli.tool import check_url

__all__ = ["demo"]


@click.command()
@click.option("--nodes", type=click.IntRange(2, 32), default=3, show_default=True,
              help="Consumer processes to start (one of them is killed half-way).")
@click.option("--tasks", "task_count", type=click.IntRange(1, 2000), default=30, show_default=True,
              help="Tasks to submit; each works for 1-2 seconds.")
@click.option("--url", "demo_url", metavar="URL", default=None, callback=check_url,
              help="Run on this store (in a namespace of its own) instead of a fresh temporary "
                   "SQLite file; `metafora --url URL demo` works too, but $METAFORA_URL is ignored "
                   "so the demo never lands in a real cluster by accident.")
@click.option("--lease-ttl", type=click.FloatRange(1.0, 30.0), default=2.5, show_default=True,
              help="Seconds a dead node's claims are held before others may take them.")
@click.option("--keep", is_flag=True, help="Keep the demo's store, ledger and node logs.")
@click.option("--live/--plain", "live", default=None,
              help="Live table or plain progress lines (default: live on a terminal).")
@click.option("--seed", type=int, default=None, hidden=True, help="Seed for the task durations.")
@click.pass_context
def demo(ctx: click.Context, nodes: int, task_count: int, demo_url: str | None, lease_ttl: float,
         keep: bool, live: bool | None, seed: int | None) -> None:
    """Start a cluster on this machine, kill a node half-way, prove every task ran once.

    With no --url the demo needs no server: its nodes share a fresh SQLite file. It finishes
    in well under a minute and exits 0 only when the ledger proves that every task ran to
    completion exactly once.
    """
    from metafora.cli._common import console
    from metafora.demo import DemoConfig, run_demo

    root = settings(ctx)
    url = demo_url if demo_url is not None else (root.url if root.url_from_command_line else None)
    config = DemoConfig(nodes=nodes, tasks=task_count, url=url, lease_ttl=lease_ttl, keep=keep,
                        live=live, seed=seed)
    ctx.exit(run_demo(config, console()))
