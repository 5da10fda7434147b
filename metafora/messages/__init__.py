"""Typed messages (bq's envelope): ``{"@type": NAME, ...fields}`` props and a Router.

The props of a message task follow protobuf's JSON mapping of ``Any``, so a producer in any
language writes the same JSON; ``@message("shop.OrderPlaced")`` names a dataclass or a
pydantic model, a protobuf message is named by its ``DESCRIPTOR.full_name``. A
:class:`Router` is a :data:`~metafora.contracts.handler.HandlerFunc` with one handler per type;
``Client.submit_message(id, msg)`` submits one. pydantic and protobuf are optional and
imported only when a class of theirs is used. See docs/messages.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metafora.contracts.recipes import register
from metafora.core.errors import ConfigError
from metafora.core.task import Task
from metafora.messages.codec import decode, encode, named_type, schema_of
from metafora.messages.context import MessageContext
from metafora.messages.errors import MalformedMessage, MessageError, UnknownMessageType
from metafora.messages.naming import (
    TYPE_KEY,
    TYPE_URL_PREFIX,
    Kind,
    bare_name,
    kind_of,
    message,
    type_name,
    type_url,
)
from metafora.messages.router import MessageFn, Router

__all__ = [
    "TYPE_KEY",
    "TYPE_URL_PREFIX",
    "Kind",
    "MalformedMessage",
    "MessageContext",
    "MessageError",
    "MessageFn",
    "Router",
    "UnknownMessageType",
    "bare_name",
    "decode",
    "encode",
    "kind_of",
    "message",
    "message_task",
    "named_type",
    "schema_of",
    "type_name",
    "type_url",
]

_SUBMIT = ("conn", "if_exists")
_TASK = ("selector", "priority", "prefer", "spread", "group")


def message_task(task_id: str, msg: object, options: Mapping[str, Any]) -> tuple[Task, dict[str, Any]]:
    """The task of ``Client.submit_message`` and the options left for ``submit_task``.

    ``options``: ``conn`` and ``if_exists`` (the submit's), ``selector``, ``priority``,
    ``prefer``, ``spread`` and ``group`` (the task's). ConfigError for any other.
    """
    unknown = sorted(set(options) - set(_SUBMIT) - set(_TASK))
    if unknown:
        raise ConfigError(f"submit_message got unknown option(s) {', '.join(unknown)} (known: "
                          f"{', '.join(_SUBMIT + _TASK)})")
    task = Task(task_id, encode(msg), **{k: options[k] for k in _TASK if k in options})
    return task, {k: options[k] for k in _SUBMIT if k in options}


# Client.submit_message encodes by these rules (the client knows no recipe of the messages:
# they tell it, when they load; metafora.contracts.recipes).
register("message_task", message_task)
