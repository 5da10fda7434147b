"""metafora: run long-running tasks across a masterless cluster.

Consumers claim tasks as leases through a :class:`Coordinator`, run each in a
:class:`Handler`, and keep the cluster even by work stealing (:mod:`metafora.balancers`).
See the README and ``docs/`` for the guarantees.
"""

from __future__ import annotations  # already loaded by the interpreter: nothing can shadow it

import sys as _sys  # built in: nothing on sys.path can shadow it

# ``python -m metafora`` puts the working directory first on sys.path, and imports this
# package before its ``__main__`` runs: a json.py, click.py or typing.py planted there would
# run at the imports below. While ``-m`` looks for its module sys.argv[0] is "-m": drop the
# entry now, before any import (``os`` is loaded at start-up; the ``worker MODULE:NAME``
# import still searches the directory, last, for that import only: metafora.cli._load).
if _sys.argv[:1] == ["-m"] and _sys.path and "os" in _sys.modules and (
        _sys.path[0] in ("", _sys.modules["os"].getcwd())):
    del _sys.path[0]

from typing import TYPE_CHECKING as _TYPE_CHECKING  # after the entry above is gone

from metafora.contracts.balancer import Balancer, BalancerContext, ClusterState, RunningTask
from metafora.contracts.client import Client
from metafora.contracts.coordinator import Coordinator, CoordinatorContext
from metafora.contracts.handler import AsyncHandler, Handler, HandlerFunc, simple_handler
from metafora.core import commands, errors
from metafora.core._moved import install_finder as _install_finder
from metafora.core.commands import Command
from metafora.core.errors import MetaforaError
from metafora.core.schedule_model import Schedule
from metafora.core.task import Task, TaskInfo, TaskState
from metafora.surfaces.connect import default_url, open_async_client, open_client, open_coordinator

# The modules that moved into their floor's folder keep their old names (``metafora.task`` is
# ``metafora.core.task``): served by one finder from one table, no file left at the old path.
_install_finder()

if _TYPE_CHECKING:
    from metafora.consumer import Consumer


def __getattr__(name: str) -> object:
    """``metafora.Consumer`` is imported at first use: the consumer's modules (asyncio, the
    HTTP server, the balancers) cost a third of a second of CPU, which every command of the
    CLI that only reads or writes the store (``tasks``, ``submit``) paid at start-up."""
    if name == "Consumer":
        from metafora.consumer import Consumer

        globals()["Consumer"] = Consumer
        return Consumer
    raise AttributeError(f"module 'metafora' has no attribute {name!r}")

__all__ = [
    "AsyncHandler",
    "Balancer",
    "BalancerContext",
    "Client",
    "ClusterState",
    "Command",
    "Consumer",
    "Coordinator",
    "CoordinatorContext",
    "Handler",
    "HandlerFunc",
    "MetaforaError",
    "RunningTask",
    "Schedule",
    "Task",
    "TaskInfo",
    "TaskState",
    "commands",
    "default_url",
    "errors",
    "open_async_client",
    "open_client",
    "open_coordinator",
    "simple_handler",
]

__version__ = "0.2.0"

