"""examples/block_pipeline/run.py in a subprocess, as a new user runs it: one command on the
embedded SQLite default (a worker killed with SIGKILL mid-run, the proof printed), and on
PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "block_pipeline" / "run.py"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "METAFORA_URL"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=180, check=False)


def _assert_proved(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    assert "with SIGKILL" in done.stdout and "moved to node-" in done.stdout
    at, last = map(int, re.findall(r"processed index (-?\d+) of (\d+)", done.stdout)[0])
    assert at < last  # killed mid-run
    proof = done.stdout.split("proof:", 1)[1]
    assert proof.count("[ok]") == 8 and "FAILED" not in proof
    assert "every block and every chunk was done, none skipped" in done.stdout
    assert "Traceback" not in done.stderr


def test_runs_on_the_embedded_sqlite_default_with_one_command(tmp_path: Path) -> None:
    done = _run([], tmp_path)
    _assert_proved(done)
    assert (tmp_path / "metafora.db").exists()


@pytest.mark.integration
def test_runs_on_postgres(postgres_url: str, tmp_path: Path) -> None:
    _assert_proved(_run(["--url", postgres_url, "--blocks", "40"], tmp_path))
