"""A pytest plugin for testing handlers against real metafora stores (entry point ``pytest11``).

Installed with metafora, it gives every test suite these fixtures:

- ``metafora_url``: a fresh, empty store URL for one test. Tests that use it run once per store
  kind chosen with ``--metafora-stores memory,sqlite,postgresql,etcd`` (or
  ``$METAFORA_TEST_STORES``; default ``memory``), or per the kinds of a
  ``@pytest.mark.metafora_stores(...)`` marker.
- ``metafora_client``: an operator :class:`~metafora.contracts.client.Client` on that store.
- ``metafora_cluster``: a :class:`~metafora.testing.LocalCluster` on that store (consumers in
  threads), shut down after the test.
- ``metafora_store_url``: ``make(kind) -> url`` for tests that pick the kind themselves.

Where the stores come from: ``memory`` is in-process; ``sqlite`` is a file in the test's
temporary directory; ``postgresql`` and ``etcd`` are real servers from
:mod:`metafora.testing.servers` (``$METAFORA_TEST_POSTGRES_URL`` / ``$METAFORA_TEST_ETCD_URL``, else a
container when a Docker engine answers, else a server already on 127.0.0.1:5432 for
PostgreSQL, else local binaries — ``initdb``/``pg_ctl``, ``etcd`` — started on free loopback
ports for the session and stopped by pid). With none, the test is skipped with the reason
(failed when ``CI=true``). Each test gets its own namespace (an etcd namespace is deleted
after the test); a session gets one throw-away PostgreSQL database. The session fixtures
``metafora_postgres_server``, ``metafora_postgres_database`` and ``metafora_etcd_server`` give
the servers' base URLs to tests that need them.

Skips in CI: with ``CI=true`` and the ini option ``metafora_ci_fail_skips = true`` (or after
:func:`fail_skips_in_ci` from a ``conftest.py``), every skipped test, and every module skipped at
collection, is reported as a failure instead: a suite that silently skips its PostgreSQL tests
in CI has not tested PostgreSQL. Skips that are right on every machine (a Linux-only test on
macOS) are allowed one by one with :func:`allow_skip`: a node id prefix, a piece of the skip's
reason, and why it is right.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the fixtures import them when they run
    from metafora.contracts.client import Client
    from metafora.testing import LocalCluster

__all__ = [
    "ENV_STORES",
    "STORE_KINDS",
    "AllowedSkip",
    "allow_skip",
    "fail_skips_in_ci",
    "metafora_client",
    "metafora_cluster",
    "metafora_etcd_server",
    "metafora_postgres_database",
    "metafora_postgres_server",
    "metafora_store_url",
    "metafora_url",
]

STORE_KINDS = ("memory", "sqlite", "postgresql", "etcd")
"""The store kinds ``--metafora-stores`` accepts (``all`` means every one)."""

ENV_STORES = "METAFORA_TEST_STORES"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--metafora-stores``."""
    group = parser.getgroup("metafora", "metafora stores")
    group.addoption("--metafora-stores", default=None, metavar="KINDS",
                    help="Comma-separated store kinds the metafora_url fixture runs each test on: "
                         f"{', '.join(STORE_KINDS)} or all (default: ${ENV_STORES}, else memory).")
    parser.addini("metafora_ci_fail_skips", type="bool", default=False,
                  help="With CI=true, report every skipped test as a failure (metafora plugin).")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``metafora_stores`` marker; check ``--metafora-stores``."""
    config.addinivalue_line(
        "markers", "metafora_stores(*kinds): the store kinds metafora_url runs this test on")
    text = config.getoption("--metafora-stores") or os.environ.get(ENV_STORES)
    if text:
        parse_kinds(text)  # a typo is a usage error at once, not a collection error per module
    if config.getini("metafora_ci_fail_skips"):
        fail_skips_in_ci(config)


@dataclasses.dataclass(frozen=True)
class AllowedSkip:
    """A skip that is right on every machine, so ``CI=true`` lets it through.

    ``nodeid`` is a prefix of the test's node id (``tests/unit/test_x.py::test_y`` or a whole
    file), ``reason`` a piece of the skip's reason (both must match), ``why`` says why the skip
    is right (for the reader of the allow-list; it is shown beside the skip)."""

    nodeid: str
    reason: str
    why: str


_FAIL_SKIPS = pytest.StashKey[list[AllowedSkip]]()


def fail_skips_in_ci(config: pytest.Config, allowed: Iterable[AllowedSkip] = ()) -> None:
    """Under ``CI=true``, turn every skip of this session into a failure, except ``allowed``.

    Call it from a ``conftest.py``'s ``pytest_configure`` (or set the ini option
    ``metafora_ci_fail_skips = true``). Without ``CI=true`` it only records the allow-list."""
    config.stash.setdefault(_FAIL_SKIPS, []).extend(allowed)


def allow_skip(config: pytest.Config, nodeid: str, reason: str, why: str) -> None:
    """Allow one skip under :func:`fail_skips_in_ci` (see :class:`AllowedSkip`)."""
    fail_skips_in_ci(config, [AllowedSkip(nodeid, reason, why)])


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_a_skip(config: pytest.Config, report: pytest.TestReport | pytest.CollectReport) -> None:
    allowed = config.stash.get(_FAIL_SKIPS, None)
    if allowed is None or not _in_ci() or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    for entry in allowed:
        if report.nodeid.startswith(entry.nodeid) and entry.reason in reason:
            return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true, which fails every skip not in the allow-list "
                       f"(metafora.testing.pytest_plugin.allow_skip): {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, pytest.TestReport, pytest.TestReport]:
    """Under ``CI=true`` (when enabled), a skipped test's report becomes a failure."""
    report = yield
    _fail_a_skip(item.config, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[
        None, pytest.CollectReport, pytest.CollectReport]:
    """Under ``CI=true`` (when enabled), a module skipped at collection is an error."""
    report = yield
    _fail_a_skip(collector.config, report)
    return report


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


def _serve(kind: str, server: contextlib.AbstractContextManager[str]) -> Iterator[str]:
    """Enter ``server`` (from metafora.testing.servers), or skip/fail saying why there is none."""
    from metafora.testing.servers import ServerUnavailable

    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(server)
        except ServerUnavailable as exc:
            _unavailable(kind, str(exc))
        yield url


@pytest.fixture(scope="session")
def metafora_postgres_server() -> Iterator[str]:
    """A PostgreSQL server's maintenance-database URL for the session (found or started)."""
    from metafora.testing.servers import postgres_server

    yield from _serve("postgresql", postgres_server())


@pytest.fixture(scope="session")
def metafora_postgres_database(metafora_postgres_server: str) -> Iterator[str]:
    """A throw-away PostgreSQL database for the session, dropped at its end."""
    from metafora.testing.servers import postgres_database

    with postgres_database(metafora_postgres_server) as url:
        yield url


@pytest.fixture(scope="session")
def metafora_etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An etcd's base URL (``etcd://host:port``) for the session (found or started)."""
    from metafora.testing.servers import etcd_server

    yield from _serve("etcd", etcd_server(tmp_path_factory.mktemp("metafora-etcd")))


def _namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def metafora_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """``make(kind) -> url``: a fresh, empty store of ``kind`` for this test (see the module doc)."""
    dropped: list[str] = []
    etcd_urls: list[str] = []

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
            base = str(request.getfixturevalue("metafora_postgres_database"))
            sep = "&" if "?" in base else "?"
            return f"{base}{sep}namespace={_namespace()}"
        url = f"{request.getfixturevalue('metafora_etcd_server')}/{_namespace()}"
        etcd_urls.append(url)
        return url

    yield make
    from metafora.coordinators.memory import drop_store

    for name in dropped:
        drop_store(f"{name}/metafora")
    if etcd_urls:
        from metafora.testing.servers import drop_etcd_namespace

        for url in etcd_urls:
            with contextlib.suppress(Exception):  # best effort: the server may be gone
                drop_etcd_namespace(url)


@pytest.fixture
def metafora_url(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> str:
    """A fresh, empty store URL for this test, of each kind chosen by ``--metafora-stores``."""
    kind = getattr(request, "param", "memory")
    return metafora_store_url(str(kind))


@pytest.fixture
def metafora_client(metafora_url: str) -> Iterator[Client]:
    """An operator client on ``metafora_url``, closed after the test."""
    from metafora.surfaces.connect import open_client

    with open_client(metafora_url) as client:
        yield client


@pytest.fixture
def metafora_cluster(metafora_url: str) -> Iterator[LocalCluster]:
    """A :class:`~metafora.testing.LocalCluster` on ``metafora_url``; every consumer it started is
    shut down after the test."""
    from metafora.testing import LocalCluster

    with LocalCluster(metafora_url) as cluster:
        yield cluster
