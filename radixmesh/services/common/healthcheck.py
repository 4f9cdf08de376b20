"""A health probe for container runtimes and Kubernetes: exits 0 when the service answers healthy, 1 when not.

  python -m radixmesh.services.common.healthcheck --port N [--host H] [--service NAME]   grpc.health.v1 Check == SERVING
      [--tls-cert C --tls-key K --tls-ca CA [--tls-server-name N]]              ... of a service with mutual TLS
  python -m radixmesh.services.common.healthcheck --http http://127.0.0.1:30000/health   HTTP 200 (the router)
  python -m radixmesh.services.common.healthcheck --auto                                the container's own service

`--auto` is what the image's HEALTHCHECK runs: it finds the oldest `python -m radixmesh.services.<name>` process (the
one the entrypoint started; with `serve` its children are younger) and probes it where its settings put it: the router
and the launcher over HTTP /health, every other service over gRPC health, at the port taken like the service takes it
(flag, then its RADIXMESH_PORT, then the --config file, then the service's default), with its own TLS certificate
when it runs with mutual TLS. The health service never needs the internal token (services.common.auth)."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

HTTP_MODULES = {"radixmesh.services.router": 30000, "radixmesh.services.launch": 30000}  # module -> default HTTP port
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class Target(NamedTuple):
    kind: str  # "grpc" or "http"
    host: str
    port: int


def check_grpc(host: str, port: int, service: str = "", timeout_s: float = 3.0,
               tls: dict | None = None) -> tuple[bool, str]:
    """`tls`: the service's --tls-cert, --tls-key, --tls-ca (and --tls-server-name) as keyword arguments of
    InternalAuthSettings, when it runs with mutual TLS (the health service needs no token)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from radixmesh.services.common.auth import InternalAuth, InternalAuthSettings
    from radixmesh.services.common.auth_channel import sync_channel

    auth = InternalAuth.from_settings(InternalAuthSettings(**tls)) if tls else InternalAuth()
    with sync_channel(f"{host}:{port}", auth=auth) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{host}:{port}: {e.code().name} {e.details() or ''}".strip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{host}:{port}: {status}"


def check_http(url: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"{url}: HTTP {reply.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


def _flag(argv: list[str], name: str) -> str | None:
    """The last value of --name (as `--name V` or `--name=V`), as argparse would keep it."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _from_config(argv: list[str], key: str) -> str | None:
    path = _flag(argv, "--config")
    if not path:
        return None
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    value = data.get(key, data.get(key.replace("_", "-")))
    return None if value is None else str(value)


def target_of(argv: list[str], environ: dict | None = None) -> Target:
    """Where a service started with `python -m <module> <args>` (argv from its `-m` on) answers health checks."""
    environ = os.environ if environ is None else environ
    module, args = argv[1], argv[2:]
    http = module in HTTP_MODULES

    def setting(name: str) -> str | None:
        return _flag(args, "--" + name) or environ.get("RADIXMESH_" + name.upper()) or _from_config(args, name)

    port = setting("port") or (HTTP_MODULES[module] if http else None)
    if port is None or int(port) == 0:
        raise LookupError(f"{module} was started without a fixed port (--port or RADIXMESH_PORT)")
    host = setting("host") or "127.0.0.1"
    host = "127.0.0.1" if host in WILDCARDS else host
    return Target("http" if http else "grpc", host, int(port))


TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")


def tls_of(argv: list[str], environ: dict | None = None) -> dict:
    """The TLS settings of a service started with `python -m <module> <args>`, taken as it takes them (flag,
    environment, --config file); empty when it runs without TLS."""
    environ = os.environ if environ is None else environ
    args = argv[2:]
    found = {name: _flag(args, "--" + name.replace("_", "-")) or environ.get("RADIXMESH_" + name.upper())
             or _from_config(args, name) for name in TLS_FLAGS}
    return {k: v for k, v in found.items() if v}


def main_service(proc: Path = Path("/proc")) -> tuple[list[str], dict]:
    """The oldest `python -m radixmesh.services.<name>` process (the container's main service): its command line from
    `-m` on, and its environment."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
            started = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: start time
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile, or not ours to read
        for i, arg in enumerate(argv[:-1]):
            if arg == "-m" and argv[i + 1].startswith("radixmesh.services."):
                found.append((started, int(entry.name), argv[i:]))
                break
    if not found:
        raise LookupError("no `python -m radixmesh.services.<name>` process is running")
    _, pid, argv = min(found)
    try:
        raw = (proc / str(pid) / "environ").read_bytes().decode(errors="replace").split("\0")
        environ = dict(item.split("=", 1) for item in raw if "=" in item)
    except OSError:
        environ = dict(os.environ)
    return argv, environ


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Exit 0 when a radixmesh service is healthy, 1 when not.")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--port", type=int, help="gRPC port: grpc.health.v1 Check must answer SERVING")
    how.add_argument("--http", metavar="URL", help="HTTP URL (e.g. the router's /health) that must answer 200")
    how.add_argument("--auto", action="store_true", help="probe this container's main radixmesh service")
    p.add_argument("--host", default="127.0.0.1", help="with --port: the address (default: 127.0.0.1)")
    p.add_argument("--service", default="", help="with --port: a service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    for name in TLS_FLAGS:  # with --port, for a service running with mutual TLS (--auto finds its own)
        p.add_argument("--" + name.replace("_", "-"), help=f"with --port: the service's --{name.replace('_', '-')}")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    args = p.parse_args(argv)
    try:
        if args.auto:
            argv, environ = main_service()
            target = target_of(argv, environ)
            ok, message = (check_http(f"http://{target.host}:{target.port}/health", args.timeout)
                           if target.kind == "http" else
                           check_grpc(target.host, target.port, "", args.timeout, tls_of(argv, environ)))
        elif args.http:
            ok, message = check_http(args.http, args.timeout)
        else:
            tls = {name: getattr(args, name) for name in TLS_FLAGS if getattr(args, name)}
            ok, message = check_grpc(args.host, args.port, args.service, args.timeout, tls)
    except (LookupError, OSError, ValueError) as e:
        ok, message = False, str(e)
    if not args.quiet:
        print(("healthy: " if ok else "unhealthy: ") + message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
