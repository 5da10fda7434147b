"""Claim at risk: how long before the claim is lost a handler is warned.

One consumer runs one task on a private store (an etcd member and a PostgreSQL cluster of
its own, so they may be frozen and killed; a SQLite file), then the store is taken away
(see :mod:`tests.integration.risk_harness`): *frozen* (SIGSTOP of every store process;
SQLite: the write lock held by another connection, renewals waiting) or *cut off* (killed:
connections refused; SQLite: the write lock held with a 0.1 s busy timeout, renewals
refused). Measured per run, on the monotonic clock:

- ``warned after``: seconds from the fault to the handler's ``at_risk``;
- ``lead to stop``: seconds from ``at_risk`` to the handler's ``stop()`` (the node's fence);
- ``lead to expiry``: that plus the fencing margin, the least time the store still keeps
  the claim after the stop (:mod:`metafora.core.leases`), i.e. the warning's lead
  on the claim's loss.

Lease TTLs: 3 s on SQL stores, 2 s on etcd (its smallest); the lead scales with the TTL.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import Stores, save, table
from metafora.coordinators.etcd.config import ETCD_FENCING
from metafora.coordinators.sql.options import SQL_FENCING
from metafora.core.leases import Fencing

FAULTS = ("frozen", "cut")
TTL = {"sqlite": 3, "postgresql": 3, "etcd": 2}
FENCING: dict[str, Fencing] = {"sqlite": SQL_FENCING, "postgresql": SQL_FENCING, "etcd": ETCD_FENCING}


def _measure(kind: str, rounds: int, workdir: Path) -> dict[str, dict[str, Any]]:
    """``rounds`` runs of each fault on a private store of ``kind``."""
    from tests.integration.risk_harness import (
        etcd_faults,
        postgres_faults,
        run_scenario,
        sqlite_faults,
    )

    ttl = TTL[kind]
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        if kind == "postgresql":
            from metafora.testing.servers.postgres import TempPostgres

            cluster = TempPostgres()
            stack.callback(cluster.stop)
        elif kind == "etcd":
            from tests.fixtures.etcd import find_etcd, start_server

            binary = find_etcd()
            if binary is None:
                raise SystemExit("no etcd binary: apt-get install etcd-server")
            server = start_server(binary, workdir / "etcd")
            stack.callback(server.stop)
        for fault in FAULTS:
            runs = []
            for _ in range(rounds):
                ns = "r" + uuid.uuid4().hex[:8]
                if kind == "sqlite":
                    path = str(workdir / f"{ns}.db")
                    busy = 30 if fault == "frozen" else 0.1
                    url = f"sqlite:///{path}?lease_ttl={ttl}&busy_timeout={busy}"
                    faults = sqlite_faults(path)
                elif kind == "postgresql":
                    url = f"{cluster.url}?namespace={ns}&lease_ttl={ttl}&connect_timeout=30"
                    faults = postgres_faults(cluster)
                else:
                    url = server.url(ns) + f"?lease_ttl={ttl}&timeout=30"
                    faults = etcd_faults(server)
                outcome = run_scenario(url, faults[fault], renew_every=ttl / 3)
                runs.append({"warned_after_s": outcome.warned_after_s, "lead_s": outcome.lead_s})
            margin = FENCING[kind].margin(ttl)
            leads = [r["lead_s"] for r in runs]
            results[fault] = {
                "lease_ttl_s": ttl,
                "margin_s": margin,
                "warned_after_s": statistics.fmean(r["warned_after_s"] for r in runs),
                "lead_to_stop_s": statistics.fmean(leads),
                "lead_to_stop_min_s": min(leads),
                "lead_to_expiry_s": statistics.fmean(leads) + margin,
                "runs": runs,
            }
    return results


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Measure every store kind asked for; print and save."""
    rounds = 2 if quick else 5
    data: dict[str, Any] = {}
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="metafora-at-risk-"))
    quiet = logging.getLogger("metafora")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # every run fences a node on purpose: its warnings are noise
    try:
        for kind in stores.kinds:
            data[kind] = _measure(kind, rounds, workdir)
    finally:
        quiet.setLevel(level)
    for kind in stores.kinds:
        for fault, r in data[kind].items():
            rows.append((kind, fault, r["lease_ttl_s"], r["warned_after_s"], r["lead_to_stop_s"],
                         r["lead_to_stop_min_s"], r["lead_to_expiry_s"]))
    table(f"claim-at-risk warning lead time (s; mean of {rounds} runs)",
          ("store", "fault", "lease_ttl", "warned after", "lead to stop", "min", "lead to expiry"),
          rows)
    save("at_risk", {"quick": quick, "rounds": rounds, "results": data})
    return data
