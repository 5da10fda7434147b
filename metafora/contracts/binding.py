"""The one hook of a HandlerFunc that needs the node it runs on: ``bind_node(NodeBinding)``.

The streams' handler func keeps its progress in the consumer's store and publishes the
node's ``metafora_stream_lag``; the gates' counts its items into the node's stats; a message
Router writes through the consumer's coordinator. Each implements :class:`BindsToNode`, and
the consumer calls :func:`bind_handler_func` once, before any task runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from metafora.contracts.coordinator import Coordinator
from metafora.contracts.handler import HandlerFunc
from metafora.core.errors import ConfigError
from metafora.core.metrics import ConsumerStats

__all__ = ["BindsToNode", "Gauges", "NodeBinding", "bind_handler_func"]

Gauges = Callable[[], Mapping[str, tuple[str, float]]]
"""Node-level gauges, read at each ``/metrics`` scrape: name -> (help text, value)."""


@dataclass(frozen=True)
class NodeBinding:
    """What a :class:`~metafora.Consumer` gives the HandlerFunc it runs, once, before any task
    runs (see :class:`BindsToNode`)."""

    coordinator: Coordinator
    """The consumer's coordinator: a handler func keeping its state in the store uses it."""
    stats: ConsumerStats
    """The node's stats (its ``/metrics``): a handler func may count into them."""
    add_gauges: Callable[[Gauges], None]
    """Registers node-level gauges (``metafora_stream_lag``), read at each scrape."""


@runtime_checkable
class BindsToNode(Protocol):
    """A HandlerFunc that needs the node it runs on (the streams', the gates', a message
    Router): the consumer calls :meth:`bind_node` once and runs the HandlerFunc it returns
    (itself, or a copy bound to that node)."""

    def bind_node(self, node: NodeBinding) -> HandlerFunc:
        """The HandlerFunc to run on ``node``."""
        ...


def bind_handler_func(handler_func: HandlerFunc, node: NodeBinding) -> HandlerFunc:
    """The HandlerFunc a consumer runs: ``handler_func.bind_node(node)`` when it has one;
    else the older hooks, each when present (``bind_coordinator(coordinator)``,
    ``attach_stats(stats)``, ``gauges()``), so a handler func written for them still works."""
    if isinstance(handler_func, BindsToNode):
        bound = handler_func.bind_node(node)
        if not callable(bound):
            raise ConfigError("handler_func.bind_node must return a HandlerFunc")
        return bound
    bind = getattr(handler_func, "bind_coordinator", None)
    if callable(bind):
        handler_func = bind(node.coordinator)
        if not callable(handler_func):
            raise ConfigError("handler_func.bind_coordinator must return a HandlerFunc")
    attach = getattr(handler_func, "attach_stats", None)
    if callable(attach):
        attach(node.stats)
    gauges = getattr(handler_func, "gauges", None)
    if callable(gauges):
        node.add_gauges(gauges)
    return handler_func
