"""Issue 16's and 18's reproductions, as a user runs them: ``python -m metafora`` in a subprocess.

Each runs at every log level, plain and JSON, and must print neither the password nor any
piece of it, while naming the part of the URL that is wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metafora.logs import LEVELS
from tests.acceptance.test_cli_subprocess import metafora

CASES = [
    # an unencoded '/' in the password: was "bad host or port 'postgres:pa'" and the whole URL
    ("postgresql://postgres:pa/ssLeak77@127.0.0.1:5432/db", ["ssLeak77", "pa/ss", "postgres:pa"], 3,
     "postgresql://postgres:***@127.0.0.1:5432/db"),
    # an unencoded '@' and a bad port: was the tail 'ssLeak77' and a mangled '***ostgresql'
    ("postgresql://postgres:p@ssLeak77@host:99999/db", ["ssLeak77", "p@ss", "***ostgres"], 2,
     "'host:99999'"),
    # issue 18: a password in the query string
    ("postgresql://postgres@127.0.0.1:1/postgres?password=QueryPW123", ["QueryPW123"], 2,
     "password=***"),
]


@pytest.mark.parametrize(("url", "pieces", "code", "named"), CASES)
@pytest.mark.parametrize("json_logs", [False, True])
def test_reproductions_show_no_password(tmp_path: Path, url: str, pieces: list[str], code: int,
                                        named: str, json_logs: bool) -> None:
    for level in LEVELS:
        args = ["--url", url, "--log-level", level, *(["--log-json"] if json_logs else []), "tasks"]
        proc = metafora(*args, cwd=tmp_path)
        output = proc.stdout + proc.stderr
        assert proc.returncode == code, output
        assert named in proc.stderr
        assert [p for p in pieces if p in output] == [], output
