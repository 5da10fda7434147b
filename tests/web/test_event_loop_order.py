"""The browser tests leave no event loop behind: an ``asyncio.run`` after them works.

Playwright's sync API marks its event loop as running on the thread that drives it. With the
session's browser held open, every later ``asyncio.run`` in that pytest process failed
("cannot be called from a running event loop"): stage 1 passed only because tests/web was
collected last (issue 53). The check runs a browser test and then an ``asyncio.run`` in one
pytest process of its own, in that order, whatever order (or worker) this test gets.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BROWSER_TEST = "tests/web/test_web_charts.py::test_empty_charts_render_in_a_browser"
HERE = Path(__file__).resolve().relative_to(REPO).as_posix()


def test_asyncio_run_works_here() -> None:
    """The second half of the check below (on its own, it passes anywhere)."""

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert asyncio.run(answer()) == 42


def test_asyncio_run_after_a_browser_test_in_the_same_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         "-p", "no:xdist", "--basetemp", str(tmp_path / "inner"),
         BROWSER_TEST, f"{HERE}::test_asyncio_run_works_here"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "2 passed" in out, out[-3000:]  # both ran (a skipped browser test would prove nothing)
