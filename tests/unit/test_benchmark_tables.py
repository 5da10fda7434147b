"""docs/benchmarks.md's generated tables are what their results files render (benchmarks/tables.py)."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import tables


def test_every_marked_table_matches_its_results_file() -> None:
    assert tables.check() == []


def test_every_registered_table_is_on_a_page() -> None:
    text = "".join(page.read_text() for page in tables.PAGES if page.exists())
    assert [n for n in tables.TABLES if f"<!-- table: {n} -->" not in text] == []


def test_a_figure_edited_by_hand_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    good = "# t\n\n<!-- table: latency -->\n" + "\n".join(tables.render("latency")) + "\n<!-- /table -->\n"
    page.write_text(good)
    assert tables.check([page]) == []
    lines = good.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("| sqlite"))
    lines[row] = re.sub(r"\d", lambda m: str((int(m[0]) + 1) % 10), lines[row], count=1)  # one figure
    page.write_text("\n".join(lines) + "\n")
    (diff,) = tables.check([page])
    assert "| sqlite" in diff
    tables.check([page], write=True)
    assert page.read_text() == good
