"""Issue 52, findings 8 and 9: ``--json`` output escapes C1, bidi and other invisible
characters (they reached the terminal raw), and task and node ids refuse every blank but the
ASCII space (``task\\u00a01`` and ``task\\u20071`` printed like ``task 1``)."""

from __future__ import annotations

import json
import sys
import unicodedata
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from metafora import Task, open_client
from metafora.cli import cli
from metafora.coordinators.memory import drop_store
from metafora.core.errors import ConfigError, InvalidTaskId
from metafora.core.masking import escape_json
from metafora.core.task import LOOKALIKE_BLANKS, validate_task_id
from metafora.surfaces.connect import validate_node_id

HOSTILE = "x\u009b[2J\u0085y\u202eabc\u2028\u2029\u2066z\u200e\u0090"
UNSAFE = ["\u009b", "\u0085", "\u202e", "\u2028", "\u2029", "\u2066", "\u200e", "\u0090"]


@pytest.fixture
def url() -> Iterator[str]:
    name = f"json-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


@pytest.mark.parametrize("args", [["tasks", "--json"], ["show", "t1", "--json"]])
def test_json_output_escapes_c1_and_bidi_controls(url: str, args: list[str]) -> None:
    with open_client(url) as client:
        client.submit_task(Task("t1", {"note": HOSTILE, HOSTILE: 1}))
        result = CliRunner().invoke(cli, ["--url", url, *args])
    assert result.exit_code == 0, result.output
    raw = [c for c in UNSAFE if c in result.output]
    assert raw == [], raw  # before: every one of them, raw
    parsed = json.loads(result.output)
    info = parsed[0] if isinstance(parsed, list) else parsed
    assert info["props"] == {"note": HOSTILE, HOSTILE: 1}  # the same value, escaped
    assert "\\u009b" in result.output and "\\u202e" in result.output


def test_escape_json_keeps_the_value_and_readable_letters() -> None:
    text = json.dumps({"k": "é ü 漢 \U0001f600 \U000e0041 \u00ad"}, ensure_ascii=False)
    escaped = escape_json(text)
    assert json.loads(escaped) == json.loads(text)
    assert "é ü 漢 \U0001f600" in escaped and "\\udb40\\udc41" in escaped and "\\u00ad" in escaped


def _blanks() -> list[str]:
    found = [chr(c) for c in range(sys.maxunicode + 1)
             if unicodedata.category(chr(c)) in ("Zs", "Zl", "Zp") and c != 0x20]
    return sorted(set(found) | LOOKALIKE_BLANKS)


@pytest.mark.parametrize("blank", _blanks(), ids=lambda c: f"U+{ord(c):04X}")
def test_ids_refuse_every_blank_but_the_ascii_space(blank: str) -> None:
    with pytest.raises(InvalidTaskId, match=f"U\\+{ord(blank):04X}"):
        validate_task_id(f"task{blank}1")  # before: accepted
    with pytest.raises(ConfigError, match=f"U\\+{ord(blank):04X}"):
        validate_node_id(f"node{blank}1")
    assert validate_task_id("task 1") == "task 1"


def test_the_braille_blank_and_no_break_space_are_refused_at_submit(url: str) -> None:
    with open_client(url) as client:
        for task_id in ("task\u00a01", "task\u20071", "task\u28001"):
            with pytest.raises(InvalidTaskId):
                client.submit_task(Task(task_id))
        assert client.tasks() == []
