"""Helpers for users' own tests: a fake clock, an in-process cluster, a run ledger, real servers.

>>> clock = FakeClock()
>>> coord = open_coordinator("memory://t1", node_id="a")   # in-process store

- :class:`FakeClock` (:mod:`metafora.testing.clock`): time that moves only when told to.
- :class:`LocalCluster`, :class:`RecordingContext`, :func:`wait_for`
  (:mod:`metafora.testing.cluster`): consumers in threads on one store, and bounded waits.
- :class:`FileLedger`, :class:`LedgerRun` (:mod:`metafora.testing.ledger`): every handler run
  recorded outside the store.
- :mod:`metafora.testing.servers`: real PostgreSQL and etcd servers on loopback, found or started.
- :mod:`metafora.testing.pytest_plugin`: the pytest plugin (entry point ``pytest11``) whose
  fixtures give a test a fresh store of each kind.
"""

from __future__ import annotations

from metafora.testing.clock import FakeClock
from metafora.testing.cluster import LocalCluster, RecordingContext, wait_for
from metafora.testing.ledger import FileLedger, LedgerRun

__all__ = ["FakeClock", "FileLedger", "LedgerRun", "LocalCluster", "RecordingContext", "wait_for"]
