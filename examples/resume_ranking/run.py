"""Rank 100 resumes with a gated partition: classify each (gate 0, fan-out), then rank the
top 10 once every one is classified (gate 1, fan-in).

    python examples/resume_ranking/run.py            # embedded SQLite default, local classifier
    python examples/resume_ranking/run.py --http     # classify through a tiny HTTP service
    python examples/resume_ranking/run.py --url postgresql://user:pw@host/db --nodes 3

The job is one partition (a metafora task) holding 101 items: 100 resumes at gate 0 and one
``rank`` item at gate 1. A consumer with ``gates.handler_func`` works gate 0 (items in
parallel), jumps to gate 1 only when all of gate 0 is complete, ranks, and completes the
partition. Afterwards ``metafora items JOB`` shows every item and its classification.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from metafora import Consumer, Task, TaskState, gates, open_client, open_coordinator
from metafora.surfaces.connect import default_url

SKILLS = ["python", "go", "sql", "postgres", "etcd", "kubernetes", "rust", "distributed-systems",
          "kafka", "terraform", "react", "statistics"]
WANTED = {"python": 3, "distributed-systems": 5, "postgres": 2, "etcd": 2, "go": 2, "sql": 1, "kafka": 1}
FIRST = ["Ada", "Alan", "Barbara", "Edsger", "Frances", "Grace", "Jim", "John", "Ken", "Leslie",
         "Margaret", "Radia", "Tony", "Niklaus", "Shafi", "Whitfield", "Butler", "Liskov", "Dennis", "Donald"]
LAST = ["Lovelace", "Turing", "Hopper", "Dijkstra", "Allen", "Gray", "Backus", "Thompson", "Lamport",
        "Hamilton", "Perlman", "Hoare", "Wirth", "Goldwasser", "Diffie", "Lampson", "Ritchie", "Knuth"]


def make_resumes(count: int = 100, seed: int = 42) -> list[dict[str, Any]]:
    """Synthetic resumes (deterministic for a seed)."""
    rng = random.Random(seed)
    return [
        {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)} #{n:03d}",
         "years": rng.randint(0, 25),
         "skills": sorted(rng.sample(SKILLS, rng.randint(2, 6)))}
        for n in range(count)
    ]


def classify(resume: dict[str, Any]) -> dict[str, Any]:
    """Score a resume: wanted skills, plus experience (capped at 15 years)."""
    score = sum(WANTED.get(skill, 0) for skill in resume["skills"]) * 10 + min(resume["years"], 15) * 3
    label = "strong" if score >= 90 else "maybe" if score >= 50 else "no"
    return {**resume, "score": score, "label": label}


# -- processors --------------------------------------------------------------------------


class Pipeline:
    """Gate 0: classify (locally or over HTTP); gate 1: rank the classified resumes."""

    def __init__(self, items: gates.ItemStore, http: gates.HTTPProcessor | None) -> None:
        self.items = items
        self.http = http
        self.concurrency = 8  # items of the partition in flight at once

    def process(self, item: gates.Item) -> gates.Response:
        """The gates.Processor method: route an item by its gate."""
        if item.gate == 0:
            if self.http is not None:
                return self.http.process(item)
            classified = classify(json.loads(item.data))
            return gates.Response(gate=0, done=True, data=json.dumps(classified))
        return self.rank(item)

    def rank(self, item: gates.Item) -> gates.Response:
        """Gate 1 (fan-in): read every classified resume back and keep the ten best."""
        done = self.items.list(item.partition, gate=0, status=gates.ItemStatus.COMPLETE)
        classified = [json.loads(i.data) for i in done]
        top = sorted(classified, key=lambda r: (-r["score"], r["name"]))[:10]
        return gates.Response(gate=1, done=True, data=json.dumps({"ranked": len(classified), "top": top}))


def start_service() -> tuple[ThreadingHTTPServer, str]:
    """A tiny classification service on 127.0.0.1 (a free port), in a daemon thread."""

    class Classify(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_POST(self) -> None:
            item = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            try:
                resume = json.loads(item["data"])
                body = json.dumps({"gate": item["gate"], "done": True, "data": classify(resume)}).encode()
                status = 200
            except (TypeError, ValueError, KeyError) as exc:
                body, status = f"not a resume: {exc}".encode(), 422  # 4xx: the item fails for good
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # the default 5 drops bursts of connections (1 s SYN retries)

    server = Server(("127.0.0.1", 0), Classify)
    threading.Thread(target=server.serve_forever, name="classify-service", daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/classify"


# -- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Add the job's items, run consumers until the partition is done, print the top 10."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=default_url(),
                        help="store URL (default: $METAFORA_URL or sqlite:///metafora.db)")
    parser.add_argument("--http", action="store_true", help="classify through a local HTTP service")
    parser.add_argument("--nodes", type=int, default=1, help="consumers to run (threads of this process)")
    parser.add_argument("--resumes", type=int, default=100, help="how many resumes")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    args = parser.parse_args(argv)

    job = f"resumes-{uuid.uuid4().hex[:8]}"
    items = gates.ItemStore(args.url)
    server, service_url = start_service() if args.http else (None, None)
    http = gates.HTTPProcessor(service_url, timeout=10) if service_url else None
    consumers: list[Consumer] = []
    threads: list[threading.Thread] = []
    finished = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: finished.set())
    signal.signal(signal.SIGTERM, lambda *_: finished.set())
    try:
        resumes = make_resumes(args.resumes)
        ids = items.add(job, [gates.NewItem(0, json.dumps(r)) for r in resumes]
                        + [gates.NewItem(1, b"rank")])
        print(f"job {job}: {len(resumes)} resumes at gate 0, 1 ranking item at gate 1 "
              f"(items {ids[0]}..{ids[-1]} in {items.name})")
        for n in range(args.nodes):
            coord = open_coordinator(args.url, node_id=f"ranker-{uuid.uuid4().hex[:6]}-{n}")
            consumer = Consumer(coord, gates.handler_func(Pipeline(items, http), coord, items))
            consumers.append(consumer)
            thread = threading.Thread(target=consumer.run, name=f"consumer-{n}", daemon=True)
            thread.start()
            threads.append(thread)
        began = time.monotonic()
        with open_client(args.url) as client:
            client.submit_task(Task(job))
            deadline = began + args.timeout
            state = client.get_task(job).state
            while state not in (TaskState.DONE, TaskState.FAILED) and not finished.is_set():
                if time.monotonic() > deadline:
                    print(f"gave up after {args.timeout:g}s (task is {state.value})", file=sys.stderr)
                    return 1
                finished.wait(0.05)
                state = client.get_task(job).state
            if state is not TaskState.DONE:
                info = client.get_task(job)
                print(f"job {job} is {info.state.value}: {info.error or 'interrupted'}", file=sys.stderr)
                return 1
        elapsed = time.monotonic() - began
        (rank,) = items.list(job, gate=1)
        result = json.loads(rank.data)
        print(f"classified {result['ranked']} resumes, then ranked them, in {elapsed:.2f}s"
              f"{' (over HTTP)' if http else ''}\n")
        print(f"{'#':>3}  {'candidate':<28} {'score':>5} {'years':>5}  skills")
        for place, r in enumerate(result["top"], start=1):
            print(f"{place:>3}  {r['name']:<28} {r['score']:>5} {r['years']:>5}  {', '.join(r['skills'])}")
        print(f"\nsee every item: metafora --url {items.name} items {job}")
        return 0
    finally:
        for consumer in consumers:
            consumer.shutdown(timeout=10)
        for thread in threads:
            thread.join(15)
        if server is not None:
            server.shutdown()
            server.server_close()
        items.close()


if __name__ == "__main__":
    sys.exit(main())
