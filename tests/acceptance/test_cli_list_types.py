"""Issue 50: ``metafora worker MODULE:ROUTER --list-types`` prints a JSON Schema per message
type of the Router and exits 0 without touching the store; anything else than a Router is a
usage error (exit 2) without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import metafora
from tests.helpers import SUBPROCESS_DEADLINE

REPO = Path(metafora.__file__).resolve().parents[1]

APP = '''
import dataclasses

from google.protobuf import timestamp_pb2

from metafora.messages import Router, message


@message("shop.OrderPlaced")
@dataclasses.dataclass
class OrderPlaced:
    order_id: str
    qty: int = 1


router = Router()
router.register(OrderPlaced, lambda msg, ctx: None)
router.register(timestamp_pb2.Timestamp, lambda msg, ctx: None)


def plain(task, stop):
    return True
'''


def _worker(app: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(app), str(REPO)])
    # A store URL nothing listens on: --list-types must not try to reach it.
    url = "postgresql://nobody@127.0.0.1:1/none"
    return subprocess.run([sys.executable, "-m", "metafora", "--url", url, "worker", *args],
                          cwd=app, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_DEADLINE, check=False)


def test_list_types_prints_each_types_schema_and_exits_0(tmp_path: Path) -> None:
    (tmp_path / "shopapp.py").write_text(APP)
    done = _worker(tmp_path, "shopapp:router", "--list-types")
    assert done.returncode == 0, done.stderr
    schemas = json.loads(done.stdout)
    assert list(schemas) == ["google.protobuf.Timestamp", "shop.OrderPlaced"]
    order = schemas["shop.OrderPlaced"]
    assert order["properties"]["qty"] == {"type": "integer"}
    assert order["required"] == ["@type", "order_id"]
    assert schemas["google.protobuf.Timestamp"]["properties"]["@type"]["enum"] == [
        "google.protobuf.Timestamp", "type.googleapis.com/google.protobuf.Timestamp"]


def test_list_types_of_something_else_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "shopapp.py").write_text(APP)
    done = _worker(tmp_path, "shopapp:plain", "--list-types")
    assert done.returncode == 2
    assert "Router" in done.stderr and "Traceback" not in done.stderr
