"""The README's example: a handler, a consumer in your own main, one task submitted.

    .venv/bin/python examples/quickstart.py [--url URL]

The store is ``--url``, else ``$METAFORA_URL``, else ``sqlite:///metafora.db`` (as for the
``metafora`` command, with its errors and exit codes).
"""

from __future__ import annotations

import signal
import threading

import click

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.cli.tool import MetaforaCommand, url_option


def crawl(task: Task, stop: threading.Event) -> bool:
    print(f"working on {task.id} (token {task.token}) with {dict(task.props)}")
    stop.wait(task.props.get("seconds", 1))  # real work checks `stop` now and then
    return not stop.is_set()  # True: done; False: release it to another node


@click.command(cls=MetaforaCommand)
@url_option
def main(url: str) -> None:
    """Submit the task 'hello' (once) and run a consumer for three seconds."""
    with open_client(url) as client:
        if not any(t.id == "hello" for t in client.tasks()):
            client.submit_task(Task("hello", {"seconds": 1}))
    consumer = Consumer(open_coordinator(url), simple_handler(crawl))
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    timer = threading.Timer(3, consumer.shutdown)  # a daemon would run until SIGTERM
    timer.start()
    try:
        consumer.run()
    finally:
        timer.cancel()


if __name__ == "__main__":
    main()
