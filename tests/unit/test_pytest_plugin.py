"""metafora's pytest plugin (entry point pytest11), run in inner pytest sessions by pytester."""

from __future__ import annotations

import pytest

USER_TESTS = '''
import threading

from metafora import Task, TaskState, simple_handler


def resize(task, stop):
    return task.props["width"] > 0


def test_handler_finishes(metafora_cluster):
    metafora_cluster.add(simple_handler(resize), "worker")
    metafora_cluster.client.submit_task(Task("img-1", {"width": 640}))
    metafora_cluster.wait_for_state("img-1", TaskState.DONE, timeout=30)


def test_client_sees_submissions(metafora_client, metafora_url):
    assert metafora_client.tasks() == []
    metafora_client.submit_task(Task("a"))
    assert [t.id for t in metafora_client.tasks()] == ["a"]
    assert metafora_url.split("://")[0] in ("memory", "sqlite")
'''


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An inner pytest in a process of its own. In-process (``pytester.runpytest``), the modules
    an inner run imported first (SQLAlchemy's dialects, grpc) were dropped when it ended, and the
    next import made a second copy of them beside objects of the first: a later test of this
    worker failed in SQLAlchemy ("'InternalTraversal' object is not callable"). Without
    hypothesis' plugin, which these suites do not use (its set-up took 2 s a run)."""
    return pytester.runpytest_subprocess("-p", "no:hypothesispytest", *args, timeout=300)


def test_fixtures_default_to_memory(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = _run(pytester, "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_handler_finishes?store=memory? PASSED*"])


def test_stores_option_runs_each_test_per_store(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = _run(pytester, "-v", "-p", "no:cacheprovider", "--metafora-stores", "memory,sqlite")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*test_client_sees_submissions?store=sqlite? PASSED*"])


def test_env_var_and_marker(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METAFORA_TEST_STORES", "sqlite")
    pytester.makepyfile(test_marked='''
import pytest


def test_from_env(metafora_url):
    assert metafora_url.startswith("sqlite:///")


@pytest.mark.metafora_stores("memory")
def test_marked(metafora_url):
    assert metafora_url.startswith("memory://")


@pytest.mark.parametrize("metafora_url", ["memory"], indirect=True)
def test_own_parametrize(metafora_url):
    assert metafora_url.startswith("memory://")
''')
    result = _run(pytester, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_unknown_store_kind_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = _run(pytester, "-p", "no:cacheprovider", "--metafora-stores", "mongo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown store kind(s) mongo*"])


def test_a_store_that_does_not_answer_skips_locally_and_fails_in_ci(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METAFORA_TEST_ETCD_URL", "etcd://127.0.0.1:1")
    pytester.makepyfile(test_user='''
def test_needs_etcd(metafora_client):
    pass
''')
    monkeypatch.setenv("CI", "false")
    result = _run(pytester, "-p", "no:cacheprovider", "--metafora-stores", "etcd", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no etcd store: $METAFORA_TEST_ETCD_URL (127.0.0.1:1) does not answer*"])
    monkeypatch.setenv("CI", "true")
    result = _run(pytester, "-p", "no:cacheprovider", "--metafora-stores", "etcd")
    result.assert_outcomes(errors=1)


SERVER_TESTS = '''
import os

from metafora import Task, TaskState, simple_handler


def test_handler_on_a_real_server(metafora_cluster, metafora_url):
    assert metafora_url.split("://")[0] in ("postgresql", "etcd")
    metafora_cluster.add(simple_handler(lambda task, stop: True), "worker")
    metafora_cluster.client.submit_task(Task("job-1"))
    metafora_cluster.wait_for_state("job-1", TaskState.DONE, timeout=60)


def test_each_test_gets_an_empty_namespace(metafora_client):
    assert metafora_client.tasks() == []
    metafora_client.submit_task(Task("job-1"))
'''


@pytest.mark.postgresql
@pytest.mark.etcd
def test_the_plugin_finds_or_starts_real_servers_for_a_users_suite(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # A user's suite defines no store fixture and names no server: the plugin finds
    # PostgreSQL (here the machine's on :5432, else initdb) and starts etcd from its binary.
    for name in ("METAFORA_TEST_POSTGRES_URL", "METAFORA_TEST_ETCD_URL"):
        monkeypatch.delenv(name, raising=False)
    from metafora.testing.servers import find_etcd

    if find_etcd() is None:
        pytest.skip("no etcd binary")  # CI installs etcd-server; under CI=true this skip fails
    pytester.makepyfile(test_user=SERVER_TESTS)
    result = pytester.runpytest_subprocess(  # no hypothesis plugin: 2 s of set-up, unused here
        "-v", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--metafora-stores",
        "postgresql,etcd", timeout=600)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*test_handler_on_a_real_server?store=etcd? PASSED*"])


def test_server_unavailable_says_what_was_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    from metafora.testing import servers
    from metafora.testing.servers import etcd

    monkeypatch.delenv("METAFORA_TEST_ETCD_URL", raising=False)
    monkeypatch.setenv("METAFORA_TEST_ETCD", "/nonexistent/etcd")
    monkeypatch.setattr(etcd, "docker_answers", lambda: False)  # where etcd_server looks it up
    with pytest.raises(servers.ServerUnavailable, match="no etcd binary"), \
            servers.etcd_server():
        pass
