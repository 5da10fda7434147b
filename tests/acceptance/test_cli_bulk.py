"""``metafora submit --from-file -`` as users run it: JSON lines on stdin, a subprocess, SQLite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from metafora import TaskState, open_client
from tests.acceptance.test_cli_subprocess import _env


def test_submit_from_stdin_in_a_subprocess(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/bulk.db"
    lines = "".join(json.dumps({"id": f"s{i:04d}", "props": {"i": i}}) + "\n" for i in range(1500))
    proc = subprocess.run([sys.executable, "-m", "metafora", "--url", url, "submit", "--from-file", "-"],
                          input=lines, env=_env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "submitted 1500 task(s)" in proc.stdout
    with open_client(url) as client:
        infos = client.tasks()
    assert len(infos) == 1500 and all(i.state is TaskState.PENDING for i in infos)
    first_five = "".join(lines.splitlines(keepends=True)[:5])
    again = subprocess.run([sys.executable, "-m", "metafora", "--url", url, "submit", "--from-file", "-"],
                           input=first_five, env=_env(), capture_output=True, text=True, timeout=120,
                           check=False)
    assert again.returncode == 1 and "already exist" in again.stderr and "Traceback" not in again.stderr
