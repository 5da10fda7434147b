"""Node commands (freeze, unfreeze, balance, stop_task) and their JSON wire format.

Wire format: ``{"command": NAME, "parameters": {...}}``. Unknown or malformed commands
are rejected with :class:`~metafora.core.errors.InvalidCommand` by ``from_json``; a consumer
that meets one logs a warning and carries on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metafora.core.errors import InvalidCommand, InvalidTaskId
from metafora.core.jsontext import load_object
from metafora.core.task import validate_task_id

__all__ = [
    "BALANCE",
    "FREEZE",
    "STOP_TASK",
    "UNFREEZE",
    "Command",
    "balance",
    "freeze",
    "stop_task",
    "unfreeze",
]

FREEZE = "freeze"
UNFREEZE = "unfreeze"
BALANCE = "balance"
STOP_TASK = "stop_task"

# name -> required parameters and their types
_SCHEMAS: dict[str, dict[str, type]] = {
    FREEZE: {},
    UNFREEZE: {},
    BALANCE: {},
    STOP_TASK: {"task": str},
}


@dataclass(frozen=True)
class Command:
    """A command to one node. Build it with the module's constructors."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _validate(self.name, self.params)
        object.__setattr__(self, "params", dict(self.params))

    def to_json(self) -> str:
        """The wire form, ``{"command": name, "parameters": {...}}``."""
        return json.dumps({"command": self.name, "parameters": dict(self.params)}, sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> Command:
        """Parse and validate the wire form; raise InvalidCommand naming the problem."""
        obj = load_object(data, "command", InvalidCommand) if isinstance(data, str | bytes) else data
        if not isinstance(obj, Mapping):
            raise InvalidCommand("command must be a JSON object with 'command' and 'parameters'")
        extra = set(obj) - {"command", "parameters"}
        if extra:
            raise InvalidCommand(f"command has unknown fields: {', '.join(sorted(extra))}")
        name = obj.get("command")
        params = obj.get("parameters", {})
        if params is None:
            params = {}
        if not isinstance(name, str):
            raise InvalidCommand("command name ('command') must be a string")
        if not isinstance(params, Mapping):
            raise InvalidCommand(f"parameters of command {name!r} must be a JSON object")
        return cls(name, params)


def _validate(name: str, params: Mapping[str, Any]) -> None:
    schema = _SCHEMAS.get(name)
    if schema is None:
        known = ", ".join(sorted(_SCHEMAS))
        raise InvalidCommand(f"unknown command {name!r} (known: {known})")
    if not isinstance(params, Mapping):
        raise InvalidCommand(f"parameters of command {name!r} must be a mapping")
    missing = set(schema) - set(params)
    if missing:
        raise InvalidCommand(f"command {name!r} needs parameter(s): {', '.join(sorted(missing))}")
    unknown = set(params) - set(schema)
    if unknown:
        raise InvalidCommand(f"command {name!r} has unknown parameter(s): {', '.join(sorted(unknown))}")
    for key, typ in schema.items():
        if not isinstance(params[key], typ):
            raise InvalidCommand(f"parameter {key!r} of command {name!r} must be a {typ.__name__}")
    if name == STOP_TASK:
        try:
            validate_task_id(params["task"])
        except InvalidTaskId as exc:
            raise InvalidCommand(f"stop_task: {exc}") from None


def freeze() -> Command:
    """Stop the node from claiming new tasks (running tasks keep running)."""
    return Command(FREEZE)


def unfreeze() -> Command:
    """Let a frozen node claim tasks again."""
    return Command(UNFREEZE)


def balance() -> Command:
    """Ask the node to run its balancer now."""
    return Command(BALANCE)


def stop_task(task_id: str) -> Command:
    """Ask the node to stop a task and release it (another node may then claim it)."""
    return Command(STOP_TASK, {"task": task_id})
