"""requirements/dev.lock covers what setup.cfg asks for the tests, the checks and the docs.

CI builds every venv from the lock alone (.ci/run), so that a fresh machine and a cached one
test with the same versions (issue 53). A requirement added to setup.cfg but not to the lock
would be missing there, or a pin outside a new bound would be installed: re-make the lock
(``bash .ci/lock``) when this fails.
"""

from __future__ import annotations

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("dev", "docs")


def _required() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in EXTRAS:
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(line.split("#")[0].strip()) for line in lines if line.split("#")[0].strip()]


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for raw in text.splitlines():
        line = raw.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not a pin in requirements/dev.lock: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def unmet(lock_text: str) -> list[str]:
    """The requirements of setup.cfg (the package and its dev and docs extras) the lock does
    not pin, or pins outside their bounds."""
    pins = _pins(lock_text)
    problems = []
    for req in _required():
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req}: not in the lock")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{req}: the lock pins {pinned}")
    return problems


def test_the_lock_pins_every_requirement_within_its_bounds() -> None:
    assert unmet((ROOT / "requirements" / "dev.lock").read_text()) == [], "re-make it: bash .ci/lock"


def test_a_missing_or_stale_pin_is_found() -> None:
    lock = (ROOT / "requirements" / "dev.lock").read_text()
    stale = "\n".join(line for line in lock.splitlines() if not line.lower().startswith("click=="))
    stale += "\nclick==7.0\n"
    assert unmet(stale) == ["click>=8.1: the lock pins 7.0"]
    missing = "\n".join(line for line in lock.splitlines() if not line.lower().startswith("ruff=="))
    assert unmet(missing) == ["ruff>=0.4: not in the lock"]
