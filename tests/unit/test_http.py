"""/info, /metrics and the probes /healthz and /readyz of a consumer, over real HTTP on loopback."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metafora import Consumer, Task, TaskState, open_coordinator, simple_handler
from metafora.core.errors import ConfigError
from metafora.testing import LocalCluster, wait_for


def get(addr: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_info_metrics_and_health() -> None:
    release = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        if task.id == "boom":
            raise RuntimeError("boom")
        if task.id == "long":
            release.wait(30)
        return True

    with LocalCluster() as cluster:
        consumer = cluster.add(simple_handler(work), "web", http_addr="127.0.0.1:0")
        addr = wait_for(lambda: consumer.http_address, what="http server")
        for i in range(5):
            cluster.client.submit_task(Task(f"ok{i}"))
        cluster.client.submit_task(Task("boom"))
        cluster.client.submit_task(Task("long"))
        wait_for(lambda: len(cluster.client.tasks("done")) == 5
                 and len(cluster.client.tasks("failed")) == 1, what="tasks finished")

        status, body = get(addr, "/info")
        info = json.loads(body)
        assert status == 200 and info["node"] == "web" and info["frozen"] is False
        assert [t["id"] for t in info["tasks"]] == ["long"]
        assert info["tasks"][0]["token"] > 0 and info["tasks"][0]["started"]

        status, body = get(addr, "/metrics")
        assert status == 200
        samples = {
            (s.name, s.labels.get("le")): s.value
            for fam in text_string_to_metric_families(body.decode())
            for s in fam.samples
        }
        assert samples[("metafora_claims_total", None)] == 7
        assert samples[("metafora_done_total", None)] == 5
        assert samples[("metafora_failed_total", None)] == 1
        assert samples[("metafora_running_tasks", None)] == 1
        calls = samples[("metafora_claim_latency_seconds_count", None)]  # batched claims
        assert 1 <= calls <= 7
        assert samples[("metafora_claim_latency_seconds_bucket", "+Inf")] == calls

        status, body = get(addr, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert get(addr, "/nope")[0] == 404
        release.set()
        cluster.wait_for_state("long", TaskState.DONE)
        cluster.stop(consumer)
    with pytest.raises(OSError):
        get(addr, "/healthz")


@pytest.mark.parametrize("bad", ["nohost", ":80", "h:port", "h:70000"])
def test_bad_http_addr_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="http_addr"):
        Consumer(open_coordinator("memory://http-bad"), simple_handler(lambda t, s: True),
                 http_addr=bad)


def _headers(addr: str, path: str) -> dict[str, str]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as resp:
            return {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return {k.lower(): v for k, v in err.headers.items()}


def test_all_interfaces_warn_what_they_expose_and_every_response_has_the_headers(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="metafora.http"), LocalCluster() as cluster:
        consumer = cluster.add(simple_handler(lambda t, s: True), "open", http_addr="0.0.0.0:0")
        addr = wait_for(lambda: consumer.http_address, what="http server")
        port = addr.rsplit(":", 1)[1]
        for path in ("/info", "/healthz", "/nope"):
            got = _headers(f"127.0.0.1:{port}", path)
            assert got.get("x-content-type-options") == "nosniff", (path, got)
            assert "frame-ancestors 'none'" in got.get("content-security-policy", ""), (path, got)
    warnings = [r.getMessage() for r in caplog.records if r.name == "metafora.http"]
    assert any("task ids and fencing tokens" in w and "without authentication" in w for w in warnings)


def test_loopback_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="metafora.http"), LocalCluster() as cluster:
        consumer = cluster.add(simple_handler(lambda t, s: True), "closed", http_addr="127.0.0.1:0")
        wait_for(lambda: consumer.http_address, what="http server")
    assert [r for r in caplog.records if r.name == "metafora.http"] == []


@pytest.mark.parametrize("url", ["memory://probes", "sqlite"])
def test_readyz_turns_503_when_shutdown_starts_while_healthz_stays_200(url: str, tmp_path: Path) -> None:
    """Kubernetes stops routing to a node that is shutting down, but must not kill it while it
    hands its tasks off: /readyz 503 from the start of the shutdown, /healthz 200 until the end."""
    if url == "sqlite":
        url = f"sqlite:///{tmp_path / 'probes.db'}?lease_ttl=5"
    stopping, let_go = threading.Event(), threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        stop.wait(60)
        stopping.set()
        let_go.wait(60)  # the shutdown's window: stopping, the claim still held
        return False

    with LocalCluster(url) as cluster:
        consumer = cluster.add(simple_handler(work), "probed", http_addr="127.0.0.1:0")
        addr = wait_for(lambda: consumer.http_address, what="http server")
        cluster.client.submit_task(Task("held"))
        cluster.wait_for_state("held", TaskState.CLAIMED)
        status, body = get(addr, "/readyz")
        ready = json.loads(body)
        assert status == 200 and ready["ready"] and ready["registered"] and not ready["stopping"]
        if url.startswith("sqlite"):
            assert 0 < ready["lease_left_s"] <= 5
        else:
            assert ready["lease_left_s"] is None  # the memory store has no lease by the clock
        closer = threading.Thread(target=consumer.shutdown, name="shutdown")
        closer.start()
        try:
            assert stopping.wait(30), "stop() never reached the handler"
            status, body = get(addr, "/readyz")
            assert status == 503 and json.loads(body)["stopping"] is True
            assert get(addr, "/healthz")[0] == 200
            assert cluster.client.get_task("held").state is TaskState.CLAIMED
        finally:
            let_go.set()
            closer.join(60)
        assert cluster.client.get_task("held").state is TaskState.PENDING


def test_a_dead_loop_is_not_alive() -> None:
    """A consumer whose side thread failed is not alive (/healthz 503: restart it) and says why."""
    consumer = Consumer(open_coordinator("memory://probes-dead"), simple_handler(lambda t, s: True))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except RuntimeError as exc:  # run() raises the error that stopped it
            raised.append(exc)

    runner = threading.Thread(target=run, name="consumer")
    runner.start()
    try:
        wait_for(consumer.ready, what="ready")
        assert consumer.healthy()
        consumer._supervisor.fail_fast("watch", RuntimeError("the watch died"))
        probes = consumer.probes()
        assert probes["alive"] is False and probes["ready"] is False
        assert probes["error"] == "RuntimeError"
    finally:
        consumer.shutdown()
        runner.join(30)
    assert [str(e) for e in raised] == ["the watch died"]


def test_a_side_loop_that_cannot_start_stops_the_consumer_with_a_named_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of threads at start: run() raises an error naming the loop, shutdown still completes,
    and the node was never reported ready (ready means every side loop is up)."""
    from metafora.core.errors import MetaforaError

    consumer = Consumer(open_coordinator("memory://probes-no-thread"),
                        simple_handler(lambda t, s: True))
    real_start = threading.Thread.start
    seen_ready: list[bool] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("metafora-schedules-"):
            seen_ready.append(consumer.ready())
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(MetaforaError, match=r"cannot start the schedules loop .*can.t start new"):
        consumer.run()
    assert seen_ready == [False]
    assert not consumer.ready()
