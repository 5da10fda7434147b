"""Former name of :mod:`metafora.testing.servers` (real PostgreSQL and etcd servers for tests).

Kept so that ``from metafora.testservers import ...`` goes on working; new code imports
:mod:`metafora.testing.servers`.
"""

from __future__ import annotations

from metafora.testing.servers import (
    ENV_ETCD_BINARY,
    ENV_ETCD_URL,
    ENV_POSTGRES_URL,
    EtcdCluster,
    EtcdServer,
    ServerUnavailable,
    TempPostgres,
    TLSFiles,
    docker_answers,
    drop_etcd_namespace,
    etcd_server,
    find_etcd,
    free_ports,
    pg_bin,
    postgres_answers,
    postgres_database,
    postgres_server,
    start_etcd,
    start_etcd_cluster,
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
