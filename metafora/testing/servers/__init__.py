"""Real store servers for tests: PostgreSQL and etcd on loopback, found or started, stopped by pid.

metafora's pytest plugin (:mod:`metafora.testing.pytest_plugin`) gets its servers here, and so
does metafora's own test suite: one way to get a store. Where a server comes from, in order:

- PostgreSQL (:func:`postgres_server`): ``$METAFORA_TEST_POSTGRES_URL``; a container from
  ``testcontainers`` when a Docker engine answers; a server on 127.0.0.1:5432 that lets
  ``postgres`` in; a throw-away cluster made with ``initdb`` and started with ``pg_ctl`` on a
  free loopback port (as the ``postgres`` user when run as root).
- etcd (:func:`etcd_server`): ``$METAFORA_TEST_ETCD_URL``; a container when a Docker engine
  answers; the ``etcd`` binary (``$METAFORA_TEST_ETCD`` or on PATH) on free loopback ports with
  a temporary data directory.

When none works, :class:`ServerUnavailable` says what was tried. Nothing here sleeps to
synchronise: readiness is polled against deadlines, and processes are stopped by pid.

:mod:`metafora.testing.servers.postgres` and :mod:`metafora.testing.servers.etcd` hold each
kind; this module names them all.
"""

from __future__ import annotations

from metafora.testing.servers.base import ServerUnavailable, docker_answers, free_ports
from metafora.testing.servers.etcd import (
    ENV_ETCD_BINARY,
    ENV_ETCD_URL,
    EtcdCluster,
    EtcdServer,
    TLSFiles,
    drop_etcd_namespace,
    etcd_server,
    find_etcd,
    start_etcd,
    start_etcd_cluster,
)
from metafora.testing.servers.postgres import (
    ENV_POSTGRES_URL,
    TempPostgres,
    pg_bin,
    postgres_answers,
    postgres_database,
    postgres_server,
)

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
