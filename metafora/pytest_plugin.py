"""A pytest plugin for testing handlers against real metafora stores (entry point ``pytest11``).

Installed with metafora, it gives every test suite these fixtures:

- ``metafora_url``: a fresh, empty store URL for one test. Tests that use it run once per store
  kind chosen with ``--metafora-stores memory,sqlite,postgresql,etcd`` (or
  ``$METAFORA_TEST_STORES``; default ``memory``), or per the kinds of a
  ``@pytest.mark.metafora_stores(...)`` marker.
- ``metafora_client``: an operator :class:`~metafora.coordinator.Client` on that store.
- ``metafora_cluster``: a :class:`~metafora.testing.LocalCluster` on that store (consumers in
  threads), shut down after the test.
- ``metafora_store_url``: ``make(kind) -> url`` for tests that pick the kind themselves.

Where the stores come from: ``memory`` is in-process; ``sqlite`` is a file in the test's
temporary directory; ``postgresql`` and ``etcd`` use a ``postgres_url`` / ``etcd_url`` fixture
when the suite defines one (metafora's own suite does: it starts local servers), else
``$METAFORA_TEST_POSTGRES_URL`` / ``$METAFORA_TEST_ETCD_URL``, else a server on the default
loopback port; with none, the test is skipped (failed when ``CI=true``). Each test gets its own
namespace.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest

if TYPE_CHECKING:  # the fixtures import them when they run
    from metafora.coordinator import Client
    from metafora.testing import LocalCluster

__all__ = [
    "ENV_STORES",
    "STORE_KINDS",
    "metafora_client",
    "metafora_cluster",
    "metafora_store_url",
    "metafora_url",
]

STORE_KINDS = ("memory", "sqlite", "postgresql", "etcd")
"""The store kinds ``--metafora-stores`` accepts (``all`` means every one)."""

ENV_STORES = "METAFORA_TEST_STORES"
ENV_POSTGRES = "METAFORA_TEST_POSTGRES_URL"
ENV_ETCD = "METAFORA_TEST_ETCD_URL"
_LOCAL = {"postgresql": ("127.0.0.1", 5432, "postgresql://postgres@127.0.0.1:5432/postgres"),
          "etcd": ("127.0.0.1", 2379, "etcd://127.0.0.1:2379")}


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--metafora-stores``."""
    group = parser.getgroup("metafora", "metafora stores")
    group.addoption("--metafora-stores", default=None, metavar="KINDS",
                    help="Comma-separated store kinds the metafora_url fixture runs each test on: "
                         f"{', '.join(STORE_KINDS)} or all (default: ${ENV_STORES}, else memory).")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``metafora_stores`` marker; check ``--metafora-stores``."""
    config.addinivalue_line(
        "markers", "metafora_stores(*kinds): the store kinds metafora_url runs this test on")
    text = config.getoption("--metafora-stores") or os.environ.get(ENV_STORES)
    if text:
        parse_kinds(text)  # a typo is a usage error at once, not a collection error per module


def parse_kinds(text: str) -> list[str]:
    """``"memory, sqlite"`` or ``"all"`` into kinds; pytest.UsageError for an unknown kind."""
    kinds = [k.strip().lower() for k in text.split(",") if k.strip()]
    if kinds == ["all"]:
        return list(STORE_KINDS)
    unknown = [k for k in kinds if k not in STORE_KINDS]
    if unknown or not kinds:
        raise pytest.UsageError(
            f"--metafora-stores: unknown store kind(s) {', '.join(unknown) or '(none)'}; "
            f"use {', '.join(STORE_KINDS)} or all")
    return list(dict.fromkeys(kinds))


def _chosen(metafunc: pytest.Metafunc) -> list[str]:
    marker = metafunc.definition.get_closest_marker("metafora_stores")
    if marker is not None:
        return parse_kinds(",".join(str(a) for a in marker.args))
    text = metafunc.config.getoption("--metafora-stores") or os.environ.get(ENV_STORES) or "memory"
    return parse_kinds(text)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each test that uses ``metafora_url`` once per chosen store kind."""
    if "metafora_url" not in metafunc.fixturenames:
        return
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        listed = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if "metafora_url" in listed:
            return  # the test parametrizes it itself
    kinds = _chosen(metafunc)
    metafunc.parametrize("metafora_url", kinds, indirect=True, ids=[f"store={k}" for k in kinds])


def _unavailable(kind: str, reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the {kind} store is required in CI: {reason}")
    pytest.skip(f"no {kind} store: {reason}")


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _server_url(request: pytest.FixtureRequest, kind: str, fixture: str, env: str) -> str:
    """A fresh-namespace URL on a server: the suite's fixture, else $env, else loopback."""
    try:
        return str(request.getfixturevalue(fixture))
    except pytest.FixtureLookupError:
        pass
    namespace = f"t{uuid.uuid4().hex[:12]}"
    base = os.environ.get(env)
    if base:
        parts = urlsplit(base)
        host, port = parts.hostname or "127.0.0.1", parts.port or _LOCAL[kind][1]
        if not _answers(host, port):
            _unavailable(kind, f"${env} ({host}:{port}) does not answer")
    else:
        host, port, base = _LOCAL[kind]
        if not _answers(host, port):
            _unavailable(kind, f"no ${env} and nothing answers on {host}:{port}")
    if kind == "etcd":
        parts = urlsplit(base)
        return f"{parts.scheme}://{parts.netloc}/{namespace}"
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}namespace={namespace}"


@pytest.fixture
def metafora_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """``make(kind) -> url``: a fresh, empty store of ``kind`` for this test (see the module doc)."""
    dropped: list[str] = []

    def make(kind: str) -> str:
        if kind not in STORE_KINDS:
            raise ValueError(f"unknown store kind {kind!r} (use {', '.join(STORE_KINDS)})")
        if kind == "memory":
            name = f"pytest-{uuid.uuid4().hex[:8]}"
            dropped.append(name)
            return f"memory://{name}"
        if kind == "sqlite":
            return f"sqlite:///{tmp_path / f'metafora-{uuid.uuid4().hex[:6]}.db'}"
        if kind == "postgresql":
            return _server_url(request, kind, "postgres_url", ENV_POSTGRES)
        return _server_url(request, kind, "etcd_url", ENV_ETCD)

    yield make
    from metafora.coordinators.memory import drop_store

    for name in dropped:
        drop_store(f"{name}/metafora")


@pytest.fixture
def metafora_url(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> str:
    """A fresh, empty store URL for this test, of each kind chosen by ``--metafora-stores``."""
    kind = getattr(request, "param", "memory")
    return metafora_store_url(str(kind))


@pytest.fixture
def metafora_client(metafora_url: str) -> Iterator[Client]:
    """An operator client on ``metafora_url``, closed after the test."""
    from metafora.connect import open_client

    with open_client(metafora_url) as client:
        yield client


@pytest.fixture
def metafora_cluster(metafora_url: str) -> Iterator[LocalCluster]:
    """A :class:`~metafora.testing.LocalCluster` on ``metafora_url``; every consumer it started is
    shut down after the test."""
    from metafora.testing import LocalCluster

    with LocalCluster(metafora_url) as cluster:
        yield cluster
