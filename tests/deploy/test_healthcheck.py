"""The health probe (services/common/healthcheck.py) against real gRPC health and HTTP servers, and how `--auto`
finds a container's main service and its port."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixmesh.services.common import healthcheck

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def grpc_health():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


@pytest.fixture
def http_health():
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            code = status["code"] if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield status, f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()
    server.server_close()


def test_grpc_serving_not_serving_and_down(grpc_health):
    servicer, port = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--port", str(port)]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main(["--port", str(port), "--quiet"]) == 1
    servicer.set("radixmesh.v1.WorkerService", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--port", str(port), "--service", "radixmesh.v1.WorkerService"]) == 0
    assert healthcheck.main(["--port", str(port), "--service", "no.Such", "--quiet"]) == 1  # NOT_FOUND


def test_grpc_nothing_listening():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert healthcheck.main(["--port", str(port), "--timeout", "1", "--quiet"]) == 1


def test_http(http_health):
    status, url = http_health
    assert healthcheck.main(["--http", url]) == 0
    status["code"] = 503
    assert healthcheck.main(["--http", url, "--quiet"]) == 1


def test_command_line_exit_status(grpc_health):
    servicer, port = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    r = subprocess.run([sys.executable, "-m", "radixmesh.services.common.healthcheck", "--port", str(port)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SERVING" in r.stdout


def test_target_follows_the_services_settings(tmp_path):
    t = healthcheck.target_of
    assert t(["-m", "radixmesh.services.router", "--host", "0.0.0.0",
              "--tokenizer-url", "x:1"], {}) == ("http", "127.0.0.1", 30000)
    assert t(["-m", "radixmesh.services.launch", "serve", "--port=8000"], {}) == ("http", "127.0.0.1", 8000)
    assert t(["-m", "radixmesh.services.worker", "--port", "1", "--port", "50051"], {}) == ("grpc", "127.0.0.1", 50051)
    assert t(["-m", "radixmesh.services.tokenizer", "--host", "10.1.2.3"],
             {"RADIXMESH_PORT": "7001"}) == ("grpc", "10.1.2.3", 7001)
    config = tmp_path / "kv.yaml"
    config.write_text("port: 6001\nbackend: memory\n")
    assert t(["-m", "radixmesh.services.kvstore", "--config", str(config)], {}) == ("grpc", "127.0.0.1", 6001)
    with pytest.raises(LookupError):
        t(["-m", "radixmesh.services.kvstore"], {})  # port 0: a random port nobody can probe


def _fake_proc(root: Path, pid: int, argv: list[str], start: int, env: dict) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    # /proc/<pid>/stat: the name in parentheses may hold spaces; the start time is field 22
    (d / "stat").write_text(f"{pid} (py thon) S 1 " + " ".join(["0"] * 17) + f" {start} 0 0\n")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")


def test_main_service_is_the_oldest_radixmesh_process(tmp_path):
    _fake_proc(tmp_path, 1, ["/usr/bin/catatonit", "--", "python"], 5, {})
    _fake_proc(tmp_path, 7, ["python", "-m", "radixmesh.services.launch", "serve", "--port", "30000"], 10, {"A": "1"})
    _fake_proc(tmp_path, 3, ["python", "-m", "radixmesh.services.tokenizer", "--port", "41000"], 20, {})
    (tmp_path / "self").mkdir()
    argv, env = healthcheck.main_service(tmp_path)
    assert argv == ["-m", "radixmesh.services.launch", "serve", "--port", "30000"] and env == {"A": "1"}
    with pytest.raises(LookupError):
        healthcheck.main_service(tmp_path / "self")

