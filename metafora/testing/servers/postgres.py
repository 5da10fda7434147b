"""PostgreSQL for tests: a server from the environment, a container, the machine's, or initdb.

:func:`postgres_server` tries, in order: ``$METAFORA_TEST_POSTGRES_URL``; a container from
``testcontainers`` when a Docker engine answers; a server on 127.0.0.1:5432 that lets
``postgres`` in; a throw-away cluster (:class:`TempPostgres`) made with ``initdb`` and started
with ``pg_ctl`` on a free loopback port (as the ``postgres`` user when run as root). Processes
are stopped by pid; nothing sleeps to synchronise.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import select
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from metafora.testing.servers.base import ServerUnavailable, docker_answers, free_ports, host_port

__all__ = [
    "ENV_POSTGRES_URL",
    "TempPostgres",
    "pg_bin",
    "postgres_answers",
    "postgres_database",
    "postgres_server",
]

ENV_POSTGRES_URL = "METAFORA_TEST_POSTGRES_URL"
"""A PostgreSQL server URL (maintenance database) tests should use instead of finding one."""

_LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


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
            raise ServerUnavailable(f"${ENV_POSTGRES_URL} ({host_port(env, 5432)}) does not answer")
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
