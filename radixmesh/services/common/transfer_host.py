"""The address peers reach a process's transfer engine at (PD workers' KV transfers, the kvstore's Mooncake pages).
A module of its own so the kvstore, which moves no KV pool, does not import torch for it (services.common.kv_transfer
does)."""

from __future__ import annotations

import socket


def transfer_host(configured: str | None, listen_host: str) -> str:
    """The configured address, else the gRPC listen address unless that is a wildcard, else this host's name
    resolved."""
    if configured:
        return configured
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    return socket.gethostbyname(socket.gethostname())
