"""Helpers for the metrics tests: start a service as a real process, scrape its /metrics over HTTP and read samples
with prometheus_client's parser."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.services import forkserver
from radixmesh.services.launch import free_port
from tests.e2e.mesh import http_get  # noqa: F401 - re-exported for the metrics tests
from tests.conftest import ROOT


def start_grpc(module: str, *args: str, log: Path | None = None, timeout: float = 120.0, port: int | None = None,
               env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start `python -m module --port P ... args` (P free unless given; `env` added to the environment) and wait
    until its gRPC health says SERVING."""
    proc, url = spawn_grpc(module, *args, log=log, port=port, env=env)
    wait_grpc(proc, url, timeout)
    return proc, url


def spawn_grpc(module: str, *args: str, log: Path | None = None, port: int | None = None,
               env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """start_grpc without the wait: services spawned one after another and then awaited (wait_grpc) start side by
    side, as the launcher starts a mesh, instead of each one's start-up waiting for the one before."""
    port = port or free_port()
    out = open(log, "w") if log else None
    argv = [module, "--port", str(port), "--log-level", "warning", *args]
    env = {**os.environ, **(env or {})}
    server = os.environ.get(forkserver.ENV)  # the suite's fork server (tests/conftest.py), where there is one
    if server:
        fds = (0, out.fileno(), out.fileno()) if out else (0, 1, 2)
        proc = forkserver.spawn(server, argv, env, cwd=str(ROOT), new_session=False, fds=fds)
        if isinstance(proc, forkserver.Forked):
            return proc, f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT if out else None, env=env)
    return proc, f"127.0.0.1:{port}"


def wait_grpc(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    """Wait until the service spawn_grpc started at `url` says SERVING (killed if it does not within `timeout`)."""
    module = proc.args[0] if isinstance(proc, forkserver.Forked) else proc.args[2]
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(url) as ch:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{module} exited with {proc.returncode}"
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{module} not healthy within {timeout} s")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM and wait; the exit code (a service stops cleanly with 0)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http_get(url, timeout=2)[0] < 500:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not answering within {timeout} s")


class Scrape:
    """One /metrics scrape: every sample, by its exposition name (`x_total`, `x_count`, `x_bucket`, ...)."""

    def __init__(self, text: str):
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        self.types = {family.name: family.type for family in text_string_to_metric_families(text)}

    def all(self, name: str, **labels: str) -> list:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
        return sum(s.value for s in self.all(name, **labels))

    def labels(self, name: str, key: str) -> set[str]:
        return {s.labels[key] for s in self.all(name) if key in s.labels}


def scrape(port: int, path: str = "/metrics", headers: dict | None = None) -> Scrape:
    status, body = http_get(f"http://127.0.0.1:{port}{path}", headers)
    assert status == 200, f"GET {path} on {port}: {status} {body[:200]!r}"
    return Scrape(body.decode())
