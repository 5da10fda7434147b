"""What the test servers share: the error saying none could be had, free ports, Docker, addresses."""

from __future__ import annotations

import shutil
import socket
import subprocess
from urllib.parse import urlsplit

__all__ = ["ServerUnavailable", "docker_answers", "free_ports", "host_port"]


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


def host_port(url: str, default_port: int) -> str:
    """``host:port`` of a URL (never its credentials)."""
    parts = urlsplit(url)
    try:
        port = parts.port or default_port
    except ValueError:
        port = default_port
    return f"{parts.hostname or '127.0.0.1'}:{port}"
