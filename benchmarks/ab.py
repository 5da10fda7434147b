"""A benchmark, this checkout against an earlier revision, interleaved in one session.

Both sides run this checkout's benchmark code (copied into the earlier revision's tree), on the
same stores and the same machine minute by minute; only the ``metafora`` package differs. The
earlier revision is checked out into a temporary ``git worktree`` (removed afterwards). Rounds
alternate base and head in ABBA order (base, head; head, base; ...), so a change in the machine's
load, or a warm-up one side leaves the other, touches both; each figure is the median of a side's
rounds, and the ratio head / base. Use an even number of rounds for a balanced order.

    python benchmarks/ab.py claims --base REV [--rounds 3] [--stores sqlite,postgresql] [--full]
    python benchmarks/ab.py gates|latency|storm|peers --base REV ...
    METAFORA_STREAMS_MANY=0 python benchmarks/ab.py streams --base REV --stores sqlite --full
    python benchmarks/ab.py claims --base REV --save-as ab_moves_claims   # keep older results

Figures compared: claims, consumer tasks/s (the default balancer, and DumbBalancer: the
same consumer whatever the balancer's changes); storm, seconds until every task is held; gates,
items/s; latency, submit-to-start p50 and p99 (ms); peers, metafora's short tasks/s and
submit-to-start p50 (ms); streams, one stream's jobs/s, its ratio to the raw commit rate and
its CPU us per job (``METAFORA_STREAMS_MANY=0`` leaves the many-streams run out).
Writes ``benchmarks/results/ab_NAME.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # python benchmarks/ab.py

from benchmarks.common import ALLOW_DIRTY, RESULTS, save, settings, table

ROOT = Path(__file__).resolve().parent.parent
Figures = dict[str, float]


def _claims(results: Any) -> Figures:
    figures = {f"{r['store']}, {r['procs']} processes: tasks/s": float(r["consumer_tasks_per_s"])
               for r in results}
    figures.update({f"{r['store']}, {r['procs']} processes, DumbBalancer: tasks/s":
                    float(r["dumb_tasks_per_s"]) for r in results if "dumb_tasks_per_s" in r})
    return figures


def _storm(results: Any) -> Figures:
    return {f"{r['store']}, {r['tasks']:,} tasks / {r['processes']} processes: s to all held":
            float(r["seconds_to_all_held"]) for r in results}


def _gates(results: Any) -> Figures:
    return {f"{store}, {scenario}: items/s": float(v["items_per_s"])
            for store, scenarios in results.items() for scenario, v in scenarios.items()}


def _latency(results: Any) -> Figures:
    return {f"{store}: submit-to-start {pct} ms": float(v[f"{pct}_ms"])
            for store, v in results.items() for pct in ("p50", "p99")}


def _peers(summary: Any) -> Figures:
    out: Figures = {}
    for system, figures in summary.items():
        if system.startswith("metafora"):
            out[f"{system}: tasks/s"] = float(figures["tasks_per_s"]["median"])
            out[f"{system}: p50 ms"] = float(figures["p50_ms"]["median"])
    return out


def _herd(results: Any) -> Figures:
    out: Figures = {}
    for r in results:
        at = f"{r['store']}, {r['nodes']} nodes"
        for key, label in (("xacts_per_task", "txns/task"), ("cpu_ms_per_task", "CPU ms/task"),
                           ("races_lost_per_claim", "races lost/claim"), ("p50_ms", "p50 ms"),
                           ("p99_ms", "p99 ms"), ("tasks_per_s", "tasks/s")):
            out[f"{at}: {label}"] = float(r[key])
    return out


def _streams(results: Any) -> Figures:
    out: Figures = {}
    for store, r in results.items():
        out[f"{store}: raw commits/s"] = float(r["commit_rate"])
        out[f"{store}: CPU us/commit"] = float(r["commit_cpu_us"])
        for one in r["one_stream"]:
            at = f"{store}, max_processing {one['max_processing']}, {one['work']}"
            out[f"{at}: jobs/s"] = float(one["jobs_per_s"])
            out[f"{at}: x commit rate"] = float(one["jobs_per_s"]) / float(r["commit_rate"])
            out[f"{at}: CPU us/job"] = float(one["cpu_us_per_job"])
    return out


# name -> (the JSON key its figures sit under, how to read them)
READERS: dict[str, tuple[str, Callable[[Any], Figures]]] = {
    "claims": ("results", _claims),
    "storm": ("results", _storm),
    "gates": ("results", _gates),
    "latency": ("results", _latency),
    "peers": ("summary", _peers),
    "herd": ("results", _herd),
    "streams": ("results", _streams),
}


def _median(values: list[float]) -> float:
    """The median of the runs that measured (a NaN is a run that could not, e.g. a claims
    window with no task left in it); NaN when none did."""
    measured = [v for v in values if not math.isnan(v)]
    return statistics.median(measured) if measured else math.nan


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _command(name: str, quick: bool, stores: str) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks", name]
    if quick:
        cmd.append("--quick")
    if name == "peers":
        return [*cmd, "--rounds", "1", "--systems", "metafora-postgresql,metafora-sqlite"]
    return [*cmd, "--stores", stores]


# Run at start-up (site imports sitecustomize after the .pth files) on each side:
# - the editable install's finder goes: it serves any metafora module the root lacks from this
#   checkout, so a base revision imported a module added since (a worker process of peers once
#   loaded metafora.contracts from the head into a base without it);
# - a revision from before the floors' folders gets the new names of the modules that moved
#   (this checkout's table, metafora.core._moved.MOVED_MODULES, read backwards), each served as
#   the module of its old name, after the root's own files: the benchmark code of this checkout
#   imports the new names, as the head's finder serves the old ones.
_SITE = """\
import importlib, importlib.abc, importlib.machinery, sys, types

sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
_OLD = {new!r}
_FOLDERS = {{n.rsplit(".", 1)[0] for n in _OLD}}


class _NewNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname in _OLD or fullname in _FOLDERS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in _FOLDERS)
        return None

    def create_module(self, spec):
        if spec.name in _FOLDERS:
            return types.ModuleType(spec.name)
        return importlib.import_module(_OLD[spec.name])

    def exec_module(self, module):
        pass


sys.meta_path.append(_NewNames())
"""


def _site(scratch: Path) -> Path:
    """A directory with the sitecustomize above (for PYTHONPATH's head)."""
    from metafora.core._moved import MOVED_MODULES

    site = scratch / "site"
    site.mkdir(exist_ok=True)
    new = {now: was for was, now in MOVED_MODULES.items()}
    (site / "sitecustomize.py").write_text(_SITE.format(new=new))
    return site


def _run_side(name: str, root: Path, scratch: Path, quick: bool, stores: str) -> Figures:
    """One run of the benchmark, importing ``metafora`` from ``root`` only (checked)."""
    # The base tree holds this checkout's benchmark files (uncommitted there): a side's figures
    # are an intermediate file; the ab results file, saved here, is refused on a dirty head.
    site = _site(scratch)
    env = dict(os.environ, METAFORA_BENCH_RESULTS=str(scratch),
               PYTHONPATH=os.pathsep.join((str(site), str(root))), **{ALLOW_DIRTY: "1"})
    # Every metafora module the benchmark imports must come from root: an editable install
    # serves a top-level module root lacks (one added after its revision) from its own tree.
    check = (f"import sys, metafora, benchmarks.{name}; "
             "print('\\n'.join(getattr(m, '__file__', None) or '' for n, m in list(sys.modules.items())"
             " if n == 'metafora' or n.startswith('metafora.')))")
    files = subprocess.run([sys.executable, "-c", check], cwd=root, env=env, check=True,
                           capture_output=True, text=True).stdout.split()
    strays = [f for f in files if not Path(f).resolve().is_relative_to(root.resolve())]
    if not files or strays:
        raise RuntimeError(f"metafora imports from {', '.join(strays) or 'nowhere'}, not from {root}")
    subprocess.run(_command(name, quick, stores), cwd=root, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    key, read = READERS[name]
    saved = scratch / f"{name}.json"
    if not saved.exists():  # a variant saved under its own name (herd_single)
        saved = max(scratch.glob(f"{name}_*.json"), key=lambda p: p.stat().st_mtime)
    return read(json.loads(saved.read_text())[key])


def run(name: str, base: str, rounds: int, quick: bool, stores: str,
        save_as: str | None = None) -> dict[str, Any]:
    """Measure ``rounds`` interleaved rounds of base and head; print and save the medians
    (as ``results/ab_NAME.json``, or ``results/SAVE_AS.json``)."""
    commit = _git("rev-parse", "--verify", f"{base}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="metafora-ab-") as tmp:
        tree = Path(tmp) / "base"
        _git("worktree", "add", "--detach", str(tree), commit)
        try:
            for source in (ROOT / "benchmarks").glob("*.py"):  # the same benchmark on both sides
                shutil.copy2(source, tree / "benchmarks" / source.name)
            sides = {"base": tree, "head": ROOT}
            runs: dict[str, list[Figures]] = {side: [] for side in sides}
            # the machine's 1-minute load average as each run started and ended (a shared
            # machine: the figures are only as steady as it was)
            loads: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
            order: list[list[str]] = []
            for n in range(rounds):
                # ABBA: base first in even rounds, head first in odd ones, so neither side always
                # runs on the machine the other has just warmed (caches, autovacuum, page cache).
                names = ["base", "head"] if n % 2 == 0 else ["head", "base"]
                order.append(names)
                for side in names:
                    root = sides[side]
                    out = Path(tmp) / side
                    out.mkdir(exist_ok=True)
                    start = os.getloadavg()[0]
                    runs[side].append(_run_side(name, root, out, quick, stores))
                    loads[side].append((start, os.getloadavg()[0]))
                    print(f"{name} round {n + 1}/{rounds} {side}: "
                          + ", ".join(f"{k} {v:,.2f}" for k, v in runs[side][-1].items()), flush=True)
        finally:
            _git("worktree", "remove", "--force", str(tree))
            shutil.rmtree(tree, ignore_errors=True)
    medians = {side: {k: _median([r[k] for r in rs]) for k in rs[0]} for side, rs in runs.items()}
    rows = [(k, medians["base"][k], medians["head"][k], medians["head"][k] / medians["base"][k])
            for k in medians["head"] if k in medians["base"]]
    table(f"{name}, head vs {base} ({commit[:10]}), medians of {rounds} rounds"
          + (" (quick)" if quick else ""), ("figure", "base", "head", "head / base"), rows)
    data = {"name": name, "base": base, "base_commit": commit, "head_commit": _git("rev-parse", "HEAD"),
            "rounds": rounds, "order": order, "quick": quick, "settings": settings(),
            "runs": runs, "load_average": loads,
            "results": {k: {"base": b, "head": h, "ratio": r} for k, b, h, r in rows}}
    save(save_as or f"ab_{name}", data)
    return data


def main() -> None:
    """``python benchmarks/ab.py NAME --base REV [--rounds N] [--stores ...] [--full] [--save-as F]``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/ab.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(READERS))
    parser.add_argument("--base", required=True, help="the earlier revision (a git rev)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stores", default="sqlite,postgresql,etcd")
    parser.add_argument("--full", action="store_true", help="the full sizes, not --quick")
    parser.add_argument("--save-as", default=None,
                        help="the results file's name (default ab_NAME; a new name keeps older results)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    RESULTS.mkdir(exist_ok=True)
    run(args.name, args.base, args.rounds, not args.full, args.stores, args.save_as)


if __name__ == "__main__":
    main()
