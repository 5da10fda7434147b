"""``metafora joblogs`` in a subprocess: the job logs of a SQLite store, as a table and as JSON;
a clear usage error (no traceback) on a store that is not SQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from metafora.streams import SQLJobLog
from tests.acceptance.test_cli_subprocess import _env


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metafora", *args], cwd=cwd, env=_env(), text=True,
                          capture_output=True, timeout=60, check=False)


def test_joblogs_lists_each_log_with_its_size(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/m.db"
    empty = _run("--url", url, "joblogs", cwd=tmp_path)
    assert empty.returncode == 0 and "no job logs" in empty.stdout, empty.stderr
    for name, count in (("chunks", 3), ("blocks", 1)):
        log = SQLJobLog(url, name)
        log.append([(f"k{i}", i) for i in range(count)])
        log.close()
    listed = _run("--url", url, "joblogs", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = [line.replace("│", " ").split()[:3] for line in listed.stdout.splitlines()
            if "chunks" in line or "blocks" in line]
    assert rows == [["blocks", "1", "0"], ["chunks", "3", "2"]]
    as_json = json.loads(_run("--url", url, "joblogs", "--json", cwd=tmp_path).stdout)
    assert [(i["name"], i["size"], i["head"]) for i in as_json] == [("blocks", 1, 0), ("chunks", 3, 2)]


def test_joblogs_on_a_store_that_is_not_sql_is_a_usage_error(tmp_path: Path) -> None:
    done = _run("--url", "memory://x", "joblogs", cwd=tmp_path)
    assert done.returncode != 0 and "needs a SQL store URL" in done.stderr
    assert "Traceback" not in done.stderr
