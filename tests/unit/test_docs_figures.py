"""No measured figure in the docs' prose: figures live in the generated blocks (issue 53).

A figure typed into prose drifts: the docs once said "5,000 -> 5,840 tasks/s", which no results
file holds, and kept a "Where targets are missed" section after the targets were met. Every
measured figure is in a block ``python -m benchmarks.tables`` generates from a results file
(``<!-- table: ... -->``), with the command and the commit that made it. This check reads the
docs' markdown outside those blocks and outside code, for the shapes a measurement takes:
a throughput (``tasks/s``, ``claims/s``, ...), a ratio to a peer or a balancer (``1.2x pgqueuer``,
``0.97x `DumbBalancer```), a duration in milliseconds (``18 ms``; ``every 10 ms`` is a setting,
not a measurement), CPU-seconds (``0.65 CPU-s``), a range of seconds (``7.4-9.1 s``) a before/after
(``3,227 -> 7,510``), and in a table typed by hand any decimal or thousands-separated number.
Settings in seconds (``lease_ttl`` of 30 s) are defaults, checked by test_documented_defaults.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUM = r"\d[\d,]*(?:\.\d+)?"
FIGURES = re.compile("|".join([
    rf"{NUM}\s*(?:[-\u2013]\s*{NUM}\s*)?(?:tasks|claims|rows|items|offers|requests|submits|writes)/s",
    rf"{NUM}\s*[\u00d7x]\s*(?:the\s+)?`?(?:pgqueuer|procrastinate|DumbBalancer|FairBalancer)",
    rf"(?<!every )(?<!each )(?<![\w.]){NUM}\s*(?:[-\u2013]\s*{NUM}\s*)?ms\b",
    rf"{NUM}\s*CPU-s\b",
    rf"(?<![\w.]){NUM}\s*[-\u2013]\s*{NUM}\s*s\b",  # a measured range of seconds (a setting has one value)
    rf"{NUM}\s*(?:->|\u2192)\s*{NUM}",
]))
# A cell of a table typed by hand that holds a measurement: only figures (``1.50``,
# ``7,620 (-12 %)``, ``1.0 / 187 / 3,187``) with a decimal or thousands-separated number.
FIGURE_CELL = re.compile(r"^[\d\s,./()%\u2212+-]*(?:\d{1,3}(?:,\d{3})+|\d+\.\d+)[\d\s,./()%\u2212+-]*$")
# On the benchmark pages, where measurements live, any number with a decimal point, a thousands
# separator or a unit is taken for one (a command in backticks is not prose).
BENCHMARK_FIGURE = re.compile(
    rf"(?<![\w.,])(?:{NUM}\s*(?:[-\u2013]\s*{NUM}\s*)?(?:s|ms|%|x|\u00d7|MiB|KiB|MB|KB|GiB|GB|CPU-s)(?![\w/])"
    r"|\d{1,3}(?:,\d{3})+|\d+\.\d+)")
_BACKTICKED = re.compile(r"`[^`\n]*`")
_GENERATED = re.compile(r"^<!-- table: [\w.-]+ -->\n.*?^<!-- /table -->$", re.M | re.S)
_CODE = re.compile(r"^```.*?^```$", re.M | re.S)


def prose(text: str) -> str:
    """``text`` without its generated blocks and its fenced code (blanked, so lines keep their
    numbers)."""
    def blank(match: re.Match[str]) -> str:
        return "\n" * match[0].count("\n")

    return _CODE.sub(blank, _GENERATED.sub(blank, text))


def figures_in(text: str, *, benchmark_page: bool = False) -> list[tuple[int, str]]:
    """(line, figure) for each measured figure in the prose of a markdown ``text`` (stricter on
    a ``benchmark_page``)."""
    found = []
    for number, line in enumerate(prose(text).splitlines(), start=1):
        for match in FIGURES.finditer(line):
            found.append((number, match[0]))
        if benchmark_page:
            found += [(number, m[0]) for m in BENCHMARK_FIGURE.finditer(_BACKTICKED.sub("", line))
                      if (number, m[0]) not in found]
        if line.startswith("|"):  # one figure per row is enough to show it
            found += [(number, c.strip()) for c in line.strip(" |").split("|")
                      if FIGURE_CELL.match(c.strip())][:1]
    return found


def _is_benchmark_page(page: Path) -> bool:
    return page == ROOT / "docs" / "benchmarks.md" or page.parent == ROOT / "docs" / "benchmarks"


def _pages() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_measured_figure_outside_the_generated_blocks(page: Path) -> None:
    found = figures_in(page.read_text(), benchmark_page=_is_benchmark_page(page))
    assert found == [], (f"{page.relative_to(ROOT)}: measured figures typed into prose (put them "
                         "in a generated table, benchmarks/tables.py, or leave them out): "
                         + "; ".join(f"line {n}: {f!r}" for n, f in found))


PLANTED = """# Claims

<!-- table: claims -->
| sqlite | 5,840 tasks/s |
<!-- /table -->

The consumer went from 5,000 -> 5,840 tasks/s after the change.
Short tasks at the defaults: 1.18x `DumbBalancer`, 0.4\u00d7 pgqueuer.
A page took 18\u201338 ms; the watcher wakes every 10 ms.

| store | claims |
|---|---|
| sqlite | 12,345 |
| `127.0.0.1:5432` | 1 |

```python
print("12 ms")  # code is not prose
```
"""


def test_a_planted_figure_on_a_benchmark_page_is_found() -> None:
    text = ("# Storm\n\nThe storm took 37.5 s on 10,000 tasks (`--tasks 10,000`), 3 % more.\n"
            "It runs `python -m benchmarks storm`.\n")
    assert figures_in(text) == []
    assert figures_in(text, benchmark_page=True) == [(3, "37.5 s"), (3, "10,000"), (3, "3 %")]


def test_a_planted_figure_is_found() -> None:
    assert figures_in(PLANTED) == [
        (7, "5,000 -> 5,840"),  # (its "5,840 tasks/s" is inside that match)
        (8, "1.18x `DumbBalancer"), (8, "0.4\u00d7 pgqueuer"),
        (9, "18\u201338 ms"), (13, "12,345"),
    ]
