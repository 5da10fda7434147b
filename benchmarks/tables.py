"""Render the figure tables of the benchmark pages (docs/benchmarks/*.md, their index
docs/benchmarks.md, and the README) from benchmarks/results/.

Every generated table sits between two markers in a markdown file::

    <!-- table: claims -->
    ...generated: a provenance line, a blank line, the table...
    <!-- /table -->

``python -m benchmarks.tables`` checks that each marked block is what its results file renders
(exit 1 and a diff when not: CI runs this); ``python -m benchmarks.tables --write`` rewrites the
blocks from the files. The provenance line names the results file, when and on what machine it
was measured, the command that made it and the commit it ran at (``save()`` in
benchmarks/common.py records both; files saved before it did say "not recorded" and the commit
that committed them, from their ``committed_in`` field).

To add a table:

1. Make the benchmark save its figures with ``benchmarks.common.save(name, data)`` and commit the
   file in benchmarks/results/ (a run for history: save it under a new name, e.g.
   ``storm_2026-11-28``, so the older file stays).
2. Write a renderer here: ``@table("name", source="results-file-stem", command="python -m ...")``
   over a function ``(data: dict) -> list[str]`` returning the markdown lines (a caption line, a
   blank line and the table are usual; ``row()`` and ``fmt()`` format cells the same way
   everywhere).
3. Put ``<!-- table: name -->`` and ``<!-- /table -->`` on two lines of the page where the table
   goes and run ``python -m benchmarks.tables --write``. Never edit a figure by hand between
   the markers: the check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
BENCHMARK_PAGES = ROOT / "docs" / "benchmarks"
"""One page per benchmark; docs/benchmarks.md is the generated index of where we stand."""
PAGES = (ROOT / "docs" / "benchmarks.md", *sorted(BENCHMARK_PAGES.glob("*.md")), ROOT / "README.md")
"""The markdown files whose marked blocks are generated."""
OVERVIEW = "overview"
"""The block of docs/benchmarks.md that lists every page's tables (:func:`overview`)."""

Renderer = Callable[[dict[str, Any]], list[str]]


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One generated table: its results file (``benchmarks/results/<source>.json``), the
    command that makes that file (when the file does not record it), and its renderer."""

    name: str
    source: str
    command: str
    render: Renderer


TABLES: dict[str, TableSpec] = {}


def table(name: str, *, source: str | None = None, command: str) -> Callable[[Renderer], Renderer]:
    """Register a renderer for the block ``<!-- table: name -->`` (see the module doc)."""

    def register(render: Renderer) -> Renderer:
        if name in TABLES:
            raise ValueError(f"two tables named {name!r}")
        TABLES[name] = TableSpec(name, source or name, command, render)
        return render

    return register


def fmt(value: Any) -> str:
    """A cell: floats by size (12,345 / 12.3 / 1.23), NaN as '-', the rest as str()."""
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def row(*cells: Any) -> str:
    """One markdown table row."""
    return "| " + " | ".join(fmt(c) for c in cells) + " |"


def header(*columns: str) -> list[str]:
    """A markdown table's header and rule."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def load(source: str) -> dict[str, Any]:
    """``benchmarks/results/<source>.json``."""
    data: dict[str, Any] = json.loads((RESULTS_DIR / f"{source}.json").read_text())
    return data


def provenance(spec: TableSpec, data: dict[str, Any]) -> str:
    """The line under which a table is traced to its file, command, commit and machine."""
    m = data.get("machine", {})
    machine = ", ".join(str(x) for x in (f"{m.get('cpus', '?')} CPUs", m.get("memory"),
                                          f"Python {m.get('python', '?')}", m.get("platform")) if x)
    command = data.get("command") or spec.command
    env = " ".join(f"{k}={v}" for k, v in (data.get("environment") or {}).items())
    command = f"{env} {command}" if env and data.get("command") else command
    if str(data.get("commit", "")).endswith("+dirty"):
        commit = (f"commit {data['commit']} (uncommitted changes: no commit reproduces these"
                  " figures)")
    elif data.get("commit"):
        commit = f"commit {data['commit']}"
    elif data.get("committed_in"):
        commit = f"commit not recorded (the results were committed in {data['committed_in']})"
    else:
        commit = "commit not recorded"
    quick = " (--quick)" if data.get("quick") else ""
    return (f"<sub>Generated by `python -m benchmarks.tables` from "
            f"`benchmarks/results/{spec.source}.json`: `{command}`{quick}, {commit}, measured "
            f"{data.get('measured_at', '?')} on {machine}.</sub>")


def commit_state(data: dict[str, Any]) -> str:
    """The commit a results file ran at, as a cell: the commit, "uncommitted changes" beside a
    ``+dirty`` one (no commit reproduces it), or "not recorded"."""
    recorded = str(data.get("commit") or "")
    if not recorded or recorded == "unknown":
        return "not recorded"
    if recorded.endswith("+dirty"):
        return f"{recorded.removesuffix('+dirty')[:7]}, uncommitted changes"
    return recorded[:7]


def overview(pages: Iterable[Path] | None = None) -> list[str]:
    """Where we stand: each benchmark page, the tables on it, and for each its results file,
    when it was measured and whether a commit reproduces it."""
    if pages is None:
        found = sorted(BENCHMARK_PAGES.glob("*.md"))
        pages = [p for p in found if p.stem != "history"] + [p for p in found if p.stem == "history"]
    out = ["Every table of the benchmark pages, the results file it is generated from, when that was"
           " measured and at which commit (\"uncommitted changes\": measured on a checkout no commit"
           " reproduces; \"not recorded\": saved before the commit was recorded):", ""]
    out += header("page", "table", "results file", "measured", "commit")
    for page in pages:
        text = page.read_text()
        title = text.splitlines()[0].lstrip("# ").strip()
        for match in _BLOCK.finditer(text):
            spec = TABLES[match["name"]]
            data = load(spec.source)
            out.append(row(f"[{title}](benchmarks/{page.name})", f"`{spec.name}`",
                           f"`{spec.source}.json`", str(data.get("measured_at", "?"))[:10],
                           commit_state(data)))
    return out


def render(name: str) -> list[str]:
    """The generated lines of one block (provenance, blank line, the renderer's lines)."""
    if name == OVERVIEW:
        return ["<sub>Generated by `python -m benchmarks.tables` from the benchmark pages and"
                " their results files.</sub>", "", *overview()]
    spec = TABLES[name]
    data = load(spec.source)
    return [provenance(spec, data), "", *spec.render(data)]


_BLOCK = re.compile(r"^<!-- table: (?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- /table -->$", re.M | re.S)


def rewrite(text: str) -> str:
    """``text`` with every marked block regenerated (KeyError for an unknown table name)."""

    def block(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in TABLES and name != OVERVIEW:
            raise KeyError(f"<!-- table: {name} --> has no renderer in benchmarks/tables.py")
        return f"<!-- table: {name} -->\n" + "\n".join(render(name)) + "\n<!-- /table -->"

    return _BLOCK.sub(block, text)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def check(pages: Iterable[Path] = PAGES, write: bool = False) -> list[str]:
    """The diffs between each page and its regenerated blocks (written back when ``write``)."""
    problems: list[str] = []
    for page in pages:
        if not page.exists():
            continue
        text = page.read_text()
        try:
            new = rewrite(text)
        except (KeyError, FileNotFoundError) as exc:
            problems.append(f"{_name(page)}: {exc}")
            continue
        if new == text:
            continue
        if write:
            page.write_text(new)
            continue
        rel = _name(page)
        problems.append("".join(difflib.unified_diff(
            text.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"{rel} (as committed)", tofile=f"{rel} (from benchmarks/results)")))
    return problems


# --- the tables ----------------------------------------------------------------------------


@table("claims", command="python -m benchmarks claims")
def _claims(data: dict[str, Any]) -> list[str]:
    if all("dumb_tasks_per_s" in r for r in data["results"]):
        return [
            "Claim throughput (consumer: claim + handler + fenced done per task, as a user starts"
            " it: the default balancer; the limit: the store's own batch claim path in bare loops,"
            " same processes, same run; the same consumers with `DumbBalancer` an extra column):",
            "",
            *header("store", "processes", "tasks", "one by one claims/s", "batch claims/s (the limit)",
                    "consumer tasks/s", "consumer / limit", "DumbBalancer tasks/s (extra)"),
            *(row(r["store"], r["procs"], r["tasks"], r["raw_claims_per_s"], r["batch_claims_per_s"],
                  r["consumer_tasks_per_s"], f"{r['ratio']:.0%}", r["dumb_tasks_per_s"])
              for r in data["results"]),
        ]
    if all("batch_claims_per_s" in r for r in data["results"]):
        return [
            "Claim throughput (consumer: claim + handler + fenced done per task; the limit: the"
            " store's own batch claim path in bare loops, same processes, same run):",
            "",
            *header("store", "processes", "tasks", "one by one claims/s", "batch claims/s (the limit)",
                    "consumer tasks/s", "consumer / limit"),
            *(row(r["store"], r["procs"], r["tasks"], r["raw_claims_per_s"], r["batch_claims_per_s"],
                  r["consumer_tasks_per_s"], f"{r['ratio']:.0%}") for r in data["results"]),
        ]
    # Results saved before the batch loop was measured: the raw loop claimed one task per
    # statement, not the store's batch path, so it was not the limit it was called.
    return [
        "Claim throughput (consumer: claim + handler + fenced done per task; raw: the bare claim"
        " statement/txn loop, same processes, same run):",
        "",
        *header("store", "processes", "tasks", "raw claims/s", "consumer tasks/s", "ratio"),
        *(row(r["store"], r["procs"], r["tasks"], r["raw_claims_per_s"], r["consumer_tasks_per_s"],
              f"{r['ratio']:.0%}") for r in data["results"]),
    ]


@table("storm", command="python -m benchmarks storm")
def _storm(data: dict[str, Any]) -> list[str]:
    def store(r: dict[str, Any]) -> str:
        members = r.get("etcd_members")
        return f"{r['store']}, {members} members" if members and members > 1 else r["store"]

    return [
        "Start-up storm (N pending tasks, P consumer processes started at once with the"
        " Consumer's default balancer and, unlike a user's default of 60 s, balance_every 5 s;"
        " async handlers holding their task; targets at 100,000 / 10: 30 s on SQL, 60 s on a"
        " 3-member etcd). A run re-measures the stores and size it ran and keeps the other rows:"
        " each row says when it was measured (the line above names the last run).",
        "",
        *header("store", "tasks / processes", "s to all held", "spread held", "spread +2 periods",
                "races lost / claim", "requests / task", "measured"),
        *(row(store(r), f"{r['tasks']:,} / {r['processes']}", r["seconds_to_all_held"],
              r["spread_at_all_held"], r["spread_after_2_periods"], r["races_lost_per_claim"],
              r["requests_per_task"], r.get("measured_at", "?"))
          for r in data["results"]),
    ]


@table("security", command="python -m benchmarks security")
def _security(data: dict[str, Any]) -> list[str]:
    return [
        "Costly requests on a `metafora web` process (SQLite), client-side time over one keep-alive"
        " connection (target: `/tasks` with ten 1 MiB errors under 100 ms):",
        "",
        *header("page", "requests", "bytes", "p50 ms", "max ms"),
        *(row(k, v["requests"], v["bytes"], v["p50_ms"], v["max_ms"]) for k, v in data["pages"].items()),
        "",
        "The dashboard's resident memory under a large `POST /login` body (target: grows by less than"
        " 10 MB):",
        "",
        *header("body", "answer", "MiB accepted", "RSS before KiB", "RSS after KiB", "grown MB"),
        *(row(k, v["answer"], v["mib_accepted"], v["rss_before_kib"], v["rss_after_kib"], v["grown_mb"])
          for k, v in data.get("memory", {}).items()),
        *_security_round_three(data.get("round_three")),
    ]


def _security_round_three(cases: dict[str, Any] | None) -> list[str]:
    """The third round's cases (issue 52), where the results file has them."""
    if not cases:
        return []
    return ["", "The third round's cases (SQLite; each holds when the value is refused or the "
            "answer is right):", "", *header("case", "holds", "figure"),
            *(row(k, v["holds"], v["figure"]) for k, v in cases.items())]


@table("latency", command="python -m benchmarks latency")
def _latency(data: dict[str, Any]) -> list[str]:
    return [
        "Submit-to-start latency on an idle cluster of 3 consumer processes (ms):",
        "",
        *header("store", "submits", "p50", "p99", "max"),
        *(row(k, v["submits"], v["p50_ms"], v["p99_ms"], v["max_ms"]) for k, v in data["results"].items()),
    ]


@table("failover", command="python -m benchmarks failover")
def _failover(data: dict[str, Any]) -> list[str]:
    return [
        "Failover of one of 3 consumers holding 100 tasks (lease_ttl 3 s): seconds until all its"
        " tasks run elsewhere:",
        "",
        *header("store", "tasks on the killed node", "SIGKILL (target ≤ 4 s)", "tasks on the stopped node",
                "SIGTERM (target ≤ 1 s)"),
        *(row(k, v["kill_tasks"], v["kill_s"], v["graceful_tasks"], v["graceful_s"])
          for k, v in data["results"].items()),
    ]


@table("at_risk", command="python -m benchmarks at_risk --quick")
def _at_risk(data: dict[str, Any]) -> list[str]:
    return [
        *header("store", "fault", "lease_ttl", "warned after", "lead to stop", "lead to expiry"),
        *(row(k, f, v["lease_ttl_s"], v["warned_after_s"], v["lead_to_stop_s"], v["lead_to_expiry_s"])
          for k, faults in data["results"].items() for f, v in faults.items()),
    ]


@table("scale", command="python -m benchmarks scale")
def _scale(data: dict[str, Any]) -> list[str]:
    out = [
        "Scale: coordinator claims/s with 10,000 vs many finished tasks in the store; RSS of a"
        " consumer running 1,000 tasks; idle store requests per second per idle node:",
        "",
        *header("store", "claims/s (10k)", "claims/s (big)", "change", "RSS MiB", "idle req/s/node"),
    ]
    for k, v in data["results"].items():
        big = next(val for key, val in v.items()
                   if key.startswith("claims_per_s_") and key != "claims_per_s_10k")
        out.append(row(k, v["claims_per_s_10k"], big, f"{v['change']:+.0%}", v["rss_mib_1000_tasks"],
                       v["idle_requests_per_s_per_node"]))
    pg = data["results"].get("postgresql")
    if pg:
        out += ["", f"PostgreSQL claim plan: `{pg['claim_plan']}`"]
    return out


@table("capacity", command="python benchmarks/capacity.py --stores sqlite,postgresql,etcd")
def _capacity(data: dict[str, Any]) -> list[str]:
    out = header("store", "handlers", "s to hold", "RSS MiB", "idle RSS MiB", "KiB/task", "threads",
                 "shutdown s", "ignored stop()", "pending after")
    for v in data["results"]:
        if "error" in v:
            out.append(row(v["store"], v["mode"], v["error"], "", "", "", "", "", "", ""))
            continue
        out.append(row(v["store"], v["mode"], v["seconds_to_hold"], v["rss_mib"], v["idle_rss_mib"],
                       v["kib_per_task"], v["threads"], v["shutdown_s"], v["ignored_stop"],
                       v["pending_after"]))
    return out


@table("submit_application", command="python -m benchmarks submit --stores postgresql,sqlite")
def _submit_application(data: dict[str, Any]) -> list[str]:
    from benchmarks.submit import CASES, WAY_NAMES

    load = data["load_average"]
    out = [f"Medians of {data['results'][0]['rounds']} interleaved rounds, tasks/s (range of the"
           f" rounds); load average (1, 5, 15 min) {', '.join(map(str, load['before']))} before,"
           f" {', '.join(map(str, load['after']))} after.", ""]
    out += header("store", "path", "tasks", "baseline", "tasks/s", "way", "tasks/s", "ratio")
    ways = {(path, size): names for path, size, names in CASES}
    for v in data["results"]:
        names = ways[v["path"], v["size"]]
        base = v["tasks_per_s"][names[0]]
        label = f"batch of {v['size']:,}" if v["path"] == "transaction" else f"{v['size']} concurrent"
        for way in names[1:]:
            got = v["tasks_per_s"][way]
            out.append(row(v["store"], label, f"{v['tasks']:,}", WAY_NAMES[names[0]], _ranged(base),
                           WAY_NAMES[way], _ranged(got), f"{got['median'] / base['median']:.2f}x"))
    return out


def _ranged(figure: dict[str, float]) -> str:
    return f"{fmt(figure['median'])} ({fmt(figure['min'])}-{fmt(figure['max'])})"


@table("peers", command="python -m benchmarks peers --rounds 3 --systems "
                        "metafora-postgresql,metafora-sqlite,pgqueuer")
def _peers(data: dict[str, Any]) -> list[str]:
    from benchmarks.peers import Spread, labels_for, markdown

    summary = {s: {k: Spread(**v) for k, v in f.items()} for s, f in data["summary"].items()}
    labels = dict(data["labels"])
    if "pgqueuer" in labels:  # the row was always the capped one: said so in results saved before
        labels["pgqueuer"] = labels_for(["pgqueuer"], data.get("versions", {}))["pgqueuer"]
    return markdown(summary, labels, data["rounds"], data["tasks"], data["submits"]).splitlines()


@table("peers_first", command="METAFORA_PEERS_NAME=peers_first METAFORA_PEERS_WORKLOADS=throughput"
                              " python -m benchmarks peers --rounds 4 --systems metafora-postgresql,"
                              "metafora-sqlite,pgqueuer-default,pgqueuer-recommended,metafora-postgresql-10")
@table("peers_first_20k", command="METAFORA_PEERS_NAME=peers_first_20k METAFORA_PEERS_TASKS=20000"
                                  " METAFORA_PEERS_WORKLOADS=throughput python -m benchmarks peers --rounds 3"
                                  " --systems metafora-postgresql,metafora-sqlite,pgqueuer-default,"
                                  "pgqueuer-recommended,metafora-postgresql-10")
@table("peers_first2", command="METAFORA_PEERS_NAME=peers_first2 METAFORA_PEERS_WORKLOADS=throughput"
                               " python -m benchmarks peers --rounds 3 --systems metafora-postgresql,"
                               "metafora-sqlite,pgqueuer-default,pgqueuer-recommended")
@table("peers_first2_20k", command="METAFORA_PEERS_NAME=peers_first2_20k METAFORA_PEERS_TASKS=20000"
                                   " METAFORA_PEERS_WORKLOADS=throughput python -m benchmarks peers"
                                   " --rounds 3 --systems metafora-postgresql,metafora-sqlite,"
                                   "pgqueuer-default,pgqueuer-recommended")
@table("peers_short", command="METAFORA_PEERS_TASKS=20000 METAFORA_PEERS_WORKLOADS=throughput"
                              " METAFORA_PEERS_NAME=peers_short python -m benchmarks peers --rounds 8"
                              " --systems metafora-postgresql,metafora-postgresql-dumb,"
                              "metafora-sqlite,metafora-sqlite-dumb,pgqueuer")
@table("peers_short_sqlite", command="METAFORA_PEERS_TASKS=20000 METAFORA_PEERS_WORKLOADS=throughput"
                                     " METAFORA_PEERS_NAME=peers_short_sqlite python -m benchmarks peers"
                                     " --rounds 6 --systems metafora-sqlite,metafora-sqlite-dumb,pgqueuer")
def _peers_short(data: dict[str, Any]) -> list[str]:
    return [f"Load average {data['load_average_at_start']:.1f} at the start,"
            f" {data['load_average_at_end']:.1f} at the end (2 cores).", "", *_peers(data)]


@table("restart_quick_2026-11-29", source="restart_quick_2026-11-29",
       command="python -m benchmarks restart --quick --stores sqlite,postgresql,etcd")
@table("restart_quick_2026-11-29_eighth", source="restart_quick_2026-11-29_eighth",
       command="python -m benchmarks restart --quick --stores sqlite,postgresql,etcd")
@table("restart_2026-11-29", source="restart_2026-11-29",
       command="python -m benchmarks restart --stores sqlite,postgresql,etcd")
@table("restart_2026-11-29_quiet", source="restart_2026-11-29_quiet",
       command="python -m benchmarks restart --stores sqlite,postgresql,etcd")
def _restart(data: dict[str, Any]) -> list[str]:
    load = ", ".join(f"{x:.1f}" for x in data["load_average"])
    out = [f"{data['nodes']} processes, {data['tasks']:,} long-running tasks, balancer"
           f" {data['balancer']}, balance every {data['balance_every']:g} s; load average at the"
           f" end {load} (2 cores).", ""]
    out += header("store", "cold: even s", "cold: extra starts/task", "late: share s",
                  "steady: moves", "join: moves / share", "leave: moves / held",
                  "rolling: starts/task")
    for kind, r in data["results"].items():
        out.append(row(kind, r["cold"]["even_s"], r["cold"]["extra_starts_per_task"],
                       r["late"]["late_share_s"], r["steady"]["moves"],
                       f"{r['join']['moves']:,} / {r['join']['new_share']:,}",
                       f"{r['leave']['moves']:,} / {r['leave']['leaver_held']:,}",
                       r["rolling"]["starts_beyond_first_per_task"]))
    return out


@table("rolling", command="METAFORA_ROLLING_SIZES=5x10000 python -m benchmarks rolling"
                          " --stores sqlite,postgresql")
@table("rolling_first", command="python -m benchmarks rolling --stores sqlite,postgresql")
@table("rolling_base", command="METAFORA_ROLLING_STICKY_FOR=0 METAFORA_ROLLING_NAME=rolling_base"
                               " python -m benchmarks rolling --stores sqlite,postgresql"
                               " (benchmarks/rolling.py copied into a checkout of 455fe10)")
def _rolling(data: dict[str, Any]) -> list[str]:
    load = ", ".join(f"{x:.1f}" for x in data["load_average"])
    sticky = (f"same ids with `sticky_for={data['sticky_for']:g}` (opt-in)" if data["sticky_for"]
              else "same ids without a hold (no `sticky_for`)")
    out = [f"Each process in turn: SIGTERM, joined, started again; {sticky}; new ids at the"
           f" defaults. Load average {load} (2 cores). Targets (issue 51): same ids at most"
           " 1.05 starts per task and every gap at most its process's restart + 1 s; new ids no"
           " worse than the base (2.0 starts per task, the fewest a leave and a join can cost).",
           ""]
    out += header("store", "size", "ids", "starts/task", "max starts of a task",
                  "restart s (max)", "max gap - restart s", "gaps > restart + 1 s",
                  "even after a restart (max s)", "cold start: even s", "starts target",
                  "gaps target")
    for r in data["results"]:
        same = r["ids"] == "same" and data["sticky_for"]
        starts_ok = r["starts_per_task"] <= (1.05 if same else 2.0 + 0.01)
        gaps_ok = r["gaps_over_restart_plus_1s"] == 0
        out.append(row(r["store"], f"{r['nodes']} x {r['tasks']:,}", r["ids"], r["starts_per_task"],
                       r["max_starts_of_a_task"], max(r["restart_s"]), r["max_gap_over_restart_s"],
                       f"{r['gaps_over_restart_plus_1s']:,} of {r['gaps']:,}",
                       max(r["even_after_each_s"]), r["cold_even_s"],
                       "met" if starts_ok else "missed",
                       ("met" if gaps_ok else "missed") if same else "-"))
    return out


@table("idle_cluster", command="python -m benchmarks idle_cluster")
def _idle_cluster(data: dict[str, Any]) -> list[str]:
    out = [f"{data['results'][0]['nodes']} nodes at the Consumer's defaults holding every task (async"
           " handlers); the store's work per node per second over the window, which starts"
           " `settle` seconds after all were held." + (f" Note: {data['note']}." if data.get("note") else ""),
           ""]
    out += header("store", "held tasks", "rows read /s", "blocks /s", "transactions /s",
                  "statements /s", "requests /s", "s to all held", "settle, window (s)")
    for r in data["results"]:
        per = r["per_node_per_s"]
        nan = float("nan")
        out.append(row(r["store"], f"{r['tasks']:,}", per.get("rows", nan), per.get("blocks", nan),
                       per.get("xacts", nan), per.get("statements", nan), per.get("requests", nan),
                       r["seconds_to_all_held"],
                       f"{r.get('settle_s', data['settle_s']):.0f}, "
                       f"{r.get('window_s', data['window_s']):.0f}"))
    return out


def _ab(data: dict[str, Any]) -> list[str]:
    """An A/B of two revisions (``benchmarks/ab.py``): medians, each side's range, the ratio."""
    runs, loads = data["runs"], data.get("load_average")
    quick = ", --quick sizes" if data["quick"] else ""
    settings = "".join(f", {k}={v}" for k, v in data.get("settings", {}).items())
    if loads:
        every = [x for side in loads.values() for pair in side for x in pair]
        load = f"load average {min(every):.1f}-{max(every):.1f} on 2 cores as the runs started and ended"
    else:
        load = "load average not recorded"
    out = [f"`{data['name']}`: head {data['head_commit'][:7]} against base {data['base_commit'][:7]}"
           f" ({data['base']}), medians of {data['rounds']} rounds in ABBA order{quick}{settings};"
           f" {load}:", ""]
    out += header("figure", "base", "head", "head / base", "base runs (min-max)", "head runs (min-max)")
    for figure, r in data["results"].items():
        spread = [f"{fmt(min(x[figure] for x in runs[side]))}-{fmt(max(x[figure] for x in runs[side]))}"
                  for side in ("base", "head")]
        out.append(row(figure, r["base"], r["head"], f"{r['ratio']:.2f}", *spread))
    return out


@table("prune", command="python -m benchmarks prune --stores sqlite,postgresql")
def _prune(data: dict[str, Any]) -> list[str]:
    round_s = data.get("round_s", 20.0)
    out = [f"{data['rows']:,} finished tasks pruned while a consumer process claims short tasks;"
           f" rounds of {round_s:.0f} s without and with pruning alternate until they are gone,"
           " each round with pruning against the mean of the rounds without on either side"
           " (median of the rounds). Rows/s include the pruner's rests between batches; the"
           " load is the machine's 1-minute load average at the rounds' ends (median, range);"
           " each store's run names its commit.",
           ""]
    out += header("store", "pruned", "prune s", "rows/s", "rounds", "consumer tasks/s without",
                  "with", "with / without (median)", "rounds' ratios (min-max)", "load", "commit")
    for r in data["results"]:
        ratios = r["ratios"] or [float("nan")]
        load = r["load_1m"]
        out.append(row(r["store"], f"{r['pruned']:,}", r["prune_s"], r["rows_per_s"], r["rounds"],
                       r["median_without_tasks_per_s"], r["median_with_tasks_per_s"],
                       f"{r['ratio']:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}",
                       f"{r['median_load_1m']:.1f} ({min(load):.1f}-{max(load):.1f})",
                       r.get("commit", data.get("commit", "?"))))
    return out


for _source in ("ab_moves_claims", "ab_moves_claims_sqlite", "ab_moves_gates", "ab_moves_peers",
                "ab_moves_storm"):
    table(_source, command="python benchmarks/ab.py NAME --base 358ea26")(_ab)
# A/B tables saved with --save-as NAME: NAME -> (environment, ab.py arguments before --save-as).
_AB_RUNS = {
    "ab_storm_issue33": ("", "storm --base c519f1d --stores postgresql --rounds 2 --full"),
    "ab_moves_claims_sqlite_quiet": ("METAFORA_CLAIMS_TASKS=5000",
                                     "claims --base 358ea26 --rounds 6 --stores sqlite"),
    "ab_storm_offers": ("", "storm --base 79e15f6 --rounds 4 --full --stores postgresql,sqlite"),
    "ab_moves_gates_sqlite_quiet": ("", "gates --base 358ea26 --rounds 4 --stores sqlite"),
    "ab_moves_peers_quiet": ("METAFORA_PEERS_TASKS=5000 METAFORA_PEERS_WORKLOADS=throughput,latency",
                             "peers --base 358ea26 --rounds 4"),
    "ab_moves_peers_latency": ("METAFORA_PEERS_WORKLOADS=latency", "peers --base 358ea26 --rounds 8"),
    "ab_moves_claims_sqlite_quiet2": ("METAFORA_CLAIMS_TASKS=5000",
                                      "claims --base 358ea26 --rounds 6 --stores sqlite"),
    "ab_storm_etcd3": ("METAFORA_BENCH_ETCD_MEMBERS=3",
                       "storm --base fec03b5 --rounds 2 --full --stores etcd"),
    "ab_storm_today_sqlite": ("", "storm --base fec03b5 --rounds 2 --full --stores sqlite"),
    "ab_storm_today_pg": ("", "storm --base fec03b5 --rounds 2 --full --stores postgresql"),
    "ab_storm_gc_etcd3": ("METAFORA_BENCH_ETCD_MEMBERS=3",
                          "storm --base 3c268bb --rounds 4 --full --stores etcd"),
    "ab_storm_gc_sql": ("", "storm --base 3c268bb --rounds 2 --full --stores postgresql,sqlite"),
    "ab_claims_dumb_sqlite": ("METAFORA_CLAIMS_PROCS=1,2",
                              "claims --base 358ea26 --rounds 4 --stores sqlite --full"),
    "ab_final_storm": ("", "storm --base 358ea26 --rounds 4 --stores sqlite,postgresql,etcd"),
    "ab_final_gates": ("", "gates --base 358ea26 --rounds 4 --stores sqlite,postgresql"),
    "ab_final_gates_pg": ("", "gates --base 358ea26 --rounds 6 --stores postgresql"),
    "ab_final_peers": ("METAFORA_PEERS_TASKS=5000 METAFORA_PEERS_WORKLOADS=throughput,latency",
                       "peers --base 358ea26 --rounds 4"),
    "ab_storm_etcd3_today": ("METAFORA_BENCH_ETCD_MEMBERS=3",
                             "storm --base 4877bf8 --rounds 2 --full --stores etcd"),
    "ab_peers_checkpoints": ("METAFORA_PEERS_TASKS=20000 METAFORA_PEERS_WORKLOADS=throughput",
                             "peers --base 8c0b369 --rounds 4"),
    "ab_house_claims": ("METAFORA_CLAIMS_PROCS=2", "claims --base 455fe10 --rounds 2 --stores sqlite"),
    "ab_house_storm": ("", "storm --base 455fe10 --rounds 4 --stores sqlite"),
    "ab_house_gates": ("", "gates --base 455fe10 --rounds 2 --stores sqlite"),
    "ab_house_peers": ("", "peers --base 455fe10 --rounds 2"),
    "ab_house_peers_latency_branch": ("METAFORA_PEERS_WORKLOADS=latency", "peers --base 0edbcfa --rounds 4"),
}
_AB_RUNS["ab_herd_bulk"] = ("", "herd --base main --rounds 4 --full --stores postgresql")
_AB_RUNS["ab_streams_issue49"] = ("METAFORA_STREAMS_MANY=0",
                                  "streams --base e628112 --rounds 4 --full --stores sqlite")
_AB_RUNS["ab_herd_bulk_two"] = ("METAFORA_HERD_NODES=2",
                                "herd --base main --rounds 2 --full --stores postgresql")
_AB_RUNS["ab_herd_bulk_ten"] = ("METAFORA_HERD_NODES=10",
                                "herd --base main --rounds 2 --full --stores postgresql")
_AB_RUNS["ab_herd_single"] = ("METAFORA_HERD_SUBMIT=single METAFORA_HERD_TASKS=2000",
                              "herd --base main --rounds 2 --full --stores postgresql")
_AB_RUNS["ab_peers_first"] = ("METAFORA_PEERS_TASKS=5000 METAFORA_PEERS_WORKLOADS=throughput",
                              "peers --base 2f4c031 --rounds 4 --full")
_AB_RUNS["ab_peers_first_20k"] = ("METAFORA_PEERS_TASKS=20000 METAFORA_PEERS_WORKLOADS=throughput",
                                  "peers --base 2f4c031 --rounds 4 --full")
# Issue 48's closing A/B: the house (floors as folders, the moved names' finder) and the rest of
# round 5 against main before its house changes, on a quiet machine.
for _bench in ("claims", "storm", "gates", "peers"):
    _AB_RUNS[f"ab_house_final_{_bench}"] = ("", f"{_bench} --base 455fe10 --rounds 2")
_AB_RUNS["ab_house_quiet_claims"] = ("", "claims --base 358ea26 --rounds 4")
_AB_RUNS["ab_house_final_gates6"] = ("", "gates --base 455fe10 --rounds 6")
_AB_RUNS["ab_house_final_claims_pg4"] = ("METAFORA_CLAIMS_PROCS=4",
                                         "claims --base 455fe10 --rounds 4 --stores postgresql")
for _source, (_env, _args) in _AB_RUNS.items():
    table(_source, command=f"{_env + ' ' if _env else ''}python benchmarks/ab.py {_args}"
                           f" --save-as {_source}")(_ab)


def _herd_growth(data: dict[str, Any]) -> list[str]:
    """The herd's A/B as growth: each side's 10-node figure over its 2-node one (target 1.3x)."""
    res = data["results"]
    out = ["What a task costs on 10 nodes over what it costs on 2 (medians of the rounds above;"
           " the target is at most 1.3x for both):", ""]
    out += header("figure", "base 2", "base 10", "base 10/2", "head 2", "head 10", "head 10/2")
    for label in ("txns/task", "CPU ms/task", "races lost/claim"):
        two, ten = res.get(f"postgresql, 2 nodes: {label}"), res.get(f"postgresql, 10 nodes: {label}")
        if two is None or ten is None:
            continue
        out.append(row(label, two["base"], ten["base"], f"{ten['base'] / two['base']:.2f}x",
                       two["head"], ten["head"], f"{ten['head'] / two['head']:.2f}x"))
    return out


for _source in ("ab_herd_bulk", "ab_herd_single"):
    table(f"{_source}_growth", source=_source, command=f"python benchmarks/ab.py ({_source})")(_herd_growth)


@table("streams", command="python -m benchmarks streams")
def _streams(data: dict[str, Any]) -> list[str]:
    results = data["results"]
    first = next(iter(results.values()))
    jobs = first["one_stream"][0]["jobs"]
    load = data.get("load_before", [float("nan")])[0]
    out = [f"One stream of {jobs:,} jobs prefilled in a `SQLJobLog`, no-op work, options at their"
           " defaults but `max_search_ahead` (max(100, 4 x max_processing)). jobs/s: the stream's rate,"
           " from the first job's start to the last job's end; beside it the store's raw commit rate"
           " (single-row commits through the bare driver) measured in the same run. Target: at least"
           " 10x the commit rate at 64 in flight. Also the seconds from the submit to the stored"
           " processed index at the last job: they add the claim, the source's start-up and the last"
           " write (at most every `flush_every`, 0.5 s). The CPU time of the process (every thread)"
           " per job and per commit moves less than a rate on a loaded machine."
           f" 1-minute load {load:.1f} at the start.", ""]
    out += header("store", "max_processing", "work", "jobs/s", "raw commits/s", "x commit rate",
                  "CPU µs per job / per commit", "s to stored")
    for kind, r in results.items():
        for one in r["one_stream"]:
            out.append(row(kind, one["max_processing"], f"`{one['work']}`", one["jobs_per_s"],
                           r["commit_rate"], f"{one['jobs_per_s'] / r['commit_rate']:.2f}x",
                           f"{one['cpu_us_per_job']:.1f} / {r['commit_cpu_us']:.1f}", one["seconds"]))
    out += ["", "Many streams over 4 worker processes (`max_processing=4`, no-op work), all done: the"
            " streams per node when the jobs were done and once the fair balancer evened them out"
            " (its rounds are 60 s apart), and how many streams `metafora streams` showed lagging"
            " when a third of the jobs were done.", ""]
    out += header("store", "streams x jobs", "seconds", "jobs/s", "per node at done", "per node",
                  "even (within one)", "lagging mid-run")
    for kind, r in results.items():
        many = r["many_streams"]
        after = many.get("even_after_done_s")
        out.append(row(kind, f"{many['streams']} x {many['jobs_per_stream']:,}", many["seconds"],
                       many["jobs_per_s"], " / ".join(str(v) for v in many["per_node_at_done"].values()),
                       " / ".join(str(v) for v in many["per_node"].values()),
                       "no" if after is None else f"yes, {after:.0f} s after done",
                       many["lagging_streams_mid_run"]))
    for kind, r in results.items():
        listing = r["many_streams"].get("metafora_streams_mid_run", "").splitlines()
        if len(listing) > 3:
            out += ["", f"`metafora streams` on {kind} when a third of the jobs were done (its first"
                    " lines):", "", "```text", *listing[:7], "```"]
            break
    return out


@table("herd_statements", command="METAFORA_BENCH_COUNT=DIR python -m benchmarks herd (2, then 10"
       " nodes); python -m benchmarks.statement_counts --save herd_statements DIR2 DIR10")
def _herd_statements(data: dict[str, Any]) -> list[str]:
    """What the herd's nodes asked PostgreSQL, by kind and statement, at 2 and at 10 nodes."""
    two, ten = data["runs"]["2"], data["runs"]["10"]
    out = [f"One run of each size, {data['tasks']:,} tasks (load {data['load_at_save']:.1f} on 2"
           " cores as it was saved); connections by kind (a read is one transaction), then the"
           " statements (`hot:` the claim / finish round trips; rows: what the watch's scans and"
           " the claims returned):", ""]
    out += header("what", "2 nodes", "10 nodes", "10 / 2", "rows at 2", "rows at 10")
    for kind in ("read", "hot", "write", "transaction"):
        a, b = two["txns"].get(kind, 0), ten["txns"].get(kind, 0)
        out.append(row(f"connections: {kind}", a, b, f"{b / a:.2f}x" if a else "-", "", ""))
    names = sorted(set(two["stmts"]) | set(ten["stmts"]),
                   key=lambda n: (-(two["stmts"].get(n, 0) + ten["stmts"].get(n, 0)), n))
    for name in names[:16]:
        a, b = two["stmts"].get(name, 0), ten["stmts"].get(name, 0)
        out.append(row(f"`{name}`", a, b, f"{b / a:.2f}x" if a else "-",
                       two["rows"].get(name, ""), ten["rows"].get(name, "")))
    return out


def main(argv: list[str] | None = None) -> int:
    """Check (default) or ``--write`` the generated blocks; ``--list`` the tables."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the blocks from the results files")
    parser.add_argument("--list", action="store_true", help="list the tables and their results files")
    args = parser.parse_args(argv)
    if args.list:
        for spec in TABLES.values():
            print(f"{spec.name}: benchmarks/results/{spec.source}.json ({spec.command})")
        return 0
    problems = check(write=args.write)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("the tables differ from their results files: `python -m benchmarks.tables --write` "
              "regenerates them (never edit a figure by hand)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


