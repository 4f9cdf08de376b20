"""Ports the launcher hands its services: never one it handed out before, nor one its own flags name (a parent
process picked the router's ports with a free_port of its own, and the kernel may offer them again here)."""

from __future__ import annotations

import re
import socket

from radixmesh.services.common import ports
from radixmesh.services.launch import LaunchSettings, plan


class FakeKernel:
    """socket.socket whose bind to port 0 gets the next of `offered`: the kernel offering ports again, as it may for
    ports no one holds yet."""

    def __init__(self, offered):
        self.offered = iter(offered)

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = next(self.offered)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_reserved_port_is_never_handed_out(monkeypatch):
    monkeypatch.setattr(ports, "_RECENT_PORTS", ports.collections.deque(maxlen=64))
    monkeypatch.setattr(socket, "socket", FakeKernel([41001, 41002, 41001, 41003]))
    ports.reserve(41002, None)
    assert [ports.free_port(), ports.free_port()] == [41001, 41003]


def test_the_launch_plan_never_hands_out_the_routers_ports(monkeypatch):
    """The router's HTTP ports (one per replica) and gRPC port come with the flags; the kernel offering them first
    to the launcher's free_port must not put a tokenizer or worker on them (a CI run failed on exactly that)."""
    monkeypatch.setattr(ports, "_RECENT_PORTS", ports.collections.deque(maxlen=64))
    settings = LaunchSettings(num_workers=2, num_routers=2)
    monkeypatch.setattr(socket, "socket", FakeKernel([42100, 42000, 42001, *range(43000, 43100)]))
    children = plan(settings, {"model_path": "m"}, router={"port": 42000, "grpc_port": 42100})
    chosen = [int(p) for c in children if not c.name.startswith("router")
              for p in re.findall(r"--(?:port|stream-lane-port)', '(\d+)", str(c.argv))]
    assert len(chosen) == 6 and min(chosen) >= 43000 and len(set(chosen)) == len(chosen), chosen
