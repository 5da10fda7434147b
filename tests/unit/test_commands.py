"""metafora.core.commands: building node commands and checking what comes off the wire.

The wire format's round trip and the malformed inputs: test_values.py.
"""

from __future__ import annotations

import pytest

from metafora.core import commands
from metafora.core.commands import BALANCE, FREEZE, STOP_TASK, UNFREEZE, Command
from metafora.core.errors import InvalidCommand


def test_each_constructor_builds_its_command() -> None:
    assert (commands.freeze().name, commands.unfreeze().name, commands.balance().name) == (
        FREEZE, UNFREEZE, BALANCE)
    stop = commands.stop_task("t1")
    assert (stop.name, dict(stop.params)) == (STOP_TASK, {"task": "t1"})
    assert commands.freeze().params == {}


def test_a_command_keeps_a_copy_of_its_parameters_and_is_hashable() -> None:
    params = {"task": "t1"}
    cmd = Command(STOP_TASK, params)
    params["task"] = "t2"
    assert cmd.params == {"task": "t1"}
    assert cmd == commands.stop_task("t1")
    assert len({commands.freeze(), commands.freeze(), commands.balance()}) == 2


@pytest.mark.parametrize(("name", "params", "message"), [
    ("reboot", {}, r"unknown command 'reboot' \(known: balance, freeze, stop_task, unfreeze\)"),
    (STOP_TASK, {}, "command 'stop_task' needs parameter\\(s\\): task"),
    (FREEZE, {"now": True}, "command 'freeze' has unknown parameter\\(s\\): now"),
    (STOP_TASK, {"task": 7}, "parameter 'task' of command 'stop_task' must be a str"),
    (STOP_TASK, {"task": "a\nb"}, "stop_task: task id 'a\\\\nb' contains the control character"),
    (FREEZE, ["x"], "parameters of command 'freeze' must be a mapping"),
])
def test_a_bad_command_is_refused_when_built(name: str, params: object, message: str) -> None:
    with pytest.raises(InvalidCommand, match=message):
        Command(name, params)  # type: ignore[arg-type]


def test_from_json_accepts_text_bytes_a_mapping_and_null_parameters() -> None:
    assert Command.from_json(b'{"command": "balance"}') == commands.balance()
    assert Command.from_json('{"command": "freeze", "parameters": null}') == commands.freeze()
    assert Command.from_json({"command": "stop_task", "parameters": {"task": "t"}}) == \
        commands.stop_task("t")


def test_from_json_errors_name_the_problem() -> None:
    with pytest.raises(InvalidCommand, match="command has unknown fields: node, when"):
        Command.from_json('{"command": "freeze", "when": 1, "node": "a"}')
    with pytest.raises(InvalidCommand, match="must be a JSON object with 'command'"):
        Command.from_json(["freeze"])  # type: ignore[arg-type]
    with pytest.raises(InvalidCommand, match="command: nested deeper than"):
        Command.from_json('{"command": "freeze", "parameters": ' + "[" * 5000 + "]" * 5000 + "}")
