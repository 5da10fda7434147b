"""Real store servers for tests: PostgreSQL and etcd on loopback, found or started, stopped by pid.

metafora's pytest plugin (:mod:`metafora.pytest_plugin`) gets its servers here, and so does
metafora's own test suite: one way to get a store. Where a server comes from, in order:

- PostgreSQL (:func:`postgres_server`): ``$METAFORA_TEST_POSTGRES_URL``; a container from
  ``testcontainers`` when a Docker engine answers; a server on 127.0.0.1:5432 that lets
  ``postgres`` in; a throw-away cluster made with ``initdb`` and started with ``pg_ctl`` on a
  free loopback port (as the ``postgres`` user when run as root).
- etcd (:func:`etcd_server`): ``$METAFORA_TEST_ETCD_URL``; a container when a Docker engine
  answers; the ``etcd`` binary (``$METAFORA_TEST_ETCD`` or on PATH) on free loopback ports with
  a temporary data directory.

When none works, :class:`ServerUnavailable` says what was tried. Nothing here sleeps to
synchronise: readiness is polled against deadlines, and processes are stopped by pid.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import select
import shutil
import signal
import socket
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
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "ENV_ETCD_BINARY",
    "ENV_ETCD_URL",
    "ENV_POSTGRES_URL",
    "EtcdCluster",
    "EtcdServer",
    "ServerUnavailable",
    "TLSFiles",
    "TempPostgres",
    "docker_answers",
    "drop_etcd_namespace",
    "etcd_server",
    "find_etcd",
    "free_ports",
    "pg_bin",
    "postgres_answers",
    "postgres_database",
    "postgres_server",
    "start_etcd",
    "start_etcd_cluster",
]

ENV_POSTGRES_URL = "METAFORA_TEST_POSTGRES_URL"
"""A PostgreSQL server URL (maintenance database) tests should use instead of finding one."""
ENV_ETCD_URL = "METAFORA_TEST_ETCD_URL"
"""An etcd URL (``etcd://host:port``) tests should use instead of starting one."""
ENV_ETCD_BINARY = "METAFORA_TEST_ETCD"
"""The etcd binary to start (a path or a name on PATH; default ``etcd``)."""

_LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
_START_DEADLINE = 30.0
_STOP_DEADLINE = 10.0


class ServerUnavailable(RuntimeError):
    """No server of the kind asked could be found or started; the message says what was tried."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback TCP ports (held open together while chosen)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def docker_answers() -> bool:
    """Whether a Docker engine answers ``docker info`` (testcontainers needs one)."""
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        done = subprocess.run([docker, "info"], check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _kill_and_wait(pid: int, sig: int, timeout: float = 30.0) -> None:
    """Signal a process (not necessarily our child) and wait for it to exit, bounded."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        select.select([fd], [], [], timeout)  # readable once the process has exited
    finally:
        os.close(fd)


# -- PostgreSQL ---------------------------------------------------------------------------


def _libpq(url: str) -> str:
    """A libpq URI (``postgresql://``) for any accepted scheme (``postgresql+psycopg`` too)."""
    parts = urlsplit(url)
    return urlunsplit(("postgresql", parts.netloc, parts.path, parts.query, ""))


def postgres_answers(url: str, timeout: int = 3) -> bool:
    """Whether a PostgreSQL server at ``url`` lets us in (False without psycopg)."""
    try:
        import psycopg
    except ImportError:
        return False
    try:
        with psycopg.connect(_libpq(url), connect_timeout=timeout):
            return True
    except psycopg.Error:
        return False


def pg_bin(name: str) -> str | None:
    """A PostgreSQL server program (``initdb``, ``pg_ctl``) on PATH or in Debian's place."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


class TempPostgres:
    """A throw-away cluster from initdb/pg_ctl on a free loopback port (``postgres`` user when
    we are root, since initdb refuses root). :meth:`kill` and :meth:`start` let a test take the
    server away and bring it back; :meth:`stop` deletes it."""

    def __init__(self) -> None:
        initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise ServerUnavailable("initdb/pg_ctl not found")
        self.root = Path(tempfile.mkdtemp(prefix="metafora-pg-"))
        self.data = self.root / "data"
        self.port = free_ports(1)[0]
        self.pid: int | None = None
        self._prefix: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                shutil.rmtree(self.root, ignore_errors=True)
                raise ServerUnavailable("running as root and there is no 'postgres' user") from None
            os.chown(self.root, user.pw_uid, user.pw_gid)
            runuser = shutil.which("runuser")
            self._prefix = [runuser, "-u", "postgres", "--"] if runuser else ["su", "postgres", "-c"]
        self._pg_ctl = pg_ctl
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        """The maintenance database's URL."""
        try:
            self._run([initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
            self.start()
        except BaseException:
            self.stop()
            raise

    def start(self) -> None:
        """Start the server (again, on the same port and data)."""
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run([self._pg_ctl, "-D", str(self.data), "-o", options, "-l",
                   str(self.root / "log"), "-w", "-t", "60", "start"])
        pidfile = self.data / "postmaster.pid"
        self.pid = int(pidfile.read_text().splitlines()[0])

    def kill(self) -> None:
        """Take the server away abruptly (immediate shutdown); :meth:`start` brings it back."""
        pidfile = self.data / "postmaster.pid"
        if self.pid is None and pidfile.exists():
            with contextlib.suppress(OSError, ValueError, IndexError):
                self.pid = int(pidfile.read_text().splitlines()[0])
        if self.pid is not None:
            _kill_and_wait(self.pid, signal.SIGQUIT)
            self.pid = None

    def stop(self) -> None:
        """Kill the server and delete its files."""
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, argv: list[str]) -> None:
        if self._prefix and self._prefix[0] == "su":
            argv = [*self._prefix, " ".join(argv)]
        else:
            argv = [*self._prefix, *argv]
        try:
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError as exc:
            detail = (exc.stderr or b"").decode(errors="replace").strip()[-500:]
            raise ServerUnavailable(f"{Path(argv[-1] if argv else '?').name}: {detail}") from exc


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """The URL of a PostgreSQL server's maintenance database (see the module doc for the order).

    A server this function started is stopped when the context ends.
    """
    env = os.environ.get(ENV_POSTGRES_URL)
    if env:
        if not postgres_answers(env, timeout=10):
            raise ServerUnavailable(f"${ENV_POSTGRES_URL} ({_where(env, 5432)}) does not answer")
        yield env
        return
    tried: list[str] = []
    if docker_answers():
        try:
            from testcontainers.postgres import PostgresContainer  # type: ignore[import-not-found]
        except ImportError:
            tried.append("Docker answers but testcontainers is not installed")
        else:
            with PostgresContainer("postgres:15") as container:
                yield str(container.get_connection_url(driver=None))
            return
    if postgres_answers(_LOCAL_POSTGRES):
        yield _LOCAL_POSTGRES
        return
    tried.append("nothing lets postgres in on 127.0.0.1:5432")
    if pg_bin("initdb") is None:
        tried.append("no initdb (apt-get install postgresql)")
    else:
        try:
            cluster = TempPostgres()
        except (ServerUnavailable, OSError, subprocess.SubprocessError) as exc:
            tried.append(f"initdb/pg_ctl: {exc}")
        else:
            try:
                yield cluster.url
            finally:
                cluster.stop()
            return
    raise ServerUnavailable("; ".join(tried))


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, ""))


@contextlib.contextmanager
def postgres_database(server_url: str, prefix: str = "metafora_test") -> Iterator[str]:
    """A throw-away database ``<prefix>_<random>`` on ``server_url``, dropped at the end.

    Without the CREATEDB privilege, the server's own database is shared (tests isolate by
    namespace).
    """
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.errors.InsufficientPrivilege:
        yield server_url
        return
    try:
        yield _with_database(server_url, name)
    finally:
        with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- etcd ---------------------------------------------------------------------------------


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
        """Poll ``/health`` until it answers true, with a deadline."""
        _poll(lambda: _healthy(self.client_url, self.tls), time.monotonic() + timeout,
              f"etcd {self.name}", self.proc, self.data_dir.with_suffix(".log"))

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
    """Start ``size`` members with a static ``--initial-cluster`` and wait until healthy."""
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
    """Start one single-member etcd under ``base`` and wait until it is healthy."""
    client, peer = free_ports(2)
    server = EtcdServer(binary, name, base / f"{name}.etcd", client, peer, tls=tls)
    try:
        server.start()
    except BaseException:
        server.kill()
        raise
    return server


def _where(url: str, default_port: int) -> str:
    """``host:port`` of a URL (never its credentials)."""
    parts = urlsplit(url)
    try:
        port = parts.port or default_port
    except ValueError:
        port = default_port
    return f"{parts.hostname or '127.0.0.1'}:{port}"


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
            raise ServerUnavailable(f"${ENV_ETCD_URL} ({_where(env, 2379)}) does not answer")
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
    from metafora.config import parse_store_url
    from metafora.coordinators.etcd.config import EtcdConfig
    from metafora.coordinators.etcd.driver import Delete, EtcdDriver
    from metafora.coordinators.etcd.layout import Keys

    config = EtcdConfig.from_url(parse_store_url(url), {})
    driver = EtcdDriver(config.connection)
    try:
        driver.txn([], [Delete(Keys(config.namespace).root, prefix=True)])
    finally:
        driver.close()
