"""Why a message task cannot be handled: its type is unknown, or its fields do not decode.

Both are :class:`~metafora.core.errors.InvalidProps`: the task's data is at fault, not the node.
The router raises them from the task's handler, so that task (and only it) is failed with
the message as its error; ``metafora retry ID`` runs it again once a handler is deployed.
"""

from __future__ import annotations

from metafora.core.errors import InvalidProps

__all__ = ["MalformedMessage", "MessageError", "UnknownMessageType"]


class MessageError(InvalidProps):
    """A message task's props do not give a message this router can handle.

    ``type_name`` is the ``@type`` it named (None when it named none), ``field`` the field
    path at fault (None when the fault is not in one field).
    """

    def __init__(self, text: str, *, type_name: str | None = None,
                 field: str | None = None) -> None:
        super().__init__(text)
        self.type_name = type_name
        self.field = field


class UnknownMessageType(MessageError):
    """The task's ``@type`` names no type this router has a handler for (or none at all)."""


class MalformedMessage(MessageError):
    """The task's fields do not decode to its ``@type``'s class (the field is named)."""
