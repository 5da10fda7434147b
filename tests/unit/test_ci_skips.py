"""The CI=true hook: a skipped test or module fails the run (metafora.testing.pytest_plugin).

Each case runs an inner pytest in a subprocess (pytester.runpytest_subprocess), with the
environment a CI run has, so the hook is tested the way CI meets it."""

from __future__ import annotations

import pytest

SKIPPING = '''
import sys
import pytest


def test_runs():
    assert True


def test_skips_at_run_time():
    pytest.skip("no etcd binary")


@pytest.mark.skipif(True, reason="psycopg is not installed")
def test_skipped_by_marker():
    pass


@pytest.fixture
def server():
    pytest.skip("no PostgreSQL server")


def test_skipped_by_its_fixture(server):
    pass


@pytest.mark.skipif(sys.platform != "nonesuch", reason="only on the nonesuch platform")
def test_allowed_platform_skip():
    pass
'''

MODULE_SKIP = '''
import pytest

pytest.importorskip("a_module_nobody_has", reason="the extra is not installed")


def test_never_collected():
    pass
'''

CONFTEST = '''
from metafora.testing.pytest_plugin import AllowedSkip, fail_skips_in_ci


def pytest_configure(config):
    fail_skips_in_ci(config, [AllowedSkip("test_skipping.py::test_allowed_platform_skip",
                                          "nonesuch platform", "a platform skip is right")])
'''


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None,
         *args: str) -> pytest.RunResult:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    # Without hypothesis' plugin, which the inner suites do not use: its session set-up cost
    # each inner run 2 s of its 2.5 (the hook under test is metafora's plugin).
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-rA",
                                         *args, timeout=120)


def test_under_ci_every_skip_not_allowed_fails_the_run(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_skipping=SKIPPING)
    result = _run(pytester, monkeypatch, "true")
    # A skip while the test runs is a failure; one in its set-up (a marker, a fixture) an error.
    result.assert_outcomes(passed=1, failed=1, errors=2, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # Each line on its own: the inner run's order is pytest-randomly's (the summary lists the
    # errors in the order they happened), and the order is not what is tested.
    for line in ("ERROR *test_skipped_by_marker*skipped under CI=true*psycopg is not installed*",
                 "ERROR *test_skipped_by_its_fixture*skipped under CI=true*no PostgreSQL server*",
                 "FAILED *test_skips_at_run_time*skipped under CI=true*no etcd binary*"):
        result.stdout.fnmatch_lines([line])
    result.stdout.fnmatch_lines(["*SKIPPED*nonesuch platform*"])  # the allowed one


def test_under_ci_a_module_skipped_at_collection_is_an_error(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_extra=MODULE_SKIP)
    result = _run(pytester, monkeypatch, "true")
    result.assert_outcomes(errors=1)
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*skipped under CI=true*the extra is not installed*"])


def test_without_ci_skips_stay_skips(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_skipping=SKIPPING, test_extra=MODULE_SKIP)
    for ci in (None, "false"):
        result = _run(pytester, monkeypatch, ci)
        result.assert_outcomes(passed=1, skipped=5)
        assert result.ret == pytest.ExitCode.OK


def test_the_ini_option_turns_it_on_for_a_users_suite(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nmetafora_ci_fail_skips = true\n")
    pytester.makepyfile(test_skipping=SKIPPING)
    result = _run(pytester, monkeypatch, "true")
    result.assert_outcomes(passed=1, failed=1, errors=3)  # no allow-list: the platform skip too
    pytester.makeini("[pytest]\n")
    result = _run(pytester, monkeypatch, "true")
    result.assert_outcomes(passed=1, skipped=4)  # a user's suite: off unless asked for


def test_this_suite_fails_its_skips_in_ci(pytestconfig: pytest.Config) -> None:
    from metafora.testing.pytest_plugin import _FAIL_SKIPS
    from tests.conftest import ALLOWED_SKIPS

    assert pytestconfig.stash[_FAIL_SKIPS] == ALLOWED_SKIPS
    assert all(entry.why and entry.reason for entry in ALLOWED_SKIPS)
