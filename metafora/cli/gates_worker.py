"""``metafora gates worker --processor-url URL``: a node running gated partitions with an HTTP
processor configured by flags (Go Feed ships its processor as a binary the same way), no
Python module to write.

Each claimed task is a partition of the item store (``--items-url``, else ``--url``); its
items are POSTed to ``--processor-url`` as :class:`~metafora.gates.HTTPProcessor` does, or with
``--batch N`` N at a time as :class:`~metafora.gates.HTTPBatchProcessor` does. Signals and
exit codes are ``metafora worker``'s.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit

import click

from metafora import Consumer
from metafora.cli._common import CliError, Duration, ExitCode, scrub, settings
from metafora.cli.items import items_url_option
from metafora.cli.worker import _option, _Signals
from metafora.core.masking import mask_url
from metafora.gates import HTTPBatchProcessor, HTTPProcessor, ItemStore, handler_func
from metafora.gates.processor import Processor
from metafora.surfaces.connect import open_coordinator

__all__ = ["gates", "processor_from_flags"]

MAX_BATCH = 10_000
MAX_CONCURRENCY = 256


def _processor_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """An http:// or https:// URL with a host, nothing else."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname
            or any(c.isspace() for c in value.strip()) or (port is not None and port == 0)):
        raise click.BadParameter(f"must be an http:// or https:// URL with a host, got "
                                 f"{mask_url(value)!r}", ctx, param)
    return value.strip()


def _headers(values: tuple[str, ...]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for value in values:
        name, colon, text = value.partition(":")
        if not colon or not name.strip() or any(c in value for c in "\r\n"):
            raise click.BadParameter(f"must be NAME: VALUE on one line, got {value.split(':')[0]!r}...",
                                     param_hint="'--header'")
        headers[name.strip()] = text.strip()
    return headers


def processor_from_flags(url: str, batch: int | None, concurrency: int, timeout: float,
                         headers: dict[str, str]) -> Processor:
    """The HTTP processor the flags describe: batch mode with ``batch``."""
    if batch is not None:
        return HTTPBatchProcessor(url, batch, timeout, headers, concurrency=concurrency)
    return HTTPProcessor(url, timeout, headers, concurrency=concurrency)


@click.group()
def gates() -> None:
    """Gated partitions run by a node: metafora gates worker --processor-url URL."""


@gates.command("worker")
@_option("--processor-url", required=True, metavar="URL", callback=_processor_url,
         help="POST the items here (http:// or https://); the JSON answer says where each goes.")
@_option("--batch", type=click.IntRange(1, MAX_BATCH), default=None, metavar="N",
         help=f"Send N items per request (1-{MAX_BATCH}): {{\"items\": [...]}} answered by "
              "{\"responses\": [...]}. Without it, one item per request.")
@_option("--concurrency", type=click.IntRange(1, MAX_CONCURRENCY), default=4, show_default=True,
         metavar="N", help=f"Requests in flight per partition (1-{MAX_CONCURRENCY}).")
@_option("--timeout", "request_timeout", type=click.FloatRange(0.1, 3600), default=30.0,
         show_default=True, help="Seconds a request may take (then it is retried).")
@_option("--header", "header_values", multiple=True, metavar="NAME:VALUE",
         help="A header sent with every request, e.g. 'Authorization: Bearer T' (repeat it).")
@_option("--max-attempts", type=click.IntRange(1, 100), default=3, show_default=True,
         help="Attempts of an item (or a batch) before it fails.")
@items_url_option
@_option("--node-id", default=None, metavar="ID", help="This node's id (default: hostname-<random>).")
@_option("--max-tasks", type=click.IntRange(min=1, max=100_000), default=None,
         help="At most this many partitions at once.")
@_option("--http", "http_addr", default=None, metavar="HOST:PORT",
         help="Serve /info, /metrics (gate item counts included), /healthz and /readyz here.")
@_option("--shutdown-timeout", type=Duration(), default="30s", show_default=True,
         help="On SIGTERM, how long partitions may take to stop before they are abandoned.")
@click.pass_context
def worker(ctx: click.Context, processor_url: str, batch: int | None, concurrency: int,
           request_timeout: float, header_values: tuple[str, ...], max_attempts: int,
           items_url: str | None, node_id: str | None, max_tasks: int | None,
           http_addr: str | None, shutdown_timeout: timedelta) -> None:
    """Run a node whose tasks are gated partitions, their items POSTed to --processor-url,
    until SIGTERM or SIGINT (exit codes: metafora worker's)."""
    headers = _headers(header_values)  # everything refusable before the store is touched
    processor = processor_from_flags(processor_url, batch, concurrency, request_timeout, headers)
    url = settings(ctx).url
    items = ItemStore(items_url or url)
    coordinator = open_coordinator(url, node_id=node_id)
    try:
        handler = handler_func(processor, coordinator, items, concurrency=concurrency,
                               batch_size=batch * concurrency if batch else 100,
                               max_attempts=max_attempts)
        consumer = Consumer(coordinator, handler, max_tasks=max_tasks, http_addr=http_addr,
                            shutdown_timeout=shutdown_timeout)
    except BaseException:
        coordinator.close()
        items.close()
        raise
    mode = f"batches of {batch}" if batch else "one item a request"
    click.echo(f"metafora gates worker {consumer.node_id} on {mask_url(url, brief=True)}: items to "
               f"{mask_url(processor_url, brief=True)} ({mode}, {concurrency} at once); SIGTERM or "
               "Ctrl-C stops it", err=True)
    try:
        with _Signals(consumer).installed():
            try:
                consumer.run()
            except Exception as exc:
                if consumer.info().get("started") is None:
                    raise
                message = f"the consumer {consumer.node_id} stopped: {type(exc).__name__}: {exc}"
                raise CliError.make(scrub(message, url), ExitCode.CONSUMER_DIED) from exc
    finally:
        items.close()
    click.echo(f"metafora gates worker {consumer.node_id} stopped", err=True)
