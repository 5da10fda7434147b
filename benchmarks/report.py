"""Print the saved results (benchmarks/results/*.json) as the markdown tables of docs/benchmarks.md."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.common import RESULTS


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _row(*cells: Any) -> str:
    return "| " + " | ".join(_fmt(c) for c in cells) + " |"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return (
            f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
        )
    return str(value)


def main() -> None:
    """Print every table whose results exist."""
    out: list[str] = []
    if (data := _load("claims")) is not None:
        out += [
            "Claim throughput (consumer: claim + handler + fenced done per task; raw: the bare claim"
            " statement/txn loop, same processes, same run):",
            "",
            "| store | processes | tasks | raw claims/s | consumer tasks/s | ratio |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            _row(
                r["store"],
                r["procs"],
                r["tasks"],
                r["raw_claims_per_s"],
                r["consumer_tasks_per_s"],
                f"{r['ratio']:.0%}",
            )
            for r in data["results"]
        ]
        out.append("")
    if (data := _load("latency")) is not None:
        out += [
            "Submit-to-start latency on an idle cluster of 3 consumer processes (ms):",
            "",
            "| store | submits | p50 | p99 | max |",
            "|---|---|---|---|---|",
        ]
        out += [
            _row(k, v["submits"], v["p50_ms"], v["p99_ms"], v["max_ms"]) for k, v in data["results"].items()
        ]
        out.append("")
    if (data := _load("peers")) is not None:
        from benchmarks.peers import readme_text

        out += [readme_text(data)]
    if (data := _load("failover")) is not None:
        out += [
            "Failover of one of 3 consumers holding 100 tasks (lease_ttl 3 s): seconds until all its"
            " tasks run elsewhere:",
            "",
            "| store | tasks on the killed node | SIGKILL (target ≤ 4 s) | tasks on the stopped node |"
            " SIGTERM (target ≤ 1 s) |",
            "|---|---|---|---|---|",
        ]
        out += [
            _row(k, v["kill_tasks"], v["kill_s"], v["graceful_tasks"], v["graceful_s"])
            for k, v in data["results"].items()
        ]
        out.append("")
    if (data := _load("rebalance")) is not None:
        out += [
            "Rebalance: 300 tasks on 2 nodes, a 3rd joins (FairBalancer 1.2, balance_every 2 s):",
            "",
            "| store | seconds to within threshold | task moves (minimum 60) | moves after convergence |"
            " final counts |",
            "|---|---|---|---|---|",
        ]
        out += [
            _row(
                k,
                v["converge_s"],
                v["moves"],
                v["moves_after_converged"],
                " / ".join(str(c) for c in v["final"].values()),
            )
            for k, v in data["results"].items()
        ]
        out.append("")
    if (data := _load("scale")) is not None:
        out += [
            "Scale: coordinator claims/s with 10,000 vs many finished tasks in the store; RSS of a"
            " consumer running 1,000 tasks; idle store requests per second per idle node:",
            "",
            "| store | claims/s (10k) | claims/s (big) | change | RSS MiB | idle req/s/node |",
            "|---|---|---|---|---|---|",
        ]
        for k, v in data["results"].items():
            big = next(
                val for key, val in v.items() if key.startswith("claims_per_s_") and key != "claims_per_s_10k"
            )
            out.append(
                _row(
                    k,
                    v["claims_per_s_10k"],
                    big,
                    f"{v['change']:+.0%}",
                    v["rss_mib_1000_tasks"],
                    v["idle_requests_per_s_per_node"],
                )
            )
        pg = data["results"].get("postgresql")
        if pg:
            out += ["", f"PostgreSQL claim plan: `{pg['claim_plan']}`"]
        out.append("")
    if (data := _load("capacity")) is not None:
        out += [
            f"Capacity: one node holding {data['tasks']:,} tasks that wait for stop() (RSS target"
            " < 250 MB with async handlers; shutdown_timeout 30 s):",
            "",
            "| store | handlers | s to hold | RSS MiB | idle RSS MiB | KiB/task | threads |"
            " shutdown s | ignored stop() | pending after |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in data["results"]:
            if "error" in v:
                out.append(_row(v["store"], v["mode"], v["error"], "", "", "", "", "", "", ""))
                continue
            out.append(_row(v["store"], v["mode"], v["seconds_to_hold"], v["rss_mib"],
                            v["idle_rss_mib"], v["kib_per_task"], v["threads"], v["shutdown_s"],
                            v["ignored_stop"], v["pending_after"]))
        out.append("")
    if (data := _load("at_risk")) is not None:
        out += [
            f"Claim-at-risk warning lead time (mean of {data['rounds']} runs; seconds from the fault"
            " to the warning, from the warning to the handler's stop, and to the earliest expiry of"
            " the claim in the store):",
            "",
            "| store | fault | lease_ttl | warned after | lead to stop | lead to expiry |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            _row(k, f, v["lease_ttl_s"], v["warned_after_s"], v["lead_to_stop_s"], v["lead_to_expiry_s"])
            for k, faults in data["results"].items() for f, v in faults.items()
        ]
        out.append("")
    if (data := _load("gates")) is not None:
        out += ["Gates: see `benchmarks/results/gates.json`.", ""]
    if (data := _load("simulate")) is not None:
        from benchmarks.simulate import markdown

        out += [markdown(data), ""]
    machine = next((d["machine"] for n in ("claims", "latency", "failover") if (d := _load(n))), None)
    if machine:
        out.append(
            f"Measured on: {machine['cpus']} CPUs, {machine.get('memory', '?')},"
            f" Python {machine['python']}, {machine['platform']}."
        )
    print("\n".join(out))


if __name__ == "__main__":
    main()
