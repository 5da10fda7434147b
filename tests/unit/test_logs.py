"""Log formats carry the stable extra fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from metafora.logs import configure


@pytest.fixture(autouse=True)
def restore_root() -> object:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield None
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_have_extra_fields() -> None:
    out = io.StringIO()
    configure("info", json_lines=True, stream=out)
    logging.getLogger("metafora.consumer").info(
        "claimed %s", "t1", extra={"node": "n1", "task": "t1", "token": 4, "action": "claim"})
    logging.getLogger("x").debug("hidden")
    line = json.loads(out.getvalue().strip())
    assert line["message"] == "claimed t1" and line["level"] == "info"
    assert (line["node"], line["task"], line["token"], line["action"]) == ("n1", "t1", 4, "claim")


def test_plain_lines_and_bad_level() -> None:
    out = io.StringIO()
    configure("debug", stream=out)
    logging.getLogger("m").debug("hello", extra={"node": "n1"})
    assert "[node=n1] hello" in out.getvalue()
    with pytest.raises(ValueError, match="log level"):
        configure("loud")
