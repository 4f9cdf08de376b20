"""Names that stand for several machines: every address a DNS name resolves to (a Kubernetes headless Service, a
compose service with replicas), and host:port strings with IPv6 addresses bracketed."""

from __future__ import annotations

import asyncio
import socket


def split_host_port(text: str, what: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port); ValueError naming `what` when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} takes host:port, got {text!r}")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6), sorted; [] when the name does not resolve (yet)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return sorted({info[4][0] for info in infos})
