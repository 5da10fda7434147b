"""``Router``: one handler per message type, as a :data:`~metafora.contracts.handler.HandlerFunc`.

bq's consumers register a handler per protobuf message type; here ``@router.handles(Type)``
does, for dataclasses and pydantic models (named with ``@message``) and protobuf message
classes. A claimed task's ``@type`` picks the handler; its fields are decoded to the class on
the handler's thread (or loop) and the handler is called as ``fn(msg, ctx)``:

- returns ``None`` or ``True``: done; ``False``: release (another node may run it again);
  raises: failed with the error;
- an ``async def`` handler runs on the consumer's event loop, a plain one on a thread.

A task whose type has no handler here, or whose fields do not decode, is **failed** with an
error naming the type and the field (:class:`~metafora.messages.errors.UnknownMessageType`,
:class:`~metafora.messages.errors.MalformedMessage`); nothing else stops, and once a handler
is deployed ``metafora retry ID`` runs it again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from metafora.contracts.binding import NodeBinding
from metafora.contracts.handler import AsyncHandler, Handler, simple_handler
from metafora.core.errors import ConfigError
from metafora.core.task import Task
from metafora.messages.codec import decode, named_type, schema_of
from metafora.messages.context import MessageContext
from metafora.messages.errors import UnknownMessageType
from metafora.messages.naming import bare_name, kind_of, type_url

__all__ = ["MessageFn", "Router"]

log = logging.getLogger(__name__)

MessageFn = Callable[[Any, MessageContext], "bool | Awaitable[bool | None] | None"]
"""A message handler: ``fn(msg, ctx) -> bool | None`` (or ``async def``)."""

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class _Entry:
    cls: type
    fn: Callable[..., Any]
    is_async: bool


def _outcome(result: object) -> bool:
    """A handler's return as the task's outcome: None and True are done, False releases."""
    return result is None or bool(result)


class Router:
    """Handlers per message type; call it with a claimed task to get its Handler.

    ``store``: the coordinator or client that ``ctx.complete`` / ``ctx.checkpoint`` write
    to; by default the Consumer's coordinator (:meth:`bind_coordinator`), or the one the
    task was claimed from.
    """

    def __init__(self, *, store: object | None = None) -> None:
        self._store = store
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def bind_coordinator(self, coordinator: object) -> Router:
        """The HandlerFunc a Consumer of ``coordinator`` runs (the Consumer calls it): this
        router when it was given its store, else a view of it writing to ``coordinator``
        that shares its handlers (one registered later is seen by both)."""
        if self._store is not None:
            return self
        bound = Router(store=coordinator)
        bound._entries, bound._lock = self._entries, self._lock
        return bound

    def bind_node(self, node: NodeBinding) -> Router:
        """The HandlerFunc a Consumer runs on ``node`` (:class:`~metafora.contracts.binding.BindsToNode`):
        :meth:`bind_coordinator` of the node's coordinator."""
        return self.bind_coordinator(node.coordinator)

    def handles(self, cls: type) -> Callable[[F], F]:
        """Decorator: ``fn(msg, ctx)`` handles the messages of ``cls`` (see :meth:`register`)."""

        def register(fn: F) -> F:
            self.register(cls, fn)
            return fn

        return register

    def register(self, cls: type, fn: Callable[..., Any]) -> None:
        """Make ``fn(msg, ctx)`` the handler of ``cls``'s messages.

        ConfigError for a class that is no message type (or has no name), a dataclass field
        of an unsupported type, a handler that is not callable, or a type already handled.
        """
        kind_of(cls)
        name = bare_name(type_url(cls))
        if not callable(fn):
            raise ConfigError(f"the handler of {name} must be callable, not {fn!r}")
        schema_of(cls)  # a dataclass field of a type that cannot be read is refused now
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None))  # noqa: B004 - an object with an async __call__
        with self._lock:
            known = self._entries.get(name)
            if known is not None:
                raise ConfigError(f"message type {name} already has a handler here "
                                  f"({getattr(known.fn, '__qualname__', known.fn)!r})")
            self._entries[name] = _Entry(cls, fn, is_async)

    def types(self) -> dict[str, type]:
        """Full type name -> class, of every type handled here (sorted by name)."""
        with self._lock:
            return {name: self._entries[name].cls for name in sorted(self._entries)}

    def schemas(self) -> dict[str, dict[str, Any]]:
        """Full type name -> a JSON Schema of its props (``@type`` and the fields), sorted."""
        return {name: schema_of(cls) for name, cls in self.types().items()}

    def _entry(self, task: Task) -> _Entry:
        name = named_type(task.props)
        with self._lock:
            entry = self._entries.get(name)
            known = sorted(self._entries)
        if entry is None:
            raise UnknownMessageType(
                f"message type {name!r} has no handler on this node (it handles: "
                f"{', '.join(known) or 'nothing'}); deploy one, then `metafora retry {task.id}`",
                type_name=name)
        return entry

    def __call__(self, task: Task) -> Handler | AsyncHandler:
        """The handler of one claimed task (a HandlerFunc): decodes and dispatches in ``run``."""
        try:
            entry = self._entry(task)
        except UnknownMessageType as exc:
            refused = exc

            def refuse(_task: Task, _stop: threading.Event) -> bool:
                raise refused

            return simple_handler(refuse)(task)
        store = self._store
        if entry.is_async:
            async def run_async(claimed: Task, stop: asyncio.Event) -> bool:
                msg = decode(entry.cls, claimed.props)
                result = await entry.fn(msg, MessageContext(claimed, stop, store))
                return _outcome(result)

            return simple_handler(run_async)(task)

        def run(claimed: Task, stop: threading.Event) -> bool:
            msg = decode(entry.cls, claimed.props)
            return _outcome(entry.fn(msg, MessageContext(claimed, stop, store)))

        return simple_handler(run)(task)

    def __repr__(self) -> str:
        return f"Router({', '.join(self.types()) or 'no types'})"
