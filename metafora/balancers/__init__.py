"""The bundled balancers: pick one per Consumer, or write your own :class:`~metafora.Balancer`.

- :class:`FairBalancer` keeps each node near its fair share of the work (weights, selectors),
  balancing from both sides with the fewest moves (arithmetic: :mod:`metafora.balancers.shares`);
  the consumer's default.
- :class:`DumbBalancer` claims everything and releases nothing.
- :class:`ResourceBalancer` claims and releases by CPU or memory usage
  (:class:`CpuReporter`, :class:`MemoryReporter`, or your own :class:`ResourceReporter`).
- :class:`SleepBalancer` gives lightly loaded nodes a head start on each claim.
"""

from __future__ import annotations

from metafora.balancers.dumb import DumbBalancer
from metafora.balancers.fair import FairBalancer
from metafora.balancers.resource import (
    CpuReporter,
    MemoryReporter,
    ResourceBalancer,
    ResourceReporter,
)
from metafora.balancers.sleep import SleepBalancer

__all__ = [
    "CpuReporter",
    "DumbBalancer",
    "FairBalancer",
    "MemoryReporter",
    "ResourceBalancer",
    "ResourceReporter",
    "SleepBalancer",
]
