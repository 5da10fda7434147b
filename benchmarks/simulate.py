"""Past this machine: the restart scenarios at 100 and 1,000 nodes and 1,000,000 tasks, simulated.

One process, a fake clock, a simulated store (:mod:`benchmarks.sim_model`) and simulated
consumers (:mod:`benchmarks.sim_node`) running the REAL balancer (``FairBalancer`` by default,
whatever its rules are at the time of the run). Deterministic for a seed. Scenarios, as in
:mod:`benchmarks.restart` (long-running tasks that never finish; a start after a task's first
is a **move**):

- **cold**: N nodes start together over T pending tasks: seconds until every task is held (the
  store requests are counted over that storm) and until even (every node within 10 % of its
  share, or +-1 task, and every task held), starts beyond the first per task;
- **steady**: the even cluster for ``STEADY_S`` simulated seconds: moves (target 0);
- **join**: one more node: moves (target <= 1.2 x the new share), seconds until even;
- **leave**: one node shuts down gracefully: seconds until the others hold everything, moves
  then (target = the leaver's tasks) and until even;
- **rolling**: nodes in turn shut down and start again (same id) ``RESTART_PAUSE_S`` after
  they exited, each waiting for every task to be held: starts beyond the first per task
  (target <= 2 for the whole cluster). At 1,000 nodes a sample of ``ROLLING_SAMPLE`` nodes is
  restarted (each restart of the 1,000 costs every node two balances of the real balancer:
  the whole takes hours on one core) and the per-restart moves are extrapolated to all;
- **late**: N - 1 nodes start, the last ``LATE_S`` seconds later: seconds from its start
  until it holds its share (within 10 %), and until even (moves and requests from its start).

Each window also counts store requests per node per second (claim requests, count reads,
release writes), and :mod:`benchmarks.sim_load` extrapolates them to PostgreSQL and etcd.

    python -m benchmarks simulate [--quick] [--stores postgresql]

``--quick``: 100 nodes x 100,000 tasks (about a minute); else 100 and 1,000 nodes x
1,000,000 tasks. With PostgreSQL in ``--stores`` (the default) the cost of a count read at
the simulated sizes is measured on it. Environment: ``METAFORA_SIM_SEED`` (default 1),
``METAFORA_SIM_COUNT_APPROVED=0`` (do not count the offers approved for a claim burst in the
balancer's ``task_count``, as the consumer did before this round; it counts them now),
``METAFORA_SIM_BALANCE_EVERY``
(seconds, default 60: the consumer's), ``METAFORA_SIM_ROLLING`` (nodes restarted in the rolling
scenario at 1,000 nodes; ``all`` for every one).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from benchmarks.common import save, table
from benchmarks.restart import EVEN_WITHIN, LATE_S, is_even
from benchmarks.sim_load import extrapolate, measure_count_reads
from benchmarks.sim_model import SimConfig
from benchmarks.sim_node import Cluster
from metafora.balancers import FairBalancer
from metafora.contracts.balancer import Balancer

__all__ = ["Cluster", "cold_and_after", "late_starter", "markdown", "run_simulate"]

LIMIT = 300.0  # simulated seconds a phase may take before it is reported as not converged
ROLLING_SAMPLE = 20  # nodes restarted in the rolling scenario when the cluster is larger
RESTART_PAUSE_S = 1.0  # simulated seconds from a node's exit to its start again (a process start)


def fair(rng: random.Random) -> Balancer:
    """The balancer every simulated node runs: FairBalancer with its defaults."""
    return FairBalancer(rng=rng)


@dataclass
class Mark:
    """The counters at the start of a window."""

    at: float
    wall: float
    total_starts: int
    started: int
    counters: dict[str, int]
    offers: int


_COUNTERS = ("claim_requests", "claim_rows", "etcd_txns", "races_lost", "count_reads",
             "aux_reads", "release_requests", "releases")


def mark(cluster: Cluster) -> Mark:
    """The counters now."""
    s = cluster.store
    return Mark(cluster.now, time.monotonic(), s.total_starts, s.started,
                {name: sum(getattr(s, name)) for name in _COUNTERS}, s.offers_sent)


def window(cluster: Cluster, since: Mark) -> dict[str, Any]:
    """Moves, starts and store requests since ``since``, per node per second too."""
    s = cluster.store
    seconds = cluster.now - since.at
    nodes = max(1, len(cluster.nodes))
    out: dict[str, Any] = {"window_s": seconds, "nodes": nodes,
                           "starts": s.total_starts - since.total_starts,
                           "moves": (s.total_starts - since.total_starts) - (s.started - since.started),
                           "offers": s.offers_sent - since.offers, "wall_s": time.monotonic() - since.wall}
    for name in _COUNTERS:
        out[name] = sum(getattr(s, name)) - since.counters[name]
    per = nodes * seconds if seconds > 0 else math.nan
    out["per_node_s"] = {k: out[k] / per for k in ("claim_requests", "count_reads", "release_requests")}
    return out


def summary(cluster: Cluster) -> dict[str, Any]:
    """The counts now: min, max, share, and whether every node is even."""
    counts = cluster.counts()
    tasks = len(cluster.store.tasks)
    values = list(counts.values()) or [0]
    return {"nodes": len(counts), "min": min(values), "max": max(values),
            "share": tasks / max(1, len(counts)), "even": is_even(counts, tasks)}


def even(cluster: Cluster, nodes: int | None = None) -> Callable[[], bool]:
    """A check that every live node is even (and there are ``nodes``), computed only when the
    counts changed since the last call."""
    seen = [-1, False]

    def check() -> bool:
        version = cluster.store.version
        if version != seen[0]:
            counts = cluster.counts()
            seen[0] = version
            seen[1] = (nodes is None or len(counts) == nodes) and is_even(counts, len(cluster.store.tasks))
        return bool(seen[1])

    return check


def cold_and_after(nodes: int, tasks: int, cfg: SimConfig, seed: int, steady_s: float,
                   rolling: int) -> dict[str, Any]:
    """cold, steady, join, leave and rolling on one cluster, in that order."""
    out: dict[str, Any] = {}
    cluster = Cluster(tasks, cfg, seed, fair)
    names = [f"n{i:04d}" for i in range(nodes)]
    since = mark(cluster)
    for name in names:
        cluster.start(name)
    held_s = cluster.run_until(cluster.all_held, LIMIT)
    storm = window(cluster, since)  # the start-up storm: until every task is held
    cold_s = held_s + cluster.run_until(even(cluster, nodes), LIMIT - held_s)
    moves = cluster.store.total_starts - cluster.store.started
    out["cold"] = {"even_s": cold_s, "held_s": held_s, "extra_starts_per_task": moves / tasks,
                   "counts": summary(cluster), **storm, "until_even": window(cluster, since)}
    since = mark(cluster)
    cluster.run_for(steady_s)
    out["steady"] = {"seconds": steady_s, "counts": summary(cluster), **window(cluster, since)}
    since = mark(cluster)
    cluster.start("joiner")
    join_s = cluster.run_until(even(cluster, nodes + 1), LIMIT)
    out["join"] = {"even_s": join_s, "new_share": math.ceil(tasks / (nodes + 1)),
                   "counts": summary(cluster), **window(cluster, since)}
    since = mark(cluster)
    leaver = names[-1]
    held = cluster.counts()[leaver]
    cluster.stop(leaver)
    adopted_s = cluster.run_until(lambda: not cluster.running(leaver) and cluster.all_held(), LIMIT)
    adopted = window(cluster, since)["moves"]
    even_s = cluster.run_until(even(cluster, nodes), LIMIT)
    out["leave"] = {"adopted_s": adopted_s, "moves_adopted": adopted, "even_s": adopted_s + even_s,
                    "leaver_held": held, "counts": summary(cluster), **window(cluster, since)}
    out["rolling"] = rolling_restart(cluster, sorted({*names[:-1], "joiner"}), rolling)
    return out


def _gone(cluster: Cluster, name: str) -> bool:
    return not cluster.running(name)


def rolling_restart(cluster: Cluster, names: list[str], count: int) -> dict[str, Any]:
    """The first ``count`` of ``names`` in turn: graceful stop, start again, wait until all held."""
    since = mark(cluster)
    before = cluster.store.starts[:]
    chosen = names[:count]
    steps = []
    for name in chosen:
        began = cluster.now
        cluster.stop(name)
        cluster.run_until(partial(_gone, cluster, name), LIMIT)
        cluster.run_for(RESTART_PAUSE_S)
        cluster.start(name)
        cluster.run_until(cluster.all_held, LIMIT)
        steps.append(cluster.now - began)
    even_s = cluster.run_until(even(cluster, len(names)), LIMIT)
    tasks = len(cluster.store.tasks)
    starts = cluster.store.starts
    moved = window(cluster, since)
    per_task = moved["starts"] / tasks
    return {"restarted": len(chosen), "of": len(names), "even_after_s": even_s,
            "step_s_mean": sum(steps) / max(1, len(steps)),
            "starts_beyond_first_per_task": per_task,
            "extrapolated_per_task": per_task * len(names) / max(1, len(chosen)),
            "max_moves_of_a_task": max(a - b for a, b in zip(starts, before, strict=True)),
            "counts": summary(cluster), **moved}


def late_starter(nodes: int, tasks: int, cfg: SimConfig, seed: int) -> dict[str, Any]:
    """N - 1 nodes start, the last one LATE_S later: seconds until it holds its share."""
    cluster = Cluster(tasks, cfg, seed + 1, fair)
    for i in range(nodes - 1):
        cluster.start(f"e{i:04d}")
    cluster.run_for(LATE_S)
    since = mark(cluster)
    late = cluster.start("late")
    share = tasks / nodes
    store = cluster.store
    held_s = cluster.run_until(lambda: store.held[late.node] >= share * (1 - EVEN_WITHIN) - 1, LIMIT)
    even_s = cluster.run_until(even(cluster, nodes), LIMIT)
    return {"late_share_s": held_s, "even_s": held_s + even_s, "late_held": store.held[late.node],
            "share": share, "extra_starts_per_task": (store.total_starts - store.started) / tasks,
            "counts": summary(cluster), **window(cluster, since)}


def _config() -> SimConfig:
    return SimConfig(balance_every=float(os.environ.get("METAFORA_SIM_BALANCE_EVERY", "60")),
                     count_approved=os.environ.get("METAFORA_SIM_COUNT_APPROVED", "1") == "1")


def _rolling_count(nodes: int) -> int:
    wanted = os.environ.get("METAFORA_SIM_ROLLING", "")
    if wanted == "all":
        return nodes
    return int(wanted) if wanted else (nodes if nodes <= 100 else ROLLING_SAMPLE)


def run_simulate(quick: bool, kinds: list[str]) -> dict[str, Any]:
    """Every scenario at every size; print, extrapolate and save."""
    sizes = [(100, 100_000)] if quick else [(100, 1_000_000), (1000, 1_000_000)]
    steady_s = 60.0 if quick else 300.0
    seed = int(os.environ.get("METAFORA_SIM_SEED", "1"))
    cfg = _config()
    results: dict[str, Any] = {}
    for nodes, tasks in sizes:
        began = time.monotonic()
        data = cold_and_after(nodes, tasks, cfg, seed, steady_s, _rolling_count(nodes))
        data["late"] = late_starter(nodes, tasks, cfg, seed)
        data["wall_s"] = time.monotonic() - began
        results[f"{nodes}x{tasks}"] = data
        print(f"simulated {nodes} nodes x {tasks:,} tasks in {data['wall_s']:.0f} s")
    costs = measure_count_reads(sizes) if "postgresql" in kinds else {}
    load = {key: extrapolate(data, costs.get(key)) for key, data in results.items()}
    _print(results, load, cfg, steady_s)
    save("simulate", {"quick": quick, "seed": seed, "config": asdict(cfg), "steady_s": steady_s,
                      "limit_s": LIMIT, "balancer": repr(fair(random.Random(0))),
                      "count_read_cost_ms": costs, "results": results, "load": load})
    return results


def _print(results: dict[str, Any], load: dict[str, Any], cfg: SimConfig, steady_s: float) -> None:
    rows: list[tuple[Any, ...]] = []
    for key, r in results.items():
        roll = r["rolling"]
        rows.append((key, r["cold"]["even_s"], r["cold"]["extra_starts_per_task"],
                     f"{r['cold']['counts']['min']}-{r['cold']['counts']['max']}",
                     r["late"]["late_share_s"], r["steady"]["moves"],
                     f"{r['join']['moves']} / {r['join']['new_share']}", r["join"]["even_s"],
                     f"{r['leave']['moves_adopted']} / {r['leave']['leaver_held']}",
                     r["leave"]["even_s"],
                     f"{roll['extrapolated_per_task']:.2f} ({roll['restarted']}/{roll['of']})"))
    table(f"simulate: FairBalancer, balance every {cfg.balance_every:g} s, claim burst "
          f"{cfg.claim_burst}, count approved {cfg.count_approved}",
          ("nodes x tasks", "cold: even s", "cold: extra starts/task", "cold: min-max",
           "late: share s", f"steady {steady_s:g} s: moves", "join: moves / share", "join: even s",
           "leave: moves / held", "leave: even s", "rolling: starts/task"), rows)
    rows = []
    for key, per in load.items():
        for scenario, x in per.items():
            rows.append((key, scenario, x["claims_node_s"], x["count_reads_node_s"],
                         x["releases_node_s"], x["pg_requests_s"], x["pg_busy_s_per_s"],
                         x["etcd_requests_s"], x["etcd_watch_events_s"]))
    table("simulate: store load (per node per second; cluster-wide extrapolation)",
          ("nodes x tasks", "scenario", "claim req/node/s", "count reads/node/s", "release req/node/s",
           "PG req/s", "PG busy s/s", "etcd req/s", "etcd watch events/s"), rows)


def _n(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:,.{digits}f}"


def _size(key: str) -> str:
    nodes, tasks = key.split("x")
    return f"{int(nodes):,} x {int(tasks):,}"


def markdown(data: dict[str, Any]) -> str:
    """The saved results as the markdown tables of docs/benchmarks.md."""
    cfg = data["config"]
    out = [f"Simulated clusters (`python -m benchmarks simulate`, seed {data['seed']}): "
           f"{data['balancer']}, balance every {cfg['balance_every']:g} s, claim burst "
           f"{cfg['claim_burst']}, count approved offers {cfg['count_approved']}; "
           f"'-': not within {data['limit_s']:g} simulated s.", "",
           "| nodes x tasks | cold: s to all held / even | cold: moves per task | cold: min-max |"
           " late: s to share / even | steady " f"{data['steady_s']:g} s: moves |"
           " join: moves / new share | join: s to even | leave: moves / leaver's |"
           " leave: s to all held / even | rolling: starts per task (restarted) | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in data["results"].items():
        cold, late, join, leave, roll = (r[k] for k in ("cold", "late", "join", "leave", "rolling"))
        out.append(
            f"| {_size(key)} | {_n(cold['held_s'])} / {_n(cold['even_s'])} |"
            f" {cold['extra_starts_per_task']:.3f} | {cold['counts']['min']:,}-{cold['counts']['max']:,} |"
            f" {_n(late['late_share_s'])} / {_n(late['even_s'])} | {r['steady']['moves']:,} |"
            f" {join['moves']:,} / {join['new_share']:,} | {_n(join['even_s'])} |"
            f" {leave['moves_adopted']:,} / {leave['leaver_held']:,} |"
            f" {_n(leave['adopted_s'], 2)} / {_n(leave['even_s'])} |"
            f" {roll['extrapolated_per_task']:.2f} ({roll['restarted']:,} of {roll['of']:,}) |"
            f" {r['wall_s']:,.0f} |")
    costs = data.get("count_read_cost_ms") or {}
    measured = ("a count read measured at " + ", ".join(f"{_size(k)}: {v:,.0f} ms" for k, v in costs.items())
                if costs else "count reads not measured: no PostgreSQL busy time")
    out += ["", "Store load per node and extrapolated cluster-wide"
            f" (see `benchmarks/sim_load.py`; {measured}):", "",
            "| nodes x tasks | scenario | window s | claim req/node/s | count reads/node/s |"
            " release req/node/s | PostgreSQL tx/s | PostgreSQL busy s/s | etcd req/s |"
            " etcd watch events/s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key, per in data["load"].items():
        for scenario, x in per.items():
            out.append(
                f"| {_size(key)} | {scenario} | {x['window_s']:,.1f} |"
                f" {x['claims_node_s']:.2f} | {x['count_reads_node_s']:.2f} | {x['releases_node_s']:.3f} |"
                f" {x['pg_requests_s']:,.0f} | {_n(x['pg_busy_s_per_s'])} | {x['etcd_requests_s']:,.0f} |"
                f" {x['etcd_watch_events_s']:,.0f} |")
    return "\n".join(out)
