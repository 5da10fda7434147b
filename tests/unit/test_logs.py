"""Log formats carry the stable extra fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from metafora.core.logs import configure


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


def test_outcome_lines_read_as_phrases(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 18: "task t4 fail" read badly; the `action` field keeps its stable value."""
    import threading

    from metafora import Task, simple_handler
    from metafora.testing import LocalCluster, wait_for

    def work(task: Task, stop: threading.Event) -> bool:
        if task.id == "t4":
            raise RuntimeError("boom")
        return task.id == "t1"  # t2 is released (and claimed again: fine)

    caplog.set_level(logging.INFO, logger="metafora.consumer")
    with LocalCluster() as cluster:
        cluster.add(simple_handler(work), "n1")
        for task_id in ("t1", "t2", "t4"):
            cluster.client.submit_task(Task(task_id))
        wait_for(lambda: {"done", "failed", "released"} <= {
            r.getMessage().split()[-1] for r in caplog.records if r.getMessage().startswith("task t")
        }, what="the three outcomes logged")
    lines = {r.getMessage(): getattr(r, "action", None) for r in caplog.records}
    assert lines["task t1 done"] == "done"
    assert lines["task t2 released"] == "release"
    assert lines["task t4 failed"] == "fail"
    assert not any(m.endswith((" fail", " release")) for m in lines)
