"""Rebalance: 300 tasks on 2 nodes, a 3rd joins (FairBalancer, balance_every 2 s).

Measured: time until every node is within the threshold (1.2 x average), and the number of
task moves (the minimum under FairBalancer's rule is 2 x (150 - 120) = 60), watched for a
while after convergence to catch ping-pong.

Event-driven (issue 15): the same join with the default ``balance_every`` (60 s), so only the
stores' membership events can make the nodes balance in time (target: within the threshold
<= 10 s after the join); then one node shuts down (SIGTERM) and the time until the two others
hold every task is measured (its tasks are orphans: no ``claim_delay``). Last, the pause a
stateful task sees during a handoff (``metafora stop``): from the last item its old owner
did to the first its new owner did, with the final checkpoint's own time beside it (target:
<= 1 s plus the checkpoint); in-process consumers (threads), 5 handoffs per store.
"""

from __future__ import annotations

import functools
import math
import queue
import signal
import threading
import time
from typing import Any

from benchmarks.common import Fleet, Stores, WorkerSpec, percentile, save, table
from metafora import Task, open_client

TASKS = 300
THRESHOLD = 1.2
BALANCE_EVERY = 2.0


def measure(url: str, settle: float) -> dict[str, float]:
    """One run: seconds to converge, moves, and moves after convergence."""
    with Fleet() as fleet, open_client(url) as client:
        spec = {"mode": "hold", "balancer": "fair", "balance_every": BALANCE_EVERY}
        for node in ("rb0", "rb1"):
            fleet.start(WorkerSpec(url, node, **spec))  # type: ignore[arg-type]
        for i in range(TASKS):
            client.submit_task(Task(f"r{i:04d}"))
        started = 0
        while started < TASKS:
            fleet.expect("start", timeout=60)
            started += 1
        joined = time.monotonic()
        fleet.start(WorkerSpec(url, "rb2", **spec))  # type: ignore[arg-type]
        starts: list[float] = []
        converged: float | None = None
        converged_wall = 0.0
        limit = math.ceil(THRESHOLD * TASKS / 3)
        deadline = joined + 120
        while time.monotonic() < deadline:
            try:
                while True:  # drain: the queue lags the store
                    event = fleet.events.get(timeout=0.05)
                    if event[0] == "start":
                        starts.append(event[4])
            except queue.Empty:
                pass
            if converged is None:
                counts = client.node_task_count()
                if len(counts) == 3 and sum(counts.values()) == TASKS and max(counts.values()) <= limit:
                    converged, converged_wall = time.monotonic() - joined, time.time()
                    deadline = time.monotonic() + settle
        moves = len(starts)
        after = sum(1 for t in starts if t > converged_wall + 0.05) if converged is not None else 0
        return {"converge_s": converged if converged is not None else float("nan"),
                "moves": moves, "moves_after_converged": after,
                "final": client.node_task_count()}  # type: ignore[dict-item]


def _drain(fleet: Fleet, starts: list[float]) -> None:
    try:
        while True:  # the queue lags the store
            event = fleet.events.get(timeout=0.05)
            if event[0] == "start":
                starts.append(event[4])
    except queue.Empty:
        pass


def measure_events(url: str, settle: float) -> dict[str, Any]:
    """Join then graceful leave with the default balance_every (60 s): seconds to converge."""
    with Fleet() as fleet, open_client(url) as client:
        spec = {"mode": "hold", "balancer": "fair", "balance_every": 60.0}
        for node in ("ev0", "ev1"):
            fleet.start(WorkerSpec(url, node, **spec))  # type: ignore[arg-type]
        client.submit_tasks(Task(f"e{i:04d}") for i in range(TASKS))
        started = 0
        while started < TASKS:
            fleet.expect("start", timeout=60)
            started += 1
        joined = time.monotonic()
        fleet.start(WorkerSpec(url, "ev2", **spec))  # type: ignore[arg-type]
        starts: list[float] = []
        limit = math.ceil(THRESHOLD * TASKS / 3)
        join_s = float("nan")
        converged_wall = 0.0
        deadline = joined + 90
        while time.monotonic() < deadline:
            _drain(fleet, starts)
            counts = client.node_task_count()
            if len(counts) == 3 and sum(counts.values()) == TASKS and max(counts.values()) <= limit:
                join_s, converged_wall = time.monotonic() - joined, time.time()
                break
        settle_end = time.monotonic() + settle
        while time.monotonic() < settle_end:
            _drain(fleet, starts)
        after = sum(1 for t in starts if t > converged_wall + 0.05)
        left = time.monotonic()
        fleet.kill("ev1", signal.SIGTERM)
        leave_s = float("nan")
        deadline = left + 90
        while time.monotonic() < deadline:
            _drain(fleet, [])
            counts = client.node_task_count()
            if set(counts) == {"ev0", "ev2"} and sum(counts.values()) == TASKS:
                leave_s = time.monotonic() - left
                break
        return {"join_converge_s": join_s, "join_moves": len(starts), "moves_after": after,
                "leave_adopted_s": leave_s, "final": client.node_task_count()}


def _grew(items: list[Any], beyond: int) -> bool:
    return len(items) > beyond


def measure_handoff(url: str, handoffs: int) -> dict[str, float]:
    """Pauses of a stateful task moved ``handoffs`` times between two in-process nodes."""
    from metafora import Consumer, open_coordinator
    from metafora.core import commands
    from metafora.statemachine import Commands, handler_func
    from metafora.statemachine.machine import Message, MessageKind
    from metafora.testing import LocalCluster, wait_for

    lock = threading.Lock()
    done: list[tuple[int, str, float]] = []
    checkpoints: list[float] = []

    def stateful(node: str) -> Any:
        def step(task: Task, cmds: Commands) -> Message:
            i = int(cmds.cursor or 0)
            while True:
                with lock:
                    done.append((i, node, time.monotonic()))
                i += 1
                msg = cmds.get(timeout=0.01)
                if msg is not None and msg.kind is MessageKind.RELEASE:
                    began = time.monotonic()
                    reply = cmds.handoff(str(i))
                    with lock:
                        checkpoints.append(time.monotonic() - began)
                    return reply
                if msg is not None:
                    return msg

        return step

    pauses: list[float] = []
    with LocalCluster(url, shutdown_timeout=10) as cluster:
        for node in ("ha", "hb"):
            coord = open_coordinator(url, node_id=node)
            cluster.start(Consumer(coord, handler_func(stateful(node), coord, poll_interval=0.05),
                                   release_backoff=0.2))
        cluster.client.submit_task(Task("handoff"))
        wait_for(lambda: len(done) > 20, 60, "the task to run")
        for _ in range(handoffs):
            with lock:
                owner, mark = done[-1][1], len(done)
            cluster.client.submit_command(owner, commands.stop_task("handoff"))

            def moved(owner: str = owner, mark: int = mark) -> bool:
                with lock:
                    return any(n != owner for _, n, _ in done[mark:])

            wait_for(moved, 60, "the task to move")
            with lock:
                tail = done[mark - 1:]
            last_old = max(t for _, n, t in tail if n == owner)
            first_new = min(t for _, n, t in tail if n != owner)
            pauses.append(first_new - last_old)
            # Long enough for the old owner's release back-off (0.2 s, doubling) to pass.
            wait_for(functools.partial(_grew, done, mark + 150), 60, "the new owner to work")
        with lock:
            order = [i for i, _, _ in done]
        exact = order == list(range(len(order)))
    return {"pause_p50_s": percentile(pauses, 50), "pause_max_s": max(pauses),
            "checkpoint_max_s": max(checkpoints), "resumed_exactly": float(exact)}


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Measure every store; print and save."""
    rows, data = [], {}
    for kind in stores.kinds:
        result = measure(stores.url(kind), settle=3 * BALANCE_EVERY if quick else 6 * BALANCE_EVERY)
        data[kind] = result
        rows.append((kind, result["converge_s"], result["moves"], 60, result["moves_after_converged"],
                     str(result["final"])))
    table("rebalance: 300 tasks, 2 nodes + 1 joining (FairBalancer 1.2, balance every 2 s)",
          ("store", "converge s", "moves", "min moves", "moves after", "final counts"), rows)
    events_rows, events = [], {}
    for kind in stores.kinds:
        ev = measure_events(stores.url(kind), settle=5.0 if quick else 15.0)
        events[kind] = ev
        events_rows.append((kind, ev["join_converge_s"], ev["join_moves"], ev["moves_after"],
                            ev["leave_adopted_s"], str(ev["final"])))
    table("membership events: 300 tasks, 2 nodes + 1 joining, then 1 leaving (SIGTERM); "
          "balance_every 60 s (target: join <= 10 s)",
          ("store", "join converge s", "moves", "moves after", "leave adopted s", "final counts"),
          events_rows)
    handoff_rows, handoff = [], {}
    for kind in stores.kinds:
        ho = measure_handoff(stores.url(kind), 3 if quick else 5)
        handoff[kind] = ho
        handoff_rows.append((kind, ho["pause_p50_s"], ho["pause_max_s"], ho["checkpoint_max_s"],
                             bool(ho["resumed_exactly"])))
    table("handoff: a stateful task moved by `metafora stop` (target: pause <= 1 s + checkpoint)",
          ("store", "pause p50 s", "pause max s", "checkpoint max s", "resumed exactly"),
          handoff_rows)
    save("rebalance", {"quick": quick, "results": data, "events": events, "handoff": handoff})
    return data
