"""Free TCP ports for the services a process starts (the launcher's, the tests' and benchmarks' meshes)."""

from __future__ import annotations

import collections
import socket

_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=4096)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and not one this process handed out lately: the kernel may offer a closed port
    again at once, and of two services given the same one the second would fail to start."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port


def reserve(*ports: int | None) -> None:
    """Ports chosen elsewhere (a flag given to this process, e.g. by a parent that picked it with a free_port of its
    own): free_port never hands them out here, where the kernel, not yet seeing them bound, may offer them again."""
    for port in ports:
        if port and port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
