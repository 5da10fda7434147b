"""examples/resume_ranking/run.py in a subprocess: one command on the embedded SQLite default,
and over HTTP with several consumers on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "resume_ranking" / "run.py"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "METAFORA_URL"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120, check=False)


def _top10(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    return [line for line in lines[start + 1:start + 11] if line.strip()]


def test_runs_on_the_embedded_sqlite_default_with_one_command(tmp_path: Path) -> None:
    done = _run([], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "classified 100 resumes, then ranked them" in done.stdout
    top = _top10(done.stdout)
    assert [line.split()[0] for line in top] == [str(n) for n in range(1, 11)]
    scores = [int(line.split()[4]) for line in top]  # place, First, Last, #NNN, score, ...
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[-1]
    assert (tmp_path / "metafora.db").exists()  # the embedded default, in the working directory


def test_runs_over_http_with_three_consumers_on_postgres(postgres_url: str, tmp_path: Path) -> None:
    done = _run(["--http", "--nodes", "3", "--url", postgres_url], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(over HTTP)" in done.stdout and len(_top10(done.stdout)) == 10
