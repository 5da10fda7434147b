"""Host names and addresses: which ones name only this machine, and which Host headers a
server bound to an address answers (the DNS-rebinding check). The info server and the
dashboard share these rules."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable

__all__ = ["LOOPBACK_NAMES", "allowed_hosts", "host_allowed", "host_name", "is_loopback"]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
_WILDCARDS = frozenset({"0.0.0.0", "::"})  # binds to every interface


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, loopback: bool, extra: Iterable[str] = ()) -> frozenset[str]:
    """The Host names a request may carry (lower case, without a port): loopback names for a
    loopback bind; for a wildcard bind (``0.0.0.0``, ``::``) the loopback names and this
    machine's own names too; the bound address itself; every ``--allow-host``. An address
    (``10.1.2.3``) is always accepted as well (see :func:`host_allowed`)."""
    names = {bind_host.lower().strip("[]"), *(name.lower().strip("[]") for name in extra)}
    if loopback or bind_host.strip("[]") in _WILDCARDS:
        names.update(name.strip("[]") for name in LOOPBACK_NAMES)
    if bind_host.strip("[]") in _WILDCARDS:
        with contextlib.suppress(OSError):
            names.update({socket.gethostname().lower(), socket.getfqdn().lower()})
    names.discard("")
    names.difference_update(_WILDCARDS)  # a wildcard bind is not a name anyone may send
    return frozenset(names)


def host_allowed(name: str, hosts: frozenset[str]) -> bool:
    """Whether a request's Host ``name`` may be answered: one of ``hosts``, or an IP address.

    DNS rebinding needs a *name* that an attacker's DNS points at this server; a Host that is
    an address was typed by whoever connected to that address, so it is safe to answer.
    """
    if name in hosts:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(header: str) -> str:
    """The name of a Host header without its port (``[::1]:80`` -> ``::1``), lower case."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value
