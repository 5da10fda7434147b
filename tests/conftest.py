"""Test wiring: real-store fixtures are plugins under tests/fixtures/."""

from __future__ import annotations

import importlib.util
import os
import resource
import time
import zlib

import pytest
from hypothesis import settings

from metafora.testing.pytest_plugin import AllowedSkip, fail_skips_in_ci

# Each store's fixtures live in their own plugin module; a module not written yet is skipped.
pytest_plugins = [
    name
    for name in ("tests.fixtures.postgres", "tests.fixtures.etcd", "tests.fixtures.faults")
    if importlib.util.find_spec(name) is not None
] + ["pytester"]  # metafora's own pytest plugin (metafora.testing.pytest_plugin) is tested with pytester

# Tests that need a store server get a marker of its name, so `-m "not postgresql and not etcd"`
# selects the memory and SQLite tests (CI runs those on every supported Python).
_SERVER_FIXTURES = {
    "postgresql": {"postgres_server_url", "postgres_database_url", "postgres_url", "temp_postgres",
                   "metafora_postgres_server", "metafora_postgres_database"},
    "etcd": {"etcd_server", "etcd_url", "etcd_factory", "etcd_cluster", "metafora_etcd_server"},
}


# CI's stages (.ci/run): `isolated` tests (one process, their own temp dirs, databases and
# namespaces) under pytest-xdist -n 2; the rest of integration/acceptance under -n 3 (they
# wait more than they compute; each has its own temp dir, database per xdist worker, namespace
# and free ports); `timing` tests (marked in their files: they measure wall-clock time) one at
# a time, first, with nothing else of the run beside them; the `soak` modules below (long
# multi-process fleets and the fault campaign) two at a time, in a job beside stages 1 and 2.
ISOLATED_DIRS = ("tests/unit/", "tests/conformance/", "tests/web/")
SOAK_MODULES = (
    "tests/faults/test_campaign.py",  # every fault scenario on PostgreSQL and a 3-member etcd
    "tests/integration/test_even_cluster.py",  # fleets of processes joining and leaving
    "tests/integration/test_gates_processes.py",
    "tests/integration/test_limit_processes.py",
    "tests/integration/test_placement_processes.py",
    "tests/integration/test_rebalance_processes.py",
    "tests/integration/test_schedule_processes.py",
    "tests/integration/test_statemachine_processes.py",
    "tests/integration/test_stream_processes.py",
    "tests/integration/test_sql_multiprocess.py",
)

# Hypothesis: HYPOTHESIS_PROFILE=ci (CI, where the property tests run once, beside the soaks: 200
# examples, no per-example deadline on a shared 2-core machine), push (a quick local
# pass: 25), default (hypothesis' own). "soak" is the former name of "ci".
# A test's own @settings(max_examples=...) still wins over the profile.
settings.register_profile("push", max_examples=25, deadline=None)
settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("soak", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Each test runs once in CI (issue 53). The tests every supported Python runs (PORTABLE_DIRS,
# memory and SQLite only, no timing, soak or property test) are dealt out among the Pythons:
# `--python-share K/N@SALT` keeps the portable tests whose share is K (of N) and every other
# test; the share of a test is crc32(SALT:node id) mod N, so a run's salt (CI's seed) moves each
# test to another Python from run to run while a run is reproducible from its seed.
PORTABLE_DIRS = ("tests/unit/", "tests/conformance/")
NOT_PORTABLE = ("postgresql", "etcd", "timing", "soak", "hypothesis")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--python-share", metavar="K/N@SALT", default=None,
                     help="run share K (0..N-1) of the portable tests and every other test")


def _python_share(spec: str) -> tuple[int, int, str]:
    share, _, salt = spec.partition("@")
    k, _, n = share.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise pytest.UsageError(f"--python-share {spec!r}: expected K/N@SALT with 0 <= K < N")
    return int(k), int(n), salt


def _portable(item: pytest.Item) -> bool:
    return item.nodeid.startswith(PORTABLE_DIRS) and not any(
        item.get_closest_marker(name) for name in NOT_PORTABLE)


def _deal_shares(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("python_share")
    if spec is None:
        return
    k, n, salt = _python_share(spec)
    kept, others = [], []
    for item in items:
        share = zlib.crc32(f"{salt}:{item.nodeid}".encode()) % n
        (kept if share == k or not _portable(item) else others).append(item)
    if others:
        config.hook.pytest_deselected(items=others)
        items[:] = kept


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by the store servers its fixtures or its store parameter need, and by
    its CI stage (isolated, soak); then keep this Python's share (--python-share)."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(ISOLATED_DIRS):
            item.add_marker(pytest.mark.isolated)
        if path in SOAK_MODULES:
            item.add_marker(pytest.mark.soak)
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        # A parameter may be a tuple, ("postgresql", "psycopg"): each of its parts counts (such a
        # test ran among the portable ones, on the other Pythons, without its marker).
        values = callspec.params.values() if callspec is not None else ()
        params = {str(part) for v in values for part in (v if isinstance(v, tuple) else (v,))}
        for server, names in _SERVER_FIXTURES.items():
            if fixtures & names or server in params:
                item.add_marker(getattr(pytest.mark, server))
    _deal_shares(config, items)


# Under CI=true every skip is a failure (the hook is metafora's pytest plugin, enabled below),
# except these, which are right on every machine. Add one only with its reason: a skip that
# hides a missing server, extra or binary in CI is a test that did not run.
ALLOWED_SKIPS = [
    # The test reads a thread limit from /proc/self/status, which only Linux has; on macOS the
    # skip is the truth, not a missing dependency.
    AllowedSkip("tests/unit/test_capacity_limit.py::", "reads /proc/self/status",
                "Linux only (/proc)"),
]


def pytest_configure(config: pytest.Config) -> None:
    """Fail every skip under CI=true, but for ALLOWED_SKIPS."""
    fail_skips_in_ci(config, ALLOWED_SKIPS)


_CPU_LOG = os.environ.get("METAFORA_TEST_CPU_LOG")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """With ``METAFORA_TEST_CPU_LOG=FILE``: append each test's CPU seconds (this process and
    the children it waited for) and wall seconds to FILE, to find what a CI stage spends its
    cores on (the durations JUnit records are wall time, mostly waiting)."""
    if not _CPU_LOG:
        return (yield)
    began, wall = _cpu_now(), time.monotonic()
    try:
        return (yield)
    finally:
        cpu = _cpu_now() - began
        with open(_CPU_LOG, "a", encoding="utf-8") as out:
            out.write(f"{cpu:.2f}\t{time.monotonic() - wall:.2f}\t{item.nodeid}\n")


def _cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
