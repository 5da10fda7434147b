"""The README's example: a handler, a consumer in your own main, one task submitted."""

from __future__ import annotations

import signal
import threading

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler


def crawl(task: Task, stop: threading.Event) -> bool:
    print(f"working on {task.id} (token {task.token}) with {dict(task.props)}")
    stop.wait(task.props.get("seconds", 1))  # real work checks `stop` now and then
    return not stop.is_set()  # True: done; False: release it to another node


def main() -> None:
    url = "sqlite:///metafora.db"  # or postgresql://..., etcd://host:2379/ns, memory://name
    with open_client(url) as client:
        if not any(t.id == "hello" for t in client.tasks()):
            client.submit_task(Task("hello", {"seconds": 1}))
    consumer = Consumer(open_coordinator(url), simple_handler(crawl))
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    threading.Timer(3, consumer.shutdown).start()  # a daemon would run until SIGTERM
    consumer.run()


if __name__ == "__main__":
    main()
