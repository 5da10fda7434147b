"""Gates throughput, this checkout against an earlier revision, interleaved in one session.

Both sides run this checkout's ``benchmarks/gates.py`` (same benchmark code, same stores, same
machine minute by minute); only the ``metafora`` package differs. The earlier revision is
checked out into a temporary ``git worktree`` (removed afterwards). Rounds alternate base and
head, so a change in the machine's load touches both; the figure is the median of each side's
items/s and the ratio head ÷ base per scenario.

    python benchmarks/gates_ab.py --base aa98784^1 [--rounds 3] [--items 50000]
                                  [--stores postgresql,sqlite]

Writes ``benchmarks/results/gates_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # python benchmarks/gates_ab.py

from benchmarks.common import RESULTS, save, table

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _run_side(root: Path, scratch: Path, items: int, stores: str) -> dict[str, float]:
    """One run of ``root``'s gates benchmark (this checkout's code, copied there for the base),
    importing ``metafora`` from ``root`` (checked), its results written to ``scratch``."""
    env = dict(os.environ, METAFORA_GATES_ITEMS=str(items), METAFORA_BENCH_RESULTS=str(scratch),
               PYTHONPATH=str(root))
    where = subprocess.run([sys.executable, "-c", "import metafora; print(metafora.__file__)"],
                           cwd=root, env=env, check=True, capture_output=True, text=True).stdout
    if not Path(where.strip()).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"metafora imports from {where.strip()}, not from {root}")
    subprocess.run([sys.executable, "benchmarks/gates.py", "--stores", stores], cwd=root, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    data = json.loads((scratch / "gates.json").read_text())["results"]
    return {f"{store}: {scenario}": float(v["items_per_s"])
            for store, scenarios in data.items() for scenario, v in scenarios.items()}


def run(base: str, rounds: int, items: int, stores: str) -> dict[str, Any]:
    """Measure ``rounds`` interleaved rounds of base and head; print and save the medians."""
    commit = _git("rev-parse", "--verify", f"{base}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="metafora-ab-") as tmp:
        tree = Path(tmp) / "base"
        _git("worktree", "add", "--detach", str(tree), commit)
        try:
            for source in (ROOT / "benchmarks").glob("*.py"):  # the same benchmark on both sides
                shutil.copy2(source, tree / "benchmarks" / source.name)
            sides = {"base": tree, "head": ROOT}
            runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for n in range(rounds):
                for side, root in sides.items():
                    out = Path(tmp) / side
                    out.mkdir(exist_ok=True)
                    runs[side].append(_run_side(root, out, items, stores))
                    print(f"round {n + 1}/{rounds} {side}: "
                          + ", ".join(f"{k} {v:,.0f}" for k, v in runs[side][-1].items()), flush=True)
        finally:
            _git("worktree", "remove", "--force", str(tree))
            shutil.rmtree(tree, ignore_errors=True)
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    rows = [(k, medians["base"][k], medians["head"][k], medians["head"][k] / medians["base"][k])
            for k in medians["head"] if k in medians["base"]]
    table(f"gates items/s, head vs {base} ({commit[:10]}), medians of {rounds} rounds, {items:,} items",
          ("scenario", "base items/s", "head items/s", "head / base"), rows)
    data = {"base": base, "base_commit": commit, "head_commit": _git("rev-parse", "HEAD"),
            "rounds": rounds, "items": items, "runs": runs,
            "results": {k: {"base": b, "head": h, "ratio": r} for k, b, h, r in rows}}
    save("gates_ab", data)
    return data


def main() -> None:
    """``python benchmarks/gates_ab.py --base REV [--rounds N] [--items N] [--stores ...]``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/gates_ab.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the earlier revision (a git rev)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--stores", default="postgresql,sqlite")
    args = parser.parse_args()
    if args.rounds < 1 or args.items < 100:
        parser.error("--rounds must be at least 1 and --items at least 100")
    RESULTS.mkdir(exist_ok=True)
    run(args.base, args.rounds, args.items, args.stores)


if __name__ == "__main__":
    main()
