"""A real redis-server (Debian's `redis-server`, which `make test` installs) on a free loopback port, in a temp
directory, without persistence. Tests import the `redis_server` fixture from here; it skips only when the binary is
missing."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from radixmesh.services.common.ports import free_port

START_TIMEOUT_S = 10.0


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """One redis-server process; stop() and start() again keep the port (a restart, empty: nothing is saved)."""

    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.workdir)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}: "
                                   f"{(self.workdir / 'redis.log').read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGKILL: the server vanishes as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path_factory) -> RedisServer:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it: apt-get install redis-server)")
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
