"""Ports the launcher hands its services: never one it handed out before, nor one its own flags name (a parent
process picked the router's ports with a free_port of its own, and the kernel may offer them again here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from radixmesh.services.common import ports
from radixmesh.services.launch import LaunchSettings, plan


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """free_port with no history, its locks in a folder of this test's own."""
    monkeypatch.setattr(ports, "_RECENT_PORTS", ports.collections.deque(maxlen=64))
    monkeypatch.setattr(ports, "_LOCKS", ports.collections.OrderedDict())
    monkeypatch.setattr(ports, "_LOCK_DIR", tmp_path / "locks")
    yield monkeypatch
    for fd in ports._LOCKS.values():
        os.close(fd)


def offer(monkeypatch, offered):
    """The random choice of port gives the next of `offered`, bound to repeat a port as chance may. Tests that need
    an offered port taken offer ports below the range free_port draws from (19xxx): the other test process's meshes
    never listen there (a CI run's mesh held 24002 when this test offered it)."""
    it = iter(offered)
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(it))


def test_a_reserved_port_is_never_handed_out(fresh):
    offer(fresh, [19101, 19102, 19101, 19103])
    ports.reserve(19102, None)
    assert [ports.free_port(), ports.free_port()] == [19101, 19103]


def test_the_launch_plan_never_hands_out_the_routers_ports(fresh):
    """The router's HTTP ports (one per replica) and gRPC port come with the flags; the kernel offering them first
    to the launcher's free_port must not put a tokenizer or worker on them (a CI run failed on exactly that)."""
    settings = LaunchSettings(num_workers=2, num_routers=2)
    offer(fresh, [22100, 22000, 22001, *range(23000, 23100)])
    children = plan(settings, {"model_path": "m"}, router={"port": 22000, "grpc_port": 22100})
    chosen = [int(p) for c in children if not c.name.startswith("router")
              for p in re.findall(r"--(?:port|stream-lane-port)', '(\d+)", str(c.argv))]
    assert len(chosen) == 6 and min(chosen) >= 23000 and len(set(chosen)) == len(chosen), chosen


def test_a_port_another_process_chose_is_not_handed_out(fresh):
    """Two launchers (two test workers' meshes) choosing at once: a port one of them holds for a service that has
    not bound it yet is skipped by the other (a CI run failed on a metrics port taken this way)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from radixmesh.services.common import ports; from pathlib import Path; "
         "ports._LOCK_DIR = Path(sys.argv[1]); ports.random.randrange = lambda a, b: 19001; "
         "print(ports.free_port(), flush=True); sys.stdin.read()", str(ports._LOCK_DIR)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "19001"
        offer(fresh, [19001, 19002])
        assert ports.free_port() == 19002
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    offer(fresh, [19001])  # its process gone, its lock went with it
    assert ports.free_port() == 19001


def test_ports_come_from_below_the_kernels_ephemeral_range(fresh):
    """Where any process's bind(0) or outgoing connection could never take them."""
    chosen = [ports.free_port() for _ in range(50)]
    assert len(set(chosen)) == 50
    assert all(ports._LOW <= p < ports._ephemeral_start() for p in chosen), chosen


def test_without_a_writable_lock_folder_ports_still_come(fresh, tmp_path):
    """A read-only temp folder (a locked-down container): no lock, the range still keeps the kernel's picks away."""
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    fresh.setattr(ports, "_LOCK_DIR", blocked / "locks")
    assert ports._LOW <= ports.free_port() < ports._ephemeral_start()
