"""Release facts: one version (``metafora.__version__``) seen by the CLI, the metadata and the changelog."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from click.testing import CliRunner

import metafora
from metafora.cli import DISTRIBUTION, cli

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
