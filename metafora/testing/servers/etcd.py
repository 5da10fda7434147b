"""etcd for tests: a server from the environment, a container, or the etcd binary on loopback.

:func:`etcd_server` tries, in order: ``$METAFORA_TEST_ETCD_URL``; a container when a Docker
engine answers; the ``etcd`` binary (``$METAFORA_TEST_ETCD`` or on PATH) on free loopback
ports with a temporary data directory. :class:`EtcdServer` and :class:`EtcdCluster` run
members as child processes that a test can stop, kill and start again. Readiness is polled
against deadlines; processes are stopped by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from metafora.testing.servers.base import ServerUnavailable, docker_answers, free_ports, host_port

__all__ = [
    "ENV_ETCD_BINARY",
    "ENV_ETCD_URL",
    "EtcdCluster",
    "EtcdServer",
    "TLSFiles",
    "drop_etcd_namespace",
    "etcd_server",
    "find_etcd",
    "start_etcd",
    "start_etcd_cluster",
]

ENV_ETCD_URL = "METAFORA_TEST_ETCD_URL"
"""An etcd URL (``etcd://host:port``) tests should use instead of starting one."""
ENV_ETCD_BINARY = "METAFORA_TEST_ETCD"
"""The etcd binary to start (a path or a name on PATH; default ``etcd``)."""

_START_DEADLINE = 30.0
_STOP_DEADLINE = 10.0


def find_etcd() -> str | None:
    """Path of the etcd binary (``$METAFORA_TEST_ETCD`` or ``etcd`` on PATH), or None."""
    configured = os.environ.get(ENV_ETCD_BINARY)
    if configured:
        return configured if os.path.exists(configured) else shutil.which(configured)
    return shutil.which("etcd")


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _poll(ready: Callable[[], bool], deadline: float, what: str,
          proc: subprocess.Popen[bytes] | None, log: Path) -> None:
    gate = threading.Event()
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise ServerUnavailable(f"{what}: etcd exited with {proc.returncode}; log:\n{_tail(log)}")
        if time.monotonic() >= deadline:
            raise ServerUnavailable(f"{what}: not ready in time; log:\n{_tail(log)}")
        gate.wait(0.05)  # bounded poll of an external process, not synchronisation


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for a TLS etcd: CA, server cert/key, client cert/key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _healthy(client_url: str, tls: TLSFiles | None = None) -> bool:
    context = None
    if tls is not None:
        import ssl

        context = ssl.create_default_context(cafile=str(tls.ca))
        context.load_cert_chain(str(tls.client_cert), str(tls.client_key))
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1, context=context) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


def _owns_port(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the listening TCP socket of ``port`` (None: cannot tell,
    e.g. not Linux).

    A port from :func:`free_ports` is free again once chosen: another process (another test
    under pytest-xdist, another etcd on the machine) may bind it first. Our etcd then exits,
    but the other one answers ``/health`` on that port meanwhile, and a test would freeze or
    kill one server while its client talks to another.
    """
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    inodes = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN, the socket's inode.
            if (len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port
                    and cols[9] in inodes):
                return True
    return False


_ATTEMPTS = 3  # fresh ports for a new server whose port another process took first


def _port_taken(exc: ServerUnavailable) -> bool:
    return "address already in use" in str(exc) or "another process holds" in str(exc)


@dataclass
class EtcdServer:
    """One etcd member run as a child process; restartable with the same ports and data."""

    binary: str
    name: str
    data_dir: Path
    client_port: int
    peer_port: int
    initial_cluster: str = ""
    cluster_state: str = "new"
    tls: TLSFiles | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https`` with TLS)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """``http://127.0.0.1:PEERPORT``."""
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` for an etcd:// URL."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        """The running process id, if any."""
        return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    def url(self, namespace: str | None = None) -> str:
        """An ``etcd://`` URL for this server (a fresh random namespace by default).

        With TLS: ``etcds://`` with the CA and the client certificate as options.
        """
        ns = namespace or "t" + uuid.uuid4().hex[:10]
        if self.tls is None:
            return f"etcd://{self.endpoint}/{ns}"
        return (f"etcds://{self.endpoint}/{ns}?ca_cert={self.tls.ca}"
                f"&cert_cert={self.tls.client_cert}&cert_key={self.tls.client_key}")

    def command(self) -> list[str]:
        """The etcd command line."""
        cluster = self.initial_cluster or f"{self.name}={self.peer_url}"
        tls: list[str] = []
        if self.tls is not None:
            tls = ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
                   "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        return [
            self.binary, *tls,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--logger=zap",
            "--log-level=warn",
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-state", self.cluster_state,
            "--initial-cluster-token", f"metafora-test-{self.data_dir.parent.name}",
        ]

    def start(self, wait: bool = True) -> None:
        """Start (or restart) the member; with ``wait``, until it reports healthy."""
        if self.pid is not None:
            return
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        log = self.data_dir.with_suffix(".log")
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = _START_DEADLINE) -> None:
        """Poll ``/health`` until it answers true, with a deadline; the answer must come from
        this member's own process (ServerUnavailable if another process holds its port)."""
        log = self.data_dir.with_suffix(".log")

        def ready() -> bool:
            if not _healthy(self.client_url, self.tls):
                return False
            if self.proc is None or _owns_port(self.proc.pid, self.client_port) is not False:
                return True
            if self.proc.poll() is None:
                return False  # still binding, or about to exit: look again
            raise ServerUnavailable(f"etcd {self.name}: another process holds port "
                                    f"{self.client_port}; log:\n{_tail(log)}")

        _poll(ready, time.monotonic() + timeout, f"etcd {self.name}", self.proc, log)

    def stop(self) -> None:
        """SIGTERM the member by pid and wait for it (SIGKILL after a deadline)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(_STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(_STOP_DEADLINE)

    def kill(self) -> None:
        """SIGKILL the member by pid (a crash)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(_STOP_DEADLINE)


@dataclass
class EtcdCluster:
    """A 3-member (by default) etcd cluster on loopback."""

    members: list[EtcdServer]

    @property
    def endpoints(self) -> str:
        """``127.0.0.1:P1,127.0.0.1:P2,...``."""
        return ",".join(m.endpoint for m in self.members)

    def url(self, namespace: str | None = None) -> str:
        """An ``etcd://`` URL naming every member."""
        return f"etcd://{self.endpoints}/{namespace or 't' + uuid.uuid4().hex[:10]}"

    def stop(self, index: int) -> None:
        """Stop one member (SIGTERM by pid)."""
        self.members[index].stop()

    def kill(self, index: int) -> None:
        """Kill one member (SIGKILL by pid)."""
        self.members[index].kill()

    def start(self, index: int) -> None:
        """Start a stopped member again (it rejoins with its data dir)."""
        member = self.members[index]
        member.cluster_state = "existing"
        member.start()

    def leader(self) -> int:
        """Index of the current leader (asked with ``etcdctl endpoint status``; 0 without it)."""
        import json

        etcdctl = shutil.which("etcdctl")
        if etcdctl is None:
            return 0
        live = [m for m in self.members if m.pid is not None]
        out = subprocess.run(
            [etcdctl, "--endpoints", ",".join(m.client_url for m in live), "endpoint", "status",
             "--write-out=json"],
            check=True, capture_output=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"},
        ).stdout
        for status in json.loads(out):
            header = status["Status"]["header"]
            if header["member_id"] == status["Status"]["leader"]:
                endpoint = status["Endpoint"]
                return next(i for i, m in enumerate(self.members) if m.client_url == endpoint)
        return 0

    def stop_all(self) -> None:
        """Stop every member."""
        for member in self.members:
            member.stop()


def start_etcd_cluster(binary: str, base: Path, size: int = 3) -> EtcdCluster:
    """Start ``size`` members with a static ``--initial-cluster`` and wait until healthy (on
    fresh ports again if another process took one first)."""
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            return _start_etcd_cluster(binary, base / f"try{attempt}" if attempt > 1 else base, size)
        except ServerUnavailable as exc:
            if attempt == _ATTEMPTS or not _port_taken(exc):
                raise
    raise AssertionError("unreachable")


def _start_etcd_cluster(binary: str, base: Path, size: int) -> EtcdCluster:
    ports = free_ports(2 * size)
    members = [
        EtcdServer(binary, f"m{i}", base / f"m{i}.etcd", ports[2 * i], ports[2 * i + 1])
        for i in range(size)
    ]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m in members:
        m.initial_cluster = initial
        m.start(wait=False)
    cluster = EtcdCluster(members)
    try:
        for m in members:
            m.wait_healthy()
    except BaseException:
        cluster.stop_all()
        raise
    return cluster


def start_etcd(binary: str, base: Path, name: str = "default", tls: TLSFiles | None = None) -> EtcdServer:
    """Start one single-member etcd under ``base`` and wait until it is healthy (on fresh
    ports again if another process took one first)."""
    for attempt in range(1, _ATTEMPTS + 1):
        client, peer = free_ports(2)
        data = base / (f"{name}.etcd" if attempt == 1 else f"{name}-{attempt}.etcd")
        server = EtcdServer(binary, name, data, client, peer, tls=tls)
        try:
            server.start()
        except ServerUnavailable as exc:
            server.kill()
            if attempt == _ATTEMPTS or not _port_taken(exc):
                raise
            continue
        except BaseException:
            server.kill()
            raise
        return server
    raise AssertionError("unreachable")


def _etcd_answers(url: str) -> bool:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 2379
    scheme = "https" if parts.scheme == "etcds" else "http"
    return scheme == "https" or _healthy(f"{scheme}://{host}:{port}")


@contextlib.contextmanager
def etcd_server(base: Path | None = None) -> Iterator[str]:
    """The base URL (``etcd://host:port``) of an etcd (see the module doc for the order).

    ``base`` is where a started server keeps its data (a temporary directory by default);
    a server this function started is stopped when the context ends.
    """
    env = os.environ.get(ENV_ETCD_URL)
    if env:
        if not _etcd_answers(env):
            raise ServerUnavailable(f"${ENV_ETCD_URL} ({host_port(env, 2379)}) does not answer")
        parts = urlsplit(env)
        yield f"{parts.scheme}://{parts.netloc}"
        return
    tried: list[str] = []
    if docker_answers():
        with contextlib.ExitStack() as stack:
            url = _etcd_container(stack, tried)
            if url is not None:
                yield url
                return
    binary = find_etcd()
    if binary is None:
        tried.append(f"no etcd binary (apt-get install etcd-server, or set ${ENV_ETCD_BINARY})")
        raise ServerUnavailable("; ".join(tried))
    with contextlib.ExitStack() as stack:
        if base is None:
            base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="metafora-etcd-")))
        server = start_etcd(binary, base)
        stack.callback(server.stop)
        yield f"etcd://{server.endpoint}"


def _etcd_container(stack: contextlib.ExitStack, tried: list[str]) -> str | None:
    try:
        from testcontainers.core.container import DockerContainer  # type: ignore[import-not-found]
    except ImportError:
        tried.append("Docker answers but testcontainers is not installed")
        return None
    container: Any = DockerContainer("quay.io/coreos/etcd:v3.5.17").with_exposed_ports(2379)
    container = container.with_command(
        "etcd --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://127.0.0.1:2379")
    stack.enter_context(container)
    url = f"http://{container.get_container_host_ip()}:{container.get_exposed_port(2379)}"
    _poll(lambda: _healthy(url), time.monotonic() + _START_DEADLINE, "etcd container", None,
          Path("/nonexistent"))
    return f"etcd://{urlsplit(url).netloc}"


def drop_etcd_namespace(url: str) -> None:
    """Delete every key of the namespace of the etcd store ``url`` (after a test)."""
    from metafora.coordinators.etcd.config import EtcdConfig
    from metafora.coordinators.etcd.driver import Delete, EtcdDriver
    from metafora.coordinators.etcd.layout import Keys
    from metafora.core.config import parse_store_url

    config = EtcdConfig.from_url(parse_store_url(url), {})
    driver = EtcdDriver(config.connection)
    try:
        driver.txn([], [Delete(Keys(config.namespace).root, prefix=True)])
    finally:
        driver.close()
