"""Release facts: one version (``metafora.__version__``) seen by the CLI, the metadata and the changelog."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
from click.testing import CliRunner

import metafora
from metafora import open_client
from metafora.cli import DISTRIBUTION, cli
from metafora.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_semantic() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", metafora.__version__)


def test_cli_prints_the_version_and_the_distribution_name() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"metafora {metafora.__version__} (distribution metafora-cluster, ")
    assert DISTRIBUTION == "metafora-cluster"


def test_installed_metadata_reads_the_package_version() -> None:
    # setup.cfg says `version = attr: metafora.__version__`: the installed metadata agrees
    assert importlib.metadata.version(DISTRIBUTION) == metafora.__version__


def test_changelog_starts_with_this_version() -> None:
    headings = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings, "CHANGELOG.md has no release heading"
    assert headings[0] == metafora.__version__


def test_a_missing_driver_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def without_psycopg(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "psycopg" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_psycopg)
    with pytest.raises(ConfigError, match=re.escape("pip install 'metafora-cluster[postgres]'")):
        open_client("postgresql://nobody@127.0.0.1:1/none")


def test_install_hints_name_the_distribution() -> None:
    # `pip install 'metafora[x]'` installs an unrelated project: every extra is metafora-cluster[x]
    files = [ROOT / "README.md", *ROOT.glob("metafora/**/*.py"), *ROOT.glob("docs/**/*.md"),
             *ROOT.glob("examples/**/*.py")]
    wrong = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in files
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if "metafora[" in line]
    assert not wrong, "install hints must name metafora-cluster:\n" + "\n".join(wrong)
