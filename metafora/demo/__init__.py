"""``metafora demo``: a masterless cluster on one machine, a crash, and the proof nothing was lost.

The demo starts ``--nodes`` consumer *processes* (``python -m metafora.demo worker``) on one
store (by default a fresh SQLite file in a temporary directory: no server needed), submits
``--tasks`` tasks whose handler works for a second or two, and shows a live table of the nodes
and the tasks they run. Half-way it SIGKILLs the busiest node: its claims stay put until its
lease runs out (``lease_ttl``, 2.5 s here), then the other nodes claim them and run them
again. At the end it reads the **ledger** -- every handler appends ``start`` / ``end`` /
``stop`` lines with its node and fencing token to one file -- and proves that every task ran
to completion exactly once, that no two runs of a task overlapped, and how long failover took.

Everything goes through the public API (``open_client``, ``open_coordinator``, ``Consumer``),
so the demo runs on any store the processes can share (``--url postgresql://...``; the demo
then works in a namespace of its own).
"""

from __future__ import annotations

from metafora.demo.config import DemoConfig, DemoError, demo_url
from metafora.demo.proof import Verdict, runs_by_task, verify
from metafora.demo.run import Demo, run_demo
from metafora.demo.worker import worker_main

__all__ = [
    "Demo",
    "DemoConfig",
    "DemoError",
    "Verdict",
    "demo_url",
    "run_demo",
    "runs_by_task",
    "verify",
    "worker_main",
]
