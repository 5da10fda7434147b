"""Issue 52, finding 6: ``python -m metafora`` imports no module planted in the working
directory -- not even the ones the package itself imports first (json, click, typing,
dataclasses, datetime), which ran before the path entry was removed -- and ``metafora worker
--help`` says where MODULE:NAME is looked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLANTED = ["json", "click", "typing", "dataclasses", "datetime", "logging", "enum", "sqlalchemy"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env.pop("PYTHONSAFEPATH", None)  # the check is of the default, unsafe, path
    return env


@pytest.mark.parametrize("args", [["--help"], ["worker", "--help"], ["tasks"]])
def test_python_m_metafora_runs_no_planted_module(tmp_path: Path, args: list[str]) -> None:
    marker = tmp_path / "planted-ran"
    for name in PLANTED:
        (tmp_path / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\nraise SystemExit(97)\n",
            encoding="utf-8")
    url = f"sqlite:///{tmp_path / 'store.db'}"
    proc = subprocess.run([sys.executable, "-m", "metafora", "--url", url, *args], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert not marker.exists(), marker.read_text()  # before: json.py ran, exit 97
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_worker_help_says_the_directory_is_searched_last(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "metafora", "worker", "--help"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120, check=True)
    text = " ".join(proc.stdout.split())
    assert "current directory first" not in text
    assert "then the current directory, last" in text
