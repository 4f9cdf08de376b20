"""Free TCP ports for the services a process starts (the launcher's, the tests' and benchmarks' meshes).

A port is chosen by one process and bound by another seconds later (a child still importing torch). In that window
two things could take it: any process's bind(0) or outgoing connection, which the kernel serves from its ephemeral
range, and another launcher choosing the same port. So ports are chosen below the ephemeral range (never handed
out by the kernel), and each choice holds an advisory lock on a file named after the port, shared by every process
on the machine and let go when the choosing process exits: two launchers never hand out the same port."""

from __future__ import annotations

import collections
import fcntl
import functools
import os
import random
import socket
import tempfile
from pathlib import Path

_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=4096)
_LOCKS: collections.OrderedDict[int, int] = collections.OrderedDict()  # port -> fd holding its lock
_MAX_LOCKS = 512  # a long-lived process (a test session) lets its oldest go: their services bound them long ago
# below the ephemeral range, above well-known services and Mooncake's own picks (12000-17000 on its handshake and
# TCP transport): 20000 up to the range's start
_LOW = 20000
_LOCK_DIR = Path(tempfile.gettempdir()) / f"radixmesh-ports-{os.getuid()}"


@functools.cache
def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the usual default
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _lock(port: int) -> bool:
    """This process's claim on `port` among every process on the machine (False: another holds it). Where no lock
    file can be made (a read-only temp folder), the range alone keeps the kernel's picks away."""
    try:
        _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(_LOCK_DIR / str(port), os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _LOCKS[port] = fd
    while len(_LOCKS) > _MAX_LOCKS:
        os.close(_LOCKS.popitem(last=False)[1])
    return True


def _kernel_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, not one this process handed out lately, not one another process holds for a
    service of its own, and not one the kernel will give to anyone asking it for any port."""
    high = _ephemeral_start()
    if high - _LOW < 1000:  # an unusual range leaves no room below it: the kernel's pick, as a last resort
        while (port := _kernel_port(host)) in _RECENT_PORTS:
            pass
        _RECENT_PORTS.append(port)
        return port
    while True:
        port = random.randrange(_LOW, high)
        if port not in _RECENT_PORTS and port not in _LOCKS and _bindable(host, port) and _lock(port):
            _RECENT_PORTS.append(port)
            return port


def reserve(*ports: int | None) -> None:
    """Ports chosen elsewhere (a flag given to this process, e.g. by a parent that picked it with a free_port of its
    own): free_port never hands them out here."""
    for port in ports:
        if port and port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
