"""A consumer process under a real thread limit: its handlers' threads cannot start.

The child process lowers its own ``RLIMIT_AS`` (address space) once its consumer is running,
with 64 MiB thread stacks, so only a few more threads fit: ``Thread.start()`` then raises
``RuntimeError: can't start new thread`` as in a process out of threads. Unlike
``RLIMIT_NPROC`` (per user, and not enforced for root), a process may always lower its own
address space limit, so this works as root too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metafora import Task, TaskState
from metafora.contracts.handler import simple_handler
from metafora.testing import LocalCluster
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
TASKS = 10

CHILD = r'''
import json, os, resource, signal, sys, threading

signal.alarm(60)  # a deadline on the whole child, without a thread
from metafora import Consumer, Task, TaskState
from metafora.surfaces.connect import open_client, open_coordinator
from metafora.contracts.handler import simple_handler
from metafora.testing import wait_for

STACK = 64 << 20
url, status, tasks = sys.argv[1], sys.argv[2], int(sys.argv[3])
threading.stack_size(STACK)
client = open_client(url)


def work(task, stop):
    stop.wait(60)
    return False


consumer = Consumer(open_coordinator(url, node_id="a"), simple_handler(work),
                    release_backoff=5.0, shutdown_timeout=5.0)
errors = []


def run():
    try:
        consumer.run()
    except BaseException as exc:
        errors.append(repr(exc))


runner = threading.Thread(target=run, daemon=True)
runner.start()
wait_for(consumer.ready, 20, "the consumer to register")


def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


# Room for about three more thread stacks, and some heap.
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 3 * STACK + (48 << 20),
                                        resource.RLIM_INFINITY))
client.submit_tasks([Task(f"t{i}") for i in range(tasks)])
wait_for(lambda: consumer.info()["capacity"]["reduced"] is not None, 60, "a failed start")
running = len(consumer.tasks())
# Deadlines, not timings: on Python 3.13 beside a loaded stage (load 8 on 2 cores) the
# releases took more than 20 s once.
wait_for(lambda: len(client.tasks(TaskState.PENDING)) == tasks - running, 60,
         "the tasks not started to be released")
with open(status + ".tmp", "w") as f:
    json.dump({"capacity": consumer.info()["capacity"], "running": running,
               "alive": consumer.healthy(), "errors": errors}, f)
os.rename(status + ".tmp", status)
sys.stdin.read()  # until the test lets it go
consumer.shutdown()
runner.join(30)
print(json.dumps({"errors": errors, "joined": not runner.is_alive()}))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_process_out_of_threads_releases_what_it_cannot_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'limit.db'}"
    status = tmp_path / "status.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "1"}
    with LocalCluster(url, shutdown_timeout=5.0) as cluster:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(status), str(TASKS)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
        try:
            wait_until(lambda: status.exists() or child.poll() is not None, 180,
                       message="the child to hit its limit")
            assert status.exists(), child.communicate(timeout=10)
            seen = json.loads(status.read_text())
            running = seen["running"]
            assert seen["alive"] and not seen["errors"]
            assert seen["capacity"]["reduced"] == running < TASKS
            assert "can't start new thread" in seen["capacity"]["cause"] or (
                "MemoryError" in seen["capacity"]["cause"])
            held = {t.id for t in cluster.client.tasks(TaskState.CLAIMED) if t.owner == "a"}
            assert len(held) == running  # nothing claimed that it does not run

            def work(task: Task, stop: object) -> bool:
                stop.wait(30)  # type: ignore[attr-defined]
                return False

            b = cluster.add(simple_handler(work), node_id="b")
            wait_until(lambda: len(b.tasks()) == TASKS - running, 20,
                       message="b took what a released")
            out, err = child.communicate("", timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        assert child.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"errors": [], "joined": True}
        wait_until(lambda: len(b.tasks()) == TASKS, 20, message="b took a's tasks once it left")
