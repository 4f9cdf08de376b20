"""Launch the real mesh (`python -m radixmesh.services.launch serve`: tokenizer, workers and router as OS processes) for
end-to-end tests, and check on teardown that no process is left over.

The services are found by the launcher's log ("worker-0 started (pid N): radixmesh.services.worker --port ..."), not by
the launcher's child processes: in this suite they are forked from a fork server (tests/conftest.py,
radixmesh.services.forkserver), so their parent is that server and their /proc cmdline its own. A test that needs
services started afresh (their parent, their /proc environ) launches with NOT_FORKED."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.common.auth import TOKEN_ENV, InternalAuth
from radixmesh.services.common.auth_channel import sync_channel
from radixmesh.services.launch import free_port

REPO = Path(__file__).resolve().parents[2]
# The internal token of every mesh launched here (the launcher passes it to each service); tests that call a worker
# or the tokenizer directly send it through internal_channel().
INTERNAL_TOKEN = secrets.token_urlsafe(24)
# launch(env=NOT_FORKED): every service a fresh `python -m` process, the launcher's child, as users run it
NOT_FORKED = {"RADIXMESH_FORK_SERVER": ""}
_STARTED = re.compile(r"launch: (\S+) started \(pid (\d+)(?:, forked)?\): (.*)$")
_LOGGED: dict[int, str] = {}  # pid -> the command line its launcher logged (every mesh of this process)


def internal_channel(address: str, token: str = INTERNAL_TOKEN):
    """A blocking gRPC channel to one of a launched mesh's services, carrying the internal token."""
    return sync_channel(address, auth=InternalAuth((token,)))


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except FileNotFoundError:
        return []


def cmdline(pid: int) -> str:
    """The command line of `pid`: as a launcher logged it for a service (forked services' own is the fork server's),
    else from /proc."""
    if pid in _LOGGED:
        return _LOGGED[pid]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(FileNotFoundError):
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().split(")")[-1].split()[0] == "Z":  # a zombie has exited
                return False
    return True


@dataclass
class Mesh:
    proc: subprocess.Popen
    port: int
    grpc_port: int
    api_key: str | None = None
    log_path: Path | None = None
    known_pids: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def started(self) -> dict[str, int]:
        """Child name (tokenizer, worker-0, router ...) -> pid of its latest start, in start order, from the log."""
        out: dict[str, int] = {}
        if self.log_path is None or not self.log_path.exists():
            return out
        for line in self.log_path.read_text(errors="replace").splitlines():
            m = _STARTED.search(line)
            if m:
                pid = int(m.group(2))
                out[m.group(1)] = pid
                _LOGGED[pid] = f"{sys.executable} -m {m.group(3)}"
        return out

    def services(self) -> dict[str, int]:
        """Service module name (radixmesh.services.router, radixmesh.services.worker, ...) -> pid; several workers get -0, -1, ..."""
        out: dict[str, int] = {}
        for pid in self.started().values():
            name = next((a for a in cmdline(pid).split() if a.startswith("radixmesh.services.")), "?")
            key, i = name, 0
            while key in out:
                i += 1
                key = f"{name}-{i}"
            out[key] = pid
        return out

    def log_tail(self, n: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(model: str, tmp: Path, *args: str, num_workers: int = 1, api_key: str | None = None,
           timeout: float = 180.0, env: dict | None = None) -> Mesh:
    """`env`: set for the launcher on top of this environment and INTERNAL_TOKEN."""
    port, grpc_port = free_port(), free_port()
    # the README's command, `radixmesh serve`, from a folder that is not the checkout: nothing may import from there
    script = Path(sys.executable).with_name("radixmesh")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "radixmesh.services.launch"]
    argv = [*command, "serve", "--model-path", model, "--port", str(port),
            "--grpc-port", str(grpc_port), "--num-workers", str(num_workers), "--shutdown-grace-s", "10",
            "--log-level", "warning", *args]
    if api_key:
        argv += ["--api-key", api_key]
    log_path = tmp / f"mesh-{port}.log"
    proc = subprocess.Popen(argv, cwd=tmp, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, TOKEN_ENV: INTERNAL_TOKEN, **(env or {})})
    mesh = Mesh(proc, port, grpc_port, api_key, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode}:\n{mesh.log_tail()}")
        if "radixmesh is ready" in log_path.read_text(errors="replace"):
            mesh.known_pids = list(mesh.services().values())
            return mesh
        time.sleep(0.2)
    mesh.stop()
    raise RuntimeError(f"mesh not ready within {timeout} s:\n{mesh.log_tail()}")


def stop_and_check(mesh: Mesh) -> None:
    """Stop the launcher; every process it started must be gone."""
    code = mesh.stop()
    leftovers = [p for p in mesh.known_pids if alive(p)]
    for p in leftovers:
        os.kill(p, signal.SIGKILL)
    assert not leftovers, f"processes left over: {[cmdline(p) for p in leftovers]}"
    assert code == 0, f"launcher exit code {code}:\n{mesh.log_tail()}"


def http_get(url: str, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric_sum(url: str, *names: str) -> float:
    """The sum of every sample of the metric families `names` on the Prometheus endpoint `url`."""
    status, raw = http_get(url)
    assert status == 200, (url, status, raw[:200])
    return sum(float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
               if line.partition("{")[0].partition(" ")[0] in names)


def worker_metrics(mesh: Mesh, worker: str) -> dict[str, float]:
    """The router's samples labelled with `worker` (host:port), by name, from one scrape."""
    status, raw = http_get(mesh.url + "/metrics")
    assert status == 200, raw[:200]
    out = {}
    for line in raw.decode().splitlines():
        head, _, value = line.rpartition(" ")
        if f'worker="{worker}"' in head:
            out[head.partition("{")[0]] = float(value)
    return out


def loads(address: str) -> worker_pb2.GetLoadsResponse:
    """The worker's own load report (GetLoads over its internal channel)."""
    with internal_channel(address) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetLoads(worker_pb2.GetLoadsRequest(), timeout=10)


def streaming_on(mesh: Mesh, worker: str, streams: int = 2):
    """A predicate for a fault's trigger: true once the worker (host:port) has streams mid-answer. On a GenerateStream
    (colocated workers): at least `streams` calls whose answer has begun and not ended, by the router
    (radixmesh_router_open_streams). Over plain Generate calls (PD decode workers), where the router has no such
    count: a call to the worker has had its first message since now, by the router's metrics, and the worker
    itself (GetLoads) still runs at least `streams` requests. (Weaker signs misled CI runs: chunks of any stream
    fired a fault before this worker's first token; the router's open calls (sgl_router_running_requests) include
    answers the worker finished long ago that a slow client still reads; the worker's running count alone includes
    requests whose first token has not reached the router, which are retried, not migrated, when it dies.)"""
    ttft = "sgl_router_worker_time_to_first_token_seconds_count"
    before = worker_metrics(mesh, worker).get(ttft, 0.0)

    def ready() -> bool:
        now = worker_metrics(mesh, worker)
        if "radixmesh_router_open_streams" in now:
            return now["radixmesh_router_open_streams"] >= streams
        return now.get(ttft, 0.0) > before and loads(worker).num_running_requests >= streams
    return ready


def migrations(mesh: Mesh) -> float:
    """Streams the router moved to another worker mid-answer."""
    return metric_sum(mesh.url + "/metrics", "radixmesh_router_migrations_total")


def moved(mesh: Mesh) -> float:
    """Requests the router migrated (mid-stream) or retried (before their first token) to another worker."""
    return metric_sum(mesh.url + "/metrics", "radixmesh_router_migrations_total", "sgl_router_retries_total")


@contextlib.contextmanager
def running_mesh(model: str, tmp: Path, *args: str, **kwargs):
    """A launched mesh for a fixture's lifetime, stopped and checked for leftovers after."""
    mesh = launch(model, tmp, *args, **kwargs)
    try:
        yield mesh
    finally:
        stop_and_check(mesh)


def openai_client(mesh: Mesh, timeout: float = 120):
    import openai

    return openai.OpenAI(base_url=mesh.url + "/v1", api_key=mesh.api_key or "unused", max_retries=0, timeout=timeout)
