"""A two-stage pipeline of streams: blocks -> chunks -> verified, with a node killed mid-run.

    python examples/block_pipeline/run.py                  # embedded SQLite default (./metafora.db)
    python examples/block_pipeline/run.py --url postgresql://postgres@127.0.0.1:5432/postgres
    python examples/block_pipeline/run.py --blocks 200 --workers 4

flow-go's verification pipeline in small: a chain of blocks is appended to a job log; stage 1
is a **stream** over that log whose work finds the chunks of a block and appends them to stage
2's log (keys ``block/chunk``: a block that runs again appends nothing); stage 2 is a stream
that verifies each chunk, 8 at a time. Both streams are metafora tasks, run by worker processes
(``worker`` below); the runner kills the owner of stage 2 with SIGKILL mid-run, its streams
move to another worker after one lease, and at the end it proves from the stores that every
block and every chunk was done, none skipped, none twice in a log. Exit status 0 when the proof
holds, 1 when it does not.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from metafora import Consumer, Task, open_client, open_coordinator
from metafora.streams import Job, JobContext, SQLJobLog, stream_handler
from metafora.surfaces.connect import default_url

MAX_CHUNKS = 8
VERIFY_SECONDS = 0.03  # the "work" of verifying one chunk
FIND_SECONDS = 0.02  # the "work" of finding a block's chunks


# -- the chain -----------------------------------------------------------------------------


def block(height: int) -> dict[str, Any]:
    """Block ``height`` of the synthetic chain: its parent and how many chunks it has."""
    rng = random.Random(height)
    return {"height": height, "parent": f"block-{height - 1:05d}" if height else None,
            "chunks": rng.randint(1, MAX_CHUNKS)}


def chunk(height: int, index: int) -> dict[str, Any]:
    """Chunk ``index`` of block ``height`` (deterministic: a re-run builds the same payload)."""
    data = hashlib.sha256(f"{height}/{index}".encode()).hexdigest() * 4
    return {"block": height, "chunk": index, "data": data,
            "digest": hashlib.sha256(data.encode()).hexdigest()}


def chunks_of(job: Job) -> list[tuple[str, dict[str, Any]]]:
    """Stage 1's finding: the ``(block/chunk key, chunk)`` pairs of a block job."""
    height = int(job.payload["height"])
    return [(f"{job.id}/{i}", chunk(height, i)) for i in range(int(job.payload["chunks"]))]


# -- the workers ---------------------------------------------------------------------------


class Stages:
    """The work of both stages (one handler: a task's props say which stream it is)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._logs: dict[str, SQLJobLog] = {}
        self._lock = threading.Lock()

    def log(self, name: str) -> SQLJobLog:
        """One handle per log in this process (its appends share a pool and a listener)."""
        with self._lock:
            found = self._logs.get(name)
            if found is None:
                found = self._logs[name] = SQLJobLog(self.url, name)
            return found

    def jobs(self, task: Task) -> SQLJobLog:
        """The stream's source: the log its props name."""
        return SQLJobLog(self.url, task.props["log"])

    def work(self, job: Job, ctx: JobContext) -> None:
        """Stage 1: append the block's chunks to the next log; stage 2: verify a chunk."""
        if ctx.task.props["stage"] == "blocks":
            time.sleep(FIND_SECONDS)
            self.log(ctx.task.props["next"]).append(chunks_of(job))
            return
        time.sleep(VERIFY_SECONDS)
        if hashlib.sha256(job.payload["data"].encode()).hexdigest() != job.payload["digest"]:
            raise ValueError(f"chunk {job.id} does not match its digest")
        self.log(ctx.task.props["verified"]).append([(job.id, {"pid": os.getpid()})])


def worker(url: str, node: str) -> None:
    """One worker process: a consumer running the streams it claims, until SIGTERM."""
    stages = Stages(url)
    handler = stream_handler(stages.jobs, stages.work, max_processing=8, max_search_ahead=64,
                             poll_every=1.0)
    consumer = Consumer(open_coordinator(url, node_id=node), handler)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())
    consumer.run()


# -- the runner ----------------------------------------------------------------------------


def with_defaults(url: str) -> str:
    """The store URL with this example's namespace and a short lease (a killed worker's
    streams move after it), unless the URL sets them."""
    sep = "&" if "?" in url else "?"
    for option, value in (("namespace", "block-pipeline"), ("lease_ttl", "3")):
        if f"{option}=" not in url:
            url, sep = f"{url}{sep}{option}={value}", "&"
    return url


def start_worker(url: str, node: str) -> subprocess.Popen[bytes]:
    """A worker process running this file's ``worker`` command."""
    return subprocess.Popen([sys.executable, __file__, "worker", "--url", url, "--node", node])


def wait(what: str, predicate: Any, timeout: float) -> None:
    """Poll ``predicate`` until true (SystemExit naming ``what`` after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(0.1)


def run(url: str, blocks: int, workers: int, timeout: float) -> int:
    """Submit both streams, start the workers, feed the chain, kill one, prove the result."""
    run_id = uuid.uuid4().hex[:6]
    names = {"blocks": f"blocks-{run_id}", "chunks": f"chunks-{run_id}", "verified": f"verified-{run_id}"}
    logs = {stage: SQLJobLog(url, name) for stage, name in names.items()}
    expected = {key for h in range(blocks) for key, _ in chunks_of(Job(h, f"block-{h:05d}", block(h)))}
    client = open_client(url)
    client.submit_task(Task(names["blocks"], {"stage": "blocks", "log": names["blocks"],
                                              "next": names["chunks"]}))
    client.submit_task(Task(names["chunks"], {"stage": "chunks", "log": names["chunks"],
                                              "verified": names["verified"]}))
    procs = {f"node-{n}": start_worker(url, f"node-{n}") for n in range(workers)}
    started = time.monotonic()
    print(f"run {run_id}: {blocks} blocks ({len(expected)} chunks) through 2 streams on {workers} "
          f"workers, store {client.name}")
    def grow() -> None:  # the chain grows while the streams run
        for height in range(blocks):
            logs["blocks"].append([(f"block-{height:05d}", block(height))])
            time.sleep(0.02)

    producer = threading.Thread(target=grow, name="chain", daemon=True)
    producer.start()
    try:
        # Kill stage 2's owner once it has done about a third of the chunks.
        wait("stage 2 to start", lambda: client.stream(names["chunks"]).processed >= len(expected) // 3,
             timeout)
        owner = client.get_task(names["chunks"]).owner or ""
        at = client.stream(names["chunks"]).processed
        victim = procs.pop(owner, None)
        if victim is not None:
            victim.kill()
            victim.wait()
        killed = time.monotonic()
        print(f"killed {owner} (pid {victim.pid if victim else '?'}) with SIGKILL: it owned "
              f"{names['chunks']}, processed index {at} of {len(expected) - 1}")
        producer.join()
        wait("the stream to move", lambda: client.get_task(names["chunks"]).owner not in (None, owner),
             timeout)
        print(f"{names['chunks']} moved to {client.get_task(names['chunks']).owner} "
              f"{time.monotonic() - killed:.1f}s after the kill (one lease)")

        def finished() -> bool:
            return (client.stream(names["blocks"]).processed == blocks - 1
                    and logs["chunks"].head() == len(expected) - 1
                    and client.stream(names["chunks"]).processed == len(expected) - 1)

        wait("both streams to finish", finished, timeout)
        print(f"both streams caught up in {time.monotonic() - started:.1f}s")
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)
    ok = prove(client, logs, names, blocks, expected)
    for name in (names["blocks"], names["chunks"]):
        client.delete_task(name)  # the logs stay: `SQLJobLog(url, name)` reads them
    client.close()
    for log in logs.values():
        log.close()
    return 0 if ok else 1


def prove(client: Any, logs: dict[str, SQLJobLog], names: dict[str, str], blocks: int,
          expected: set[str]) -> bool:
    """Check from the stores that every block and chunk was done, none skipped; print it."""
    checks: list[tuple[str, bool]] = []

    def every(log: SQLJobLog) -> list[Job | None]:
        return [log.at_index(i) for i in range(log.head() + 1)]

    block_jobs, chunk_jobs = every(logs["blocks"]), every(logs["chunks"])
    chunk_keys = [job.id for job in chunk_jobs if job is not None]
    verified = {job.id for job in every(logs["verified"]) if job is not None}
    pids = {job.payload["pid"] for job in every(logs["verified"]) if job is not None}
    checks.append((f"blocks: indexes 0..{len(block_jobs) - 1} all present, {blocks} blocks",
                   len(block_jobs) == blocks and None not in block_jobs))
    checks.append((f"chunks: indexes 0..{len(chunk_jobs) - 1} all present (no gap)", None not in chunk_jobs))
    checks.append((f"chunks: each key once ({len(chunk_keys)} jobs, {len(set(chunk_keys))} keys)",
                   len(chunk_keys) == len(set(chunk_keys))))
    checks.append((f"chunks: every chunk of every block is there ({len(expected)} expected)",
                   set(chunk_keys) == expected))
    for stage in ("blocks", "chunks"):
        info, head = client.stream(names[stage]), logs[stage].head()
        checks.append((f"stream {names[stage]}: processed index {info.processed} = head {head}, "
                       f"nothing failing", info.processed == head and info.failing is None))
    checks.append((f"verified: every chunk verified ({len(verified)}), by {len(pids)} worker "
                   "process(es)", verified == expected))
    # A re-run of stage 1 (as after the kill) appends nothing: every key keeps its index.
    before = logs["chunks"].head()
    again = [index for h in range(blocks)
             for index in logs["chunks"].append(chunks_of(Job(h, f"block-{h:05d}", block(h))))]
    checks.append((f"re-running stage 1 over every block appends nothing (head stays {before})",
                   logs["chunks"].head() == before and sorted(again) == list(range(before + 1))))
    print("proof:")
    for text, passed in checks:
        print(f"  [{'ok' if passed else 'FAILED'}] {text}")
    ok = all(passed for _, passed in checks)
    print("every block and every chunk was done, none skipped" if ok else "THE PROOF FAILED")
    return ok


def main() -> None:
    """Parse the command line: the runner (default) or one ``worker``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=["run", "worker"])
    parser.add_argument("--url", default=None, help="store URL (default: $METAFORA_URL or sqlite:///metafora.db)")
    parser.add_argument("--node", default="node-0", help="(worker) its node id")
    parser.add_argument("--blocks", type=int, default=60, help="blocks in the chain (1..10000)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (2..16)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for each step")
    args = parser.parse_args()
    if not 1 <= args.blocks <= 10_000 or not 2 <= args.workers <= 16:
        parser.error("--blocks must be from 1 to 10000 and --workers from 2 to 16")
    url = args.url or default_url()
    if args.command == "worker":
        worker(url, args.node)
        return
    sys.exit(run(with_defaults(url), args.blocks, args.workers, args.timeout))


if __name__ == "__main__":
    main()
