"""The docs' Python code blocks run (issue 53).

Every fenced ``python`` block of docs/*.md and the README runs as a script of its own, in a
fresh directory with ``METAFORA_URL`` on a SQLite file there, and must exit 0 within a minute.
A block that cannot run alone says so before its fence (a blank line between, so that
Markdown does not take the fence into the comment), with why::

    <!-- docs-test: skip: a fragment of the example above -->

    ```python

(an HTML comment: neither GitHub nor the docs site shows it). The reasons are few: a fragment
that continues an example, a block that needs a server it names, or a worker that runs until
stopped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = re.compile(r"^<!-- docs-test: skip: (?P<why>.+\S) -->$")
TIMEOUT = 60


@dataclass(frozen=True)
class Block:
    """One fenced python block of a page."""

    page: str
    line: int
    code: str
    skip: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str, page: str) -> list[Block]:
    """The python blocks of a markdown ``text`` (``line``: the fence's, from 1)."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = SKIP.match(before.strip())
            found.append(Block(page, i + 1, "\n".join(lines[i + 1:end]) + "\n",
                               marker["why"] if marker else None))
            i = end
        i += 1
    return found


def run(block: Block, where: Path) -> subprocess.CompletedProcess[str]:
    """Run ``block`` as a script in the directory ``where``."""
    script = where / "block.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["METAFORA_URL"] = f"sqlite:///{where / 'store.db'}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(script)], cwd=where, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)


def _all() -> list[Block]:
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    return [b for p in pages for b in blocks(p.read_text(), str(p.relative_to(ROOT)))]


@pytest.mark.parametrize("block", [b for b in _all() if b.skip is None], ids=str)
def test_a_code_block_of_the_docs_runs(block: Block, tmp_path: Path) -> None:
    done = run(block, tmp_path)
    assert done.returncode == 0, f"{block} exits {done.returncode}:\n{done.stderr[-3000:]}"


def test_most_blocks_run() -> None:
    """The opt-out stays the exception, each with its reason."""
    every = _all()
    assert len([b for b in every if b.skip is None]) >= 7, [str(b) for b in every]


def test_a_planted_broken_block_fails_and_a_marked_one_is_left_out(tmp_path: Path) -> None:
    page = ("# Page\n\n```python\nfrom metafora import open_client\n"
            "open_client().submit_tsk('x')\n```\n\n"
            "<!-- docs-test: skip: a fragment of the example above -->\n\n```python\nconsumer.run()\n```\n")
    broken, marked = blocks(page, "page.md")
    assert (broken.line, broken.skip, marked.skip) == (3, None, "a fragment of the example above")
    done = run(broken, tmp_path)
    assert done.returncode == 1 and "submit_tsk" in done.stderr
